"""Load the XDP aggregator: through libbpf from the objects built with the project (the
default, xdp_switch/objload.py), or compiled here with bcc (XDP_AGG_TOOLCHAIN=bcc, below).

bcc compiles bpf/xdp_agg.c against the running kernel's headers at load time (4-7 s) and creates
its maps; the programs are loaded through bpfsys (xdp_switch/subprogs.py links their bpf_loop
callbacks, which bcc cannot). The per-CPU partials map is created here first, because the
program reaches it by fd (see bpf/maps.h). Everything afterwards works on file descriptors,
which xdp_switch.pins pins under bpffs.

The C sources are package data: `xdp_switch/bpf` is a link to the repository's top-level `bpf/`
in a checkout (and so in an editable install), and a copy of it in a wheel; either way
importlib.resources finds it, so an installed package compiles the program it ships.
"""

from __future__ import annotations

import contextlib
import ctypes as ct
import importlib.resources
import os
import platform
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xdp_agg import bpfsys
from xdp_agg.codegen import abi
from xdp_agg.errors import EnvironmentProblem, NeedsRoot, XdpAggError
from xdp_agg.proto import limits

from . import subprogs


def _package_dir(package: str, name: str) -> Path:
    """A directory of package data as a real path (bcc and clang read files, not resources)."""
    d = importlib.resources.files(package) / name
    if not isinstance(d, Path):  # e.g. a zip import; pip always installs packages unpacked
        raise EnvironmentProblem(
            f"{package}/{name} is not a directory on disk ({d}): "
            "install the package with pip (unpacked)"
        )
    return d


BPF_DIR = _package_dir("xdp_switch", "bpf")  # xdp_agg.c, xdp_floor.c, the headers, generated/
SOURCE = BPF_DIR / "xdp_agg.c"
BPF_XDP_DEVMAP = bpfsys.BPF_XDP_DEVMAP  # expected attach type of devmap egress programs

# Maps the control plane uses, by their names in bpf/maps.h.
MAP_NAMES = (
    "jobs",
    "workers",
    "slots",
    "slot_owner",
    "results",
    "stats",
    "worker_stats",
    "tx_ports",
    "port_workers",
    "copy_dests",
)
VARIANTS = {  # how slots are summed when several CPUs hit one slot
    "percpu": (),  # per-CPU partial sums, atomic completion count, gather by the completing CPU
    "spinlock": ("-DAGG_SPINLOCK",),  # one shared partial per slot under a bpf_spin_lock
}
# Test-only build options (bpf/aggregate.h), passed to load() as cflags by
# tests/test_xdp_concurrency.py alone: production builds define neither and compile exactly the
# program they compiled before these existed.
TEST_RACE_DELAY = "-DAGG_TEST_RACE_DELAY={}"  # spin 0..N ns (random) between arrival and addition
TEST_MUTANT_COMPLETE_ON_ARRIVAL = "-DAGG_TEST_MUTANT_COMPLETE_ON_ARRIVAL"  # the known-racy mutant


# Warnings of every build of our BPF C: -Wshadow, so that a local never hides another name (the
# compiler's warnings land in Loaded.warnings; tests/test_xdp_cases.py wants none of these).
WARNING_FLAGS = ("-Wno-unused-function", "-Wshadow")


def race_test_cflags(delay_ns: int = 0, mutant: bool = False) -> tuple[str, ...]:
    """cflags of a test-only build: a widened race window of up to `delay_ns` ns (0: none), and
    with `mutant` the deliberately racy completion on the arrival count. Never for production."""
    if not 0 <= delay_ns <= 50_000:
        raise ValueError(f"race delay must be 0..50000 ns, not {delay_ns}")
    flags = (TEST_RACE_DELAY.format(delay_ns),) if delay_ns else ()
    return flags + ((TEST_MUTANT_COMPLETE_ON_ARRIVAL,) if mutant else ())


PROG_INGRESS = "xdp_agg_ingress"
PROG_EGRESS = "xdp_agg_egress"
PROG_COPY = "xdp_agg_copy"  # unicast delivery: the egress program of every job's devmap
# How the packets of one slot reach a CPU (docs/design.md "One CPU per slot", bpf/slot_cpus.h).
SLOT_CPUS = {
    # on the CPU the NIC's receive hash chose; a slot spread over several CPUs has their partial
    # sums merged by the completing one
    "rss": (),
    # steered by xdp_agg_steer through a cpumap to the CPU that owns the slot, aggregated there
    "cpumap": ("-DAGG_CPUMAP",),
}
PROG_STEER = "xdp_agg_steer"  # cpumap: the program on the interfaces
PROG_CPUMAP = "xdp_agg_cpumap"  # cpumap: xdp_agg_ingress loaded for the cpumap's entries
CPUMAP_MAP_NAMES = ("slot_cpu", "cpu_map")  # cpumap: the maps the control plane fills
# Forwarding in the switch topology (bpf/forward.h): libbpf builds only (bcc builds pass)
FWD_MAP_NAMES = ("fwd_config", "fwd_ports", "fwd_macs", "fwd_own_macs", "fwd_own_ips", "fwd_stats")


class LoadError(XdpAggError):
    """The program could not be compiled or loaded (compiler error, verifier rejection); the
    message says what to do. A machine without bcc or kernel headers raises EnvironmentProblem."""


@dataclass
class Loaded:
    """A loaded aggregator: program and map fds (owned by the bcc or libbpf object while it
    lives)."""

    bpf: Any  # bcc.BPF or bpfsys.libbpf.Object, kept alive so the fds stay open
    progs: dict[str, int]
    maps: dict[str, int]
    pool_slots: int
    nr_cpus: int
    options: dict = field(default_factory=dict)
    own_fds: list[int] = field(default_factory=list)  # program fds, loaded here (not by bcc)
    warnings: list[str] = field(default_factory=list)  # the compiler's warning lines
    verified: dict[str, int] = field(default_factory=dict)  # program -> insns verified
    toolchain: str = "bcc"  # one of TOOLCHAINS
    path: Path | None = None  # libbpf: the object file loaded

    def close(self) -> None:
        """Close every fd of the loaded programs and maps (pins keep what they pin)."""
        if self.toolchain == "libbpf":
            self.bpf.close()  # libbpf owns every fd
            return
        for fd in self.own_fds + [self.maps[n] for n in OWN_MAPS if n in self.maps]:
            os.close(fd)
        self.own_fds.clear()
        self.bpf.cleanup()


def kernel_headers_present() -> bool:
    """bcc needs /lib/modules/$(uname -r)/build (see the Makefile's `headers` target)."""
    return (Path("/lib/modules") / platform.release() / "build" / "include").exists()


def _import_bcc():
    try:
        import bcc  # Debian's python3-bpfcc
    except ImportError as e:
        raise EnvironmentProblem(
            "bcc's Python module is missing: install python3-bpfcc (make deps) and run from a venv "
            "made with --system-site-packages from /usr/bin/python3 (make venv)"
        ) from e
    return bcc


def check_environment(what: str = "loading BPF programs"):
    """bcc, once root, kernel headers and bcc's module are there (NeedsRoot or
    EnvironmentProblem, saying what to install, when one is not)."""
    if os.geteuid() != 0:
        raise NeedsRoot(what)
    if not kernel_headers_present():
        raise EnvironmentProblem(
            f"no kernel headers at /lib/modules/{platform.release()}/build: run "
            "`sudo make headers` (installs linux-headers-amd64 and links it for this kernel)"
        )
    return _import_bcc()


@contextlib.contextmanager
def _capture_fd2():
    """Capture what bcc and the kernel write to stderr (compiler errors and warnings, the
    verifier log). Into a file, not a pipe: nobody reads a pipe while bcc writes, so more than
    a pipe's buffer of warnings would block the compile for ever."""
    sys.stderr.flush()
    saved = os.dup(2)
    out = []
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            out.append(f.read().decode(errors="replace"))


_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.M)
# the code's calls on a map (bpf/platform.h), in bcc's table methods where bcc declares the map
_MAP_CALL = re.compile(r"\b(bpf_map_lookup_elem|bpf_redirect_map)\(&(\w+),\s*")
_BCC_METHOD = {"bpf_map_lookup_elem": "lookup", "bpf_redirect_map": "redirect_map"}


def bcc_text(path: Path = SOURCE) -> str:
    """The program as bcc compiles it: one text (source_text), the code's calls on a map that
    bcc declares (`bpf_map_lookup_elem(&stats, k)`, written so for clang and libbpf) in bcc's
    table methods (`stats.lookup(k)`), which its rewriter turns into the map's fd. The maps the
    loader creates (OWN_MAPS) are pseudo fds already (bpf/platform.h AGG_FD_MAP)."""

    def method(m: re.Match) -> str:
        if m.group(2) in OWN_MAPS:
            return m.group(0)
        return f"{m.group(2)}.{_BCC_METHOD[m.group(1)]}("

    return _MAP_CALL.sub(method, source_text(path))


def source_text(path: Path = SOURCE, _seen: set | None = None) -> str:
    """The program as one text, with our own `#include "..."` files inlined.

    bcc rewrites map method calls (`stats.lookup(...)`) only in the main file, so code in our
    headers must become part of it; `#line` markers keep compiler messages pointing at the real
    file and line.
    """
    seen = set() if _seen is None else _seen
    out = []
    pos = 0
    text = path.read_text()
    for m in _INCLUDE.finditer(text):
        out.append(text[pos : m.start()])
        inc = (path.parent / m.group(1)).resolve()
        if inc not in seen:
            seen.add(inc)
            line = text.count("\n", 0, m.end()) + 2
            out.append(f'#line 1 "{inc}"\n{source_text(inc, seen)}#line {line} "{path}"\n')
        pos = m.end() + 1
    out.append(text[pos:])
    return "".join(out)


def _load_own(b, name: str, attach_type: int, frags: bool, as_name: str | None = None):
    """Load bcc's compiled `name` (map fds patched in, bpf_loop callbacks linked) through
    bpfsys: (fd, instructions the verifier processed). Every program is loaded so, since bcc's
    load_func can neither link callbacks nor load an XDP multi-buffer program
    (BPF_F_XDP_HAS_FRAGS, ../shared/design/platform.md); `as_name` loads one function a second
    time under another name (with another expected attach type)."""
    what = as_name or name
    flags = bpfsys.BPF_F_XDP_HAS_FRAGS if frags else 0
    try:
        return subprogs.load(b, name, what, flags, attach_type)
    except subprogs.LinkError as e:  # a callback the program names but the compile lacks
        raise LoadError(f"could not link {what}: {e}") from e
    except bpfsys.ProgLoadError as e:
        tail = "\n".join(e.log.strip().splitlines()[-25:])
        kind = " (frags)" if frags else ""
        raise LoadError(
            f"the kernel verifier rejected {what}{kind}: {subprogs.explain(e.log)}\n"
            f"the verifier log's tail:\n{tail}\n({e})"
        ) from e


TEST_RUN_IFINDEX = 1  # loopback: where BPF_PROG_TEST_RUN's frames come in


def prepare_test_runs(prog: Loaded) -> None:
    """What BPF_PROG_TEST_RUN needs of a loaded build beyond what attach gives it: in the cpumap
    build, a way back out of loopback (bpf/slot_cpus.h tx_self), where an answer goes (a test
    run returns the XDP_REDIRECT; nothing is sent)."""
    if "tx_self" in prog.maps:
        val = (ct.c_uint32 * 2)(TEST_RUN_IFINDEX, prog.progs[PROG_COPY])  # bpf_devmap_val
        bpfsys.map_update(prog.maps["tx_self"], ct.c_uint32(TEST_RUN_IFINDEX), val)


def test_runnable(prog: Loaded, name: str) -> int:
    """Program `name` of loaded build `prog` loaded once more as a plain XDP program, which
    BPF_PROG_TEST_RUN runs (it refuses a devmap or cpumap program); its fd, the caller's."""
    if prog.toolchain == "libbpf":
        from . import objload

        return objload.test_runnable(prog, name)
    fd, _ = _load_own(prog.bpf, name, 0, prog.options["frags"], f"{name[:9]}_run")
    return fd


def _load_programs(b, frags: bool, cpumap: bool) -> tuple[dict[str, int], dict[str, int]]:
    """Load the compiled programs: {name: fd} (the caller closes them) and {name: instructions
    the verifier processed}. With `cpumap`, also the steering program and the aggregator loaded
    a second time for the cpumap's entries (expected attach type BPF_XDP_CPUMAP, which the
    kernel neither attaches to a device nor test-runs: PROG_INGRESS stays the plain XDP load of
    the same code, which tests and the micro-benchmark run)."""
    progs: dict[str, int] = {}
    verified: dict[str, int] = {}
    devmap = bpfsys.BPF_XDP_DEVMAP
    wanted = [
        (PROG_INGRESS, PROG_INGRESS, 0),
        (PROG_EGRESS, PROG_EGRESS, devmap),
        (PROG_COPY, PROG_COPY, devmap),
    ]
    if cpumap:
        wanted += [(PROG_STEER, PROG_STEER, 0), (PROG_INGRESS, PROG_CPUMAP, bpfsys.BPF_XDP_CPUMAP)]
    try:
        for name, as_name, attach_type in wanted:
            if name == PROG_COPY and not _has(b, PROG_COPY):
                continue  # an older xdp_agg.c (bench/xdp_compare.py), before unicast delivery
            progs[as_name], verified[as_name] = _load_own(b, name, attach_type, frags, as_name)
    except BaseException:
        for fd in progs.values():
            os.close(fd)
        raise
    return progs, verified


def _has(b, name: str) -> bool:
    """Whether bcc's compile `b` holds function or map `name` (an older source may lack the
    newer ones: bench/xdp_compare.py)."""
    try:
        b[name.encode()]  # a map (bcc raises KeyError for a name it has not)
        return True
    except KeyError:
        pass
    try:
        b.dump_func(name.encode())  # a function (bcc raises Exception for one it has not)
        return True
    except Exception:
        return False


def job_copies_devmap(name: str = "copies") -> int:
    """A new devmap of the shape job_copies holds (one entry per worker: struct bpf_devmap_val,
    the interface and the egress program); returns its fd."""
    return bpfsys.map_create(bpfsys.MAP_TYPE_DEVMAP, 4, 8, limits.MAX_WORKERS, name)


def _create_job_copies() -> int:
    """The map of job -> that job's devmap of copies (bpf/maps.h job_copies); returns its fd."""
    template = job_copies_devmap("copies_tmpl")
    try:
        return bpfsys.map_create(
            bpfsys.MAP_TYPE_ARRAY_OF_MAPS, 4, 4, limits.MAX_JOBS, "job_copies", template
        )
    finally:
        os.close(template)  # the outer map keeps what it needs of it


# The maps created here, not by bcc (the program names them by fd: -DAGG_<NAME>_FD), which
# Loaded.close closes: bcc cannot declare them (a per-CPU array sized at load, a map of maps,
# a devmap hash).
OWN_MAPS = ("partials", "job_copies", "tx_self")


def _create_own_maps(pool_slots: int, cpumap: bool) -> dict[str, int]:
    """OWN_MAPS, created: {name: fd}; tx_self (bpf/slot_cpus.h) in the cpumap build only."""
    fds: dict[str, int] = {}
    try:
        fds["partials"] = bpfsys.map_create(
            bpfsys.MAP_TYPE_PERCPU_ARRAY, 4, ct.sizeof(abi.Partial), pool_slots * 2, "partials"
        )
        fds["job_copies"] = _create_job_copies()
        if cpumap:  # ifindex -> struct bpf_devmap_val
            fds["tx_self"] = bpfsys.map_create(
                bpfsys.MAP_TYPE_DEVMAP_HASH, 4, 8, limits.MAX_PORTS, "tx_self"
            )
    except BaseException:
        _close_all(fds.values())
        raise
    return fds


# How the program is built and loaded: "libbpf" (the default) loads the object
# xdp_switch/bpfbuild.py built (xdp_switch/objload.py); "bcc" compiles bpf/xdp_agg.c at load
# time (kernel headers, LLVM: seconds).
TOOLCHAINS = ("bcc", "libbpf")
TOOLCHAIN_ENV = "XDP_AGG_TOOLCHAIN"


def default_toolchain() -> str:
    """The toolchain load() uses when not told: $XDP_AGG_TOOLCHAIN, else libbpf."""
    name = os.environ.get(TOOLCHAIN_ENV) or "libbpf"
    if name not in TOOLCHAINS:
        raise ValueError(f"{TOOLCHAIN_ENV} must be one of {', '.join(TOOLCHAINS)}, not {name!r}")
    return name


def load(
    pool_slots: int = limits.DEFAULT_POOL_SLOTS,
    cflags: tuple[str, ...] = (),
    variant: str = "percpu",
    source: Path = SOURCE,
    frags: bool = False,
    slot_cpus: str = "rss",
    toolchain: str | None = None,
) -> Loaded:
    """Compile bpf/xdp_agg.c and load its programs; returns their fds and the maps' fds.

    `variant` is one of VARIANTS: "percpu" (the design) or "spinlock" (the baseline). `source`:
    another copy of xdp_agg.c (bench/xdp_compare.py loads an older revision beside this one).
    `frags`: load the programs as XDP multi-buffer programs (BPF_F_XDP_HAS_FRAGS), which take
    frames larger than a page (the jumbo size codes) and attach to a veth whose peer's MTU is
    above about 3500; built with -DAGG_FRAGS.
    `slot_cpus` is one of SLOT_CPUS: "cpumap" also loads PROG_STEER and PROG_CPUMAP and the
    maps CPUMAP_MAP_NAMES (bpf/slot_cpus.h).
    `toolchain`: one of TOOLCHAINS (None: default_toolchain()); libbpf loads the prebuilt
    object of the build (xdp_switch/objload.py), which takes no `source`.
    Raises NeedsRoot or EnvironmentProblem (not root, no bcc, no kernel headers) and LoadError
    (compiler error, or a verifier rejection: its real cause, subprogs.explain, and the tail of
    the verifier log), each with an actionable message; ValueError for a variant, slot_cpus or
    pool size out of range.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}")
    if slot_cpus not in SLOT_CPUS:
        raise ValueError(f"slot_cpus must be one of {', '.join(SLOT_CPUS)}")
    if not 1 <= pool_slots <= 1 << 14:
        raise ValueError(f"pool slots must be 1..16384, not {pool_slots}")
    toolchain = toolchain or default_toolchain()
    if toolchain not in TOOLCHAINS:
        raise ValueError(f"toolchain must be one of {', '.join(TOOLCHAINS)}")
    if toolchain == "libbpf":
        if source != SOURCE:
            raise ValueError("the libbpf toolchain loads the built objects, not another source")
        from . import objload

        return objload.load(pool_slots, tuple(cflags), variant, frags, slot_cpus)
    bcc = check_environment()
    # a cpumap has an entry per possible CPU; the kernel refuses more than it was built for
    # (NR_CPUS), which only a test building for more CPUs than this machine has can ask
    nr_cpus = min(bpfsys.possible_cpus(), bpfsys.kernel_max_cpus())
    cpumap = slot_cpus == "cpumap"
    own = _create_own_maps(pool_slots, cpumap)
    flags = [
        *(f"-DAGG_{name.upper()}_FD={fd}" for name, fd in own.items()),
        f"-DAGG_POOL_SLOTS={pool_slots}",
        f"-DAGG_NR_CPUS={nr_cpus}",
        f"-DAGG_CALLBACK_MAGIC={subprogs.CALLBACK_MAGIC:#x}",
        *WARNING_FLAGS,
        *VARIANTS[variant],
        *SLOT_CPUS[slot_cpus],
        *(("-DAGG_FRAGS",) if frags else ()),
        *cflags,
    ]
    log = []
    try:
        with _capture_fd2() as log:
            b = bcc.BPF(text=bcc_text(source).encode(), cflags=flags)
    except Exception as e:  # bcc raises plain Exceptions
        _close_all(own.values())
        tail = "\n".join("".join(log).strip().splitlines()[-25:])
        raise LoadError(f"could not compile bpf/xdp_agg.c:\n{tail}\n({e})") from e
    try:
        progs, verified = _load_programs(b, frags, cpumap)
    except LoadError:
        _close_all(own.values())
        b.cleanup()
        raise
    names = MAP_NAMES + (CPUMAP_MAP_NAMES if cpumap else ())
    maps = {name: b[name.encode()].map_fd for name in names if _has(b, name)}
    maps.update(own)
    options = {"cflags": list(cflags), "variant": variant, "frags": frags, "slot_cpus": slot_cpus}
    warnings = [line for line in "".join(log).splitlines() if "warning:" in line]
    return Loaded(
        b, progs, maps, pool_slots, nr_cpus, options, list(progs.values()), warnings, verified
    )


def _close_all(fds) -> None:
    for fd in fds:
        os.close(fd)
