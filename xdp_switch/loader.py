"""Load the XDP aggregator: the object of the build asked for, built with the project by clang
(xdp_switch/bpfbuild.py), opened and loaded through libbpf (xdp_switch/objload.py). Everything
afterwards works on file descriptors, which xdp_switch.pins pins under bpffs.

The C sources are package data: `xdp_switch/bpf` is a link to the repository's top-level `bpf/`
in a checkout (and so in an editable install), and a copy of it in a wheel; either way
importlib.resources finds it.
"""

from __future__ import annotations

import ctypes as ct
import importlib.resources
from dataclasses import dataclass, field
from pathlib import Path

from xdp_agg import bpfsys
from xdp_agg.bpfsys import libbpf
from xdp_agg.errors import EnvironmentProblem, XdpAggError
from xdp_agg.proto import limits


def _package_dir(package: str, name: str) -> Path:
    """A directory of package data as a real path (clang reads files, not resources)."""
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
# tests/root/test_xdp_concurrency.py alone: production builds define neither and compile exactly the
# program they compiled before these existed.
TEST_RACE_DELAY = "-DAGG_TEST_RACE_DELAY={}"  # spin 0..N ns (random) between arrival and addition
TEST_MUTANT_COMPLETE_ON_ARRIVAL = "-DAGG_TEST_MUTANT_COMPLETE_ON_ARRIVAL"  # the known-racy mutant


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
# Forwarding in the switch topology (bpf/forward.h): the maps the control plane fills
FWD_MAP_NAMES = (
    "fwd_config",
    "fwd_ports",
    "fwd_macs",
    "fwd_own_macs",
    "fwd_own_ips",
    "fwd_stats",
    "fwd_groups",  # IGMP snooping (bpf/snoop.h): (group, port) -> when it lapses
    "fwd_group_any",
    "fwd_mrouters",
    "fwd_querier",
)


class LoadError(XdpAggError):
    """The program could not be loaded (verifier rejection; a test-only build clang refused); the
    message says what to do. A build whose object is missing raises EnvironmentProblem."""


@dataclass
class Loaded:
    """A loaded aggregator: program and map fds (owned by the libbpf object while it lives)."""

    bpf: libbpf.Object  # kept alive so the fds stay open
    progs: dict[str, int]
    maps: dict[str, int]
    pool_slots: int
    nr_cpus: int
    options: dict = field(default_factory=dict)
    verified: dict[str, int] = field(default_factory=dict)  # program -> insns verified
    path: Path | None = None  # the object file loaded

    def close(self) -> None:
        """Close every fd of the loaded programs and maps (pins keep what they pin)."""
        self.bpf.close()  # libbpf owns every fd


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
    from . import objload

    return objload.test_runnable(prog, name)


def job_copies_devmap(name: str = "copies") -> int:
    """A new devmap of the shape job_copies holds (one entry per worker: struct bpf_devmap_val,
    the interface and the egress program); returns its fd."""
    return bpfsys.map_create(bpfsys.MAP_TYPE_DEVMAP, 4, 8, limits.MAX_WORKERS, name)


def load(
    pool_slots: int = limits.DEFAULT_POOL_SLOTS,
    cflags: tuple[str, ...] = (),
    variant: str = "percpu",
    source: Path = SOURCE,
    frags: bool = False,
    slot_cpus: str = "rss",
    skip: tuple[str, ...] = (),
) -> Loaded:
    """Load the build's object (xdp_switch/objload.py); returns its programs' and maps' fds.

    `variant` is one of VARIANTS: "percpu" (the design) or "spinlock" (the baseline).
    `frags`: the XDP multi-buffer build (BPF_F_XDP_HAS_FRAGS), which takes frames larger than a
    page (the jumbo size codes) and attaches to a veth whose peer's MTU is above about 3500.
    `slot_cpus` is one of SLOT_CPUS: "cpumap" also loads PROG_STEER and PROG_CPUMAP and the
    maps CPUMAP_MAP_NAMES (bpf/slot_cpus.h).
    `cflags` (test-only builds, race_test_cflags) and `source` (another revision's xdp_agg.c:
    bench/xdp_compare.py) are compiled by clang first, into a directory of their own; the
    builds attach makes are the ones built with the project. `skip`: programs of the build left
    unloaded (attach's cpumap build skips PROG_INGRESS, which only tests run there: the
    verifier's walk of the aggregator, most of the load's time, then happens once).
    Raises NeedsRoot, EnvironmentProblem (the build's object is missing) and LoadError (a
    verifier rejection: its real cause, objload.explain, and the tail of the verifier log),
    each with an actionable message; ValueError for a variant, slot_cpus or pool size out of
    range.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}")
    if slot_cpus not in SLOT_CPUS:
        raise ValueError(f"slot_cpus must be one of {', '.join(SLOT_CPUS)}")
    if not 1 <= pool_slots <= 1 << 14:
        raise ValueError(f"pool slots must be 1..16384, not {pool_slots}")
    from . import objload

    return objload.load(pool_slots, tuple(cflags), variant, frags, slot_cpus, source, skip)
