"""Load the XDP aggregator from its prebuilt object through libbpf.

xdp_switch/bpfbuild.py compiled bpf/xdp_agg.c once per flavour when the project was built;
here the flavour's object is opened, the sizes that depend on the machine are set (the pool's
maps' max_entries and `const volatile u32 agg_pool_slots`, the cpumap's entries), and libbpf
creates the maps (BTF-defined, the map of devmaps and the per-CPU partials included), links
the bpf_loop callbacks and loads the programs. Nothing is compiled, so attach takes a fraction
of a second and needs neither clang nor kernel headers. A test-only build (race delays or the
mutant, loader.race_test_cflags) is compiled here first, into a directory of its own; so is
another revision's source (bench/xdp_compare.py).

A refusal is explained in plain words (`explain`): the verifier's processed-instruction limit,
or the instruction it stopped at and what it said of it, ahead of the log's tail.

The aggregator's loops converge at may_goto instructions (bpf/aggregate.h, kernel 6.9). A kernel
without may_goto (Debian 12's 6.1, Ubuntu 24.04's 6.8) loads a copy of the object whose
may_goto instructions are `if r10 == 0 goto` their target, never taken: the same program, its
loops walked by the verifier step by step as before may_goto (`without_may_goto`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path

from xdp_agg import bpfsys
from xdp_agg.bpfsys import insn, libbpf
from xdp_agg.errors import EnvironmentProblem, NeedsRoot

from . import bpfbuild, loader

# map -> its entries, from (pool_slots, nr_cpus): set before load; the others are fixed in C
MAP_SIZES = {
    "slots": lambda pool, cpus: pool,
    "slot_owner": lambda pool, cpus: pool,
    "results": lambda pool, cpus: pool * 2,
    "partials": lambda pool, cpus: pool * 2,
    "contrib_cpus": lambda pool, cpus: pool * 2,
    "locked_partials": lambda pool, cpus: pool * 2,
    "cpu_map": lambda pool, cpus: cpus,
}
# the programs of a build, by flavour (xdp_agg_cpumap: the aggregator for the cpumap's entries)
PROGRAMS = (loader.PROG_INGRESS, loader.PROG_EGRESS, loader.PROG_COPY)
CPUMAP_PROGRAMS = (loader.PROG_STEER, loader.PROG_CPUMAP)
OWN_MAPS = ("partials", "job_copies")  # maps the control plane reaches beyond loader.MAP_NAMES
BPF_XDP = 37  # expected attach type of a plain XDP program (enum bpf_attach_type)
TEST_BUILD_DIR = Path(tempfile.gettempdir()) / "xdp-agg-test-builds"
VERIFIER_LIMIT = 1_000_000  # BPF_COMPLEXITY_LIMIT_INSNS, kernel/bpf/verifier.c
MAY_GOTO = insn.BPF_JMP | 0xE0  # BPF_JMP | BPF_JCOND: may_goto (kernel 6.9)
# what a kernel without may_goto runs instead: if r10 == 0 goto (the frame pointer is never 0)
NEVER = insn.BPF_JMP | insn.BPF_JEQ | insn.BPF_K
SHF_EXECINSTR = 0x4  # an ELF section of instructions


def explain(log: str) -> str:
    """The real cause of a verifier refusal, from its log: the processed-instruction limit, or
    the instruction it stopped at and what it said of it."""
    lines = [line for line in log.strip().splitlines() if line.strip()]
    m = re.search(r"BPF program is too large\. Processed (\d+) insn", log)
    if m:
        return (
            f"the verifier gave up after {int(m.group(1)):,} processed instructions, its limit "
            f"of {VERIFIER_LIMIT:,} (the program's verification grew too large)"
        )
    insns = [i for i, line in enumerate(lines) if re.match(r"\d+: \(", line)]
    if not insns:
        return lines[-1] if lines else "no verifier log"
    at = insns[-1]
    said = [line for line in lines[at + 1 :] if not line.startswith("processed ")]
    reason = said[0] if said else "(no message)"
    insn = lines[at].split(";")[0].strip()  # without the register states of a verbose log
    return f"at instruction {insn.split(':')[0]} ({insn}): {reason}"


def object_for(
    flavour: bpfbuild.Flavour, cflags: tuple[str, ...], source: Path = loader.SOURCE
) -> Path:
    """The object of `flavour`: the built one (rebuilt first in a checkout whose sources
    changed since), or with test-only `cflags` or another `source` one compiled now."""
    if source != loader.SOURCE:  # another revision's tree: compiled afresh every time
        TEST_BUILD_DIR.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(".o", f"{flavour.name}-", TEST_BUILD_DIR)
        os.close(fd)
        return bpfbuild.compile_object(source, Path(name), flavour.flags() + cflags)
    if cflags:
        tag = hashlib.sha256(" ".join(cflags).encode()).hexdigest()[:12]
        out = TEST_BUILD_DIR / f"{flavour.name}-{tag}.o"
        if bpfbuild.stale(out):
            bpfbuild.compile_object(bpfbuild.SRC_DIR / "xdp_agg.c", out, flavour.flags() + cflags)
        return out
    return _built(bpfbuild.object_path(flavour), "xdp_agg.c", flavour.flags())


def _built(out: Path, source: str, flags: tuple[str, ...] = ()) -> Path:
    """Object `out` of bpf/`source`, rebuilt first in a checkout whose sources changed since;
    EnvironmentProblem when it is missing."""
    if bpfbuild.in_checkout() and bpfbuild.stale(out):
        bpfbuild.compile_object(bpfbuild.SRC_DIR / source, out, flags)
    if not out.exists():
        raise EnvironmentProblem(
            f"the BPF object {out.name} is missing: build the project (`make bpf`, or install "
            "the wheel, which ships them)"
        )
    return out


def _refusal(e: libbpf.ObjectLoadError, frags: bool) -> loader.LoadError:
    """A LoadError that says why the kernel refused the object: explain's words for a verifier
    refusal, libbpf's for anything else."""
    if not e.prog or not e.log.strip():
        return loader.LoadError(f"libbpf could not load the aggregator: {e}")
    tail = "\n".join(e.log.strip().splitlines()[-25:])
    kind = " (frags)" if frags else ""
    return loader.LoadError(
        f"the kernel verifier rejected {e.prog}{kind}: {explain(e.log)}\n"
        f"the verifier log's tail:\n{tail}\n({e.strerror})"
    )


@functools.cache
def may_goto_supported() -> bool:
    """Whether this kernel takes may_goto (6.9): a probe program of four instructions."""
    probe = [
        insn.BPF_MOV64_IMM(insn.BPF_REG_0, bpfsys.XDP_PASS),
        insn.BPF_RAW_INSN(MAY_GOTO, 0, 0, 1, 0),  # may_goto +1
        insn.BPF_MOV64_IMM(insn.BPF_REG_0, bpfsys.XDP_PASS),
        insn.BPF_EXIT_INSN(),
    ]
    try:
        fd = bpfsys.prog_load(bpfsys.PROG_TYPE_XDP, probe, "may_goto_probe")
    except bpfsys.ProgLoadError:
        return False
    os.close(fd)
    return True


def without_may_goto(elf: bytes) -> bytes:
    """ELF object `elf` with each may_goto instruction turned into `if r10 == 0 goto` the same
    target: a jump the verifier knows is never taken, as may_goto is not but for a program that
    loops for a quarter of a second. An instruction's first byte is its opcode, and no other
    instruction of a BPF section has may_goto's (the second half of a 64-bit load has 0)."""
    out = bytearray(elf)
    shoff = struct.unpack_from("<Q", out, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", out, 0x3A)
    for i in range(shnum):
        sh = shoff + i * shentsize
        flags = struct.unpack_from("<Q", out, sh + 0x08)[0]
        offset, size = struct.unpack_from("<QQ", out, sh + 0x18)
        if not flags & SHF_EXECINSTR:
            continue
        for at in range(offset, offset + size, 8):
            if out[at] == MAY_GOTO:
                out[at], out[at + 1] = NEVER, insn.BPF_REG_10  # dst r10, the offset kept
    return bytes(out)


def _open(path: Path, pool_slots: int, nr_cpus: int) -> libbpf.Object:
    if may_goto_supported():
        obj = libbpf.Object(path)
    else:  # a copy without may_goto, under the same name (its maps' names come from it)
        tmp = Path(tempfile.mkdtemp(prefix="xdp-agg-"))
        try:
            (tmp / path.name).write_bytes(without_may_goto(path.read_bytes()))
            obj = libbpf.Object(tmp / path.name)
        finally:
            shutil.rmtree(tmp)
    try:
        names = set(obj.map_names())
        for name, size in MAP_SIZES.items():
            if name in names:
                obj.set_max_entries(name, size(pool_slots, nr_cpus))
        obj.set_rodata("agg_pool_slots", pool_slots)
    except BaseException:
        obj.close()
        raise
    return obj


def load(
    pool_slots: int,
    cflags: tuple[str, ...],
    variant: str,
    frags: bool,
    slot_cpus: str,
    source: Path = loader.SOURCE,
    skip: tuple[str, ...] = (),
) -> loader.Loaded:
    """loader.load (the arguments are checked there)."""
    if os.geteuid() != 0:
        raise NeedsRoot("loading BPF programs")
    nr_cpus = min(bpfsys.possible_cpus(), bpfsys.kernel_max_cpus())
    cpumap = slot_cpus == "cpumap"
    flavour = bpfbuild.Flavour(variant, cpumap, frags)
    try:
        path = object_for(flavour, tuple(cflags), source)
    except bpfbuild.BuildError as e:
        raise loader.LoadError(str(e)) from e
    try:
        obj = _open(path, pool_slots, nr_cpus)
    except libbpf.LibbpfError as e:  # not an object libbpf can read, a map it cannot size
        raise loader.LoadError(f"libbpf could not open {path.name}: {e}") from e
    try:
        for name in skip:
            obj.skip_program(name)
        obj.load()
    except libbpf.ObjectLoadError as e:
        obj.close()
        raise _refusal(e, frags) from e
    except BaseException:
        obj.close()
        raise
    names = tuple(n for n in PROGRAMS + (CPUMAP_PROGRAMS if cpumap else ()) if n not in skip)
    progs = {n: obj.prog_fd(n) for n in names}
    verified = {n: bpfsys.prog_info(fd).verified_insns for n, fd in progs.items()}
    wanted = (
        loader.MAP_NAMES
        + OWN_MAPS
        + loader.FWD_MAP_NAMES
        + (loader.CPUMAP_MAP_NAMES + ("tx_self",) if cpumap else ())
    )
    maps = {n: obj.map_fd(n) for n in wanted}
    options = {"cflags": list(cflags), "variant": variant, "frags": frags, "slot_cpus": slot_cpus}
    return loader.Loaded(
        obj,
        progs,
        maps,
        pool_slots,
        nr_cpus,
        options,
        verified=verified,
        path=path,
    )


def load_floor() -> libbpf.Object:
    """The micro-benchmark's floor (bpf/xdp_floor.c, bpfbuild.FLOOR) loaded; the caller closes
    it."""
    obj = libbpf.Object(_built(bpfbuild.OBJ_DIR / f"{bpfbuild.FLOOR}.o", f"{bpfbuild.FLOOR}.c"))
    try:
        obj.load()
    except BaseException:
        obj.close()
        raise
    return obj


def test_runnable(prog: loader.Loaded, name: str) -> int:
    """loader.test_runnable: the build's object opened again, program `name` alone
    loaded as a plain XDP program on the loaded build's maps (every one reused by fd); its fd,
    the caller's."""
    assert prog.path is not None, "a loaded build knows its object file"
    obj = _open(prog.path, prog.pool_slots, prog.nr_cpus)
    try:
        for m in obj.map_names():
            obj.reuse_map_fd(m, prog.bpf.map_fd(m))
        obj.only_program(name, BPF_XDP)
        try:
            obj.load()
        except libbpf.ObjectLoadError as e:
            raise _refusal(e, prog.options["frags"]) from e
        return os.dup(obj.prog_fd(name))
    finally:
        obj.close()
