"""How long after a worker joins its job's group do the results reach it through the snooping
bridge? The window in which a result would be lost for want of membership.

    sudo .venv/bin/python -m bench.mcast_join [--joins 50] [--json]

In a one-arm testbed (the bridge snooping IGMP with its querier), a sender in the aggregator's
namespace streams datagrams from the aggregator port to 32 groups round robin (each group about
every 0.3 ms). The worker joins one group after another, as hostlib does (IP_ADD_MEMBERSHIP on
a socket bound to 0.0.0.0), and records, per join, the time until its IGMP report is on its
link (a raw socket) and until the first datagram to that group arrives on its socket; then it
leaves. Before the report the bridge forwards the group nowhere, so the second time bounds how
early after a join a job's first result may come. In the host library the join precedes the
registration, and the first result needs every rank registered and one round trip more.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench import unwind_on_sigterm

GROUPS = 32
BASE = "239.18.1."  # not a job's block of the default allocation
PORT = 47000

SENDER = rf"""
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("198.18.0.1", 0xBEE0))
s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("198.18.0.1"))
end = time.monotonic() + float(sys.argv[1])
i = 0
while time.monotonic() < end:
    s.sendto(b"r" * 64, ("{BASE}%d" % (i % {GROUPS}), {PORT}))
    i += 1
    if i % {GROUPS} == 0:
        time.sleep(0.0002)
"""

MEMBER = rf"""
import json, select, socket, sys, time
from netns_testbed.sniff import records
joins = int(sys.argv[1])
raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
raw.bind(("eth0", 0))
out = []
for k in range(joins):
    g = "{BASE}%d" % (k % {GROUPS})
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", {PORT}))
    s.setsockopt(socket.IPPROTO_IP, 49, 0)  # IP_MULTICAST_ALL off, as hostlib does
    mreq = socket.inet_aton(g) + socket.inet_aton("198.18.0.10")
    while True:  # drain what the raw socket saw before this join
        try:
            raw.recv(65535, socket.MSG_DONTWAIT)
        except BlockingIOError:
            break
    t0 = time.monotonic()
    s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
    report = first = None
    while first is None and time.monotonic() - t0 < 5:
        r, _, _ = select.select([raw, s], [], [], 0.01)
        now = time.monotonic()
        if raw in r:
            for what, grp in records(raw.recv(65535)):
                if what == "report" and grp == g and report is None:
                    report = now - t0
        if s in r:
            s.recv(100)
            first = now - t0
    ms = lambda t: None if t is None else t * 1e3
    out.append({{"group": g, "report_ms": ms(report), "first_ms": ms(first)}})
    s.setsockopt(socket.IPPROTO_IP, socket.IP_DROP_MEMBERSHIP, mreq)
    s.close()
    time.sleep(0.05)
print(json.dumps(out))
"""


def _summary(values: list[float]) -> dict:
    v = sorted(values)
    if not v:
        return {}
    return {
        "n": len(v),
        "min": round(v[0], 3),
        "p50": round(v[len(v) // 2], 3),
        "p99": round(v[min(len(v) - 1, int(len(v) * 0.99))], 3),
        "max": round(v[-1], 3),
    }


def measure(joins: int = 50) -> dict:
    """Run the measurement in a fresh testbed; per-join times and their summary (ms)."""
    from netns_testbed import Testbed

    with Testbed(workers=1) as tb:
        sender = tb.popen("agg", [sys.executable, "-c", SENDER, str(5 + joins * 0.2)])
        try:
            r = tb.run(
                "w0",
                [sys.executable, "-c", MEMBER, str(joins)],
                timeout=60 + joins * 6,
                check=True,
            )
        finally:
            sender.terminate()
            sender.wait(timeout=10)
    rows = json.loads(r.stdout)
    return {
        "joins": rows,
        "report_ms": _summary([x["report_ms"] for x in rows if x["report_ms"] is not None]),
        "first_ms": _summary([x["first_ms"] for x in rows if x["first_ms"] is not None]),
        "never_delivered": sum(1 for x in rows if x["first_ms"] is None),
        "no_report_seen": sum(1 for x in rows if x["report_ms"] is None),
    }


def main(argv: list[str] | None = None) -> int:
    """Command line: print the summary (or everything with --json)."""
    ap = argparse.ArgumentParser(
        prog="python -m bench.mcast_join", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--joins", type=int, default=50)
    ap.add_argument("--json", action="store_true", help="every join, as JSON")
    args = ap.parse_args(argv)
    res = measure(args.joins)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"joins: {args.joins}, never delivered: {res['never_delivered']}")
    print(f"join -> IGMP report on the link (ms): {res['report_ms']}")
    print(f"join -> first datagram to the group (ms): {res['first_ms']}")
    return 0


if __name__ == "__main__":
    unwind_on_sigterm()  # a killed run still takes its testbed down
    sys.exit(main())
