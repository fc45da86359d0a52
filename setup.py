"""Build of the C extension hostlib._fastpath and of the XDP aggregator's BPF objects (the
metadata is in pyproject.toml).

The BPF objects (xdp_switch/bpfbuild.py: clang -target bpf, one per build flavour) are compiled
into the wheel's xdp_switch/objects/, which libbpf loads at attach (xdp_switch/objload.py).

It needs only the system compiler and Python's headers. The AVX2 kernels are compiled with a
function target attribute and picked at run time, so no -march flag is needed and one build
runs on any x86-64. -ffp-contract=off keeps the float kernels bit-identical to numpy's
(no fused multiply-add where the reference rounds twice).
"""

from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py


class BuildPyWithBpf(build_py):
    """build_py, then the BPF objects into the built package (clang at build time only)."""

    def run(self):
        super().run()
        import sys

        # the source tree, importable in pip's isolated build (an editable install too)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from xdp_switch import bpfbuild

        bpfbuild.build(Path(self.build_lib) / "xdp_switch" / "objects", quiet=True)


setup(
    cmdclass={"build_py": BuildPyWithBpf},
    ext_modules=[
        Extension(
            "hostlib._fastpath",
            # the units of the fast path (hostlib/_fastpath.c says which does what)
            sources=[
                "hostlib/_fastpath.c",
                "hostlib/fp_kernels.c",
                "hostlib/fp_io.c",
                "hostlib/fp_loop.c",
                "hostlib/fp_dense.c",
                "hostlib/fp_sparse.c",
                "hostlib/_xsk.c",
                "hostlib/xsk_prog.c",
            ],
            depends=[
                "hostlib/_xsk.h",
                "hostlib/xsk_prog.h",
                "hostlib/bpf_insn.h",
                "hostlib/fp_counters.h",
                "hostlib/fp_dense.h",
                "hostlib/fp_io.h",
                "hostlib/fp_kernels.h",
                "hostlib/fp_loop.h",
                "hostlib/fp_run.h",
                "hostlib/fp_sparse.h",
                "hostlib/fp_util.h",
                "hostlib/fp_wire.h",
            ],
            extra_compile_args=[
                "-O2",
                "-ffp-contract=off",
                "-fno-strict-aliasing",
                "-Wall",
                "-Wextra",
                "-Wshadow",
                "-Wno-missing-field-initializers",
            ],
        )
    ],
)
