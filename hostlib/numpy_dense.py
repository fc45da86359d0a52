"""The numpy dense loop: the reference implementation of the stream (docs/protocol.md section 4;
floats: 5.2), run by hostlib.engine.StreamEngine when the C loop is not built or not wanted.

An all-reduce of P packets with window w = min(window, P-ish, see below):

- packet p uses slot `slot_base + p mod w` and that slot's next version (StreamState.versions);
- packet p is sent only once this worker has the result of packet p - w. That is the
  self-clocking, and it is what makes two versions enough: the slot's previous round is complete
  (and, for the version reused, the round before it is finished on every worker);
- on the wire: job_number = low 8 bits of the all-reduce counter (results of another
  all-reduce are ignored), tsi = p; results are deduplicated by (job_number, tsi) and also
  checked against the packet's pool index;
- every packet in flight has a timer, started at srtt + 4 rttvar (RFC 6298's estimate from
  measured round trips, Karn's rule: never from retransmitted packets; adaptive so that a busy
  host or aggregator does not cause spurious retransmissions) above a floor that follows the
  round trip, doubled at each expiry of the same packet, capped at `rto_max` (the lowest packet
  without a result, a probe, at `rto`); on expiry the identical bytes are sent again. Before
  its timer, a packet is resent once results of packets sent after it show it lost
  (early_loss, hostlib.loss_detect: about a round trip). An all-reduce that receives no new
  result for `timeout` seconds raises AllreduceTimeout saying what is missing.
  (A stall deadline rather than a fixed one: a large tensor legitimately takes long, a stall
  does not.)

Floats (block scaling, see scaling.py) need one extra window: with Pd chunks and w = min(window,
Pd), packets 0..w-1 carry exponents only (e0 of chunk p), and packet p >= w carries chunk p - w
scaled with the E returned by the result of packet p - w, plus e0 of chunk p (if any): the chunk
that will use the same slot one window later. P = Pd + w.

Everything per packet is vectorised: packets are built in place in the per-slot rows they are
sent and retransmitted from (a batch of ready packets at a time, headers from a per-shape
template), results are read as one (m, plen) array and copied into the output with fancy
indexing, and the socket sends with GSO and receives with recvmmsg and GRO (udp_io). This loop
always keeps the whole slot window in flight (no congestion window: that is the C loop's).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from xdp_agg.proto import wire

from . import loss_detect, scaling
from .loss_detect import Rack, RttEstimator, late_copies
from .stream_state import Allreduce, StreamState
from .udp_io import RowReceiver

# The SwitchML header (8 bytes, wire order: wire.SML_DTYPE), read and written as one uint64. The
# exponent header follows it (wire.EXPONENTS_AT), then the payload (wire.VALUES_AT).
_HDR8 = np.dtype([("type_size", "u1"), ("job_number", "u1"), ("tsi", ">u4"), ("pool_index", ">u2")])
# Busy-polling (NumpyDenseLoop._spin) while at most this many packets are outstanding, for at
# most _SPIN_TIME seconds at a time; a failed spin costs _SPIN_PENALTY credit (a success earns 1,
# up to _SPIN_CREDIT_MAX), and below 0 the next _SPIN_BACKOFF chances are skipped.
_SPIN_OUTSTANDING, _SPIN_TIME = 64, 60e-6
_SPIN_PENALTY, _SPIN_CREDIT_MAX, _SPIN_BACKOFF = 2, 8, 200


def _offset(dtype: np.dtype, name: str) -> int:
    """The byte offset of field `name` of the structured dtype `dtype`."""
    if dtype.fields is None:
        raise TypeError(f"{dtype} is not a structured dtype")
    return dtype.fields[name][1]


assert wire.SML_DTYPE.names == ("msg_type_size", "job_number", "tsi", "pool_index")
assert _HDR8.itemsize == wire.SWITCHML_HLEN == wire.EXPONENTS_AT
_H = wire.SWITCHML_HLEN
_TSI = slice(_offset(wire.SML_DTYPE, "tsi"), _offset(wire.SML_DTYPE, "tsi") + 4)  # in a row
assert wire.EXP_DTYPE.names == ("e0", "e1") and _offset(wire.EXP_DTYPE, "e0") == 0
_NO_DUPS = np.zeros(0, dtype=np.int64)


class _Chunks:
    """A flat tensor seen as rows of k elements, the last one zero-padded.

    The full rows are a view of the tensor; only a padded last row has a buffer of its own
    (`tail`), so no tensor-sized copy is made for lengths that are not a multiple of k.
    """

    def __init__(self, flat: np.ndarray, k: int, *, source: bool) -> None:
        self.flat, self.k = flat, k
        self.full = flat.size // k
        self.rows = flat[: self.full * k].reshape(self.full, k)
        self.tail: np.ndarray | None = None
        if self.full * k != flat.size:
            self.tail = np.zeros((1, k), dtype=flat.dtype)
            if source:
                self.tail[0, : flat.size - self.full * k] = flat[self.full * k :]

    def get(self, a: int, b: int) -> np.ndarray:
        """Rows a..b-1 (a view unless they include the padded row)."""
        if b <= self.full:
            return self.rows[a:b]
        return np.concatenate((self.rows[a : self.full], self._padded(b)))

    def put(self, a: int, b: int, fn: Callable[..., None], *args: np.ndarray) -> None:
        """fn(out_rows, *args_rows) for rows a..b-1: writes straight into the tensor."""
        if b <= self.full:
            fn(self.rows[a:b], *args)
            return
        tail = self._padded(b)
        m = self.full - a
        fn(self.rows[a : self.full], *(x[:m] for x in args))
        fn(tail, *(x[m:] for x in args))

    def _padded(self, b: int) -> np.ndarray:
        """The padded last row, for a range that ends at `b` past the full rows."""
        if self.tail is None or b > self.full + 1:
            raise IndexError(f"rows up to {b} of a tensor of {self.full} rows of {self.k}")
        return self.tail

    def finish(self) -> None:
        if self.tail is not None:
            self.flat[self.full * self.k :] = self.tail[0, : self.flat.size - self.full * self.k]


def _copy_into(out: np.ndarray, values: np.ndarray) -> None:
    out[...] = values  # byte-swaps big-endian wire values as it copies


class _Transfer(Protocol):
    """What NumpyDenseLoop runs: packets and window of one all-reduce, and its payloads both ways
    (_IntTransfer, _FloatTransfer)."""

    L: int  # elements
    P: int  # packets
    w: int  # window

    def fill(self, a: int, b: int, values: np.ndarray, e0: np.ndarray) -> None:
        """Write packets a..b-1 (payload rows `values`, exponent fields `e0`)."""

    def accept(self, a: int, b: int, e0: np.ndarray, values: np.ndarray) -> None:
        """Results of packets a..b-1 (a run): e0 fields and big-endian payload rows."""

    def finish(self) -> None:
        """After the last result: what is left to write into the output."""


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
    """float32, bfloat16 and float16 tensors, block-scaled with a one-window look-ahead of the
    exponents, straight from their own type into the words of the job's width (one element a
    word, or two at 16 bits: a chunk is a packet's k elements) and back."""

    def __init__(
        self,
        src: np.ndarray,
        dst: np.ndarray,
        k: int,
        window: int,
        n: int,
        work: np.ndarray,
        wire_bits: int = 32,
    ) -> None:
        self.L, self.n, self.k, self.bits = src.size, n, k, wire_bits
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
        # scale factor of int8 exponent E at index uint8(E)
        self._f_of = _scale_table(n, wire_bits)
        self.limit: int | None = None  # M, once some agreed exponent was clipped (>= 2^127)
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
                self.x.get(c0, c1),
                self.f[c0:c1],
                self.limit,
                out=values,
                work=self._tmp[: c1 - c0],
                wire_bits=self.bits,
            )

    def accept(self, a: int, b: int, e0: np.ndarray, values: np.ndarray) -> None:
        if a < self.Pd:  # the agreed exponents E of chunks a.. (the max over the workers)
            E = e0[: min(b, self.Pd) - a]
            self.f[a : a + len(E)] = self._f_of[E.view(np.uint8)]
            if self.limit is None and np.count_nonzero(E == scaling.E_MAX):
                self.limit = scaling.int_range(self.n, self.bits)
        w = self.w
        if b > w:
            s = max(a, w)
            c0, c1 = s - w, b - w
            self.out.put(c0, c1, _dequant_rows(self.bits), values[s - a :], self.f[c0:c1])

    def finish(self) -> None:
        self.out.finish()


def _dequant_rows(wire_bits: int) -> Callable[..., None]:
    """scaling.dequantise_scaled at `wire_bits`, as _Chunks.put calls it (out, sums, f)."""
    return functools.partial(_dequant_at, wire_bits)


def _dequant_at(wire_bits: int, out: np.ndarray, sums: np.ndarray, f: np.ndarray) -> None:
    scaling.dequantise_scaled(sums, f, out, wire_bits)


@functools.lru_cache(maxsize=16)
def _scale_table(n: int, wire_bits: int = 32) -> np.ndarray:
    """scaling.scale_factors of every int8 exponent E for n workers at `wire_bits`, at index
    uint8(E)."""
    t = scaling.scale_factors(np.arange(256, dtype=np.uint8).view(np.int8), n, wire_bits)
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


class _Flight:
    """What the numpy loop tracks during one all-reduce: which packets are done, what is ready
    to be sent, and each slot's timer (views of the loop's per-slot arrays)."""

    def __init__(self, loop: NumpyDenseLoop, ar: Allreduce, expect: np.ndarray) -> None:
        P, w = ar.packets, ar.window
        self.P, self.w, self.expect = P, w, expect
        self.done = np.zeros(P + 1, dtype=bool)
        self.done[P] = True
        # per packet, once done: how many of its retransmissions may still prove spurious
        self.retx_left = np.zeros(P + 1, dtype=np.uint8)
        self.deadline, self.tries = loop._deadline[:w], loop._tries[:w]  # per slot
        self.sent_at, self.rto = loop._sent_at[:w], loop._rto[:w]
        self.deadline.fill(np.inf)
        self.tries.fill(0)
        self.rack = Rack(w)  # early loss detection (hostlib.loss_detect)
        self.ready = [(0, w)]  # runs [a, b) of packets to send
        self.next_deadline = np.inf  # no timer expires before this (lazily updated)
        self.held_until = np.inf  # the first slot free again whose ready packet waits for it
        self.last_progress = ar.t0


class NumpyDenseLoop:
    """Runs a StreamState's all-reduces in numpy, over the state's socket."""

    def __init__(self, state: StreamState) -> None:
        self.state = state
        cfg, plen = state.cfg, state.plen
        self.plen = plen
        f = state.faults
        self._rng = np.random.default_rng(f.seed if f else None)  # used with faults only
        self._rx = RowReceiver(state.sock, plen, max_rows=2 * cfg.window + 64)
        self._rtt = RttEstimator()  # kept across all-reduces
        # The packet in flight in each slot, built in place: packets are written straight into
        # these rows, sent from them, and retransmitted from them (at most one per slot).
        self._payload = np.zeros((cfg.window, plen), dtype=np.uint8)
        self._head = self._payload[:, :_H].view("<u8")[:, 0]  # type, job, tsi, pool index
        self._e0_at = wire.EXPONENTS_AT  # e1 (the next byte) stays 0
        self._values_end = wire.VALUES_AT + wire.ELEM_BYTES * cfg.elems
        self._e0 = self._payload[:, self._e0_at].view(np.int8)
        self._values = self._payload[:, wire.VALUES_AT : self._values_end].view(">i4")
        self._slots = cfg.slot_base + np.arange(cfg.window)
        # float64 rows for quantising: a packet's elements each
        self._work = np.empty((cfg.window, state.elems_per_packet))
        # per-slot state of the packet in flight: timer, expiries, first transmission, rto
        self._deadline = np.empty(cfg.window)
        self._tries = np.empty(cfg.window, dtype=np.int32)
        self._sent_at = np.empty(cfg.window)
        self._rto = np.empty(cfg.window)
        # per slot, across all-reduces: no new packet before this (loss_detect.late_copies)
        self._reuse_at = np.zeros(cfg.window)
        # (P, w) -> header template, packet slots, version parities, pool bits: see _expect
        self._plans: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}
        self._spins = cfg.spin  # busy-poll at all
        self._spin_credit = 0  # see _spin
        self._dups = _NO_DUPS  # packet numbers of the duplicate results of the last _accept

    def run(self, kind: str, src: np.ndarray, dst: np.ndarray, timeout: float | None) -> None:
        """One all-reduce of the flat `src` into `dst`, both of dtype `kind` (engine.DTYPES)."""
        cfg = self.state.cfg
        tr: _Transfer
        if kind != "int32":
            ke, n = self.state.elems_per_packet, cfg.scaling_workers
            tr = _FloatTransfer(src, dst, ke, cfg.window, n, self._work, cfg.wire_bits)
        else:
            tr = _IntTransfer(src, dst, cfg.elems, cfg.window)
        if tr.P == 0:
            return
        # the receiver's totals count this loop's datagrams only: the counters take the
        # differences, so that the sparse loop's (hostlib.numpy_sparse), on the same stream,
        # add up with them
        malformed, received = self._rx.malformed, self._rx.bytes
        needless = self._rtt.needless_count
        with self.state.allreduce(tr.P, tr.w, timeout, elements=tr.L) as ar:
            try:
                self._stream(tr, ar)
                tr.finish()
            finally:
                self._rtt.run_ended(needless)
                st = self.state.stats
                st["malformed"] += self._rx.malformed - malformed
                st["bytes_received"] += self._rx.bytes - received
                st["rtt"] = self._rtt.srtt or 0.0
                st["cwnd"] = float(tr.w)  # the whole slot window is kept in flight

    def _stream(self, tr: _Transfer, ar: Allreduce) -> None:
        """Send, receive and retransmit until every packet of `ar` has its result."""
        fl = _Flight(self, ar, self._expect(ar.packets, ar.window, ar.job_number))
        printer, P = ar.printer, ar.packets
        while ar.ndone < P:
            if fl.ready:
                self._send_ready(tr, fl)
            rows = self._wait(fl, ar)
            now = time.monotonic()
            if len(rows):
                self._take(rows, tr, fl, ar, now)
            if fl.rack.moved and self.state.cfg.early_loss:
                fl.next_deadline = fl.rack.detect(fl.deadline, now, self._rtt, self.state.cfg)
            if now >= fl.next_deadline:
                self._expire(fl, now)
            if ar.ndone < P and now - fl.last_progress > ar.timeout:
                busy = np.flatnonzero(fl.deadline < np.inf)  # slots with a packet in flight
                raise self.state.stalled(ar, ar.ndone, busy)
            if printer and now >= printer.next:
                printer.show(now, ar.ndone, self.state.stats["retransmissions"])

    def _send_ready(self, tr: _Transfer, fl: _Flight) -> None:
        """Build the ready packets in their slots' rows, send them, start their timers; a packet
        whose slot still waits for late copies of its last one stays ready."""
        cfg = self.state.cfg
        now = time.monotonic()
        first_rto = self._rtt.rto(cfg.rto, cfg.rto_max, cfg.rto_floor if cfg.early_loss else None)
        held: list[tuple[int, int]] = []
        for a, b in fl.ready:
            for s0, s1, a1 in _slot_runs(a, b, fl.w):
                wait = self._reuse_at[s0:s1] > now
                for i0, i1 in _runs(np.flatnonzero(~wait)):
                    self._send_run(tr, fl, s0 + i0, s0 + i1, a1 + i0, now, first_rto)
                held += [(a1 + int(i), a1 + int(i) + 1) for i in np.flatnonzero(wait)]
        fl.next_deadline = min(fl.next_deadline, now + first_rto)
        fl.ready = held
        fl.held_until = min((self._reuse_at[a % fl.w] for a, _ in held), default=np.inf)

    def _send_run(
        self, tr: _Transfer, fl: _Flight, s0: int, s1: int, a1: int, now: float, rto: float
    ) -> None:
        """Build packets a1.. in slots s0..s1-1, send them and start their timers."""
        b1 = a1 + s1 - s0
        self._head[s0:s1] = fl.expect[a1:b1]
        tr.fill(a1, b1, self._values[s0:s1], self._e0[s0:s1])
        self._send(self._payload[s0:s1])
        fl.tries[s0:s1] = 0
        fl.sent_at[s0:s1] = now
        fl.rack.sent(s0, s1, a1, now)
        fl.rto[s0:s1] = rto
        fl.deadline[s0:s1] = now + rto

    def _wait(self, fl: _Flight, ar: Allreduce) -> np.ndarray:
        """Results that arrived; when none did, spin briefly or sleep until one arrives, a
        timer expires, the stall deadline passes or the progress line is due."""
        rows = self._receive()
        if len(rows) == 0 and self._spins and ar.packets - ar.ndone <= _SPIN_OUTSTANDING:
            rows = self._spin()
        if len(rows) == 0:
            wake = min(fl.next_deadline, fl.held_until, fl.last_progress + ar.timeout)
            if ar.printer:
                wake = min(wake, ar.printer.next)
            self.state.sock.wait_readable(wake - time.monotonic())
            rows = self._receive()
        return rows

    def _take(
        self, rows: np.ndarray, tr: _Transfer, fl: _Flight, ar: Allreduce, now: float
    ) -> None:
        """Accept a batch of results: into the output, their packets done, their slots'
        timers stopped and the packets one window later ready."""
        runs, sel, fresh = self._accept(rows, fl.P, fl.expect, fl.done)
        if fresh:
            w = fl.w
            e0 = rows[sel, self._e0_at].view(np.int8)
            values = rows[sel, wire.VALUES_AT : self._values_end].view(">i4")
            pos = 0
            for a, b in runs:
                tr.accept(a, b, e0[pos : pos + b - a], values[pos : pos + b - a])
                pos += b - a
                fl.done[a:b] = True
                for s0, s1, a1 in _slot_runs(a, b, w):
                    self._rtt.needless(fl.rack.took(s0, s1, fl.tries[s0:s1], now, self._rtt))
                    late = late_copies(fl.rack.tx_at[s0:s1], self._rtt, self.state.cfg)
                    self._reuse_at[s0:s1] = np.where(fl.tries[s0:s1] > 0, late, 0.0)
                    fl.deadline[s0:s1] = np.inf
                    fl.retx_left[a1 : a1 + s1 - s0] = np.minimum(fl.tries[s0:s1], 255)
            ar.ndone += fresh
            fl.last_progress = now
            s = (runs[-1][1] - 1) % w  # the newest sent: it waited least for the receive
            if fl.tries[s] == 0:  # Karn: a retransmission's RTT is ambiguous
                self._rtt.update(now - fl.sent_at[s])
            fl.ready += [(a + w, min(b + w, fl.P)) for a, b in runs if a + w < fl.P]
        if self._dups.size:
            _count_spurious(self._dups, fl.retx_left, self.state.stats)

    def _expire(self, fl: _Flight, now: float) -> None:
        """Send again the packets whose deadline passed: found lost early (their timer stays)
        or their timer expired (doubled)."""
        expired = np.flatnonzero(fl.deadline <= now)
        if expired.size:
            probe = int(np.argmin(fl.done)) % fl.w  # the lowest packet without a result's slot
            resend = loss_detect.expired(
                expired, fl.rack, fl.tries, fl.rto, probe, self._rtt, self.state.cfg,
                self.state.stats,
            )  # fmt: skip
            self._send(self._payload[resend])
            fl.rack.tx_at[resend] = now
            fl.deadline[expired] = now + fl.rto[expired]
        fl.next_deadline = float(fl.deadline.min())

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
            h["type_size"] = self.state.type_size
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
        h["pool_index"] = ((self.state.versions[pmod] ^ parity).astype(np.uint16) << 15) | slot_bits
        return h.view("<u8")

    def _send(self, rows: np.ndarray) -> None:
        st = self.state.stats
        st["packets_sent"] += len(rows)
        st["bytes_sent"] += rows.size
        f = self.state.faults
        if f is not None:
            rows = self._perturb(rows, f.send_loss, f.send_duplicate)
        self.state.sock.send_rows(rows, self.state.cfg.data_address)

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
        f = self.state.faults
        if f is not None and len(rows):
            rows = self._perturb(rows, f.recv_loss, f.recv_duplicate)
        return rows

    def _perturb(self, rows: np.ndarray, loss: float, dup: float) -> np.ndarray:
        m = len(rows)
        keep = self._rng.random(m) >= loss
        self.state.stats["fault_drops"] += m - int(keep.sum())
        copies = keep.astype(np.int64) + (keep & (self._rng.random(m) < dup))
        return np.repeat(rows, copies, axis=0)

    def _accept(
        self, rows: np.ndarray, P: int, expect: np.ndarray, done: np.ndarray
    ) -> tuple[list[tuple[int, int]], slice | np.ndarray, int]:
        """Validate a batch of results: (runs [a, b) of new results, sorted; which rows they
        are, in that order: a slice or indices; how many).

        A result is valid when its first 8 header bytes are those of the packet it answers
        (type and size, job number, tsi, pool index), and new when that packet is not done.
        The caller reads e0 and the big-endian values straight from the rows (views, valid
        until the next receive): numpy byte-swaps the values while copying them into the
        output, saving a pass over the data.
        """
        st = self.state.stats
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
        idx = np.nonzero(ok & ~done[at])[0]
        new = tsi[idx]
        sel: slice | np.ndarray = idx
        if new.size > 1 and np.count_nonzero(new[1:] <= new[:-1]):  # out of order or repeated
            new, first = np.unique(new, return_index=True)  # sorted, first of repeats
            sel = idx[first]
        elif new.size and idx[-1] - idx[0] == new.size - 1:
            sel = slice(int(idx[0]), int(idx[-1]) + 1)  # in order without gaps: views, no copies
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


def _count_spurious(dups: np.ndarray, retx_left: np.ndarray, st: dict[str, float]) -> None:
    """Count the duplicate results `dups` (packet numbers) that answer a retransmission whose
    packet had its result already: each retransmission of a packet is spurious at most once."""
    u, counts = np.unique(dups, return_counts=True)
    spurious = np.minimum(counts, retx_left[u])
    st["spurious"] += int(spurious.sum())
    retx_left[u] -= spurious.astype(np.uint8)


def _slot_runs(a: int, b: int, w: int) -> tuple[tuple[int, int, int], ...]:
    """Packets a..b-1 (at most w) as (s0, s1, first packet) runs of consecutive slots p % w."""
    s0 = a % w
    if s0 + (b - a) <= w:
        return ((s0, s0 + b - a, a),)
    split = a + w - s0
    return ((s0, w, a), (0, b - split, split))
