"""Count the aggregator's result frames and the IGMP reports on one interface: what a host (or
a bridge port) actually receives, below every socket.

    python -m netns_testbed.sniff eth0        # in a namespace; stops when stdin closes
    python -m netns_testbed.sniff --sent w0   # a bridge port: the results it sends its host

A raw AF_PACKET socket sees every frame the interface receives or sends, whatever the sockets
above it joined, so a count of zero on a host in no job means that no result reached its link,
not that a socket filtered it. It prints "ready" on stderr once the socket is open, then, when
its standard input closes (or on SIGTERM), one JSON object on stdout:

    {"results": {"239.18.0.0": {"frames": 123, "first": 0.41, "last": 0.98}, ...},
     "igmp": {"239.18.0.0": {"reports": 2, "first": 0.05, "leaves": 1}}, "started": <time>}

"results" counts IPv4 UDP frames from the aggregator ports (0xBEE0..0xBEEF) by destination
address (a job's group, the subnet broadcast, or a worker for a retransmission answer);
"igmp" the membership reports (IGMPv2 and v3) and leaves by group. Times are seconds since the
socket opened (time.monotonic()), so a report and the first result to its group can be
compared: `Testbed.sniff` runs it.
"""

from __future__ import annotations

import json
import select
import signal
import socket
import struct
import sys
import time

ETH_P_ALL = 0x0003
ETH_P_IP = 0x0800
ETH_P_8021Q = 0x8100
AGG_PORT, AGG_PORT_MASK = 0xBEE0, 0xFFF0  # xdp_agg.proto.wire's range, restated: no import upward
IGMP = 2
IGMPV2_REPORT, IGMPV2_LEAVE, IGMPV3_REPORT = 0x16, 0x17, 0x22
# IGMPv3 group record types (RFC 3376 4.2.12): a join is EXCLUDE mode / CHANGE_TO_EXCLUDE,
# a leave is CHANGE_TO_INCLUDE with no sources
V3_JOIN = (2, 4)
V3_LEAVE = 3


def records(frame: bytes, outgoing: bool = False, sent: bool = False) -> list[tuple[str, str]]:
    """What `frame` (Ethernet) counts as: [("result", dst)] for a result the interface received,
    one ("report" | "leave", group) per IGMP record either way, or []. A frame the interface
    sent is never a result (a worker whose port happens to lie in 0xBEE0..0xBEEF sends its
    contributions from there), unless `sent`: then only what it sent is (a bridge port, whose
    sent frames are what goes to its host)."""
    if len(frame) < 14:
        return []
    ethertype = struct.unpack_from("!H", frame, 12)[0]
    off = 14
    if ethertype == ETH_P_8021Q and len(frame) >= 18:
        ethertype, off = struct.unpack_from("!H", frame, 16)[0], 18
    if ethertype != ETH_P_IP or len(frame) < off + 20:
        return []
    ihl = (frame[off] & 0x0F) * 4
    proto = frame[off + 9]
    dst = socket.inet_ntoa(frame[off + 16 : off + 20])
    l4 = off + ihl
    if proto == socket.IPPROTO_UDP and len(frame) >= l4 + 8:
        sport = struct.unpack_from("!H", frame, l4)[0]
        if sport & AGG_PORT_MASK == AGG_PORT and outgoing == sent:
            return [("result", dst)]
        return []
    if proto != IGMP or len(frame) < l4 + 8:
        return []
    kind = frame[l4]
    if kind in (IGMPV2_REPORT, IGMPV2_LEAVE):
        group = socket.inet_ntoa(frame[l4 + 4 : l4 + 8])
        return [("report" if kind == IGMPV2_REPORT else "leave", group)]
    if kind != IGMPV3_REPORT:
        return []
    out = []
    n = struct.unpack_from("!H", frame, l4 + 6)[0]
    pos = l4 + 8
    for _ in range(n):
        if len(frame) < pos + 8:
            break
        rtype, aux, nsrc = frame[pos], frame[pos + 1], struct.unpack_from("!H", frame, pos + 2)[0]
        group = socket.inet_ntoa(frame[pos + 4 : pos + 8])
        if rtype in V3_JOIN:
            out.append(("report", group))
        elif rtype == V3_LEAVE and nsrc == 0:
            out.append(("leave", group))
        pos += 8 + 4 * nsrc + 4 * aux
    return out


class Tally:
    """The counts `main` prints, fed one frame at a time."""

    def __init__(self, sent: bool = False) -> None:
        self.sent = sent  # count the results the interface sends, not those it receives
        self.started = time.monotonic()
        self.results: dict[str, dict] = {}
        self.igmp: dict[str, dict] = {}

    def add(self, frame: bytes, outgoing: bool = False, now: float | None = None) -> None:
        t = round((time.monotonic() if now is None else now) - self.started, 6)
        for what, addr in records(frame, outgoing, self.sent):
            if what == "result":
                r = self.results.setdefault(addr, {"frames": 0, "first": t, "last": t})
                r["frames"] += 1
                r["last"] = t
            else:
                g = self.igmp.setdefault(addr, {"reports": 0, "leaves": 0, "first": None})
                if what == "report":
                    g["reports"] += 1
                    if g["first"] is None:
                        g["first"] = t
                else:
                    g["leaves"] += 1

    def to_dict(self) -> dict:
        return {"results": self.results, "igmp": self.igmp, "started": self.started}


def _take(sock: socket.socket, tally: Tally) -> bool:
    """Add one waiting frame to the tally; False when none was waiting."""
    try:
        frame, addr = sock.recvfrom(65535, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    tally.add(frame, outgoing=addr[2] == socket.PACKET_OUTGOING)
    return True


def main(argv: list[str] | None = None) -> int:
    """Sniff on the interface named by the last argument until stdin closes; print the tally.
    `--sent` first: count the results the interface sends instead of those it receives."""
    args = sys.argv[1:] if argv is None else argv
    sent = args[:1] == ["--sent"]
    args = args[1:] if sent else args
    if len(args) != 1:
        print(
            "usage: python -m netns_testbed.sniff [--sent] IFNAME  (stops when stdin closes)",
            file=sys.stderr,
        )
        return 2
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.bind((args[0], 0))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
    tally = Tally(sent)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print("ready", file=sys.stderr, flush=True)
    while not stop:
        try:
            readable, _, _ = select.select([sock, sys.stdin], [], [], 0.5)
        except InterruptedError:
            continue
        if sys.stdin in readable and not sys.stdin.buffer.read1(4096):
            break
        if sock in readable:
            while True:
                if not _take(sock, tally):
                    break
    while _take(sock, tally):  # a last sweep: frames that arrived just before stdin closed
        pass
    print(json.dumps(tally.to_dict()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
