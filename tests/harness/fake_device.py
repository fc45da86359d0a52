"""A fake device for hostlib.pt.staging on the CPU, that checks the order of the staging's copies,
and a one-process communicator that sums as the aggregator does.

FakeDevice is a StagingDevice whose "device" memory is ordinary CPU tensors. Its copies are queued
on threads, one per stream (down, up, and the producer that `record` stands for), run in issue
order, each once the events of its `after` have completed. A copy is held until something needs
it: the host waiting for it (or for a later one of its stream, or for one that depends on it),
or an aggregation beginning (FakeDevice.aggregating, which CheckingComm and ScalingComm call):
the aggregation then releases every copy issued so far and lets them finish before it sums. So
a copy that finishes inside an aggregation is one the staging had started before that
aggregation and did not wait for: it overlapped the aggregation (`overlapped`), counted, not
timed. A staging that waited for each copy before the next step would overlap none.

What it checks (`violations`, empty when the staging kept every rule):
- a copy down never reads the device tensor before the producer's event (`record`) completed;
- a copy down into host memory that a copy up has yet to read is ordered after that copy up
  (in its `after`, or after a later copy up, the streams being in order), and by the time it
  runs, that copy up has finished;
- the host reads a chunk (the aggregation's input in pinned memory, or a copy up's source) only
  after the copy down into it has completed and the host has waited for it;
- the host memory a copy up has read is dead until the next copy down: the fake fills it with
  0xFF bytes (NaN for every float type, -1 for int32), as it does memory a copy down is about to
  fill, so a staging that read it too early would sum garbage and fail the comparisons.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from hostlib import scaling

TIMEOUT = 10.0  # seconds a fake step waits before it reports a violation (a bug, not a delay)


@dataclass(eq=False)
class FakeEvent:
    op: "_Op"
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class _Op:
    kind: str  # "ready", "down", "up", "within"
    stream: str
    index: int  # position in its stream
    serial: int  # position among every copy and event issued
    src: torch.Tensor | None
    dst: torch.Tensor | None
    after: list
    released: bool = False
    host_waited: bool = False
    overlapped: int | None = None  # the aggregation it finished in, if any
    event: FakeEvent | None = None


def _span(t: torch.Tensor) -> tuple[int, int]:
    a = t.data_ptr()
    return a, a + t.numel() * t.element_size()


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


class FakeDevice:
    """A StagingDevice on the CPU with the checks above; also the channel's `stage_on` (every
    tensor it is asked about goes through it). close() when done."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.streams: dict[str, list[_Op]] = {"ready": [], "down": [], "up": []}
        self.violations: list[str] = []
        self.pinned_calls = 0
        self.aggregations = 0
        self._serial = 0
        self._closed = False
        self._threads = [
            threading.Thread(target=self._serve, args=(name,), daemon=True) for name in self.streams
        ]
        for t in self._threads:
            t.start()

    # --- the channel's choice -----------------------------------------------------------------
    def __call__(self, tensor: torch.Tensor) -> "FakeDevice":
        return self

    # --- StagingDevice --------------------------------------------------------------------------
    def record(self, tensor: torch.Tensor) -> FakeEvent:
        return self._issue("ready", "ready", tensor, None, [])

    def pinned(self, nbytes: int) -> torch.Tensor:
        self.pinned_calls += 1
        return torch.full((nbytes,), 0xFF, dtype=torch.uint8)

    def copy_down(self, src, dst, after) -> FakeEvent:
        with self.cond:
            self._check_reuse(dst, after)
        return self._issue("down", "down", src, dst, after)

    def copy_up(self, src, dst, after) -> FakeEvent:
        with self.cond:
            self._check_read(src, "a copy up")
        return self._issue("up", "up", src, dst, after)

    def copy_within(self, src, dst, after) -> FakeEvent:
        return self._issue("within", "up", src, dst, after)

    def wait(self, event: FakeEvent) -> None:
        with self.cond:
            self._release(event.op)
            s = self.streams[event.op.stream]
            for op in s[: event.op.index + 1]:
                op.host_waited = True
            if not self.cond.wait_for(event.done.is_set, TIMEOUT):
                self.violations.append(f"host wait for {event.op.kind} timed out")

    # --- what the tests look at -----------------------------------------------------------------
    @contextlib.contextmanager
    def aggregating(self, src: np.ndarray):
        """Around one aggregation of `src`: checks it may be read, lets every copy issued so far
        run and finish (counting them as overlapped with this aggregation), then sums."""
        with self.cond:
            self._check_read_array(src)
            self.aggregations += 1
            number = self.aggregations
            issued = [op for s in self.streams.values() for op in s if not op.event.done.is_set()]
            for op in issued:
                self._release(op)
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: all(op.event.done.is_set() for op in issued), 10):
                self.violations.append(f"copies issued before aggregation {number} never ran")
            for op in issued:
                if op.overlapped is None and op.kind != "ready":
                    op.overlapped = number
        yield

    def overlapped(self, kind: str) -> int:
        """Copies of `kind` that finished inside an aggregation."""
        return sum(1 for op in self.streams[_stream(kind)] if op.kind == kind and op.overlapped)

    def count(self, kind: str) -> int:
        return sum(1 for op in self.streams[_stream(kind)] if op.kind == kind)

    def idle(self) -> bool:
        """No copy issued and not finished."""
        with self.cond:
            return all(op.event.done.is_set() for s in self.streams.values() for op in s)

    def close(self) -> None:
        with self.cond:
            self._closed = True
            self.cond.notify_all()
        for t in self._threads:
            t.join(TIMEOUT)

    # --- inside ---------------------------------------------------------------------------------
    def _issue(self, kind, stream, src, dst, after) -> FakeEvent:
        with self.cond:
            s = self.streams[stream]
            op = _Op(kind, stream, len(s), self._serial, src, dst, list(after))
            self._serial += 1
            op.event = FakeEvent(op)
            if kind == "down" and not self._up_pending(dst):
                dst.view(torch.uint8).fill_(0xFF)  # dead until the copy lands
            s.append(op)
            self.cond.notify_all()
            return op.event

    def _release(self, op: _Op) -> None:
        """Let `op` run: it, the copies before it on its stream and what they wait for."""
        todo = [op]
        while todo:
            o = todo.pop()
            for earlier in self.streams[o.stream][: o.index + 1]:
                if not earlier.released:
                    earlier.released = True
                    todo += [e.op for e in earlier.after]
        self.cond.notify_all()

    def _serve(self, name: str) -> None:
        at = 0
        while True:
            with self.cond:
                self.cond.wait_for(
                    lambda: (
                        self._closed
                        or (at < len(self.streams[name]) and self.streams[name][at].released)
                    )
                )
                if self._closed:
                    return
                op = self.streams[name][at]
                if not self.cond.wait_for(lambda: all(e.done.is_set() for e in op.after), 10):
                    self.violations.append(f"{op.kind} #{op.index}: its `after` never completed")
                self._before_run(op)
            if op.kind != "ready":
                op.dst.copy_(op.src)
            with self.cond:
                if op.kind == "up":
                    op.src.view(torch.uint8).fill_(0xFF)  # read: dead until the next copy down
                op.event.done.set()
                self.cond.notify_all()
            at += 1

    def _before_run(self, op: _Op) -> None:
        if op.kind == "down":
            span = _span(op.src)
            ready = [
                o
                for o in self.streams["ready"]
                if o.serial < op.serial and _overlap(_span(o.src), span)
            ]
            if ready and not ready[-1].event.done.is_set():
                self.violations.append(f"down #{op.index} read the tensor before it was ready")
            for up in self._ups_on(op.dst):
                if not up.event.done.is_set():
                    self.violations.append(
                        f"down #{op.index} overwrote a slot up #{up.index} reads"
                    )

    def _ups_on(self, host: torch.Tensor) -> list[_Op]:
        span = _span(host)
        return [o for o in self.streams["up"] if o.kind == "up" and _overlap(_span(o.src), span)]

    def _up_pending(self, host: torch.Tensor) -> bool:
        return any(not o.event.done.is_set() for o in self._ups_on(host))

    def _check_reuse(self, dst: torch.Tensor, after) -> None:
        """A copy down into memory a copy up has yet to read must come after that copy up."""
        covered = max((e.op.index for e in after if e.op.stream == "up"), default=-1)
        for up in self._ups_on(dst):
            if not up.event.done.is_set() and up.index > covered:
                self.violations.append(
                    f"a copy down reuses the memory of up #{up.index} without waiting for it"
                )

    def _check_read(self, host: torch.Tensor, what: str) -> None:
        span = _span(host)
        downs = [o for o in self.streams["down"] if _overlap(_span(o.dst), span)]
        if not downs:
            self.violations.append(f"{what} reads host memory no copy down filled")
            return
        last = downs[-1]
        if not (last.event.done.is_set() and last.host_waited):
            self.violations.append(
                f"{what} reads down #{last.index}'s memory before the host waited for it"
            )

    def _check_read_array(self, src: np.ndarray) -> None:
        """The aggregation's input, if it lies in memory copies down fill (a bfloat16 chunk is
        summed from a float32 host array instead where ml_dtypes is missing: the 0xFF fill
        covers it)."""
        a = src.__array_interface__["data"][0]
        span = (a, a + src.nbytes)
        if any(_overlap(_span(o.dst), span) for o in self.streams["down"]):
            self._check_read(torch.from_numpy(src.view(np.uint8)), "an aggregation")


def _stream(kind: str) -> str:
    return {"down": "down", "up": "up", "within": "up", "ready": "ready"}[kind]


class CheckingComm:
    """A communicator (hostlib's) whose every all-reduce runs inside `device.aggregating`."""

    def __init__(self, comm, device: FakeDevice) -> None:
        self.comm, self.device = comm, device
        self.rank, self.world_size, self.stats = comm.rank, comm.world_size, comm.stats

    def allreduce(self, src, out=None, *, wire_bits=None):
        with self.device.aggregating(src):
            return self.comm.allreduce(src, out=out, wire_bits=wire_bits)


class ScalingComm:
    """A world of `world` ranks in one process, for the channel: every other rank holds this
    rank's input, and the sum is what the aggregator would give: int32 wrapping modulo 2^32,
    floats block scaled per packet (hostlib.scaling): `elems` elements per packet at 32 bits,
    2 x `elems` at 16 (docs/protocol.md 5.6), so a chunk cut off the packet boundaries would
    change the result. Takes what hostlib's Communicator takes (int32, float32, float16 and
    ml_dtypes' bfloat16 arrays; `wire_bits` None, 16 or 32, None being 16 for the 16-bit
    dtypes) and rounds the float64 quotient once to the output's dtype.

    fail_at: the wire all-reduce number (0-based) that raises `error` instead, once.
    device: a FakeDevice whose `aggregating` check each all-reduce runs in.
    bits: the width of each all-reduce, in order (stats["wire_bits"]: the last one's).
    """

    def __init__(self, world: int = 3, elems: int = 256, device=None, fail_at=None, error=None):
        self.rank, self.world_size = 0, world
        self.stats = {"elems": elems}
        self.device = device
        self.fail_at, self.error = fail_at, error
        self.calls = 0
        self.lengths: list[int] = []
        self.bits: list[int] = []

    def allreduce(self, src, out=None, *, wire_bits=None):
        calls, self.calls = self.calls, self.calls + 1
        a = np.asarray(src)
        self.lengths.append(a.size)
        ctx = self.device.aggregating(a) if self.device else contextlib.nullcontext()
        with ctx:
            if calls == self.fail_at:
                raise self.error
            bits = wire_bits or (16 if a.dtype.itemsize == 2 else 32)
            if bits == 16 and a.dtype == np.int32:
                raise ValueError("int32 is exact at 32 bits only")
            self.bits.append(bits)
            self.stats["wire_bits"] = bits
            res = self._sum(a.reshape(-1), bits)
            if out is None:
                out = np.empty_like(a)
            out[...] = res.reshape(a.shape).astype(out.dtype)
            return out

    def _sum(self, x: np.ndarray, bits: int) -> np.ndarray:
        n, k = self.world_size, self.stats["elems"] * (32 // bits)
        if x.dtype == np.int32:
            return (x.astype(np.int64) * n).astype(np.int32)  # wraps as the aggregator does
        packets = -(-x.size // k)
        padded = np.zeros(packets * k, np.float32)
        padded[: x.size] = x.astype(np.float32)  # exact for the 16-bit dtypes
        chunks = padded.reshape(packets, k)
        e = scaling.chunk_exponents(chunks)
        f = scaling.scale_factors(e, n, bits)
        q = scaling.quantise_scaled(chunks, f, None).astype(np.int64) * n
        return (q / f[:, None]).reshape(-1)[: x.size]  # float64, rounded once by the caller
