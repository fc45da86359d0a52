"""Cleanup bookkeeping: what a testbed made, saved where a later process finds it.

Each namespace and link is registered *before* it is created and the state
file ``/run/netns-testbed/<prefix>.json`` is rewritten at every change, so a
crash at any point leaves a record from which ``netns-testbed down`` removes
everything. /run is a tmpfs: records vanish at reboot, as do namespaces.

An atexit hook tears down testbeds that are still up when the interpreter
exits (unless built with ``cleanup_at_exit=False``, as the CLI does).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from dataclasses import dataclass, field

from pyroute2 import IPRoute
from pyroute2 import netns as pr_netns

from . import nsexec

STATE_DIR = os.environ.get("NETNS_TESTBED_STATE_DIR", "/run/netns-testbed")


def state_path(prefix: str) -> str:
    """Path of the JSON state file for ``prefix``."""
    return os.path.join(STATE_DIR, f"{prefix}.json")


def save_state(prefix: str, state: dict) -> None:
    """Write the state file atomically (readers never see half a file)."""
    os.makedirs(STATE_DIR, exist_ok=True)
    tmp = state_path(prefix) + f".tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1, sort_keys=True)
    os.replace(tmp, state_path(prefix))


def load_state(prefix: str) -> dict | None:
    """The saved state for ``prefix``, or None if there is none (or it is unreadable)."""
    try:
        with open(state_path(prefix)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def remove_state(prefix: str) -> None:
    try:
        os.unlink(state_path(prefix))
    except FileNotFoundError:
        pass


def list_states() -> list[dict]:
    """All saved testbed states, sorted by prefix."""
    try:
        names = sorted(os.listdir(STATE_DIR))
    except FileNotFoundError:
        return []
    states = []
    for n in names:
        if n.endswith(".json"):
            st = load_state(n[: -len(".json")])
            if st is not None:
                states.append(st)
    return states


def process_start_time(pid: int | None) -> int | None:
    """Start time (clock ticks since boot) of ``pid``, or None if it doesn't run.

    Together with the PID this identifies a process even after PID reuse.
    """
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def owner_alive(state: dict) -> bool:
    """Whether the process that built the testbed in ``state`` still runs."""
    start = process_start_time(state.get("owner_pid"))
    return start is not None and start == state.get("owner_start")


@dataclass
class CleanupRegistry:
    """Namespaces, links and processes of one testbed, in creation order."""

    namespaces: list[str] = field(default_factory=list)
    links: list[list] = field(default_factory=list)  # [netns or None, ifname]
    pids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "namespaces": list(self.namespaces),
            "links": [list(x) for x in self.links],
            "pids": list(self.pids),
        }

    @classmethod
    def from_dict(cls, d: dict) -> CleanupRegistry:
        return cls(
            list(d.get("namespaces", [])),
            [list(x) for x in d.get("links", [])],
            list(d.get("pids", [])),
        )

    def kill_recorded_pids(self) -> None:
        """Kill recorded PIDs that still run inside one of our namespaces.

        The namespace check guards against PID reuse: a PID from the state
        file is only signalled if that process lives in a namespace we made.
        """
        ours = {nsexec.netns_inode(n) for n in self.namespaces} - {None}
        for pid in self.pids:
            if nsexec.pid_netns(pid) in ours:
                nsexec.kill_pid(pid)
        self.pids.clear()

    def teardown(self) -> list[str]:
        """Remove links (those outside our namespaces) and namespaces, newest first.

        Links inside our namespaces go with the namespace. Returns error
        messages instead of raising, so one failure doesn't stop the rest.
        """
        errors = []
        owned = set(self.namespaces)
        for ns, ifname in reversed(self.links):
            if ns in owned:
                continue
            try:
                with IPRoute(netns=ns) if ns else IPRoute() as ipr:
                    idx = ipr.link_lookup(ifname=ifname)
                    if idx:
                        ipr.link("del", index=idx[0])
            except Exception as e:  # noqa: BLE001 - collect and report
                errors.append(f"link {ifname} in {ns or 'root namespace'}: {e}")
        self.links.clear()
        for ns in reversed(self.namespaces):
            if os.path.exists(nsexec.netns_path(ns)):
                try:
                    pr_netns.remove(ns)
                except Exception as e:  # noqa: BLE001
                    errors.append(f"namespace {ns}: {e}")
        self.namespaces.clear()
        return errors


# Testbeds to tear down at interpreter exit, keyed by id(); strong references
# on purpose: a forgotten testbed must still be cleaned up.
_live: dict[int, object] = {}


def register_live(tb) -> None:
    _live[id(tb)] = tb


def unregister_live(tb) -> None:
    _live.pop(id(tb), None)


@atexit.register
def _teardown_at_exit() -> None:
    for tb in list(_live.values()):
        # A forked child inherits _live; only the process that built the
        # testbed may remove it.
        if getattr(tb, "_owner_pid", None) != os.getpid():
            continue
        try:
            tb.down()
        except Exception as e:  # noqa: BLE001
            print(f"netns_testbed: cleanup at exit of {tb.prefix} failed: {e}", file=sys.stderr)
