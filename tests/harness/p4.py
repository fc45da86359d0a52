"""Fixtures and helpers of the P4 (bmv2) tests.

- `p4_json`: p4/switchml.p4 compiled once per session (skips with the reason when p4c or
  simple_switch is not on PATH, or when not root);
- VethLab: simple_switch in a namespace of its own on ports s0..s{n-1}, whose veth peers h0..
  sit in a second namespace where the test sends frames and captures what comes out of every
  port with AF_PACKET sockets. Nothing else lives in either namespace (no addresses, IPv6 off),
  so every frame captured came out of the switch.
"""

from __future__ import annotations

import os
import secrets
import select
import socket
import subprocess
import time

import pytest

import xdp_agg.targets.bmv2 as bm

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4  # sll_pkttype of frames we sent ourselves


def p4_skip_reason() -> str | None:
    """Why the P4 tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces): run the tests as root, as .ci/run does"
    missing = bm.missing_tools()
    if missing:
        return (
            f"{', '.join(missing)} not on PATH: install p4c (bmv2 back end) and bmv2's "
            "simple_switch as p4/README.md says"
        )
    return None


@pytest.fixture(scope="session")
def p4_json(tmp_path_factory):
    """The v1model program compiled for bmv2, once per session."""
    reason = p4_skip_reason()
    if reason:
        pytest.skip(reason)
    return bm.compile_p4(tmp_path_factory.mktemp("p4out"))


def _ip(*args: str, netns: str | None = None) -> None:
    argv = (["nsenter", f"--net=/var/run/netns/{netns}"] if netns else []) + ["ip", *args]
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")


def _quiet_namespace(netns: str) -> None:
    """No IPv6 (no router solicitations, no MLD): the namespace sends nothing by itself."""
    subprocess.run(
        [
            "nsenter",
            f"--net=/var/run/netns/{netns}",
            "sysctl",
            "-q",
            "-w",
            "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1",
        ],
        check=True,
        capture_output=True,
    )


class _InNetns:
    """Enter a named network namespace in this thread for the duration of a `with` block
    (sockets made inside stay in it)."""

    def __init__(self, netns: str) -> None:
        self.netns = netns
        self._home: int | None = None

    def __enter__(self):
        import ctypes

        self._libc = ctypes.CDLL(None, use_errno=True)
        self._home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        fd = os.open(f"/var/run/netns/{self.netns}", os.O_RDONLY)
        try:
            if self._libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                raise OSError(ctypes.get_errno(), f"setns into {self.netns}")
        finally:
            os.close(fd)
        return self

    def __exit__(self, *exc):
        try:
            if self._libc.setns(self._home, 0x40000000) != 0:
                raise OSError("could not return to the original network namespace")
        finally:
            os.close(self._home)


class VethLab:
    """simple_switch on `nports` veths between two namespaces made for it."""

    def __init__(self, json_path, nports: int, *, log_path=None) -> None:
        self.prefix = "xp" + secrets.token_hex(2)
        self.sw_ns = f"{self.prefix}sw"
        self.host_ns = f"{self.prefix}ht"
        self.nports = nports
        self.ports = [bm.PortSpec(i, f"s{i}") for i in range(nports)]
        self.switch = bm.SimpleSwitch(json_path, self.ports, netns=self.sw_ns, log_path=log_path)
        self.socks: list[socket.socket] = []
        self._made: list[str] = []

    def up(self) -> "VethLab":
        try:
            for ns in (self.sw_ns, self.host_ns):
                _ip("netns", "add", ns)
                self._made.append(ns)
                _quiet_namespace(ns)
            for i in range(self.nports):
                _ip(
                    "link",
                    "add",
                    f"s{i}",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    f"h{i}",
                    "netns",
                    self.host_ns,
                    netns=self.sw_ns,
                )
                _ip("link", "set", f"s{i}", "up", netns=self.sw_ns)
                _ip("link", "set", f"h{i}", "up", netns=self.host_ns)
            with _InNetns(self.host_ns):
                for i in range(self.nports):
                    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
                    s.bind((f"h{i}", 0))
                    s.setblocking(False)
                    self.socks.append(s)
            self.switch.start()
            return self
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        """Stop the switch (by its PID) and delete both namespaces (and with them the veths)."""
        self.switch.stop()
        for s in self.socks:
            s.close()
        self.socks = []
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made = []

    def drain(self) -> list[tuple[int, bytes]]:
        """Whatever is waiting on the sockets now."""
        out = []
        for port, s in enumerate(self.socks):
            while True:
                try:
                    data, addr = s.recvfrom(65536)
                except BlockingIOError:
                    break
                if addr[2] != PACKET_OUTGOING:
                    out.append((port, data))
        return out

    def exchange(
        self,
        port: int,
        frame: bytes,
        expect: int,
        *,
        timeout: float = 5.0,
        grace: float = 0.1,
        quiet: float = 0.3,
    ) -> list[tuple[int, bytes]]:
        """Send `frame` into switch port `port`; return the (port, frame) pairs that come out.

        Waits for `expect` frames (up to `timeout`), then `grace` more seconds for any extra
        one; with expect == 0, `quiet` seconds in which nothing must come.
        """
        stale = self.drain()
        assert not stale, f"frames left over from an earlier step: {stale}"
        self.socks[port].send(frame)
        got: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + (timeout if expect else quiet)
        settle = None
        while True:
            now = time.monotonic()
            if settle is None and expect and len(got) >= expect:
                settle = now + grace
            end = min(deadline, settle) if settle else deadline
            if now >= end:
                break
            r, _, _ = select.select(self.socks, [], [], end - now)
            if r:
                got += self.drain()
        return got


# --- a bmv2 backend without bmv2 ------------------------------------------------------------
class FakeCLI:
    """Answers like simple_switch_CLI: handles for adds and node creation, counters."""

    def __init__(self):
        self.log: list[str] = []
        self.next_handle = 0
        self.counters: dict[tuple[str, int], int] = {}

    def _handle(self, what):
        self.next_handle += 1
        return f"{what} with handle {self.next_handle - 1}"

    def run(self, commands, check=True):
        out = []
        for c in commands:
            self.log.append(c)
            if c.startswith("table_add"):
                out.append(self._handle("Entry has been added"))
            elif c.startswith("mc_node_create"):
                out.append(self._handle("node was created"))
            elif c.startswith("counter_read"):
                _, name, idx = c.split()
                n = self.counters.get((name, int(idx)), 0)
                out.append(f"{name}[{idx}]=  ({n * 100} bytes, {n} packets)")
            else:
                out.append("")
        return out


# two switch ports with our MAC and address on each, for a Bmv2Backend over FakeCLI
PORTS = [
    bm.PortSpec(0, "p0", "02:00:00:00:01:01", "198.18.1.1"),
    bm.PortSpec(1, "p1", "02:00:00:00:02:01", "198.18.2.1"),
]
