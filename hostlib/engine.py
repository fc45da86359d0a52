"""The stream engine: one all-reduce as a self-clocked stream of packets (docs/protocol.md
section 4; floats: 5.2).

An all-reduce of P packets with window w = min(window, P-ish, see below):

- packet p uses slot `slot_base + p mod w` and that slot's next version. Versions are kept per
  slot across all-reduces (StreamEngine.versions): a slot's version must keep alternating from
  one use to the next whatever tensor uses it, or the aggregator would take a new tensor's first
  packet for a retransmission of the old one;
- packet p is sent only once this worker has the result of packet p - w. That is the
  self-clocking, and it is what makes two versions enough: the slot's previous round is complete
  (and, for the version reused, the round before it is finished on every worker);
- on the wire: job_number = low 8 bits of the engine's all-reduce counter (results of another
  all-reduce are ignored), tsi = p; results are deduplicated by (job_number, tsi) and also
  checked against the packet's pool index;
- every packet in flight has a timer, started at max(rto, srtt + 4 rttvar) (RFC 6298's estimate
  from measured round trips, Karn's rule: never from retransmitted packets; adaptive so that a
  busy host or aggregator does not cause spurious retransmissions), doubled at each expiry of the
  same packet, capped at `rto_max`; on expiry the identical bytes are sent again. An all-reduce that
  receives no new result for `timeout` seconds raises AllreduceTimeout saying what is missing.
  (A stall deadline rather than a fixed one: a large tensor legitimately takes long, a stall
  does not.)

Floats (block scaling, see scaling.py) need one extra window: with Pd chunks and w = min(window,
Pd), packets 0..w-1 carry exponents only (e0 of chunk p), and packet p >= w carries chunk p - w
scaled with the E returned by the result of packet p - w, plus e0 of chunk p (if any): the chunk
that will use the same slot one window later. P = Pd + w.

In the numpy loop everything per packet is vectorised: packets are built in place in the
per-slot rows they are sent and retransmitted from (a batch of ready packets at a time, headers
from a per-shape template), results are read as one (m, plen) array and copied into the output
with fancy indexing, and the socket sends with GSO and receives with recvmmsg and GRO (udp_io).

Two implementations of the same stream: this module's numpy loop (the reference), and the C
extension hostlib._fastpath, which runs the whole stream of one all-reduce with the GIL released
and sends the same bytes (tests/test_fastpath.py compares them). StreamEngine uses the C loop
when the extension is built (EngineConfig.native, env XDP_AGG_NATIVE=0 to force numpy). Only the
C loop has a congestion window (EngineConfig.cwnd): AIMD, starting at 16 packets, slow start up
to the slot window, halved once per loss event (a timer expiry); the numpy loop always keeps
the whole slot window in flight.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from aggproto import wire

from . import scaling
from .errors import AllreduceTimeout
from .udp_io import DatagramSocket, RowReceiver

try:
    from . import _fastpath
except ImportError:  # not built (a source checkout without build_ext): the numpy loop only
    _fastpath = None

STAT_NAMES = (
    "allreduces",  # all-reduces completed
    "elements",  # tensor elements all-reduced
    "packets_sent",  # datagrams sent, first transmissions and retransmissions
    "retransmissions",  # datagrams sent again after a timer expired
    "timeouts",  # packets whose timer expired at least once
    "results",  # results accepted (one per packet)
    "duplicates",  # results ignored because that packet was already done
    "stale",  # results of another all-reduce, or not matching the packet's slot/version
    "malformed",  # datagrams of the wrong length
    "bytes_sent",
    "bytes_received",
    "send_calls",  # system calls (one GSO call sends many datagrams)
    "recv_calls",
    "send_errors",  # sends the kernel refused (full buffer, no route): the timers recover
    "receive_drops",  # results the kernel dropped at this socket (its receive buffer was full)
    "fault_drops",  # packets and results dropped by the Faults test hook
    "elapsed",  # seconds spent in all-reduces
    "rtt",  # smoothed round trip of a packet (send to result), seconds
    "spurious",  # retransmissions that were not needed: the first copy's result came after it
    "cwnd",  # congestion window at the end of the last all-reduce, packets
)


# The SwitchML header (8 bytes, wire order: wire.SML_DTYPE), read and written as one uint64. The
# exponent header follows it (wire.EXPONENTS_AT), then the payload (wire.VALUES_AT).
_HDR8 = np.dtype([("type_size", "u1"), ("job_number", "u1"), ("tsi", ">u4"), ("pool_index", ">u2")])
# Busy-polling (StreamEngine._spin) while at most this many packets are outstanding, for at most
# _SPIN_TIME seconds at a time; a failed spin costs _SPIN_PENALTY credit (a success earns 1, up to
# _SPIN_CREDIT_MAX), and below 0 the next _SPIN_BACKOFF chances are skipped.
_SPIN_OUTSTANDING, _SPIN_TIME = 64, 60e-6
_SPIN_PENALTY, _SPIN_CREDIT_MAX, _SPIN_BACKOFF = 2, 8, 200
assert wire.SML_DTYPE.names == ("msg_type_size", "job_number", "tsi", "pool_index")
assert _HDR8.itemsize == wire.SWITCHML_HLEN == wire.EXPONENTS_AT
_H = wire.SWITCHML_HLEN
_TSI = slice(wire.SML_DTYPE.fields["tsi"][1], wire.SML_DTYPE.fields["tsi"][1] + 4)  # in a row
assert wire.EXP_DTYPE.names == ("e0", "e1") and wire.EXP_DTYPE.fields["e0"][1] == 0
# the C loop's layout is the wire module's (a stale build would send other bytes)
assert _fastpath is None or (_fastpath.VALUES_AT, _fastpath.EXP_LEN) == (
    wire.VALUES_AT,
    wire.EXP_HLEN,
)


@dataclass
class Faults:
    """Test hook: seeded random loss and duplication inside the engine.

    send_loss / send_duplicate act on outgoing contributions (first sends and retransmissions),
    recv_loss / recv_duplicate on received results. Lets loss recovery be tested without root
    or a lossy link.
    """

    send_loss: float = 0.0
    recv_loss: float = 0.0
    send_duplicate: float = 0.0
    recv_duplicate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("send_loss", "recv_loss", "send_duplicate", "recv_duplicate"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"Faults.{name} must be in [0, 1)")


@dataclass
class EngineConfig:
    """What the engine needs to know about its job (from the control endpoint)."""

    job_id: int
    world_size: int  # the n of float scaling: all workers summed (under the root of a tree)
    elems: int  # int32 per packet
    slot_base: int
    window: int  # slots of this worker: slot_base .. slot_base + window - 1
    aggregator: tuple[str, int]  # where contributions go
    rto: float = 0.015  # least retransmission timer (SwitchML: 10 ms)
    rto_max: float = 0.25
    timeout: float = 30.0  # seconds without progress before AllreduceTimeout
    progress: bool = False  # progress line on stderr for long all-reduces
    # the C loop (hostlib._fastpath): None = when built and XDP_AGG_NATIVE is not "0"
    native: bool | None = None
    cwnd: str = "aimd"  # congestion window of the C loop: "aimd", or "fixed" (= window)


class _Chunks:
    """A flat tensor seen as rows of k elements, the last one zero-padded.

    The full rows are a view of the tensor; only a padded last row has a buffer of its own
    (`tail`), so no tensor-sized copy is made for lengths that are not a multiple of k.
    """

    def __init__(self, flat: np.ndarray, k: int, *, source: bool) -> None:
        self.flat, self.k = flat, k
        self.full = flat.size // k
        self.rows = flat[: self.full * k].reshape(self.full, k)
        self.tail = None
        if self.full * k != flat.size:
            self.tail = np.zeros((1, k), dtype=flat.dtype)
            if source:
                self.tail[0, : flat.size - self.full * k] = flat[self.full * k :]

    def get(self, a: int, b: int) -> np.ndarray:
        """Rows a..b-1 (a view unless they include the padded row)."""
        if b <= self.full:
            return self.rows[a:b]
        return np.concatenate((self.rows[a : self.full], self.tail))

    def put(self, a: int, b: int, fn, *args) -> None:
        """fn(out_rows, *args_rows) for rows a..b-1: writes straight into the tensor."""
        if b <= self.full:
            fn(self.rows[a:b], *args)
            return
        m = self.full - a
        fn(self.rows[a : self.full], *(x[:m] for x in args))
        fn(self.tail, *(x[m:] for x in args))

    def finish(self) -> None:
        if self.tail is not None:
            self.flat[self.full * self.k :] = self.tail[0, : self.flat.size - self.full * self.k]


def _copy_into(out: np.ndarray, values: np.ndarray) -> None:
    out[...] = values  # byte-swaps big-endian wire values as it copies


def _dequantise_into(out: np.ndarray, sums: np.ndarray, f: np.ndarray) -> None:
    scaling.dequantise_scaled(sums, f, out)


class _IntTransfer:
    """int32 tensors: packet p carries chunk p; sums wrap modulo 2^32 like the aggregator's."""

    def __init__(self, src: np.ndarray, dst: np.ndarray, k: int, window: int) -> None:
        self.L = src.size
        self.P = -(-self.L // k)
        self.w = min(window, self.P)
        self.src = _Chunks(src, k, source=True)
        self.dst = _Chunks(dst, k, source=False)  # results go straight into dst

    def fill(self, a: int, b: int, values: np.ndarray, e0: np.ndarray) -> None:
        """Write packets a..b-1 (payload rows `values`, exponent fields `e0`)."""
        values[...] = self.src.get(a, b)
        e0[...] = 0

    def accept(self, a: int, b: int, e0: np.ndarray, values: np.ndarray) -> None:
        """Results of packets a..b-1 (a run): e0 fields and big-endian payload rows."""
        self.dst.put(a, b, _copy_into, values)

    def finish(self) -> None:
        self.dst.finish()


class _FloatTransfer:
    """float32 tensors, block-scaled with a one-window look-ahead of the exponents."""

    def __init__(
        self, src: np.ndarray, dst: np.ndarray, k: int, window: int, n: int, work: np.ndarray
    ) -> None:
        self.L, self.n, self.k = src.size, n, k
        self.Pd = -(-self.L // k)
        self.w = min(window, self.Pd)
        self.P = self.Pd + self.w
        self.x = x = _Chunks(src, k, source=True)
        # e0 of packet p: the exponent of chunk p, the neutral one past the last chunk
        self.e0 = np.empty(self.P, dtype=np.int8)
        self.e0[: x.full] = scaling.chunk_exponents(x.rows)  # raises ValueError on NaN/Inf
        if x.tail is not None:
            self.e0[x.full] = scaling.chunk_exponents(x.tail, offset=x.full * k)[0]
        self.e0[self.Pd :] = scaling.ZERO_EXPONENT
        self.f = np.zeros(self.Pd)  # scale factors of the agreed exponents, from the results
        self._f_of = _scale_table(n)  # scale factor of int8 exponent E at index uint8(E)
        self.limit = None  # M, once some agreed exponent was clipped (values >= 2^127)
        self.out = _Chunks(dst, k, source=False)
        self._tmp = work  # float64 work rows (at least w), the engine's

    def fill(self, a: int, b: int, values: np.ndarray, e0: np.ndarray) -> None:
        e0[...] = self.e0[a:b]
        w = self.w
        if a < w:  # the first window carries exponents only
            z = min(b, w) - a
            values[:z] = 0
            values, a = values[z:], a + z
        if a < b:
            c0, c1 = a - w, b - w
            scaling.quantise_scaled(
                self.x.get(c0, c1), self.f[c0:c1], self.limit, out=values, work=self._tmp[: c1 - c0]
            )

    def accept(self, a: int, b: int, e0: np.ndarray, values: np.ndarray) -> None:
        if a < self.Pd:  # the agreed exponents E of chunks a.. (the max over the workers)
            E = e0[: min(b, self.Pd) - a]
            self.f[a : a + len(E)] = self._f_of[E.view(np.uint8)]
            if self.limit is None and np.count_nonzero(E == scaling.E_MAX):
                self.limit = scaling.int_range(self.n)
        w = self.w
        if b > w:
            s = max(a, w)
            c0, c1 = s - w, b - w
            self.out.put(c0, c1, _dequantise_into, values[s - a :], self.f[c0:c1])

    def finish(self) -> None:
        self.out.finish()


@functools.lru_cache(maxsize=16)
def _scale_table(n: int) -> np.ndarray:
    """scaling.scale_factors of every int8 exponent E for n workers, at index uint8(E)."""
    t = scaling.scale_factors(np.arange(256, dtype=np.uint8).view(np.int8), n)
    t.flags.writeable = False
    return t


def _runs(idx: np.ndarray) -> list[tuple[int, int]]:
    """Sorted distinct integers as runs [a, b) of consecutive ones."""
    n = len(idx)
    if n == 0:
        return []
    first, last = int(idx[0]), int(idx[-1])
    if last - first == n - 1:
        return [(first, last + 1)]
    cut = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [n]))
    return [(int(idx[i]), int(idx[j - 1]) + 1) for i, j in zip(starts, ends)]


class StreamEngine:
    """Runs a communicator's all-reduces, one at a time, over its data socket.

    Not thread-safe: the communicator calls it from one thread.
    """

    def __init__(
        self, sock: DatagramSocket, config: EngineConfig, faults: Faults | None = None
    ) -> None:
        self.sock = sock
        self.cfg = config
        self.size_code = wire.size_code_for(config.elems)
        self.plen = wire.udp_payload_len(config.elems)
        self.versions = np.zeros(config.window, dtype=np.uint8)  # next version of each slot
        self.counter = 0  # all-reduces started; its low 8 bits are the wire job_number
        self.stats: dict[str, float] = {name: 0 for name in STAT_NAMES}
        self.faults = faults
        self._rng = np.random.default_rng(faults.seed) if faults else None
        if config.cwnd not in ("aimd", "fixed"):
            raise ValueError(f"cwnd must be 'aimd' or 'fixed', not {config.cwnd!r}")
        # Room for a few windows of results (and of packets) however late this process drains
        # its socket; a datagram takes about plen + 768 bytes of buffer (its skb).
        sock.ensure_buffers(
            rcvbuf=4 * config.window * (self.plen + 768),
            sndbuf=2 * config.window * (self.plen + 768),
        )
        self.native = _use_native(config.native)
        self._fast = None
        if self.native:
            self._fast = _fastpath.Engine(
                sock.fileno(),
                config.aggregator[0],
                config.aggregator[1],
                config.elems,
                config.window,
                config.world_size,
                wire.type_size(wire.MSG_TYPE_DATA, self.size_code),
                config.slot_base,
                config.rto,
                config.rto_max,
                gso=sock.gso,
                gro=sock.gro,
                cwnd=config.cwnd,
                faults=None
                if faults is None
                else (
                    faults.send_loss,
                    faults.recv_loss,
                    faults.send_duplicate,
                    faults.recv_duplicate,
                    faults.seed,
                ),
            )
        self._rx = RowReceiver(sock, self.plen, max_rows=2 * config.window + 64)
        self._rtt = _RttEstimator()  # kept across all-reduces
        # The packet in flight in each slot, built in place: packets are written straight into
        # these rows, sent from them, and retransmitted from them (at most one per slot).
        self._payload = np.zeros((config.window, self.plen), dtype=np.uint8)
        self._head = self._payload[:, :_H].view("<u8")[:, 0]  # type, job, tsi, pool index
        self._e0_at = wire.EXPONENTS_AT  # e1 (the next byte) stays 0
        self._values_end = wire.VALUES_AT + wire.ELEM_BYTES * config.elems
        self._e0 = self._payload[:, self._e0_at].view(np.int8)
        self._values = self._payload[:, wire.VALUES_AT : self._values_end].view(">i4")
        self._type_size = wire.type_size(wire.MSG_TYPE_DATA, self.size_code)
        self._slots = config.slot_base + np.arange(config.window)
        self._work = np.empty((config.window, config.elems))  # float64 rows for quantising
        # per-slot state of the packet in flight: timer, expiries, first transmission, rto
        self._deadline = np.empty(config.window)
        self._tries = np.empty(config.window, dtype=np.int32)
        self._sent_at = np.empty(config.window)
        self._rto = np.empty(config.window)
        self._plans: dict[tuple[int, int], tuple] = {}  # (P, w) -> header template, see _expect
        self._spin_credit = 0  # see _spin
        self._dups = _NO_DUPS  # packet numbers of the duplicate results of the last _accept

    # --- public -----------------------------------------------------------------------------
    def allreduce_int32(self, src: np.ndarray, dst: np.ndarray, timeout: float | None = None):
        """Sum the flat int32 `src` over the job into the flat int32 `dst` (may be src)."""
        if self.native:
            self._run_native(False, src, dst, timeout)
            return
        self._run(_IntTransfer(src, dst, self.cfg.elems, self.cfg.window), timeout)

    def allreduce_float32(self, src: np.ndarray, dst: np.ndarray, timeout: float | None = None):
        """Sum the flat float32 `src` over the job into the flat float32 `dst` (may be src)."""
        if self.native:
            self._run_native(True, src, dst, timeout)
            return
        n = self.cfg.world_size
        self._run(_FloatTransfer(src, dst, self.cfg.elems, self.cfg.window, n, self._work), timeout)

    # --- the loop ---------------------------------------------------------------------------
    def _run(self, tr, timeout: float | None) -> None:
        cfg, st = self.cfg, self.stats
        timeout = cfg.timeout if timeout is None else timeout
        P, w = tr.P, tr.w
        if P == 0:
            return
        number = self.counter
        self.counter += 1
        t0 = time.monotonic()
        expect = self._expect(P, w, number & 0xFF)
        done = np.zeros(P + 1, dtype=bool)
        done[P] = True
        # per packet, once done: how many of its retransmissions may still prove spurious
        retx_left = np.zeros(P + 1, dtype=np.uint8)
        deadline, tries = self._deadline[:w], self._tries[:w]  # per slot
        sent_at, rto = self._sent_at[:w], self._rto[:w]
        deadline.fill(np.inf)
        tries.fill(0)
        ready = [(0, w)]  # runs [a, b) of packets to send
        next_deadline = np.inf  # no timer expires before this (lazily updated)
        ndone = results_here = 0
        last_progress = t0
        printer = _Progress(number, P, self.plen, t0) if cfg.progress else None
        try:
            while ndone < P:
                if ready:
                    now = time.monotonic()
                    first_rto = self._rtt.rto(cfg.rto, cfg.rto_max)
                    for a, b in ready:
                        for s0, s1, a1 in _slot_runs(a, b, w):
                            b1 = a1 + s1 - s0
                            self._head[s0:s1] = expect[a1:b1]
                            tr.fill(a1, b1, self._values[s0:s1], self._e0[s0:s1])
                            self._send(self._payload[s0:s1])
                            tries[s0:s1] = 0
                            sent_at[s0:s1] = now
                            rto[s0:s1] = first_rto
                            deadline[s0:s1] = now + first_rto
                    next_deadline = min(next_deadline, now + first_rto)
                    ready = []
                rows = self._receive()
                if len(rows) == 0 and P - ndone <= _SPIN_OUTSTANDING:
                    rows = self._spin()
                if len(rows) == 0:
                    wake = min(next_deadline, last_progress + timeout)
                    if printer:
                        wake = min(wake, printer.next)
                    self.sock.wait_readable(wake - time.monotonic())
                    rows = self._receive()
                now = time.monotonic()
                if len(rows):
                    runs, sel, fresh = self._accept(rows, P, expect, done)
                    if fresh:
                        e0 = rows[sel, self._e0_at].view(np.int8)
                        values = rows[sel, wire.VALUES_AT : self._values_end].view(">i4")
                        pos = 0
                        for a, b in runs:
                            tr.accept(a, b, e0[pos : pos + b - a], values[pos : pos + b - a])
                            pos += b - a
                            done[a:b] = True
                            for s0, s1, a1 in _slot_runs(a, b, w):
                                deadline[s0:s1] = np.inf
                                retx_left[a1 : a1 + s1 - s0] = np.minimum(tries[s0:s1], 255)
                        ndone += fresh
                        results_here += fresh
                        last_progress = now
                        s = runs[0][0] % w  # Karn: a retransmission's RTT is ambiguous
                        if tries[s] == 0:
                            self._rtt.update(now - sent_at[s])
                        ready = [(a + w, min(b + w, P)) for a, b in runs if a + w < P]
                    if self._dups.size:
                        _count_spurious(self._dups, retx_left, st)
                if now >= next_deadline:
                    expired = np.flatnonzero(deadline <= now)
                    if expired.size:
                        st["timeouts"] += int(np.count_nonzero(tries[expired] == 0))
                        tries[expired] += 1
                        st["retransmissions"] += expired.size
                        self._send(self._payload[expired])
                        rto[expired] = np.minimum(rto[expired] * 2, cfg.rto_max)
                        deadline[expired] = now + rto[expired]
                    next_deadline = float(deadline.min())
                if ndone < P and now - last_progress > timeout:
                    busy = np.flatnonzero(deadline < np.inf)  # slots with a packet in flight
                    raise self._stalled(number, P, timeout, results_here, busy)
                if printer and now >= printer.next:
                    printer.show(now, ndone, st["retransmissions"])
            tr.finish()
            st["allreduces"] += 1
            st["elements"] += tr.L
        finally:
            # Advance every slot's version by its uses in this all-reduce, even on failure, so
            # that the next all-reduce of this worker lines up with the ranks that completed.
            uses = (P - np.arange(w) + w - 1) // w
            self.versions[:w] = (self.versions[:w] + uses) & 1
            st["elapsed"] += time.monotonic() - t0
            st["send_calls"] = self.sock.send_calls
            st["recv_calls"] = self.sock.recv_calls
            st["send_errors"] = self.sock.send_errors
            st["receive_drops"] = self.sock.receive_drops() or 0
            st["malformed"] = self._rx.malformed
            st["bytes_received"] = self._rx.bytes
            st["rtt"] = self._rtt.srtt or 0.0
            st["cwnd"] = float(w)  # the numpy loop keeps the whole slot window in flight
            if printer:
                printer.close(time.monotonic(), ndone, st["retransmissions"])

    def _run_native(
        self, is_float: bool, src: np.ndarray, dst: np.ndarray, timeout: float | None
    ) -> None:
        """One all-reduce through the C loop: the same packets as _run with the transfers
        above (P, w and the exponents as _IntTransfer and _FloatTransfer make them)."""
        cfg, st = self.cfg, self.stats
        timeout = cfg.timeout if timeout is None else timeout
        k, L = cfg.elems, src.size
        Pd = -(-L // k)
        w = min(cfg.window, Pd)
        exps = None
        if is_float:
            exps, bad = _fastpath.chunk_exponents(src, k)  # before anything is sent
            if bad >= 0:
                raise scaling.nonfinite_error(src[bad], bad)
        P = Pd + w if is_float else Pd
        if P == 0:
            return
        number = self.counter
        self.counter += 1
        t0 = time.monotonic()
        printer = _Progress(number, P, self.plen, t0) if cfg.progress else None
        show = None
        if printer:

            def show(ndone: int, retx: int) -> None:
                now = time.monotonic()
                if now >= printer.next:
                    printer.show(now, ndone, retx)

        res = None
        try:
            res = self._fast.allreduce(
                is_float,
                src,
                dst,
                P,
                w,
                number & 0xFF,
                self.versions[:w].tobytes(),
                exps,
                timeout,
                progress=show,
                progress_every=0.25,
            )
            if res["status"] != "done":
                raise self._stalled(number, P, timeout, res["results_here"], res["busy"])
            st["allreduces"] += 1
            st["elements"] += L
        finally:
            uses = (P - np.arange(w) + w - 1) // w  # as in _run, on failure too
            self.versions[:w] = (self.versions[:w] + uses) & 1
            st["elapsed"] += time.monotonic() - t0
            if res is not None:
                c = res["counters"]
                for name in _NATIVE_COUNTED:
                    st[name] += c[name]
                self.sock.send_calls += c["send_calls"]
                self.sock.recv_calls += c["recv_calls"]
                self.sock.send_errors += c["send_errors"]
                if res["last_errno"]:
                    self.sock.last_send_error = OSError(
                        res["last_errno"], os.strerror(res["last_errno"])
                    )
                if res["gso_refused"]:
                    self.sock.gso = False
            st["send_calls"] = self.sock.send_calls
            st["recv_calls"] = self.sock.recv_calls
            st["send_errors"] = self.sock.send_errors
            st["receive_drops"] = self.sock.receive_drops() or 0
            st["rtt"] = self._fast.srtt
            st["cwnd"] = self._fast.cwnd
            if printer:
                done = res["ndone"] if res is not None else 0
                printer.close(time.monotonic(), done, st["retransmissions"])

    def _expect(self, P: int, w: int, jn: int) -> np.ndarray:
        """The first 8 header bytes of packets 0..P-1 (type and size, job number, tsi, pool
        index) as little-endian uint64: what is sent, and what the result must echo. Entry P
        matches nothing (results with tsi >= P are looked up there).

        Pool index of packet p: slot base + p % w, version (versions[p % w] + p // w) & 1.
        What depends only on (P, w) is kept for the next all-reduces of that shape.
        """
        plan = self._plans.get((P, w))
        if plan is None:
            p = np.arange(P + 1)
            pmod, pdiv = p % w, p // w
            h = np.empty(P + 1, dtype=_HDR8)
            h["type_size"] = self._type_size
            h["tsi"] = p
            h["tsi"][P] = 0  # never equal to the tsi of a result looked up here
            slot_bits = wire.pool_index(self._slots[pmod], 0)
            plan = (h, pmod, pdiv & 1, slot_bits)
            if len(self._plans) >= 8:
                self._plans.pop(next(iter(self._plans)))
            self._plans[(P, w)] = plan
        template, pmod, parity, slot_bits = plan
        h = template.copy()
        h["job_number"] = jn
        h["pool_index"] = ((self.versions[pmod] ^ parity).astype(np.uint16) << 15) | slot_bits
        return h.view("<u8")

    def _send(self, rows: np.ndarray) -> None:
        st = self.stats
        st["packets_sent"] += len(rows)
        st["bytes_sent"] += rows.size
        f = self.faults
        if f is not None:
            rows = self._perturb(rows, f.send_loss, f.send_duplicate)
        self.sock.send_rows(rows, self.cfg.aggregator)

    def _spin(self) -> np.ndarray:
        """Receive without sleeping for up to _SPIN_TIME, if spinning has been paying off.

        Waking from poll() costs tens of microseconds, a large share of a small all-reduce's
        round trip when a CPU is free for the spinning worker. When workers outnumber the CPUs,
        spinning takes the CPU from the very workers whose contributions complete the result:
        then the spins come back empty, and after a few failures spinning stops (it is tried
        again now and then, in case the machine got quieter).
        """
        if self._spin_credit < 0:
            self._spin_credit += 1  # a probe again after |credit| skipped chances
            return self._rx.empty
        end = time.monotonic() + _SPIN_TIME
        while True:
            rows = self._receive()
            if len(rows):
                self._spin_credit = min(self._spin_credit + 1, _SPIN_CREDIT_MAX)
                return rows
            if time.monotonic() >= end:
                self._spin_credit -= _SPIN_PENALTY
                if self._spin_credit < 0:
                    self._spin_credit = -_SPIN_BACKOFF
                return rows

    def _receive(self) -> np.ndarray:
        rows = self._rx.drain()
        f = self.faults
        if f is not None and len(rows):
            rows = self._perturb(rows, f.recv_loss, f.recv_duplicate)
        return rows

    def _perturb(self, rows: np.ndarray, loss: float, dup: float) -> np.ndarray:
        m = len(rows)
        keep = self._rng.random(m) >= loss
        self.stats["fault_drops"] += m - int(keep.sum())
        copies = keep.astype(np.int64) + (keep & (self._rng.random(m) < dup))
        return np.repeat(rows, copies, axis=0)

    def _accept(self, rows, P, expect, done):
        """Validate a batch of results: (runs [a, b) of new results, sorted; which rows they
        are, in that order: a slice or indices; how many).

        A result is valid when its first 8 header bytes are those of the packet it answers
        (type and size, job number, tsi, pool index), and new when that packet is not done.
        The caller reads e0 and the big-endian values straight from the rows (views, valid
        until the next receive): numpy byte-swaps the values while copying them into the
        output, saving a pass over the data.
        """
        st = self.stats
        m = len(rows)
        self._dups = _NO_DUPS
        head = rows[:, :_H].view("<u8")[:, 0]
        # the usual batch: results of consecutive packets t0.., all valid and new
        t0 = int(rows[0, _TSI].view(">u4")[0])
        if (
            t0 + m <= P
            and not np.count_nonzero(head != expect[t0 : t0 + m])
            and not np.count_nonzero(done[t0 : t0 + m])
        ):
            st["results"] += m
            return [(t0, t0 + m)], slice(0, m), m
        tsi = rows[:, _TSI].view(">u4")[:, 0].astype(np.int64)
        at = np.minimum(tsi, P)
        ok = head == expect[at]
        sel = np.nonzero(ok & ~done[at])[0]
        new = tsi[sel]
        if new.size > 1 and np.count_nonzero(new[1:] <= new[:-1]):  # out of order or repeated
            new, first = np.unique(new, return_index=True)  # sorted, first of repeats
            sel = sel[first]
        elif new.size and sel[-1] - sel[0] == new.size - 1:
            sel = slice(int(sel[0]), int(sel[-1]) + 1)  # in order without gaps: views, no copies
        st["results"] += new.size
        if new.size < m:  # what the others were
            valid = int(np.count_nonzero(ok))
            st["stale"] += m - valid
            st["duplicates"] += valid - new.size
            if valid > new.size:  # which packets the duplicates answer, for _count_spurious
                dup = ok.copy()
                dup[sel] = False
                self._dups = tsi[dup]
        return _runs(new), sel, int(new.size)

    def _stalled(self, number, P, timeout, results_here, busy) -> AllreduceTimeout:
        """The AllreduceTimeout of a stalled all-reduce; `busy`: the slot offsets (0..w-1)
        with a packet in flight."""
        cfg = self.cfg
        slots = tuple(int(cfg.slot_base + s) for s in busy)
        agg = f"{cfg.aggregator[0]}:{cfg.aggregator[1]}"
        outstanding = P - results_here
        if results_here == 0:
            never = " (it has never answered this worker)" if self.stats["results"] == 0 else ""
            msg = (
                f"all-reduce #{number} got no result at all from the aggregator at {agg} "
                f"(job id {cfg.job_id}) within {timeout:g} s{never}: {P} packet(s), "
                f"{len(busy)} in flight in slot(s) {_ranges(slots)}. Either the aggregator is "
                f"not running, has no such job or does not know this worker's address, or "
                f"another rank is not contributing."
            )
        else:
            msg = (
                f"all-reduce #{number} made no progress for {timeout:g} s: {outstanding} of {P} "
                f"packet(s) without a result, {len(busy)} in flight in slot(s) {_ranges(slots)} "
                f"({results_here} results received from {agg})."
            )
        if self.sock.last_send_error is not None:
            msg += f" Last send error: {self.sock.last_send_error}."
        return AllreduceTimeout(
            msg,
            aggregator=cfg.aggregator,
            packets=P,
            outstanding=outstanding,
            outstanding_slots=slots,
            results=results_here,
        )


_NO_DUPS = np.zeros(0, dtype=np.int64)
# the counters the C loop reports per all-reduce that add up in StreamEngine.stats as they are
# (the socket's system calls and errors go through the DatagramSocket's own counters)
_NATIVE_COUNTED = (
    "packets_sent",
    "retransmissions",
    "timeouts",
    "results",
    "duplicates",
    "stale",
    "malformed",
    "bytes_sent",
    "bytes_received",
    "fault_drops",
    "spurious",
)


def _count_spurious(dups: np.ndarray, retx_left: np.ndarray, st: dict) -> None:
    """Count the duplicate results `dups` (packet numbers) that answer a retransmission whose
    packet had its result already: each retransmission of a packet is spurious at most once."""
    u, counts = np.unique(dups, return_counts=True)
    spurious = np.minimum(counts, retx_left[u])
    st["spurious"] += int(spurious.sum())
    retx_left[u] -= spurious.astype(np.uint8)


def _use_native(native: bool | None) -> bool:
    """Whether to run the C loop: `native` if given, else when it is built and the
    environment does not say XDP_AGG_NATIVE=0."""
    if native is None:
        return _fastpath is not None and os.environ.get("XDP_AGG_NATIVE", "1") != "0"
    if native and _fastpath is None:
        raise ImportError(
            "EngineConfig(native=True) but hostlib._fastpath is not built: run "
            "`python setup.py build_ext --inplace` (or pip install) in the source tree"
        )
    return bool(native)


def _slot_runs(a: int, b: int, w: int):
    """Packets a..b-1 (at most w) as (s0, s1, first packet) runs of consecutive slots p % w."""
    s0 = a % w
    if s0 + (b - a) <= w:
        return ((s0, s0 + b - a, a),)
    split = a + w - s0
    return ((s0, w, a), (0, b - split, split))


def _ranges(values: tuple[int, ...]) -> str:
    """'3-5, 9' for (3, 4, 5, 9)."""
    if not values:
        return "none"
    out, start, prev = [], values[0], values[0]
    for v in values[1:] + (None,):
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
        if v is not None:
            start = prev = v
    return ", ".join(out)


class _RttEstimator:
    """Smoothed round-trip time and its variation (RFC 6298, one sample per received batch)."""

    def __init__(self) -> None:
        self.srtt: float | None = None
        self.rttvar = 0.0

    def update(self, sample: float) -> None:
        if self.srtt is None:
            self.srtt, self.rttvar = sample, sample / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - sample)
            self.srtt = 0.875 * self.srtt + 0.125 * sample

    def rto(self, floor: float, cap: float) -> float:
        """The first timer of a packet: srtt + 4 rttvar, within [floor, cap]."""
        if self.srtt is None:
            return floor
        return min(max(floor, self.srtt + 4 * self.rttvar), cap)


class _Progress:
    """Progress of a long all-reduce on stderr, shown once it runs for over a second.

    On a terminal, one line rewritten in place twice a second; otherwise (a log file, a pipe)
    whole lines, one every 5 seconds and a last one at the end, so that logs stay readable.
    """

    def __init__(self, number: int, packets: int, plen: int, t0: float) -> None:
        self.number, self.packets, self.plen, self.t0 = number, packets, plen, t0
        self.next = t0 + 1.0
        self.shown = False
        try:
            self.tty = sys.stderr.isatty()
        except (AttributeError, ValueError):  # replaced or closed stderr
            self.tty = False
        self.every = 0.5 if self.tty else 5.0

    def _line(self, now: float, done: int, retx: float) -> str:
        rate = done * self.plen / max(now - self.t0, 1e-9) / 1e6
        return (
            f"hostlib all-reduce #{self.number}: {done}/{self.packets} packets "
            f"({100 * done // self.packets}%), {rate:.1f} MB/s, {int(retx)} retransmissions"
        )

    def show(self, now: float, done: int, retx: float) -> None:
        line = self._line(now, done, retx)
        sys.stderr.write(f"\r{line}" if self.tty else f"{line}\n")
        sys.stderr.flush()
        self.shown = True
        self.next = now + self.every

    def close(self, now: float, done: int, retx: float) -> None:
        if self.shown:
            self.show(now, done, retx)
            if self.tty:
                sys.stderr.write("\n")
