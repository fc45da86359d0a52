"""The C and P4 code generated from the protocol's Python definitions, next to them: the BPF
program's headers (bpf/generated: wire.h from xdp_agg.proto.wire, abi.h from abi), and the P4
program's (p4/include, and the per-element parts in xdp_agg.codegen.p4). abi holds the layouts of
the XDP program's maps, which the XDP target reads with ctypes. `python -m xdp_agg.codegen` writes
every generated file; `--check` reports drift."""
