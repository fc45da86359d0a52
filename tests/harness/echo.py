"""EchoAggregator: a scripted aggregator for comparing the host loops on exactly what they send
(tests/unit/test_fastpath.py: the dense C and numpy loops; tests/unit/test_sparse_host.py: the
sparse ones). It records every datagram and answers each with a deterministic function of it alone.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time

import numpy as np

from harness.ranks import loopback_prefix
from xdp_agg.proto import wire

SOL_UDP, UDP_SEGMENT = 17, 103  # <linux/udp.h>


class EchoAggregator:
    """Answers every datagram at once with a result derived from it alone.

    The result keeps the first 8 header bytes; e0 becomes max(e0, bump[tsi % 64]) (another
    worker with larger values, so floats are quantised with an exponent above their own) and
    each value gets `add * (tsi + i)` added (modulo 2^32, as the aggregator's sums). Options
    script the path: `drop` (tsi -> how many first copies get no answer), `dup` (tsi answered
    twice), `late` (tsi whose first answer is held back `late_s` seconds, so that the engine's
    resend is answered first; with `late_until` = (tsi, m) instead until the m-th copy of that
    tsi arrived: an event, not a time), `queue` = (tsi, s) (every answer from that tsi on held
    s seconds: a standing queue's round trip), `blackout` = (i, m) (the i-th to the i+m-1-th
    datagram received get no answer: a burst of loss, counted in datagrams), `reverse` (each
    batch answered in reverse order), `answer_limit` (answer only that many datagrams, then go
    silent), `gso` (send a batch's answers as UDP GSO messages: runs of one length to one
    address, a shorter answer ending a run; an engine's GRO socket gets each run as one buffer
    to cut).
    """

    def __init__(
        self,
        *,
        bump: bool = True,
        add: int = 3,
        drop=None,
        dup=(),
        late=(),
        late_s: float = 0.08,
        late_until: tuple[int, int] | None = None,
        queue: tuple[int, float] | None = None,
        blackout: tuple[int, int] | None = None,
        reverse: bool = False,
        answer_limit: int | None = None,
        gso: bool = False,
    ):
        self.prefix = loopback_prefix()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((f"{self.prefix}.1", 0))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
        self.address = self.sock.getsockname()
        rng = np.random.default_rng(5)
        self.bump = rng.integers(-128, 128, 64).astype(np.int8) if bump else None
        self.add = add
        self.drop = dict(drop or {})
        self.dup, self.late, self.late_s = set(dup), set(late), late_s
        self.late_until = late_until
        self.queue = queue
        self.blackout = blackout
        self.copies: dict[int, int] = {}  # tsi -> copies received
        self.reverse = reverse
        self.answer_limit = answer_limit
        self.gso = gso
        self.received: list[bytes] = []
        self.arrived: list[float] = []  # time.monotonic() of each received datagram's batch
        self._held: list[tuple[float, bytes, tuple]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def worker_ip(self, i: int = 0) -> str:
        return f"{self.prefix}.{2 + i}"

    def result(self, data: bytes) -> bytes:
        out = bytearray(data)
        tsi = int.from_bytes(data[2:6], "big")
        at = wire.EXPONENTS_AT  # the exponent header follows the SwitchML header
        if self.bump is not None:
            e0 = data[at] - 256 if data[at] >= 128 else data[at]  # int8
            out[at] = max(e0, int(self.bump[tsi % 64])) & 0xFF
        vals = np.frombuffer(data[wire.VALUES_AT :], ">i4").astype(np.int64)
        vals += self.add * (tsi + np.arange(vals.size))
        out[wire.VALUES_AT :] = vals.astype(np.uint32).astype(">u4").tobytes()  # mod 2^32
        return bytes(out)

    def _loop(self) -> None:
        answered = 0
        while not self._stop:
            wait = 0.02 if not self._held else max(0.0, min(self._held)[0] - time.monotonic())
            wait = min(wait, 0.02)
            if select.select([self.sock], [], [], wait)[0]:
                batch = []
                while True:
                    try:
                        batch.append(self.sock.recvfrom(70000, socket.MSG_DONTWAIT))
                    except BlockingIOError:
                        break
            else:
                batch = []
            out = []
            now = time.monotonic()
            for data, src in batch:
                self.received.append(data)
                self.arrived.append(now)
                tsi = int.from_bytes(data[2:6], "big")
                self.copies[tsi] = self.copies.get(tsi, 0) + 1
                if self.late_until and self.copies.get(self.late_until[0], 0) >= self.late_until[1]:
                    self._held = [(now, res, to) for _, res, to in self._held]  # release them
                if self.drop.get(tsi, 0) > 0:
                    self.drop[tsi] -= 1
                    continue
                if (
                    self.blackout
                    and 0 <= len(self.received) - 1 - self.blackout[0] < self.blackout[1]
                ):
                    continue
                res = self.result(data)
                if tsi in self.late:
                    self.late.discard(tsi)
                    hold = np.inf if self.late_until else self.late_s
                    self._held.append((now + hold, res, src))
                    continue
                if self.queue and tsi >= self.queue[0]:
                    self._held.append((now + self.queue[1], res, src))
                    continue
                out.append((res, src))
                if tsi in self.dup:
                    out.append((res, src))
            due = [h for h in self._held if h[0] <= now]
            self._held = [h for h in self._held if h[0] > now]
            out += [(res, src) for _, res, src in due]
            if self.reverse:
                out.reverse()
            if self.gso:
                self._send_gso(out)
                continue
            for res, src in out:
                if self.answer_limit is not None and answered >= self.answer_limit:
                    break
                self.sock.sendto(res, src)
                answered += 1

    def _send_gso(self, out: list[tuple[bytes, tuple]]) -> None:
        """The answers in order, as GSO messages of runs of one length to one address (the
        kernel cuts a message at its segment size; only its last datagram may be shorter)."""
        i = 0
        while i < len(out):
            seg, src = len(out[i][0]), out[i][1]
            j = i + 1
            while j < len(out) and j - i < 32 and out[j][1] == src and len(out[j][0]) <= seg:
                j += 1
                if len(out[j - 1][0]) < seg:
                    break
            msg = b"".join(res for res, _ in out[i:j])
            self.sock.sendmsg([msg], [(SOL_UDP, UDP_SEGMENT, struct.pack("H", seg))], 0, src)
            i = j

    def packets(self) -> dict[tuple[int, int], bytes]:
        """What was received, by (job number, tsi); every copy of a packet is identical."""
        out: dict[tuple[int, int], bytes] = {}
        for data in self.received:
            key = (data[1], int.from_bytes(data[2:6], "big"))
            assert out.setdefault(key, data) == data, f"a resend of {key} differs"
        return out

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self.sock.close()
