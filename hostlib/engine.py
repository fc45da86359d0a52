"""The stream engine: one all-reduce as a self-clocked stream of packets (protocol.md 3-4).

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

Everything per packet is vectorised: payloads are built with wire.build_payloads for a whole
batch of ready packets, results are parsed as one (m, plen) array and copied into the output with
fancy indexing, and the socket sends with GSO and receives with GRO (udp_io).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np

from xdp_switch import wire

from . import scaling
from .errors import AllreduceTimeout
from .udp_io import DatagramSocket, RowReceiver

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
    "fault_drops",  # packets and results dropped by the Faults test hook
    "elapsed",  # seconds spent in all-reduces
    "rtt",  # smoothed round trip of a packet (send to result), seconds
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
    world_size: int
    elems: int  # int32 per packet
    slot_base: int
    window: int  # slots of this worker: slot_base .. slot_base + window - 1
    aggregator: tuple[str, int]  # where contributions go
    rto: float = 0.015  # least retransmission timer (SwitchML: 10 ms)
    rto_max: float = 0.25
    timeout: float = 30.0  # seconds without progress before AllreduceTimeout
    progress: bool = False  # progress line on stderr for long all-reduces


class _IntTransfer:
    """int32 tensors: packet p carries chunk p; sums wrap modulo 2^32 like the aggregator's."""

    def __init__(self, src: np.ndarray, dst: np.ndarray, k: int, window: int) -> None:
        self.L = src.size
        self.P = -(-self.L // k)
        self.w = min(window, self.P)
        self.values = _rows(src, self.P, k)
        self.dst = dst
        self.padded = self.P * k != self.L
        # results go straight into dst unless the last chunk is padded
        self.out = np.empty((self.P, k), np.int32) if self.padded else dst.reshape(self.P, k)

    def contents(self, q: np.ndarray):
        return self.values[_index(q)], 0

    def accept(self, tsi: np.ndarray, e0: np.ndarray, values: np.ndarray) -> None:
        self.out[_index(tsi)] = values

    def finish(self) -> None:
        if self.padded:
            self.dst[:] = self.out.reshape(-1)[: self.L]


class _FloatTransfer:
    """float32 tensors, block-scaled with a one-window look-ahead of the exponents."""

    def __init__(self, src: np.ndarray, dst: np.ndarray, k: int, window: int, n: int) -> None:
        self.L, self.n = src.size, n
        self.Pd = -(-self.L // k)
        self.w = min(window, self.Pd)
        self.P = self.Pd + self.w
        self.x = _rows(src, self.Pd, k)
        self.exps = scaling.chunk_exponents(self.x)  # raises ValueError on NaN/Inf
        self.E = np.zeros(self.Pd, dtype=np.int8)  # agreed exponents, from the results
        self.dst = dst
        self.padded = self.Pd * k != self.L
        self.out = np.empty((self.Pd, k), np.float32) if self.padded else dst.reshape(self.Pd, k)
        self.k = k

    def contents(self, q: np.ndarray):
        e0 = np.full(len(q), scaling.ZERO_EXPONENT, dtype=np.int8)
        ahead = q < self.Pd
        e0[ahead] = self.exps[q[ahead]]
        data = q >= self.w
        if data.all():  # the common case, past the first window: every packet carries data
            c = _index(q - self.w)
            return scaling.quantise(self.x[c], self.E[c], self.n), e0
        vals = np.zeros((len(q), self.k), dtype=np.int32)
        c = q[data] - self.w
        if c.size:
            vals[data] = scaling.quantise(self.x[c], self.E[c], self.n)
        return vals, e0

    def accept(self, tsi: np.ndarray, e0: np.ndarray, values: np.ndarray) -> None:
        ahead = tsi < self.Pd
        self.E[tsi[ahead]] = e0[ahead]
        data = tsi >= self.w
        if data.all():
            c = _index(tsi - self.w)
            if isinstance(c, slice):  # divide straight into the output rows
                scaling.dequantise(values, self.E[c], self.n, out=self.out[c])
                return
        else:
            c, values = tsi[data] - self.w, values[data]
        if len(values):
            self.out[c] = scaling.dequantise(values, self.E[c], self.n)

    def finish(self) -> None:
        if self.padded:
            self.dst[:] = self.out.reshape(-1)[: self.L]


def _index(idx: np.ndarray):
    """idx as a slice when it is a run of consecutive integers (views instead of copies)."""
    n = len(idx)
    if n and idx[-1] - idx[0] == n - 1 and (n < 3 or (np.diff(idx) == 1).all()):
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def _rows(flat: np.ndarray, rows: int, k: int) -> np.ndarray:
    """flat as (rows, k), zero-padded at the end (a view when no padding is needed)."""
    if rows * k == flat.size:
        return flat.reshape(rows, k)
    out = np.zeros((rows, k), dtype=flat.dtype)
    out.reshape(-1)[: flat.size] = flat
    return out


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
        self._rx = RowReceiver(sock, self.plen, max_rows=2 * config.window + 64)
        self._rtt = _RttEstimator()  # kept across all-reduces

    # --- public -----------------------------------------------------------------------------
    def allreduce_int32(self, src: np.ndarray, dst: np.ndarray, timeout: float | None = None):
        """Sum the flat int32 `src` over the job into the flat int32 `dst` (may be src)."""
        self._run(_IntTransfer(src, dst, self.cfg.elems, self.cfg.window), timeout)

    def allreduce_float32(self, src: np.ndarray, dst: np.ndarray, timeout: float | None = None):
        """Sum the flat float32 `src` over the job into the flat float32 `dst` (may be src)."""
        n = self.cfg.world_size
        self._run(_FloatTransfer(src, dst, self.cfg.elems, self.cfg.window, n), timeout)

    # --- the loop ---------------------------------------------------------------------------
    def _run(self, tr, timeout: float | None) -> None:
        cfg, st = self.cfg, self.stats
        timeout = cfg.timeout if timeout is None else timeout
        P, w = tr.P, tr.w
        if P == 0:
            return
        number = self.counter
        self.counter += 1
        jn = number & 0xFF
        t0 = time.monotonic()
        p = np.arange(P)
        slot = cfg.slot_base + p % w
        version = (self.versions[:w].astype(np.int64)[p % w] + p // w) & 1
        pidx = wire.pool_index(slot, version)
        type_size = wire.type_size(wire.MSG_TYPE_DATA, self.size_code)
        # the bytes of the packet in flight in each slot, for retransmission: at most one per
        # slot (self-clocking), so w rows suffice whatever the tensor's size
        payload = np.empty((w, self.plen), dtype=np.uint8)
        done = np.zeros(P, dtype=bool)
        tries = np.zeros(P, dtype=np.int32)
        inflight = np.full(w, -1, dtype=np.int64)  # packet in flight per slot (at most one)
        deadline = np.full(w, np.inf)
        rto = np.full(w, cfg.rto)
        sent_at = np.zeros(w)  # first transmission of the packet in flight per slot
        ready = np.arange(w)
        ndone = results_here = 0
        last_progress = t0
        printer = _Progress(number, P, self.plen, t0) if cfg.progress else None
        try:
            while ndone < P:
                now = time.monotonic()
                if ready.size:
                    vals, e0 = tr.contents(ready)
                    fresh = wire.build_payloads(
                        job_number=jn, size_code=self.size_code, tsi=ready, slot=slot[ready],
                        version=version[ready], values=vals, e0=e0,
                    )
                    self._send(fresh)
                    s = ready % w
                    payload[s] = fresh
                    inflight[s] = ready
                    first_rto = self._rtt.rto(cfg.rto, cfg.rto_max)
                    rto[s] = first_rto
                    sent_at[s] = now
                    deadline[s] = now + first_rto
                    ready = ready[:0]
                rows = self._receive()
                if len(rows) == 0:
                    wake = min(deadline.min(), last_progress + timeout)
                    if printer:
                        wake = min(wake, printer.next)
                    self.sock.wait_readable(wake - time.monotonic())
                    rows = self._receive()
                now = time.monotonic()
                if len(rows):
                    tsi, e0, values = self._accept(rows, jn, P, pidx, type_size, done)
                    if tsi.size:
                        done[tsi] = True
                        ndone += tsi.size
                        results_here += tsi.size
                        last_progress = now
                        tr.accept(tsi, e0, values)
                        s = tsi % w
                        clean = s[tries[tsi] == 0]  # Karn: a retransmission's RTT is ambiguous
                        if clean.size:
                            self._rtt.update(now - sent_at[clean].min())
                        inflight[s] = -1
                        deadline[s] = np.inf
                        nxt = tsi + w
                        ready = nxt[nxt < P]
                expired = np.flatnonzero(deadline <= now)
                if expired.size:
                    pk = inflight[expired]
                    st["timeouts"] += int(np.count_nonzero(tries[pk] == 0))
                    tries[pk] += 1
                    st["retransmissions"] += pk.size
                    self._send(payload[expired])
                    rto[expired] = np.minimum(rto[expired] * 2, cfg.rto_max)
                    deadline[expired] = now + rto[expired]
                if ndone < P and now - last_progress > timeout:
                    raise self._stalled(number, P, w, timeout, results_here, inflight, slot)
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
            st["malformed"] = self._rx.malformed
            st["bytes_received"] = self._rx.bytes
            st["rtt"] = self._rtt.srtt or 0.0
            if printer:
                printer.close(time.monotonic(), ndone, st["retransmissions"])

    def _send(self, rows: np.ndarray) -> None:
        st = self.stats
        st["packets_sent"] += len(rows)
        st["bytes_sent"] += rows.size
        f = self.faults
        if f is not None:
            rows = self._perturb(rows, f.send_loss, f.send_duplicate)
        self.sock.send_rows(rows, self.cfg.aggregator)

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

    def _accept(self, rows, jn, P, pidx, type_size, done):
        """Validate a batch of results; the new ones as (tsi sorted, e0, values).

        values are big-endian int32 views into the receive buffer (valid until the next
        receive): numpy byte-swaps them while copying into the output, saving a pass over the
        data that wire.parse_payloads (which returns native copies) would cost.
        """
        st = self.stats
        hdr = rows[:, : wire.UDP_HDRS_LEN].view(wire.HDR_DTYPE)[:, 0]
        values = rows[:, wire.UDP_HDRS_LEN :].view(">i4")
        tsi = hdr["tsi"].astype(np.int64)
        ok = (hdr["msg_type_size"] == type_size) & (hdr["job_number"] == jn) & (tsi < P)
        at = np.where(ok, tsi, 0)
        ok &= hdr["pool_index"] == pidx[at]
        valid = int(ok.sum())
        st["stale"] += len(rows) - valid
        fresh = ok & ~done[at]
        new, first = np.unique(tsi[fresh], return_index=True)  # sorted, first of repeats
        st["duplicates"] += valid - new.size
        st["results"] += new.size
        sel = _index(np.flatnonzero(fresh)[first])  # a slice when in order without repeats
        return new, hdr["e0"][sel], values[sel]

    def _stalled(self, number, P, w, timeout, results_here, inflight, slot) -> AllreduceTimeout:
        cfg = self.cfg
        busy = inflight[inflight >= 0]
        slots = tuple(int(s) for s in np.unique(slot[busy]))
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
            msg, aggregator=cfg.aggregator, packets=P, outstanding=outstanding,
            outstanding_slots=slots, results=results_here,
        )


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
    """A one-line progress display on stderr, shown once an all-reduce runs for over a second."""

    def __init__(self, number: int, packets: int, plen: int, t0: float) -> None:
        self.number, self.packets, self.plen, self.t0 = number, packets, plen, t0
        self.next = t0 + 1.0
        self.shown = False

    def show(self, now: float, done: int, retx: float) -> None:
        rate = done * self.plen / max(now - self.t0, 1e-9) / 1e6
        sys.stderr.write(
            f"\rhostlib all-reduce #{self.number}: {done}/{self.packets} packets "
            f"({100 * done // self.packets}%), {rate:.1f} MB/s, {int(retx)} retransmissions"
        )
        sys.stderr.flush()
        self.shown = True
        self.next = now + 0.5

    def close(self, now: float, done: int, retx: float) -> None:
        if self.shown:
            self.show(now, done, retx)
            sys.stderr.write("\n")
