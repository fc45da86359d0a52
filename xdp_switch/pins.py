"""Where an attached aggregator lives between commands: pins under bpffs and a state file.

    /sys/fs/bpf/xdp-agg/<name>/maps/<map>     every map (jobs, workers, slots, ..., partials)
    /sys/fs/bpf/xdp-agg/<name>/progs/ingress  the XDP program (--slot-cpus rss)
    /sys/fs/bpf/xdp-agg/<name>/progs/steer    --slot-cpus cpumap: the XDP program, which steers
    /sys/fs/bpf/xdp-agg/<name>/progs/cpumap   ... to the aggregator on the cpumap's CPUs
    /sys/fs/bpf/xdp-agg/<name>/progs/egress   the devmap egress program (the switch topology)
    /run/xdp-agg/<name>.json                  interfaces, topology, XDP mode, netns, program id,
                                              the AttachOptions as attached (State below)
    /run/xdp-agg/<name>.jobs                  `serve`'s job table (xdp_agg.ctl.jobtable)
    /run/xdp-agg/<name>.lock                  held (flock) by the one `serve` of <name>

`detach` removes exactly these, nothing else. XDP_AGG_PIN_ROOT and XDP_AGG_STATE_DIR move them
(the tests use their own).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from xdp_agg import bpfsys
from xdp_agg.errors import NeedsRoot, XdpAggError

from .attach_options import TOPOLOGIES as TOPOLOGIES  # re-exported: pins.TOPOLOGIES
from .attach_options import XDP_MODES as XDP_MODES
from .attach_options import AttachOptions


class NotAttached(XdpAggError):
    """No aggregator of that name is attached (no state file, or nothing pinned)."""

    def __init__(self, name: str, missing: Path) -> None:
        opt = "" if name == "default" else f" --name {name}"
        super().__init__(
            f"no aggregator {name!r} is attached (no {missing}): attach one with "
            f"`xdp-agg{opt} attach IFACE`, or see `ls {state_dir()}` for the names in use"
        )


def pin_root() -> Path:
    return Path(os.environ.get("XDP_AGG_PIN_ROOT", "/sys/fs/bpf/xdp-agg"))


def state_dir() -> Path:
    return Path(os.environ.get("XDP_AGG_STATE_DIR", "/run/xdp-agg"))


def bpffs_mounted(path: Path | None = None) -> bool:
    """True when the bpffs that holds the pin root is mounted."""
    target = str(path or pin_root())
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return False
    return any(m[2] == "bpf" and (target + "/").startswith(m[1].rstrip("/") + "/") for m in mounts)


@dataclass
class State:
    """What `attach` made, recorded for status, stats and detach (the state file's JSON)."""

    name: str
    topology: str  # one of TOPOLOGIES: "one-arm" (one interface) or "switch" (one per port)
    xdp_mode: str  # one of XDP_MODES: "native" or "skb"
    netns: str | None
    interfaces: list[dict]  # {"ifname", "ifindex", "prog_id"}
    pool_slots: int
    prog_id: int
    egress_prog_id: int
    attached_at: float
    # AttachOptions.to_dict() as attached (resolved), with the loaded program's "nr_cpus"; an
    # older version's file has some of its keys (attach_options fills in the rest)
    options: dict = field(default_factory=dict)
    # routed forwarding: the kernel sysctls attach set, {path: the value before}, which detach
    # writes back (xdp_switch.forwarding)
    sysctls: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def attach_options(self) -> AttachOptions:
        """How it was attached: the recorded options, the top-level topology, XDP mode and pool
        size, and defaults for what an older version did not record. ValueError for a bad
        value."""
        top = {"topology": self.topology, "xdp_mode": self.xdp_mode, "pool_slots": self.pool_slots}
        return AttachOptions.from_dict({**self.options, **top})

    @classmethod
    def from_dict(cls, d: dict) -> State:
        """Read a state file's JSON (keys this version does not know are left out)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def check_name(name: str) -> str:
    """`name` if it can name an aggregator (a file name: not empty, no "/", no leading ".")."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"bad aggregator name {name!r}: use letters, digits, '-' or '_'")
    return name


def _bpf_obj_error(e: bpfsys.BpfError, what: str) -> XdpAggError:
    if e.errno in (errno.EPERM, errno.EACCES):
        return NeedsRoot(what)
    return XdpAggError(f"{what} failed: {os.strerror(e.errno or 0)}")


class Instance:
    """The pins and state file of one named aggregator."""

    def __init__(self, name: str) -> None:
        self.name = check_name(name)
        self.dir = pin_root() / name
        self.state_path = state_dir() / f"{name}.json"

    def exists(self) -> bool:
        return self.state_path.exists() or self.dir.exists()

    def map_path(self, name: str) -> Path:
        return self.dir / "maps" / name

    def prog_path(self, name: str) -> Path:
        return self.dir / "progs" / name

    def pin(self, maps: dict[str, int], progs: dict[str, int]) -> None:
        (self.dir / "maps").mkdir(parents=True, exist_ok=True)
        (self.dir / "progs").mkdir(parents=True, exist_ok=True)
        paths = [(fd, self.map_path(n)) for n, fd in maps.items()]
        paths += [(fd, self.prog_path(n)) for n, fd in progs.items()]
        for fd, path in paths:
            try:
                bpfsys.obj_pin(fd, str(path))
            except bpfsys.BpfError as e:
                raise _bpf_obj_error(e, f"pinning {path}") from e

    def open_maps(self) -> dict[str, int]:
        """fds of every pinned map, by name."""
        d = self.dir / "maps"
        try:
            if not d.is_dir():
                raise NotAttached(self.name, d)
            return {p.name: bpfsys.obj_get(str(p)) for p in sorted(d.iterdir())}
        except PermissionError as e:  # bpffs is root's: a non-root user cannot even list it
            raise NeedsRoot("reading the aggregator's maps") from e
        except bpfsys.BpfError as e:
            raise _bpf_obj_error(e, "reading the aggregator's maps") from e

    def open_prog(self, name: str) -> int:
        try:
            return bpfsys.obj_get(str(self.prog_path(name)))
        except bpfsys.BpfError as e:
            raise _bpf_obj_error(e, f"opening the pinned program {name}") from e

    def save_state(self, state: State) -> None:
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state.to_dict(), indent=2))
        tmp.replace(self.state_path)

    def load_state(self) -> State:
        """The recorded state; NotAttached when there is no state file."""
        try:
            text = self.state_path.read_text()
        except FileNotFoundError:
            raise NotAttached(self.name, self.state_path) from None
        except PermissionError as e:
            raise NeedsRoot(f"reading {self.state_path}") from e
        try:
            state = State.from_dict(json.loads(text))
            state.attach_options()  # its options must be ones this version can use
            return state
        except (ValueError, TypeError) as e:
            raise XdpAggError(
                f"{self.state_path} is not a state file xdp-agg can read ({e}): remove it and the "
                f"pins with `xdp-agg --name {self.name} detach`"
            ) from e

    def remove(self) -> None:
        """Unpin everything of this instance and delete its state file."""
        if self.dir.exists():
            # unlinking a pin drops the reference; bpffs directories are removed like any other
            shutil.rmtree(self.dir)
        self.state_path.unlink(missing_ok=True)
        # serve's job table (xdp_agg.app.serving.jobs_path) describes jobs of this attachment
        # only; its lock file stays (removing a held flock's file would let a second serve in)
        (state_dir() / f"{self.name}.jobs").unlink(missing_ok=True)
        parent = self.dir.parent
        if parent.exists() and not any(parent.iterdir()):
            parent.rmdir()


def instances() -> list[str]:
    """Names of the aggregators with a state file."""
    d = state_dir()
    return sorted(p.stem for p in d.glob("*.json")) if d.is_dir() else []
