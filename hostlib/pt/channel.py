"""The ordered stream of tensor all-reduces that the DDP hook and the backend share.

An AllreduceChannel owns one worker thread. submit(tensor) returns a torch Future at once (the
autograd thread never waits); the thread runs the all-reduces one at a time, in submission
order, which is the same order on every rank (as any collective requires), through the hostlib
Communicator, and completes each future with the tensor, summed (or averaged) in place.

Staging, per tensor (`_Staged`):
- CPU float32, float16, int32, contiguous: a zero-copy numpy view is sent, and the sum is
  written back into the tensor's own memory (float16 goes through float32 inside hostlib).
- CPU bfloat16 (numpy has no bfloat16): converted by torch to a float32 staging tensor, summed
  there, converted back. Non-contiguous tensors are staged through a contiguous copy.
- CUDA: copied into pinned host memory on the current stream (non-blocking); the channel's
  thread waits for that copy's event, so neither the autograd thread nor the stream blocks, then
  copies the sum back to the device.

Failure (the aggregator gone, a rank lost): hostlib raises after its stall timeout, the future
fails with AggregatorLost (a HostlibError saying what happened and how to opt into the fallback),
and DDP or Work.wait() re-raises it in the training loop. With a fallback group (a gloo process
group, `fallback=...`), the ranks instead agree, over that group, on the first all-reduce that
did not complete everywhere, redo it over gloo, and stay on gloo for the rest of the run; the
switch is logged once. See _Fallback for why that agreement is needed and is enough.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ..errors import HostlibError

log = logging.getLogger("hostlib.pt")

# dtypes the wire carries: int32 exactly, floats block-scaled through float32 (hostlib.scaling)
WIRE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32)


class AggregatorLost(HostlibError):
    """An all-reduce through the aggregator failed (timeout, aggregator or rank gone) and no
    fallback was configured, or the fallback itself failed."""


class _Staged:
    """One tensor's way to the wire and back: the numpy array sent, where the sum lands, and
    how it gets back into the tensor."""

    def __init__(self, tensor: torch.Tensor, keep_input: bool) -> None:
        self.tensor = tensor
        self.keep_input = keep_input
        self.event = None
        t = tensor.detach()
        if t.is_cuda:
            # pinned memory: the device-to-host copy is a DMA that needs no staging of its own
            wire_dtype = torch.float32 if t.dtype == torch.bfloat16 else t.dtype
            host = torch.empty(t.shape, dtype=wire_dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
            self.host = host
        elif t.dtype == torch.bfloat16 or not t.is_contiguous():
            self.host = t.to(
                torch.float32 if t.dtype == torch.bfloat16 else t.dtype,
                memory_format=torch.contiguous_format,
                copy=True,
            )
        else:
            self.host = t  # zero copy: the tensor's own memory
        self.src = self.host.numpy().reshape(-1)
        # keep_input: the sum goes to a separate array so that the input survives a failed
        # all-reduce (the fallback redoes it); otherwise it is summed in place
        self.out = np.empty_like(self.src) if keep_input else self.src

    def ready(self) -> None:
        """Wait (in the channel's thread) until a CUDA tensor's copy to the host is done."""
        if self.event is not None:
            self.event.synchronize()

    def finish(self, result: np.ndarray, divide: int) -> torch.Tensor:
        """Write `result` (the sum, flat) into the tensor, divided by `divide` if > 1."""
        res = torch.from_numpy(result).view(self.host.shape)
        if divide > 1:
            if res.dtype == torch.int32:
                raise TypeError("AVG of int32 tensors is not supported (use SUM)")
            # a result kept for the fallback (keep_input) is divided apart: the fallback may
            # send it, as the sum, to ranks that lack it
            res = res.div(divide) if self.keep_input else res.div_(divide)
        t = self.tensor.detach()
        if t.is_cuda:
            # synchronous from pinned memory, on the tensor's device's current stream of this
            # thread: the data is on the device when the future completes
            with torch.cuda.device(t.device):
                t.copy_(res)
        elif res.data_ptr() != t.data_ptr():
            t.copy_(res)  # staging buffer -> the tensor; converts bfloat16 back
        return self.tensor


class AllreduceChannel:
    """All-reduces of torch tensors through a hostlib Communicator, in order, on one thread.

    comm: the hostlib Communicator (hostlib.init); the channel does not close it unless
        `own_comm` is set.
    fallback: None (a failure raises AggregatorLost), or a gloo process group (a ProcessGroup or
        a c10d Backend of all the job's ranks, used by nothing else) over which the ranks agree on
        the failure and continue. It must be made on every rank at the same point, like any group.
    """

    def __init__(self, comm, *, fallback=None, own_comm: bool = False, name: str = "xdp-agg"):
        self.comm = comm
        self.world_size = comm.world_size
        self.rank = comm.rank
        self.name = name
        self._own_comm = own_comm
        self._fallback = _Fallback(fallback, comm.rank, comm.world_size) if fallback else None
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"xdpagg-r{comm.rank}"
        )
        self._lock = threading.Lock()
        self._seq = 0  # all-reduces submitted so far
        self._closed = False
        self.stats = {"allreduces": 0, "bytes": 0, "gloo_allreduces": 0, "seconds": 0.0}

    @property
    def on_fallback(self) -> bool:
        """True once the channel runs its all-reduces over gloo (after a failure)."""
        return self._fallback is not None and self._fallback.active

    def submit(
        self, tensor: torch.Tensor, *, average: bool = False, value=None
    ) -> torch.futures.Future:
        """Start summing `tensor` over all ranks (in place; divided by the world size if
        `average`). Returns a Future whose value is `tensor` (or `value` if given) once done; do
        not touch the tensor until then. Its error, if it fails, is the original exception
        (AggregatorLost, ValueError for NaN or Inf), not wrapped. Raises TypeError at once for a
        dtype the wire cannot carry (see WIRE_DTYPES)."""
        if tensor.dtype not in WIRE_DTYPES:
            raise TypeError(
                f"xdp-agg all-reduces {', '.join(map(str, WIRE_DTYPES))}, not {tensor.dtype}"
            )
        if average and tensor.dtype == torch.int32:
            raise TypeError("AVG of int32 tensors is not supported (use SUM)")
        fut: torch.futures.Future = torch.futures.Future()
        if tensor.numel() == 0:  # nothing to sum, on any rank (all pass the same length)
            fut.set_result(tensor if value is None else value)
            return fut
        staged = _Staged(tensor, keep_input=self._fallback is not None)
        with self._lock:
            if self._closed:
                raise HostlibError("the xdp-agg channel is closed")
            seq = self._seq
            self._seq += 1
            self._executor.submit(self._run, seq, staged, average, fut, value)
        return fut

    def _run(
        self, seq: int, staged: _Staged, average: bool, fut: torch.futures.Future, value
    ) -> None:
        t0 = time.perf_counter()
        try:
            staged.ready()
            divide = self.world_size if average else 1
            fb = self._fallback
            if fb is not None and fb.active:
                result = fb.gloo_sum(staged.src)
                self.stats["gloo_allreduces"] += 1
            else:
                try:
                    self.comm.allreduce(staged.src, out=staged.out)
                    result = staged.out
                    if fb is not None:
                        fb.completed(seq, result)
                except (ValueError, TypeError):
                    raise  # the input (NaN, Inf, a bad dtype): no fallback would help
                except HostlibError as e:
                    if fb is None:
                        raise AggregatorLost(
                            f"{self.name}: all-reduce #{seq} of {staged.src.nbytes} bytes on rank "
                            f"{self.rank} failed: {e} (set XDP_AGG_FALLBACK=gloo, or give the "
                            f"hook state a fallback group, to continue on gloo instead)"
                        ) from e
                    result = fb.recover(seq, staged.src, e, self.name)
                    self.stats["gloo_allreduces"] += 1
            out = staged.finish(result, divide)
            self.stats["allreduces"] += 1
            self.stats["bytes"] += staged.src.nbytes
            self.stats["seconds"] += time.perf_counter() - t0
            fut.set_result(out if value is None else value)
        except BaseException as e:  # noqa: BLE001 - every failure goes to the future
            fut.set_exception(e)

    def close(self) -> None:
        """Finish submitted all-reduces, stop the thread (and close the communicator if the
        channel owns it). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._executor.shutdown(wait=True)
        if self._own_comm:
            self.comm.close()


class _Fallback:
    """Agreement and the gloo path after the aggregator failed.

    Why an agreement: results come back from the aggregator to every worker, so when it
    disappears during all-reduce k, some ranks may have received all of k's results and others
    not. No rank can complete k+1 then (it needs every rank's contribution to k+1, and the ranks
    stuck at k never send it), so each rank's first failed all-reduce f_r is k or k+1, with
    k = min f_r. The ranks exchange f_r over the fallback group (one all-reduce, MIN and MAX);
    then:
    - all failed at k: each still has its input of k intact (sums go to a separate array while a
      fallback is configured), so k is redone with a gloo all-reduce;
    - some failed at k+1: those hold k's result (the channel keeps the last result), so the
      lowest such rank broadcasts it to the ranks that lack it; the ranks at k+1 then redo k+1
      over gloo, the others reach k+1 on gloo in their normal course. Every rank ends up issuing
      the same gloo collectives in the same order.
    A rank that never reports (dead) makes the gloo collective time out with the group's
    timeout: an error, never a hang.
    """

    def __init__(self, group, rank: int, world: int) -> None:
        self.group = group
        self.rank, self.world = rank, world
        self.active = False
        self._last_seq = -1
        self._last: np.ndarray | None = None

    def completed(self, seq: int, result: np.ndarray) -> None:
        """Keep the last completed all-reduce's result (its array is not reused)."""
        self._last_seq, self._last = seq, result

    def _allreduce(self, t: torch.Tensor, op) -> None:
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.group.allreduce([t], opts).wait()

    def gloo_sum(self, src: np.ndarray) -> np.ndarray:
        """The sum of `src` over all ranks through gloo (a new array)."""
        import torch.distributed as dist

        t = torch.from_numpy(src.copy())
        self._allreduce(t, dist.ReduceOp.SUM)
        return t.numpy()

    def recover(self, seq: int, src: np.ndarray, error: Exception, name: str) -> np.ndarray:
        """Agree on the failure point, switch to gloo, and return the sum of all-reduce `seq`."""
        import torch.distributed as dist

        log.warning(
            "%s: all-reduce #%d failed on rank %d (%s); falling back to gloo for the "
            "rest of the run",
            name,
            seq,
            self.rank,
            error,
        )
        # [f, -f, rank-if-it-holds-(f-1)'s-result]: one MIN all-reduce gives min f, max f and
        # the lowest rank able to serve the result of min f
        holds_prev = self._last_seq == seq - 1 and self._last is not None
        info = torch.tensor([seq, -seq, self.rank if holds_prev else self.world], dtype=torch.int64)
        try:
            self._allreduce(info, dist.ReduceOp.MIN)
        except Exception as e:
            raise AggregatorLost(
                f"{name}: all-reduce #{seq} failed ({error}), and the ranks could not agree on "
                f"falling back to gloo: {e}"
            ) from e
        k, kmax, root = int(info[0]), -int(info[1]), int(info[2])
        self.active = True
        if kmax == k:  # everyone failed at the same all-reduce: redo it
            return self.gloo_sum(src)
        if kmax != k + 1 or root >= self.world:
            raise AggregatorLost(
                f"{name}: inconsistent failure points across ranks "
                f"(first failures between #{k} and #{kmax})"
            )
        # some ranks completed k: the lowest of them broadcasts k's result
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        if seq == k:  # this rank lacks k's result
            buf = torch.from_numpy(np.empty_like(src))
            self.group.broadcast([buf], opts).wait()
            return buf.numpy()
        prev = torch.from_numpy(self._last)  # this rank holds k's result; seq == k + 1
        self.group.broadcast([prev], opts).wait()
        return self.gloo_sum(src)
