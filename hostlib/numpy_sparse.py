"""The numpy sparse loop: one all-reduce as slots walking the non-zero blocks (docs/protocol.md 8).

The reference implementation of a sparse all-reduce, in numpy, over a StreamState's socket
(hostlib.engine runs it when an all-reduce asks for sparse). A tensor of L elements is B blocks
of k (the last zero-padded); with w = min(window, B) slots, slot s walks its column, the blocks
s, s + w, s + 2w, ... Each round of a slot is at one block p, the same on every worker:

- the first round of slot s is at p = s; for floats it is an announce round instead: an empty
  packet at s naming this worker's first non-zero block at or after s and its exponent;
- at block p this worker sends its block p (msg_type 2) when it is non-zero, else the empty
  msg_type 3; either way `next` is its first non-zero block of the column after p (B: none);
- the result carries the sum of the blocks sent (or nothing) and the smallest `next` over the
  workers, with the exponent agreed for that block: the slot's next round is there, and at B
  the slot is done.

A block zero on this worker costs a 22-byte header at most, and one zero on every worker is never
visited. Every round has a timer and is retransmitted byte for byte, as in the dense loops (4.4);
results are deduplicated by their round (job number, tsi, pool index, block).

Blocks that no round visits, and rounds whose result is empty, are zero on every worker: the
output holds zeros there (when the output is the input, they already are).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from xdp_agg.proto import wire

from . import loss_detect, scaling
from .errors import bad_next_error
from .loss_detect import Rack, RttEstimator, late_copies
from .numpy_dense import _Chunks, _scale_table
from .stream_state import Allreduce, StreamState

_SP = wire.SPARSE_HDR_DTYPE
_EMPTY_LEN = wire.SPARSE_VALUES_AT  # 22: a header-only packet


@dataclass
class _Tensor:
    """The tensor as blocks: which are non-zero, their exponents (floats), each column's
    non-zero blocks in order."""

    src: _Chunks
    dst: _Chunks
    B: int
    w: int
    nonzero: np.ndarray  # bool per block
    exps: np.ndarray | None  # int8 exponent per block (floats), None for int32
    columns: list[np.ndarray]  # column s: its non-zero blocks, ascending

    def next_after(self, s: int, p: int, at: bool = False) -> int:
        """The first non-zero block of column s after block p (at or after it, with `at`)."""
        col = self.columns[s]
        i = int(np.searchsorted(col, p, side="left" if at else "right"))
        return int(col[i]) if i < len(col) else self.B

    def exponent(self, block: int) -> int:
        """e0 naming `block` (the neutral exponent past the last one, and for int32)."""
        if self.exps is None or block >= self.B:
            return scaling.ZERO_EXPONENT if self.exps is not None else 0
        return int(self.exps[block])


def _tensor(src: np.ndarray, dst: np.ndarray, k: int, window: int, is_float: bool) -> _Tensor:
    x = _Chunks(src, k, source=True)
    B = -(-src.size // k)
    w = min(window, B)
    blocks = [x.rows] + ([x.tail] if x.tail is not None else [])
    nonzero = np.concatenate([np.any(b != 0, axis=1) for b in blocks])
    exps = None
    if is_float:  # raises ValueError naming a NaN or Inf, before anything is sent
        exps = np.concatenate(
            [scaling.chunk_exponents(x.rows)]
            + ([scaling.chunk_exponents(x.tail, offset=x.full * k)] if x.tail is not None else [])
        )
    nz = np.flatnonzero(nonzero)
    order = np.argsort(nz % w, kind="stable")
    counts = np.bincount(nz % w, minlength=w)
    columns = np.split(nz[order], np.cumsum(counts)[:-1])
    if not np.shares_memory(src, dst):
        dst[...] = 0  # unvisited blocks and empty results: zeros (in place: they already are)
    out = _Chunks(dst, k, source=False)
    return _Tensor(x, out, B, w, nonzero, exps, columns)


class _Slots:
    """Per slot of the window: the round in flight (its block, whether it announces, the row it
    is sent from) and its timer."""

    def __init__(self, w: int, plen: int) -> None:
        self.block = np.arange(w, dtype=np.int64)  # the round's block
        self.rounds = np.zeros(w, dtype=np.int64)  # rounds started in this all-reduce
        self.announce = np.zeros(w, dtype=bool)
        self.done = np.zeros(w, dtype=bool)
        self.f = np.zeros(w)  # scale factor agreed for the round's block (floats)
        self.clip = np.zeros(w, dtype=bool)  # its exponent was clipped: saturate at M (5.5)
        self.rows: list[bytes] = [b""] * w
        self.deadline = np.full(w, np.inf)
        self.tries = np.zeros(w, dtype=np.int64)
        self.sent_at = np.zeros(w)
        self.rto = np.zeros(w)
        self.rack = Rack(w)  # early loss detection (hostlib.loss_detect)
        self.held = np.zeros(w, dtype=bool)  # its next round waits for late copies of the last


class NumpySparseLoop:
    """Runs a StreamState's sparse all-reduces in numpy, over the state's socket."""

    def __init__(self, state: StreamState) -> None:
        self.state = state
        f = state.faults
        self._rng = np.random.default_rng(f.seed + 1) if f else None
        self._rtt = RttEstimator()
        # per slot, across all-reduces: no new round before this (loss_detect.late_copies)
        self._reuse_at = np.zeros(state.cfg.window)
        self.union_blocks = 0  # blocks of the last all-reduce whose result had data
        self.blocks = 0  # and its blocks

    def run(self, kind: str, src: np.ndarray, dst: np.ndarray, timeout: float | None) -> None:
        """One sparse all-reduce of the flat `src` into `dst`, both of dtype `kind`
        (engine.DTYPES); a block is a packet's elements (two a word on a 16-bit job)."""
        cfg = self.state.cfg
        if src.size == 0:
            return
        is_float = kind != "int32"
        t = _tensor(src, dst, self.state.elems_per_packet, cfg.window, is_float)
        sl = _Slots(t.w, self.state.plen)
        self.union_blocks, self.blocks = 0, t.B
        needless = self._rtt.needless_count
        with self.state.allreduce(t.B, t.w, timeout, elements=src.size) as ar:
            ar.uses = sl.rounds  # versions advance by the rounds each slot ran (8.2)
            try:
                self._stream(t, sl, ar, is_float)
                t.dst.finish()
            finally:
                self._rtt.run_ended(needless)

    def _stream(self, t: _Tensor, sl: _Slots, ar: Allreduce, is_float: bool) -> None:
        st = self.state.stats
        st["sparse_allreduces"] += 1
        for s in range(t.w):
            sl.announce[s] = is_float
            sl.held[s] = True
        self._start_held(t, sl, ar)
        last = time.monotonic()
        while not sl.done.all():
            held = self._reuse_at[: t.w][sl.held]
            wake = min(float(sl.deadline.min()), float(held.min(initial=np.inf)), last + ar.timeout)
            self.state.sock.wait_readable(wake - time.monotonic())
            if self._receive(t, sl, ar):
                last = time.monotonic()
            self._start_held(t, sl, ar)
            now = time.monotonic()
            if sl.rack.moved and self.state.cfg.early_loss:
                sl.rack.detect(sl.deadline, now, self._rtt, self.state.cfg)
            self._expire(sl, now)
            if not sl.done.all() and now - last > ar.timeout:
                busy = np.flatnonzero(~sl.done)
                raise self.state.stalled(ar, ar.ndone, busy)
        st["blocks_skipped"] += int(t.B - np.count_nonzero(t.nonzero))

    def _start_held(self, t: _Tensor, sl: _Slots, ar: Allreduce) -> None:
        """Start the held rounds whose slots no late copy can reach any more."""
        for s in np.flatnonzero(sl.held & (self._reuse_at[: t.w] <= time.monotonic())):
            sl.held[s] = False
            self._start(t, sl, ar, int(s))

    def _start(self, t: _Tensor, sl: _Slots, ar: Allreduce, s: int) -> None:
        """Build slot s's round at sl.block[s] and send it."""
        p, k = int(sl.block[s]), self.state.cfg.elems
        if sl.announce[s]:
            nxt, values = t.next_after(s, p, at=True), None
        else:
            nxt = t.next_after(s, p)
            values = self._values(t, sl, s, p) if t.nonzero[p] else None
        version = int(self.state.versions[s] ^ (sl.rounds[s] & 1))
        row = wire.build_sparse_payload(
            job_number=ar.job_number,
            size_code=self.state.size_code,
            tsi=int(sl.rounds[s]) * t.w + s,
            slot=self.state.cfg.slot_base + s,
            version=version,
            block=p,
            next=nxt,
            blocks=t.B,
            values=values,
            e0=t.exponent(nxt),
            padded=self.state.cfg.pad_empty,
            wire_bits=self.state.cfg.wire_bits,
        )
        assert values is None or len(row) == wire.sparse_payload_len(k, False)
        sl.rows[s] = row
        sl.rounds[s] += 1
        if values is None:
            self.state.stats["empty_sent"] += 1
        now = time.monotonic()
        sl.tries[s], sl.sent_at[s] = 0, now
        sl.rack.sent(s, s + 1, int(sl.rounds[s] - 1) * t.w + s, now)
        cfg = self.state.cfg
        sl.rto[s] = self._rtt.rto(cfg.rto, cfg.rto_max, cfg.rto_floor if cfg.early_loss else None)
        sl.deadline[s] = now + sl.rto[s]
        self._send(row)

    def _values(self, t: _Tensor, sl: _Slots, s: int, p: int) -> np.ndarray:
        block = t.src.get(p, p + 1)
        if t.exps is None:
            return block[0]
        cfg = self.state.cfg
        limit = scaling.int_range(cfg.scaling_workers, cfg.wire_bits) if sl.clip[s] else None
        out = np.empty((1, cfg.elems), dtype=">i4")  # the payload's words
        scaling.quantise_scaled(block, sl.f[s : s + 1], limit, out, None, cfg.wire_bits)
        return out[0]

    def _receive(self, t: _Tensor, sl: _Slots, ar: Allreduce) -> bool:
        """Take what arrived; whether any result was new."""
        fresh = False
        for data, _addr in self.state.sock.recv_datagrams():
            self.state.stats["bytes_received"] += len(data)
            for d in self._perturbed(data, "recv"):
                fresh |= self._take(t, sl, ar, d)
        return fresh

    def _take(self, t: _Tensor, sl: _Slots, ar: Allreduce, data: bytes) -> bool:
        """One datagram: a new result moves its slot on (True); anything else is counted."""
        st, k = self.state.stats, self.state.cfg.elems
        try:
            msg = wire.Message.from_bytes(data)
        except ValueError:
            st["malformed"] += 1
            return False
        sp = msg.sparse
        empty = msg.msg_type == wire.MSG_TYPE_SPARSE_EMPTY
        if (
            sp is None
            or msg.size != self.state.size_code
            or msg.wire_bits != self.state.cfg.wire_bits
            or len(data) != wire.sparse_payload_len(k, empty)
        ):
            st["malformed"] += 1
            return False
        s = msg.tsi % t.w if t.w else 0
        if msg.job_number != ar.job_number or msg.tsi >= (sl.rounds[s] + 1) * t.w:
            st["stale"] += 1
            return False
        current = int(sl.rounds[s] - 1) * t.w + s
        if msg.tsi != current or sl.done[s] or sl.deadline[s] == np.inf:
            st["duplicates" if msg.tsi <= current else "stale"] += 1
            return False
        version = int(self.state.versions[s] ^ ((sl.rounds[s] - 1) & 1))
        want = (self.state.cfg.slot_base + s, version, int(sl.block[s]), t.B)
        if (msg.slot, msg.version, sp.block, sp.blocks) != want:
            st["stale"] += 1
            return False
        self._accept(t, sl, ar, s, msg)
        return True

    def _accept(self, t: _Tensor, sl: _Slots, ar: Allreduce, s: int, msg: wire.Message) -> None:
        st, p, sp = self.state.stats, int(sl.block[s]), msg.sparse
        assert sp is not None
        st["results"] += 1
        ar.ndone += 1
        now = time.monotonic()
        self._rtt.needless(sl.rack.took(s, s + 1, sl.tries[s : s + 1], now, self._rtt))
        late = late_copies(sl.rack.tx_at[s : s + 1], self._rtt, self.state.cfg)[0]
        self._reuse_at[s] = late if sl.tries[s] > 0 else 0.0
        if sl.tries[s] == 0:  # Karn: a retransmission's round trip is ambiguous
            self._rtt.update(now - sl.sent_at[s])
        sl.deadline[s] = np.inf
        if msg.msg_type == wire.MSG_TYPE_SPARSE:
            self.union_blocks += 1
            self._write(t, sl, s, p, msg.values)
        q = self._check_next(t, sl, s, p, sp.next)
        sl.announce[s] = False
        if q >= t.B:
            sl.done[s] = True
            return
        if t.exps is not None:  # the exponent agreed for block q, among the workers with data
            cfg = self.state.cfg
            sl.f[s] = _scale_table(cfg.scaling_workers, cfg.wire_bits)[msg.e0 & 0xFF]
            sl.clip[s] = msg.e0 == scaling.E_MAX
        sl.block[s] = q
        sl.held[s] = True  # started by _start_held, at once unless it was resent
        self._start_held(t, sl, ar)

    def _check_next(self, t: _Tensor, sl: _Slots, s: int, p: int, q: int) -> int:
        """The result's next block, if the rules can produce it (docs/protocol.md 8.4)."""
        mine = t.next_after(s, p, at=bool(sl.announce[s]))
        in_column = q == t.B or q % t.w == s
        forward = q > p or (q == p and sl.announce[s])
        if not (in_column and forward and q <= mine):
            raise bad_next_error(self.state.cfg.slot_base + s, p, q, mine, s, t.B, t.w)
        return q

    def _write(self, t: _Tensor, sl: _Slots, s: int, p: int, values: np.ndarray) -> None:
        if t.exps is None:
            t.dst.put(p, p + 1, _copy_row, values.reshape(1, -1))
            return
        bits = self.state.cfg.wire_bits
        t.dst.put(p, p + 1, _dequantise_row(bits), values.reshape(1, -1), sl.f[s : s + 1])

    def _expire(self, sl: _Slots, now: float) -> None:
        """Resend the rounds whose deadline passed: found lost early (their timer stays) or
        their timer expired (doubled; the probe's, the lowest round without a result, up to
        rto only: hostlib.loss_detect, as the C loop's expire)."""
        expired = np.flatnonzero(sl.deadline <= now)
        if not expired.size:
            return
        live = np.where(sl.done, np.iinfo(np.int64).max, sl.rack.pkt)
        probe = int(np.argmin(live))  # the slot of the lowest round without a result
        resend = loss_detect.expired(
            expired, sl.rack, sl.tries, sl.rto, probe, self._rtt, self.state.cfg, self.state.stats
        )
        sl.rack.tx_at[resend] = now
        sl.deadline[expired] = now + sl.rto[expired]
        for s in resend:
            self._send(sl.rows[s])

    def _send(self, row: bytes) -> None:
        st = self.state.stats
        st["packets_sent"] += 1
        st["bytes_sent"] += len(row)
        for d in self._perturbed(row, "send"):
            self.state.sock.send_rows(np.frombuffer(d, np.uint8).reshape(1, -1), self._to)

    @property
    def _to(self) -> tuple[str, int]:
        return self.state.cfg.data_address

    def _perturbed(self, data: bytes, way: str) -> list[bytes]:
        """The Faults test hook: `data` lost (no copy), kept, or duplicated."""
        f, rng = self.state.faults, self._rng
        if f is None or rng is None:
            return [data]
        loss, dup = f.send_loss, f.send_duplicate
        if way == "recv":
            loss, dup = f.recv_loss, f.recv_duplicate
        if rng.random() < loss:
            self.state.stats["fault_drops"] += 1
            return []
        return [data, data] if rng.random() < dup else [data]


def _copy_row(out: np.ndarray, values: np.ndarray) -> None:
    out[...] = values


def _dequantise_row(wire_bits: int) -> Callable[[np.ndarray, np.ndarray, np.ndarray], None]:
    """A block's sums (words) / f into its row of the output, at `wire_bits`."""

    def put(out: np.ndarray, sums: np.ndarray, f: np.ndarray) -> None:
        scaling.dequantise_scaled(sums.astype(np.int32), f, out, wire_bits)

    return put
