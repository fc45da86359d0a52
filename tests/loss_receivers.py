"""Both ends of tests/root/test_loss_down_netns.py's count: a sender and two kinds of receiver.

    python tests/loss_receivers.py send DST:PORT N      # N datagrams from 0xBEE0, then "end"
    python tests/loss_receivers.py receive PORT DEV     # counts until each socket saw "end"

The sender sends N datagrams from UDP port 0xBEE0 (an aggregation port: the testbed's loss down
applies to them) and then the end marker, a datagram "end" from port 40000, which no loss rule
touches and which follows the others on the same link. The receiver opens a kernel UDP socket on
PORT and an AF_PACKET socket on DEV (the way DPDK's net_af_packet and tcpdump receive), says
"ready" on stderr, counts on each the datagrams to PORT from 0xBEE0 until that socket has seen
the marker, and prints one JSON line: {"udp": n, "packet": m}. A marker that never comes ends it
after IDLE_S without a frame (the counts then fall short: the test fails, it does not hang).
"""

from __future__ import annotations

import json
import select
import socket
import sys

AGG_PORT = 0xBEE0
MARKER_PORT = 40000
MARKER = b"end"
ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
SO_RCVBUFFORCE = 33
IDLE_S = 10.0


def send(dst: str, n: int) -> None:
    """N datagrams to DST:PORT from the aggregation port, then the marker."""
    host, port = dst.rsplit(":", 1)
    data = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    data.bind(("0.0.0.0", AGG_PORT))
    for i in range(n):
        data.sendto(f"d{i}".encode(), (host, int(port)))
    marker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    marker.bind(("0.0.0.0", MARKER_PORT))
    marker.sendto(MARKER, (host, int(port)))


def _udp_of(frame: bytes, port: int) -> tuple[int, bytes] | None:
    """(source port, payload) of an IPv4 UDP frame to `port`, else None."""
    if len(frame) < 42 or frame[12:14] != b"\x08\x00" or frame[23] != 17:
        return None
    ihl = (frame[14] & 0x0F) * 4
    udp = frame[14 + ihl :]
    if int.from_bytes(udp[2:4], "big") != port:
        return None
    return int.from_bytes(udp[0:2], "big"), udp[8:]


def receive(port: int, dev: str) -> dict[str, int]:
    """Count on both sockets until each saw the marker; the counts."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)  # no overflow drops
    udp.bind(("0.0.0.0", port))
    raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    raw.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
    raw.bind((dev, 0))
    counts = {"udp": 0, "packet": 0}
    open_ = {udp: "udp", raw: "packet"}
    print("ready", file=sys.stderr, flush=True)
    while open_:
        ready, _, _ = select.select(list(open_), [], [], IDLE_S)
        if not ready:
            break
        for s in ready:
            kind = open_[s]
            if kind == "udp":
                payload, (_, sport) = s.recvfrom(65536)
            else:
                frame, info = s.recvfrom(65536)
                got = None if info[2] == PACKET_OUTGOING else _udp_of(frame, port)
                if got is None:
                    continue
                sport, payload = got
            if sport == MARKER_PORT and payload == MARKER:
                del open_[s]
            elif sport == AGG_PORT:
                counts[kind] += 1
    return counts


def main() -> int:
    """send DST:PORT N | receive PORT DEV."""
    if sys.argv[1] == "send":
        send(sys.argv[2], int(sys.argv[3]))
    else:
        print(json.dumps(receive(int(sys.argv[2]), sys.argv[3])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
