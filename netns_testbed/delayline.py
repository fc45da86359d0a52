"""The delay line of :mod:`netns_testbed.reorder`: one process per worker namespace.

It reads the frames the choice redirected to ``rd1`` and sends each on the uplink ``delay``
seconds after it came, with PACKET_QDISC_BYPASS (no second choice, no rate limit, no loss hook)
and a virtio-net header (a UDP GSO batch stays one frame). Run by the Testbed, ended by PID.
"""

from __future__ import annotations

import argparse
import heapq
import os
import select
import socket
import sys
import time

from .reorder import HELD, check_delay

_SOL_PACKET, _PACKET_VNET_HDR, _PACKET_QDISC_BYPASS = 263, 15, 20
_ETH_P_ALL = 0x0003
_MAX_FRAME = 65536 + 10  # a GSO batch and its virtio-net header
_SO_RCVBUFFORCE, _RCVBUF = 33, 64 << 20
_PRIORITY = 10  # SCHED_FIFO: above every ordinary process, so a frame waits its delay, not a turn


def _socket(ifname: str, bypass: bool) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
    # room for every frame held at once (GSO batches of 64 KiB): a full buffer would drop some
    s.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, _RCVBUF)
    s.setsockopt(_SOL_PACKET, _PACKET_VNET_HDR, 1)  # GSO batches travel whole, with their header
    if bypass:
        s.setsockopt(_SOL_PACKET, _PACKET_QDISC_BYPASS, 1)
    s.bind((ifname, 0))
    return s


def delay_line(out_dev: str, delay: float) -> None:
    """Read frames on HELD and send each on ``out_dev`` ``delay`` seconds after it came; runs
    until SIGTERM (the Testbed ends it by PID)."""
    # real-time: on a busy machine an ordinary process waits its turn for milliseconds, and
    # the frames it holds would come that much later than asked
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(_PRIORITY))
    rx, tx = _socket(HELD, bypass=False), _socket(out_dev, bypass=True)
    rx.setblocking(False)
    queue: list[tuple[float, int, bytes]] = []
    seq = 0
    print("ready", file=sys.stderr, flush=True)
    while True:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            tx.send(heapq.heappop(queue)[2])
        wait = max(0.0, queue[0][0] - now) if queue else 1.0
        if not select.select([rx], [], [], wait)[0]:
            continue
        while True:
            try:
                frame, addr = rx.recvfrom(_MAX_FRAME)
            except BlockingIOError:
                break
            if addr[2] == socket.PACKET_OUTGOING:
                continue  # our own HELD end sends nothing; taps see nothing else
            seq += 1
            heapq.heappush(queue, (time.monotonic() + delay, seq, frame))


def main(args: list[str] | None = None) -> int:
    """``python -m netns_testbed.delayline --out DEV --delay SECONDS`` (run by the Testbed)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", required=True, help="the uplink the held frames leave by")
    ap.add_argument("--delay", required=True, type=check_delay, help="seconds a frame is held")
    ns = ap.parse_args(args)
    try:
        delay_line(ns.out, ns.delay)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
