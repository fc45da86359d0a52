"""`python -m bench.forward`: what forwarding a frame through the box costs (issue 53), XDP
against the kernel, side by side in one run, on the same veths of one 2-worker switch testbed.

Four paths from worker 0's port to worker 1's:
- kernel routing: no XDP program; the ports' forwarding sysctls on (as routed attach sets them);
- XDP routed: `xdp-agg attach p0 p1` (forwarding routed: fib lookup, devmap redirect);
- Linux bridge: p0 and p1 in a bridge, the workers on one extra subnet (198.19.0.0/24);
- XDP switched: `xdp-agg attach p0 p1 --forwarding switched`, the same subnet.
For each: a TCP stream of TCP_MIB MiB from worker 0 to worker 1 (one connection, Python's
sendall; Gbit/s at the receiver) and, for the XDP paths, the program's own ns per forwarded
frame (BPF_PROG_TEST_RUN, FRAMES repetitions of a 64-byte UDP frame from worker 0 to worker 1,
ingress p0: parse, lookup and rewrite, the verdict not carried out) and how many of the
stream's frames XDP forwarded (the rest went through the kernel). The kernel's and the bridge's
ns per frame would need live test runs (BPF_F_TEST_XDP_LIVE_FRAMES), which this machine's
kernel refuses (EPERM), so their cost shows in the stream alone.

Prints a Markdown table (and --json). Root; the libbpf build.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from bench import unwind_on_sigterm
from netns_testbed import Testbed
from xdp_agg import bpfsys
from xdp_switch import links, pins

FRAMES = 200_000
TCP_MIB = 256
NAME = "fwdbench"
SHARED = ("198.19.0.10", "198.19.0.11")  # the workers on one segment (bridge, switched)
RECEIVER = (
    "import socket,sys,time\n"
    "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
    "s.bind((sys.argv[1],5001)); s.listen(1); print('ready',flush=True)\n"
    "c,_=s.accept(); n=0; t=None\n"
    "while True:\n"
    "    b=c.recv(1<<20)\n"
    "    if t is None: t=time.perf_counter()\n"
    "    if not b: break\n"
    "    n+=len(b)\n"
    "print(n, time.perf_counter()-t, flush=True)\n"
)
SENDER = (
    "import socket,sys\n"
    "c=socket.create_connection((sys.argv[1],5001)); b=bytes(1<<20)\n"
    "for _ in range(int(sys.argv[2])): c.sendall(b)\n"
    "c.close()\n"
)


def tcp_gbps(tb: Testbed, dst_ip: str) -> float:
    """One TCP stream of TCP_MIB MiB, worker 0 to worker 1 at dst_ip: Gbit/s at the receiver."""
    rx = tb.popen(1, [sys.executable, "-c", RECEIVER, dst_ip], stdout=-1, text=True)
    try:
        assert rx.stdout.readline().strip() == "ready"
        r = tb.run(0, [sys.executable, "-c", SENDER, dst_ip, str(TCP_MIB)], timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"TCP sender failed: {r.stderr.strip()}")
        n, secs = rx.stdout.readline().split()
        return int(n) * 8 / float(secs) / 1e9
    finally:
        rx.kill()
        rx.wait()


def frame_to(tb: Testbed, dst_mac: str, src_ip: str, dst_ip: str) -> bytes:
    """A 64-byte UDP frame from worker 0 (discard port: not ours, nothing answers but ICMP)."""
    eth = Ether(src=tb.workers[0].mac, dst=dst_mac)
    pkt = eth / IP(src=src_ip, dst=dst_ip) / UDP(sport=40000, dport=9) / (b"\0" * 18)
    return bytes(pkt)


def prog_ns(prog_fd: int, frame: bytes, ifindex: int) -> int:
    """The XDP program's ns per frame, its verdict not carried out (BPF_PROG_TEST_RUN)."""
    _, _, ns = bpfsys.prog_test_run(prog_fd, frame, repeat=FRAMES, ingress_ifindex=ifindex)
    return ns


def agg_cli(tb: Testbed, *args: str) -> str:
    r = tb.run(
        tb.aggregator, [sys.executable, "-m", "xdp_agg.app.cli", "--name", NAME, *args], timeout=120
    )
    if r.returncode != 0:
        raise RuntimeError(f"xdp-agg {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def sh(tb: Testbed, host, script: str) -> None:
    r = tb.run(host, ["sh", "-ec", script])
    if r.returncode != 0:
        raise RuntimeError(f"{script}: {r.stderr.strip()}")


def warm(tb: Testbed, ip: str) -> None:
    """Resolve the neighbours and teach a switch the MACs: a ping each way."""
    tb.run(0, ["ping", "-c", "2", "-i", "0.2", "-W", "2", ip], timeout=30)


def kernel_row(tb) -> dict:
    sh(tb, tb.aggregator, "sysctl -qw net.ipv4.conf.p0.forwarding=1 net.ipv4.conf.p1.forwarding=1")
    w1 = tb.workers[1].ip
    warm(tb, w1)
    row = {"tcp_gbps": tcp_gbps(tb, w1)}
    sh(tb, tb.aggregator, "sysctl -qw net.ipv4.conf.p0.forwarding=0 net.ipv4.conf.p1.forwarding=0")
    return row


def xdp_row(tb, p0: int, dst_mac: str, src: str, dst: str, *attach: str) -> dict:
    agg_cli(tb, "attach", "p0", "p1", *attach)
    try:
        warm(tb, dst)
        fd = pins.Instance(NAME).open_prog("ingress")
        try:
            row = {"prog_ns": prog_ns(fd, frame_to(tb, dst_mac, src, dst), p0)}
        finally:
            os.close(fd)
        row["tcp_gbps"] = tcp_gbps(tb, dst)
        fwd = json.loads(agg_cli(tb, "status", "--json"))["forwarding"]
        row["forwarded"] = fwd["counters"]["routed"] + fwd["counters"]["switched"]
    finally:
        agg_cli(tb, "detach", "--force")
    return row


def bridge_row(tb) -> dict:
    sh(
        tb,
        tb.aggregator,
        "ip link add fbr0 type bridge stp_state 0 forward_delay 0\n"
        "ip link set p0 master fbr0\nip link set p1 master fbr0\nip link set fbr0 up",
    )
    try:
        warm(tb, SHARED[1])
        row = {"tcp_gbps": tcp_gbps(tb, SHARED[1])}
    finally:
        sh(tb, tb.aggregator, "ip link del fbr0")
    return row


def run() -> dict:
    """Every row, in one testbed."""
    with Testbed(workers=2, topology="switch") as tb:
        for w, ip in zip(tb.workers, SHARED):
            sh(tb, w, f"ip addr add {ip}/24 dev eth0")
        links.enter_netns(tb.aggregator.netns)
        p0 = links.ifindex("p0")
        box_mac = links.addresses("p0")["mac"]
        w0, w1 = tb.workers[0].ip, tb.workers[1].ip
        rows = {"kernel routing": kernel_row(tb)}
        rows["XDP routed"] = xdp_row(tb, p0, box_mac, w0, w1)
        rows["Linux bridge"] = bridge_row(tb)
        rows["XDP switched"] = xdp_row(
            tb, p0, tb.workers[1].mac, *SHARED, "--forwarding", "switched"
        )
    return rows


def table(rows: dict) -> str:
    out = [
        "| path | TCP stream, Gbit/s | XDP program, ns/frame | frames XDP forwarded |",
        "|---|---|---|---|",
    ]
    for name, r in rows.items():
        prog = f"{r['prog_ns']}" if "prog_ns" in r else "-"
        fwd = f"{r['forwarded']:,}" if "forwarded" in r else "-"
        out.append(f"| {name} | {r['tcp_gbps']:.2f} | {prog} | {fwd} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.forward", description=__doc__)
    ap.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    rows = run()
    print(table(rows))
    print(
        f"\n({TCP_MIB} MiB per stream, {FRAMES} test runs per program row, "
        f"{time.monotonic() - t0:.0f} s)"
    )
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    unwind_on_sigterm()  # a killed run still takes its testbed down
    sys.exit(main())
