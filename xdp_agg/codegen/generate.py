"""Generate the C and P4 headers from the Python definitions (wire.py, abi.py).

    python -m xdp_agg.codegen          # rewrite the generated files
    python -m xdp_agg.codegen --check  # exit 1 if any committed file differs

The generated files are committed so that the BPF program, the P4 program and the host's C fast
path (hostlib/fp_wire.h) can be read and compiled without running Python; tests/root/test_codegen.py
fails when they drift.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from xdp_agg.proto import keys, reasons, wire
from xdp_agg.proto.jobs import Delivery

from . import abi
from . import p4 as p4gen
from .headers import generates

ROOT = Path(__file__).resolve().parents[2]  # the repository: xdp_agg/codegen/ is two below

# generated file -> its text (the functions below, as @generates registers them; then p4's)
GENERATED: dict[str, Callable[[], str]] = {}
_C_UINT = {1: "__u8", 2: "__be16", 4: "__be32"}
_C_SINT = {1: "__s8"}


def _c_member_type(m: wire.Member) -> str:
    return (_C_SINT if m.signed else _C_UINT)[m.nbytes]


@generates(GENERATED, "bpf/generated/wire.h", "xdp_agg/proto/wire.py", "XDP_AGG_WIRE_H")
def wire_h() -> list[str]:
    """Constants, packed header structs and sub-byte field accessors."""
    L: list[str] = []
    consts = [
        ("SML_UDP_PORT", hex(wire.UDP_PORT), "aggregator base UDP port"),
        ("SML_UDP_PORT_MASK", hex(wire.UDP_PORT_MASK), "ports accepted: (port & mask) == base"),
        ("SML_MSG_TYPE_DATA", wire.MSG_TYPE_DATA, "contribution or result"),
        ("SML_MSG_TYPE_SPARSE", wire.MSG_TYPE_SPARSE, "sparse: a block of data"),
        ("SML_MSG_TYPE_SPARSE_EMPTY", wire.MSG_TYPE_SPARSE_EMPTY, "sparse: header only"),
        ("SML_POOL_VERSION_BIT", hex(wire.POOL_VERSION_BIT), "pool_index: version"),
        ("SML_POOL_RESERVED_BIT", hex(wire.POOL_RESERVED_BIT), "pool_index: reserved"),
        ("SML_POOL_SLOT_MASK", hex(wire.POOL_SLOT_MASK), "pool_index: slot"),
        ("SML_HLEN", wire.SWITCHML_HLEN, "SwitchML header bytes"),
        ("SML_EXP_HLEN", wire.EXP_HLEN, "exponent header bytes"),
        ("SML_OFFSET", wire.SWITCHML_OFFSET, "SwitchML header offset in the frame"),
        (
            "SML_PAYLOAD_OFFSET",
            wire.PAYLOAD_OFFSET,
            "payload offset in the frame, after the SwitchML and exponent headers",
        ),
        ("SML_MAX_ELEMS", wire.MAX_ELEMS, "largest elements per packet"),
        ("SML_SPARSE_HLEN", wire.SPARSE_HLEN, "sparse header bytes (sparse packets only)"),
        (
            "SML_SPARSE_PAYLOAD_OFFSET",
            wire.SWITCHML_OFFSET + wire.SPARSE_VALUES_AT,
            "a sparse packet's payload offset in the frame, after the sparse header",
        ),
        ("SML_RESULT_TTL", wire.RESULT_TTL, "IPv4 TTL of every result"),
        ("SML_RESULT_IP_ID", wire.RESULT_IP_ID, "IPv4 identification of every result"),
        ("SML_RESULT_TOS", wire.RESULT_TOS, "IPv4 ToS byte (DSCP, ECN) of every result"),
        ("SML_RESULT_IP_FLAGS", wire.RESULT_IP_FLAGS, "IPv4 flags (DF, MF) of every result"),
    ]
    for name, value, doc in consts:
        L.append(f"#define {name} {value} /* {doc} */")
    L.append("")
    L.append("/* size code -> int32 elements per packet */")
    for code, n in wire.SIZE_CODE_ELEMS.items():
        L.append(f"#define SML_SIZE_{code}_ELEMS {n}")
    L.append("/* X(code, elems) for every size code: code that needs one copy per packet size */")
    L.append(
        "#define SML_FOR_EACH_SIZE(X) "
        + " ".join(f"X({code}, SML_SIZE_{code}_ELEMS)" for code in wire.SIZE_CODE_ELEMS)
    )
    L.append("")
    for h in wire.HEADERS:
        L.append(f"/* {h.doc} */")
        L.append(f"struct {h.name}_hdr {{")
        for m in wire.members(h):
            docs = "; ".join(
                f"{n}:{w}" if len(m.parts) > 1 else next(f.doc for f in h.fields if f.name == n)
                for n, _, w in m.parts
            )
            L.append(f"\t{_c_member_type(m)} {m.name}; /* {docs} */")
        L.append("} __attribute__((packed));")
        for m in wire.members(h):
            if len(m.parts) == 1:
                continue
            if wire.reserved_mask(m):
                L.append(
                    f"#define SML_{m.name.upper()}_RESERVED {hex(wire.reserved_mask(m))} "
                    "/* 0 in results */"
                )
            for n, shift, width in m.parts:
                if n == "reserved":
                    continue
                L.append(
                    f"#define SML_{n.upper()}(h) "
                    f"((((h)->{m.name}) >> {shift}) & {hex((1 << width) - 1)})"
                )
        L.append("")
    return L


@generates(
    GENERATED, "bpf/generated/abi.h", "xdp_agg/codegen/abi.py and xdp_agg.proto", "XDP_AGG_ABI_H"
)
def abi_h() -> list[str]:
    """limits, reasons, and the structures of the maps."""
    L: list[str] = []
    for name, (value, doc) in abi.CONSTANTS.items():
        L.append(f"#define {name} {value} /* {doc} */")
    L.append("")
    L.append("/* counter index within a job's row: why a packet took its path */")
    L.append("enum agg_reason {")
    for r in reasons.Reason:
        L.append(f"\tAGG_{r.name} = {int(r)},")
    L.append("};")
    L.append("")
    L.append("/* table keys (xdp_agg/proto/keys.py) */")
    for k in keys.KEYS:
        L.append(f"#define AGG_{k.name.upper()}({', '.join(k.args)}) ({k.expr}) /* {k.doc} */")
    L.append("")
    L.append("/* per-job options: bits of agg_job.flags */")
    for f in abi.JobFlag:
        L.append(f"#define AGG_JOB_{f.name} {int(f)}")
    L.append("")
    L.append("/* how a job's results reach its workers */")
    L.append("enum agg_delivery {")
    for d in Delivery:
        L.append(f"\tAGG_DELIVERY_{d.name} = {int(d)},")
    L.append("};")
    L.append("")
    for s in abi.STRUCTS:
        L.append(f"/* {s.doc} */")
        L.append(f"struct {s.name} {{")
        for f in s.fields:
            arr = f"[{f.count}]" if f.count > 1 else ""
            L.append(f"\t{f.ctype} {f.name}{arr}; /* {f.doc} */")
        L.append("};")
        L.append("")
    return L


@generates(GENERATED, "p4/include/wire.p4", "xdp_agg/proto/wire.py", "_XDP_AGG_WIRE_P4_")
def wire_p4() -> list[str]:
    """The same headers and constants for P4_16."""
    L: list[str] = []
    L.append(f"const bit<16> SML_UDP_PORT = {hex(wire.UDP_PORT)};")
    L.append(f"const bit<16> SML_UDP_PORT_MASK = {hex(wire.UDP_PORT_MASK)};")
    L.append(f"const bit<4> SML_MSG_TYPE_DATA = {wire.MSG_TYPE_DATA};")
    L.append(f"const bit<4> SML_MSG_TYPE_SPARSE = {wire.MSG_TYPE_SPARSE};")
    L.append(f"const bit<4> SML_MSG_TYPE_SPARSE_EMPTY = {wire.MSG_TYPE_SPARSE_EMPTY};")
    L.append(f"const bit<16> SML_POOL_SLOT_MASK = {hex(wire.POOL_SLOT_MASK)};")
    L.append(f"const bit<8> SML_RESULT_TTL = {wire.RESULT_TTL};")
    L.append(f"const bit<16> SML_RESULT_IP_ID = {wire.RESULT_IP_ID};")
    L.append(f"const bit<8> SML_RESULT_TOS = {wire.RESULT_TOS};")
    L.append(f"const bit<3> SML_RESULT_IP_FLAGS = {wire.RESULT_IP_FLAGS};")
    for code, n in wire.SIZE_CODE_ELEMS.items():
        L.append(f"const bit<3> SML_SIZE_{n} = {code};")
    L.append(f"const bit<16> SML_ETH_HLEN = {wire.ETH_HLEN};")
    L.append(f"const bit<16> SML_IPV4_HLEN = {wire.IPV4_HLEN}; // no options")
    L.append(f"const bit<16> SML_SPARSE_HLEN = {wire.SPARSE_HLEN}; // sparse header bytes")
    L.append(
        f"const bit<16> SML_UDP_LEN_SPARSE_EMPTY = "
        f"{wire.UDP_HLEN + wire.sparse_payload_len(32, True)}; // UDP length, empty, not padded"
    )
    for n in wire.SIZE_CODE_ELEMS.values():
        L.append(
            f"const bit<16> SML_UDP_LEN_{n} = {wire.UDP_HLEN + wire.udp_payload_len(n)}; "
            f"// UDP length, {n} elements"
        )
    L.append("")
    for h in wire.HEADERS:
        L.append(f"/* {h.doc} */")
        L.append(f"header {h.name}_h {{")
        for f in h.fields:
            L.append(f"    bit<{f.bits}> {f.name}; // {f.doc}")
        L.append("}")
        L.append("")
    return L


# the wire constants the C fast path uses: (name in xdp_agg.proto.wire, C macro, what it is)
FASTPATH_WIRE = (
    ("EXPONENTS_AT", "FP_EXP_AT", "the exponent header (e0, e1), from the UDP payload's start"),
    ("EXP_HLEN", "FP_EXP_LEN", "exponent header bytes"),
    ("VALUES_AT", "FP_VALUES_AT", "the first int32, from the UDP payload's start"),
    ("POOL_VERSION_BIT", "FP_POOL_VERSION_BIT", "pool_index: version"),
    ("POOL_SLOT_MASK", "FP_POOL_SLOT_MASK", "pool_index: slot"),
    ("SWITCHML_OFFSET", "FP_FRAME_HLEN", "Ethernet + IPv4 + UDP headers before the payload"),
    ("MAX_LANES", "FP_MAX_LANES", "a job's lanes on a host (hostlib/_xsk.c XSK_SLOTS)"),
    # sparse all-reduces (docs/protocol.md section 8; hostlib/fp_sparse.c)
    ("MSG_TYPE_SPARSE", "FP_MSG_TYPE_SPARSE", "msg_type of a sparse packet with a block of data"),
    ("MSG_TYPE_SPARSE_EMPTY", "FP_MSG_TYPE_SPARSE_EMPTY", "msg_type of a header-only one"),
    ("SPARSE_AT", "FP_SPARSE_AT", "the sparse header (block, next, blocks), in the UDP payload"),
    ("SPARSE_HLEN", "FP_SPARSE_HLEN", "sparse header bytes"),
    ("SPARSE_VALUES_AT", "FP_SPARSE_VALUES_AT", "a sparse packet's first int32 (an empty's end)"),
)


@generates(GENERATED, "hostlib/fp_wire.h", "xdp_agg/proto/wire.py", "HOSTLIB_FP_WIRE_H")
def fastpath_wire_h() -> list[str]:
    """The wire constants of the C fast path, and FP_WIRE_CONSTANTS(X), the
    list the extension exports for hostlib.native_stream to check against xdp_agg.proto.wire."""
    L = []
    for name, macro, doc in FASTPATH_WIRE:
        value = getattr(wire, name)
        text = hex(value) if "BIT" in name or "MASK" in name else str(value)
        L.append(f"#define {macro} {text} /* {doc} */")
    L.append("")
    L.append("/* X(name in xdp_agg.proto.wire, value) of each constant above */")
    L.append(
        "#define FP_WIRE_CONSTANTS(X) "
        + " ".join(f"X({name}, {macro})" for name, macro, _ in FASTPATH_WIRE)
    )
    return L


GENERATED.update(p4gen.GENERATED)  # the P4 program's per-element parts and reasons


def drift() -> list[str]:
    """Generated files whose committed text differs from what the definitions give."""
    out = []
    for rel, gen in GENERATED.items():
        p = ROOT / rel
        if not p.exists() or p.read_text() != gen():
            out.append(rel)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--check", action="store_true", help="only report drift (exit 1)")
    args = ap.parse_args(argv)
    if args.check:
        bad = drift()
        for rel in bad:
            print(f"{rel} is out of date: run python -m xdp_agg.codegen", file=sys.stderr)
        return 1 if bad else 0
    for rel, gen in GENERATED.items():
        p = ROOT / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(gen())
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
