"""Running commands inside a named network namespace.

We use ``nsenter --net=/var/run/netns/NAME`` rather than ``ip netns exec``:
the latter also unshares the mount namespace and remounts /sys, which hides
/sys/fs/bpf (pinned BPF maps and programs). nsenter only switches the network
namespace, then execs the command, so the PID we get is the command's own.
Consequence: /sys/class/net inside still shows the root namespace's devices;
use ``ip link`` (netlink) to list a namespace's interfaces.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

from .errors import TestbedError

NETNS_DIR = "/var/run/netns"


def netns_path(name: str) -> str:
    """Path of the bind-mounted namespace file for ``name``."""
    return os.path.join(NETNS_DIR, name)


def nsenter_argv(netns: str, argv: Sequence[str]) -> list[str]:
    """argv that runs ``argv`` in namespace ``netns``."""
    if isinstance(argv, (str, bytes)):
        raise TypeError("argv must be a list of strings, not a single string")
    return ["nsenter", f"--net={netns_path(netns)}", "--", *map(str, argv)]


def run(netns: str, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
    """subprocess.run in ``netns``; captures text output unless told otherwise."""
    if "stdout" not in kw and "stderr" not in kw and "capture_output" not in kw:
        kw["capture_output"] = True
    kw.setdefault("text", True)
    return subprocess.run(nsenter_argv(netns, argv), **kw)


def popen(netns: str, argv: Sequence[str], **kw) -> subprocess.Popen:
    """subprocess.Popen in ``netns``, in a new session so its children die with it."""
    kw.setdefault("start_new_session", True)
    return subprocess.Popen(nsenter_argv(netns, argv), **kw)


def check(netns: str, argv: Sequence[str], what: str, input: str | None = None) -> str:
    """Run a configuration command; raise TestbedError with its stderr on failure."""
    try:
        cp = run(netns, argv, input=input, timeout=30)
    except FileNotFoundError as e:  # nsenter itself missing
        raise TestbedError(f"{what}: {e}; install util-linux") from e
    if cp.returncode != 0:
        msg = (cp.stderr or cp.stdout).strip()
        raise TestbedError(f"{what} failed in namespace {netns} (exit {cp.returncode}): {msg}")
    return cp.stdout


def require_tools(*tools: str) -> None:
    """Raise TestbedError naming the Debian package for the first missing tool."""
    packages = {
        "nsenter": "util-linux",
        "ethtool": "ethtool",
        "tc": "iproute2",
        "nft": "nftables",
        "ip": "iproute2",
        "sysctl": "procps",
    }
    for t in tools:
        if shutil.which(t) is None:
            raise TestbedError(f"{t} not found: apt-get install -y {packages.get(t, t)}")


def netns_inode(name: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) identifying namespace ``name``, or None if it is gone."""
    try:
        st = os.stat(netns_path(name))
    except OSError:
        return None
    return st.st_dev, st.st_ino


def pid_netns(pid: int) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the network namespace of process ``pid``, or None."""
    try:
        st = os.stat(f"/proc/{pid}/ns/net")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def terminate(procs: Sequence[subprocess.Popen], grace: float = 2.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds, each still-running process.

    Signals go to the process group when the process leads its own session
    (the popen default), so shells' children go too; always by PID, never by name.
    """
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        _signal(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(p.pid, signal.SIGKILL)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def kill_pid(pid: int, grace: float = 2.0) -> None:
    """Like :func:`terminate` for a PID that is not our child (recorded in a state file)."""
    _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}"):
            return
        time.sleep(0.05)
    _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass
