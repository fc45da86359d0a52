"""The bmv2 switch process: simple_switch started and stopped on a set of interfaces, optionally
inside a network namespace (SimpleSwitch; give the namespace by name rather than entering it
first), and driven through simple_switch_CLI (SwitchCLI: commands in batches, one CLI process per
batch, errors raised).
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .toolchain import TOOLS, Bmv2Error, cli_python, netns_argv_prefix, which_tool

DEFAULT_THRIFT_PORT = 9090


@dataclass(frozen=True)
class PortSpec:
    """A port of the switch: bmv2 port number, the interface it runs on, and the switch's own
    address on that port (the source of result copies sent there, as the XDP program's switch
    mode uses its interface's MAC and address)."""

    port: int
    iface: str
    mac: str = "00:00:00:00:00:00"
    ip: str = "0.0.0.0"
    prefixlen: int = 32  # of ip's subnet: which neighbours (a tree's parent) are on this port

    def on_link(self, addr: str) -> bool:
        """Whether `addr` is on this port's subnet (never for a port without an address)."""
        import ipaddress

        if self.ip in ("", "0.0.0.0"):
            return False
        net = ipaddress.IPv4Interface(f"{self.ip}/{self.prefixlen}").network
        return ipaddress.IPv4Address(addr) in net


def port_specs(ifnames: list[str], netns: str | None = None) -> list[PortSpec]:
    """PortSpecs for interfaces (in `netns`, or this process's namespace), numbered 0.. in the
    order given, each with its interface's MAC and first IPv4 address (and its prefix) as our
    address there."""
    from pyroute2 import IPRoute, NetNS

    out = []
    with NetNS(netns) if netns else IPRoute() as ipr:
        for i, name in enumerate(ifnames):
            links = ipr.link_lookup(ifname=name)
            if not links:
                raise ValueError(
                    f"no interface {name!r}" + (f" in namespace {netns}" if netns else "")
                )
            link = ipr.get_links(links[0])[0]
            addrs = [
                (a.get_attr("IFA_ADDRESS"), a["prefixlen"])
                for a in ipr.get_addr(index=links[0], family=2)
            ]
            ip, plen = addrs[0] if addrs else ("0.0.0.0", 32)
            out.append(PortSpec(i, name, link.get_attr("IFLA_ADDRESS"), ip, plen))
    return out


class SwitchCLI:
    """simple_switch_CLI, one process per batch of commands (optionally inside a netns)."""

    PROMPT = "RuntimeCmd: "
    ERROR_PREFIXES = ("Error", "Invalid", "Exception", "***")

    def __init__(
        self,
        thrift_port: int = DEFAULT_THRIFT_PORT,
        netns: str | None = None,
        timeout: float = 120.0,
    ) -> None:
        self.thrift_port = thrift_port
        self.netns = netns
        self.timeout = timeout

    def argv(self) -> list[str]:
        return [
            *netns_argv_prefix(self.netns),
            cli_python(),
            which_tool(TOOLS["cli"]),
            "--thrift-port",
            str(self.thrift_port),
        ]

    def run(self, commands: list[str], *, check: bool = True) -> list[str]:
        """Run the commands in order; returns each one's output. With check, the first command
        whose output is an error raises Bmv2Error (the ones before it have taken effect)."""
        if not commands:
            return []
        r = subprocess.run(
            self.argv(),
            input="\n".join(commands) + "\n",
            capture_output=True,
            text=True,
            timeout=self.timeout,
        )
        # The CLI prints its prompt before reading each line: the text between two prompts is
        # the output of one command. Before the first prompt: the banner (or a connect error).
        parts = r.stdout.split(self.PROMPT)
        if len(parts) < len(commands) + 1:
            raise Bmv2Error(
                f"simple_switch_CLI on thrift port {self.thrift_port} answered "
                f"{len(parts) - 1} of {len(commands)} commands (is simple_switch running?):\n"
                f"{r.stdout[-2000:]}{r.stderr[-2000:]}"
            )
        outputs = [p.strip() for p in parts[1 : len(commands) + 1]]
        if check:
            for cmd, out in zip(commands, outputs):
                bad = [ln for ln in out.splitlines() if ln.startswith(self.ERROR_PREFIXES)]
                if bad:
                    raise Bmv2Error(f"`{cmd}` failed: {bad[0]}")
        return outputs

    def ready(self) -> bool:
        """Whether the switch answers on its Thrift port."""
        try:
            self.run(["show_ports"])
            return True
        except (Bmv2Error, subprocess.TimeoutExpired):
            return False


class SimpleSwitch:
    """A simple_switch process running the compiled program on the given ports.

    The process is started with start() (or `with`), in `netns` if given, and stopped by its
    PID with stop(); its console log goes to log_path (default: beside the JSON).
    """

    def __init__(
        self,
        json_path,
        ports: list[PortSpec],
        *,
        netns: str | None = None,
        thrift_port: int = DEFAULT_THRIFT_PORT,
        log_path=None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.json_path = Path(json_path)
        self.ports = list(ports)
        self.netns = netns
        self.thrift_port = thrift_port
        self.log_path = (
            Path(log_path) if log_path else self.json_path.with_suffix(f".{thrift_port}.log")
        )
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen | None = None

    def argv(self) -> list[str]:
        # `ip netns exec` (which execs, keeping the PID) rather than nsenter: it also mounts the
        # namespace's own /sys, where libpcap reads the interfaces' statistics; under nsenter
        # it finds the root namespace's /sys and logs "open: No such file or directory" forever.
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        argv = [*prefix, which_tool(TOOLS["switch"])]
        for p in self.ports:
            argv += ["-i", f"{p.port}@{p.iface}"]
        argv += ["--thrift-port", str(self.thrift_port), *self.extra_args, str(self.json_path)]
        return argv

    def cli(self, timeout: float = 120.0) -> SwitchCLI:
        return SwitchCLI(self.thrift_port, self.netns, timeout)

    def start(self, timeout: float = 30.0) -> "SimpleSwitch":
        """Start simple_switch and wait until its Thrift server answers."""
        if self.proc is not None:
            raise Bmv2Error("this simple_switch is already started")
        if self.netns:
            # The Thrift server listens on 127.0.0.1: a new namespace's loopback starts down.
            subprocess.run(
                ["ip", "-n", self.netns, "link", "set", "lo", "up"], check=True, capture_output=True
            )
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        cli = self.cli()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if cli.ready():
                return self
            time.sleep(0.2)
        self.stop()
        raise Bmv2Error(
            f"simple_switch did not come up on thrift port {self.thrift_port}; its log "
            f"({self.log_path}):\n{self.log_tail()}"
        )

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, grace: float = 3.0) -> None:
        """Stop the process we started (SIGTERM, then SIGKILL after `grace` seconds)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def __enter__(self) -> "SimpleSwitch":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
