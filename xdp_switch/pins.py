"""Where an attached aggregator lives between commands: pins under bpffs and a state file.

    /sys/fs/bpf/xdp-agg/<name>/maps/<map>     every map (jobs, workers, slots, ..., partials)
    /sys/fs/bpf/xdp-agg/<name>/progs/ingress  the XDP program
    /sys/fs/bpf/xdp-agg/<name>/progs/egress   the devmap egress program (switch mode)
    /run/xdp-agg/<name>.json                  interfaces, mode, netns, program id, options

`detach` removes exactly these, nothing else. XDP_AGG_PIN_ROOT and XDP_AGG_STATE_DIR move them
(the tests use their own).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import bpfsys


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
    """What `attach` made, recorded for status, stats and detach."""

    name: str
    mode: str  # "one-arm" or "switch"
    xdp_mode: str  # "native" or "skb"
    netns: str | None
    interfaces: list[dict]  # {"ifname", "ifindex", "prog_id"}
    pool_slots: int
    prog_id: int
    egress_prog_id: int
    attached_at: float
    options: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class Instance:
    """The pins and state file of one named aggregator."""

    def __init__(self, name: str) -> None:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"bad instance name {name!r}")
        self.name = name
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
        for name, fd in maps.items():
            bpfsys.obj_pin(fd, str(self.map_path(name)))
        for name, fd in progs.items():
            bpfsys.obj_pin(fd, str(self.prog_path(name)))

    def open_maps(self) -> dict[str, int]:
        """fds of every pinned map, by name."""
        d = self.dir / "maps"
        if not d.is_dir():
            raise FileNotFoundError(f"no aggregator {self.name!r} is attached (nothing pinned at {self.dir})")
        return {p.name: bpfsys.obj_get(str(p)) for p in sorted(d.iterdir())}

    def open_prog(self, name: str) -> int:
        return bpfsys.obj_get(str(self.prog_path(name)))

    def save_state(self, state: State) -> None:
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state.to_dict(), indent=2))
        tmp.replace(self.state_path)

    def load_state(self) -> State:
        try:
            return State(**json.loads(self.state_path.read_text()))
        except FileNotFoundError:
            raise FileNotFoundError(f"no aggregator {self.name!r} is attached (no {self.state_path})") from None

    def remove(self) -> None:
        """Unpin everything of this instance and delete its state file."""
        if self.dir.exists():
            # unlinking a pin drops the reference; bpffs directories are removed like any other
            shutil.rmtree(self.dir)
        self.state_path.unlink(missing_ok=True)
        parent = self.dir.parent
        if parent.exists() and not any(parent.iterdir()):
            parent.rmdir()


def instances() -> list[str]:
    """Names of the aggregators with a state file."""
    d = state_dir()
    return sorted(p.stem for p in d.glob("*.json")) if d.is_dir() else []
