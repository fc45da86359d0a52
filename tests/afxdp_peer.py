"""A world-of-one aggregator for tests/root/test_afxdp.py: answers every datagram to --listen with
its own bytes (the sum of one worker's contribution is that contribution) and, with --capture IF,
keeps every frame that reaches IF for that port (a raw AF_PACKET socket, below the UDP socket).
Prints "ready" on stderr once listening; when stdin closes, one JSON line: the frames in hex and
the number of datagrams answered.
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import sys

ETH_P_ALL = 0x0003


def main() -> int:
    """Echo until stdin closes, then print the captured frames."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--listen", required=True, help="IP:PORT")
    ap.add_argument("--capture", default="", help="interface whose incoming frames to keep")
    args = ap.parse_args()
    host, port = args.listen.rsplit(":", 1)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((host, int(port)))
    raw = None
    if args.capture:
        raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        raw.bind((args.capture, 0))
        # room for every frame of a test run: a full buffer would drop frames from the capture
        raw.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE (root)
    frames: list[str] = []
    answered = 0
    print("ready", file=sys.stderr, flush=True)
    watch = [sys.stdin, udp] + ([raw] if raw else [])
    while True:
        ready, _, _ = select.select(watch, [], [])
        if sys.stdin in ready and not sys.stdin.read(1):
            break
        if udp in ready:
            data, addr = udp.recvfrom(65536)
            udp.sendto(data, addr)
            answered += 1
        if raw is not None and raw in ready:
            frame, info = raw.recvfrom(65536)
            # incoming IPv4 UDP to our port (pkttype 4 = PACKET_OUTGOING: our answers)
            if info[2] != 4 and frame[12:14] == b"\x08\x00" and frame[23] == 17:
                ihl = (frame[14] & 0x0F) * 4
                if int.from_bytes(frame[14 + ihl + 2 : 14 + ihl + 4], "big") == int(port):
                    frames.append(frame.hex())
    print(json.dumps({"frames": frames, "answered": answered}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
