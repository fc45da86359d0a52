"""Build the XDP aggregator's BPF objects: `clang -target bpf -g -O2`, once per build flavour.

The Makefile (`make bpf`) and the wheel's build (setup.py) run `python -m xdp_switch.bpfbuild`,
which writes one object per flavour into xdp_switch/objects/ (package data, shipped in the
wheel); xdp_switch/objload.py loads them through libbpf. A flavour is a variant (VARIANTS),
how the slots find their CPUs (rss or cpumap) and whether the programs take multi-buffer frames
(frags): the builds attach can ask for. Test-only builds (race delays and mutants,
tests/root/test_xdp_concurrency.py) compile on demand through `compile_object` into a directory of
their own, which needs clang on the machine; production objects never do.

Objects are built with -Werror (a warning, a shadowed name among them, fails the build) and need
only UAPI headers (linux-libc-dev) and libbpf's (libbpf-dev), not the kernel's.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC_DIR = HERE / "bpf"  # a link to the repository's bpf/ in a checkout, a copy in a wheel
OBJ_DIR = HERE / "objects"
CLANG = os.environ.get("XDP_AGG_CLANG", "clang")
STRIP = "llvm-strip"  # -g: the DWARF goes, BTF and its line info (.BTF.ext) stay
VARIANT_FLAGS = {"percpu": (), "spinlock": ("-DAGG_SPINLOCK",)}
CFLAGS = (
    "-target",
    "bpf",
    "-mcpu=v3",  # 32-bit atomics whose result is used (../shared/design/platform.md)
    "-g",
    "-O2",
    "-Wall",
    "-Wshadow",
    "-Wno-unused-function",
    "-Werror",
)


class BuildError(RuntimeError):
    """clang refused a source or is missing; the message carries its output."""


@dataclass(frozen=True)
class Flavour:
    """One build of bpf/xdp_agg.c."""

    variant: str = "percpu"
    cpumap: bool = False
    frags: bool = False

    @property
    def name(self) -> str:
        return "-".join(
            ["xdp_agg", self.variant] + ["cpumap"] * self.cpumap + ["frags"] * self.frags
        )

    def flags(self) -> tuple[str, ...]:
        return (
            VARIANT_FLAGS[self.variant]
            + (("-DAGG_CPUMAP",) if self.cpumap else ())
            + (("-DAGG_FRAGS",) if self.frags else ())
        )


FLAVOURS = tuple(
    Flavour(v, c, f) for v in VARIANT_FLAGS for c in (False, True) for f in (False, True)
)
FLOOR = "xdp_floor"  # the micro-benchmark's floor program (bpf/xdp_floor.c)


def _include_dirs() -> list[str]:
    """The multiarch include directory, where Debian keeps <asm/types.h> for linux/bpf.h."""
    multiarch = Path(f"/usr/include/{platform.machine()}-linux-gnu")
    return [f"-I{multiarch}"] if multiarch.is_dir() else []


def compile_object(source: Path, out: Path, flags: tuple[str, ...] = ()) -> Path:
    """Compile `source` with CFLAGS and `flags` into `out` (written atomically); returns out."""
    if shutil.which(CLANG) is None:
        raise BuildError(f"{CLANG} is missing: install Debian's clang (make deps)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    cmd = [CLANG, *CFLAGS, *flags, *_include_dirs(), "-c", str(source), "-o", str(tmp)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = "\n".join(r.stderr.strip().splitlines()[-25:])
        raise BuildError(f"could not compile {source.name} ({' '.join(flags)}):\n{tail}")
    if shutil.which(STRIP):
        subprocess.run([STRIP, "-g", str(tmp)], check=True)
    os.replace(tmp, out)
    return out


def object_path(flavour: Flavour, obj_dir: Path | None = None) -> Path:
    return (obj_dir or OBJ_DIR) / f"{flavour.name}.o"


def sources() -> list[Path]:
    """Every file an object depends on: the C sources and headers, generated ones included."""
    return sorted(SRC_DIR.glob("*.[ch]")) + sorted(SRC_DIR.glob("generated/*.h"))


def stale(obj: Path) -> bool:
    """Whether `obj` is missing or older than one of its sources."""
    if not obj.exists():
        return True
    built = obj.stat().st_mtime
    return any(s.stat().st_mtime > built for s in sources())


def in_checkout() -> bool:
    """Whether the sources are the repository's (a link to ../bpf), where they may change after
    a build; in a wheel they are a copy, and the objects beside them are the ones shipped."""
    return SRC_DIR.is_symlink()


def build(obj_dir: Path = OBJ_DIR, force: bool = False, quiet: bool = False) -> list[Path]:
    """Every flavour's object and the floor's, those out of date rebuilt (one clang per CPU at
    a time); returns their paths."""
    jobs = [(object_path(f, obj_dir), SRC_DIR / "xdp_agg.c", f.flags()) for f in FLAVOURS]
    jobs.append((obj_dir / f"{FLOOR}.o", SRC_DIR / f"{FLOOR}.c", ()))
    todo = [(out, src, flags) for out, src, flags in jobs if force or stale(out)]
    if not quiet:
        for out, src, flags in todo:
            print(f"clang -target bpf {' '.join(flags)} {src.name} -> {out.name}", flush=True)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for done in [pool.submit(compile_object, s, o, f) for o, s, f in todo]:
            done.result()  # the first BuildError, if any
    return [out for out, _, _ in jobs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m xdp_switch.bpfbuild", description=__doc__)
    ap.add_argument("--out", type=Path, default=OBJ_DIR, help="where the objects go")
    ap.add_argument("--force", action="store_true", help="rebuild every object")
    args = ap.parse_args(argv)
    try:
        build(args.out, args.force)
    except BuildError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
