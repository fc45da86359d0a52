"""Device tensors (CUDA) through the aggregator: chunks staged through pinned host buffers, the
copies down, the aggregation on the host and the copies up overlapped.

The aggregator sums host memory (hostlib's numpy arrays), so a CUDA tensor must come down to the
host and its sum go back up. Done whole, the two copies and the aggregation run one after the
other; here the tensor is cut into chunks of `chunk_bytes` (CHUNK_BYTES, 16 MiB of 4-byte wire
elements, rounded down to whole packets) that take turns in a ring of SLOTS = 3 pinned slots,
reused by every call of the channel. The channel's thread runs, for chunk i in slot i mod 3:

    start chunk i+1's copy down (device -> its slot)      # after that slot's last copy up
    wait for chunk i's copy down
    all-reduce chunk i in its slot (hostlib, on the host)
    start chunk i's copy up (its slot -> device)

so while chunk i is summed, chunk i+1 travels down and chunk i-1 travels up; only the first
chunk's copy down and the last one's copy up are not hidden behind an aggregation. A slot's next
copy down waits on the device (an event, not the host) for the slot's last copy up. The future
completes once every copy up has finished: the sum is on the device, for any stream.

What a device must offer is StagingDevice (copy down, copy up, record an event, wait for one,
pinned memory); CudaDevice is torch.cuda's, used for every CUDA tensor (the channel's default,
CudaStaging). Tests give the channel a fake that runs its copies on threads and checks the order.

Results are those of the CPU path, bit for bit: chunks are cut at whole packets (the block
scaling is per packet: hostlib.scaling), float16 goes to hostlib as float16 and bfloat16 through
a float32 host array converted by torch on the host, as on the CPU path, and an average divides
the host result in the same dtype before it goes up. Every rank must stage the same way (all
its tensors on CUDA, or all on the CPU): a chunk is an all-reduce of its own, and the ranks'
all-reduces must have the same lengths.

Why 16 MiB (docs/pytorch.md, "CUDA tensors"): each chunk is an all-reduce of its own, whose
start and drain cost the aggregation about 0.9 ms on this project's 2-core testbed (bench/
cuda_staging.py's host sweep: 64 MiB in 1 MiB chunks +26-29%, 2 MiB +13-16%, 4 MiB +4-10%, from
8 MiB within the noise of the whole), while the first chunk's copy down and the last one's copy
up, which nothing hides, grow with the chunk (2 x 16 MiB over PCIe: not measured, no GPU here).
The ring pins 3 x 16 MiB per device.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from xdp_agg.proto.wire import SIZE_CODE_ELEMS

CHUNK_BYTES = 16 << 20  # of wire elements (4 bytes each): 4 Mi, rounded down to whole packets
SLOTS = 3  # chunk i+1 coming down, chunk i summed, chunk i-1 going up
WIRE_ITEMSIZE = 4  # int32 and float32: the largest element a slot holds
# a chunk of a multiple of this is a multiple of every packet size the wire has
PACKET_LCM = math.lcm(*SIZE_CODE_ELEMS.values())


class StagingDevice(Protocol):
    """What chunked staging needs of a device (torch.cuda's: CudaDevice).

    Events are the device's own objects; the staging only passes them back. Copies are
    asynchronous: they return at once with an event that completes when the copy has.
    """

    def record(self, tensor: torch.Tensor) -> Any:
        """In the submitting thread: an event after the work that produces `tensor` so far (on
        its current stream), which the copies down wait for."""

    def pinned(self, nbytes: int) -> torch.Tensor:
        """Host memory (uint8, `nbytes`) the device copies to and from asynchronously. Called
        once per ring: the staging keeps and reuses it."""

    def copy_down(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Any]) -> Any:
        """Start copying the device tensor `src` into the host tensor `dst` (a pinned slice, the
        same dtype and length) once every event of `after` has completed; its event."""

    def copy_up(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Any]) -> Any:
        """Start copying the host tensor `src` (a pinned slice) into the device tensor `dst` once
        every event of `after` has completed; its event."""

    def copy_within(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Any]) -> Any:
        """Start copying device tensor `src` into device tensor `dst` (same shape: a contiguous
        result back into a non-contiguous tensor) after `after`; its event."""

    def wait(self, event: Any) -> None:
        """Block the calling (host) thread until `event` has completed."""


class CudaDevice:
    """StagingDevice of one CUDA device: copies down on one side stream, copies up on another,
    each followed by a recorded event; the host waits with Event.synchronize()."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        with torch.cuda.device(self.device):
            self._down = torch.cuda.Stream()
            self._up = torch.cuda.Stream()

    def record(self, tensor: torch.Tensor) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _copy(
        self,
        stream: torch.cuda.Stream,
        src: torch.Tensor,
        dst: torch.Tensor,
        after: Sequence[torch.cuda.Event],
    ) -> torch.cuda.Event:
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            for e in after:
                stream.wait_event(e)
            dst.copy_(src, non_blocking=True)  # pinned <-> device: a DMA, no host staging
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def copy_down(
        self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[torch.cuda.Event]
    ) -> torch.cuda.Event:
        return self._copy(self._down, src, dst, after)

    def copy_up(
        self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[torch.cuda.Event]
    ) -> torch.cuda.Event:
        return self._copy(self._up, src, dst, after)

    def copy_within(
        self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[torch.cuda.Event]
    ) -> torch.cuda.Event:
        return self._copy(self._up, src, dst, after)

    def wait(self, event: torch.cuda.Event) -> None:
        event.synchronize()


class CudaStaging:
    """The channel's default choice of device: a CudaDevice per CUDA device, made on first use;
    None (the CPU path) for every other tensor."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._devices: dict[torch.device, CudaDevice] = {}

    def __call__(self, tensor: torch.Tensor) -> CudaDevice | None:
        if not tensor.is_cuda:
            return None
        with self._lock:
            dev = self._devices.get(tensor.device)
            if dev is None:
                dev = self._devices[tensor.device] = CudaDevice(tensor.device)
            return dev


class DeviceJob:
    """One device tensor's all-reduce, made in the submitting thread: its flat contiguous form
    (a copy, on the tensor's stream, if the tensor is not contiguous) and the event after which
    its data is ready."""

    def __init__(self, tensor: torch.Tensor, device: StagingDevice) -> None:
        t = tensor.detach()
        self.tensor = tensor
        self.device = device
        self.contiguous = t.is_contiguous()
        self.flat = (t if self.contiguous else t.contiguous()).view(-1)
        self.ready = device.record(self.flat)


def chunk_elems(chunk_bytes: int, packet_elems: int) -> int:
    """Elements per chunk: `chunk_bytes` of 4-byte wire elements rounded down to whole packets
    of `packet_elems` (at least one packet)."""
    return max(1, chunk_bytes // WIRE_ITEMSIZE // packet_elems) * packet_elems


class StagingRing:
    """SLOTS pinned slots of `chunk` elements, reused by every device tensor a channel stages on
    one device; `run` moves one tensor through them.

    Beside its pinned bytes, a slot gets on first need a float32 host array (bfloat16 is summed
    as float32: numpy has no bfloat16) and an array for results kept apart from the input (when
    a fallback is configured: see channel._Fallback). The slots rotate across calls, so two
    consecutive chunks, even of two tensors, never share a slot: the fallback may still need
    the previous chunk's result while the next one runs.
    """

    def __init__(self, device: StagingDevice, chunk: int, slots: int = SLOTS) -> None:
        if slots < 2:
            raise ValueError("the staging needs at least 2 slots")
        self.device = device
        self.chunk = chunk
        self.slot_bytes = chunk * WIRE_ITEMSIZE
        self.pinned = device.pinned(slots * self.slot_bytes)
        self._slots = slots
        self._next = 0  # the slot the next chunk takes
        self._up: list[Any] = [None] * slots  # each slot's last copy up, until waited for
        self._stage: list[np.ndarray | None] = [None] * slots
        self._kept: list[np.ndarray | None] = [None] * slots

    def run(
        self,
        job: DeviceJob,
        divide: int,
        reduce: Callable[[np.ndarray, np.ndarray], np.ndarray],
        keep_input: bool,
    ) -> int:
        """Sum `job`'s tensor over the ranks, chunk by chunk, into the tensor (divided by
        `divide` when > 1); the bytes handed to `reduce`.

        reduce(src, out): sums one chunk's numpy array `src` over the ranks, into `out` or a
        new array, which it returns (the channel's aggregator-or-fallback step). keep_input:
        the sum goes apart from `src` (which a fallback may redo).
        Raises what `reduce` raises, once every copy already started has finished.
        """
        n = job.flat.numel()
        bounds = [(a, min(a + self.chunk, n)) for a in range(0, n, self.chunk)]
        slots = [(self._next + i) % self._slots for i in range(len(bounds))]
        self._next = (self._next + len(bounds)) % self._slots
        downs: dict[int, Any] = {}
        sent = 0
        try:
            for i, (a, b) in enumerate(bounds):
                for j in (i, i + 1):  # chunk i (the first only) and chunk i+1: copies down
                    if j < len(bounds) and j not in downs:
                        downs[j] = self._copy_down(job, bounds[j], slots[j])
                self.device.wait(downs.pop(i))
                image = self._image(slots[i], job.flat.dtype, b - a)
                sent += self._reduce(image, slots[i], divide, reduce, keep_input)
                self._up[slots[i]] = self.device.copy_up(image, job.flat[a:b], [])
            if not job.contiguous and bounds:
                back = self.device.copy_within(
                    job.flat.view(job.tensor.shape), job.tensor.detach(), self._pending()
                )
                self.device.wait(back)
        finally:
            for e in list(downs.values()) + self._pending():
                self.device.wait(e)
            self._up = [None] * self._slots
        return sent

    def _pending(self) -> list[Any]:
        return [e for e in self._up if e is not None]

    def _copy_down(self, job: DeviceJob, bounds: tuple[int, int], slot: int) -> Any:
        """Start a chunk's copy down into its slot, after the tensor is ready and the slot's
        last copy up has read it."""
        a, b = bounds
        after = [job.ready] + ([self._up[slot]] if self._up[slot] is not None else [])
        image = self._image(slot, job.flat.dtype, b - a)
        return self.device.copy_down(job.flat[a:b], image, after)

    def _image(self, slot: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        """The first `n` elements of a slot's pinned memory, as `dtype` (the tensor's)."""
        at = slot * self.slot_bytes
        return self.pinned[at : at + n * dtype.itemsize].view(dtype)

    def _host(
        self, arrays: list[np.ndarray | None], slot: int, dtype: npt.DTypeLike, n: int
    ) -> np.ndarray:
        """A slot's host array (made once, chunk * 4 bytes) as `n` elements of `dtype`."""
        host = arrays[slot]
        if host is None:
            host = arrays[slot] = np.empty(self.slot_bytes, dtype=np.uint8)
        return host[: n * np.dtype(dtype).itemsize].view(dtype)

    def _reduce(
        self,
        image: torch.Tensor,
        slot: int,
        divide: int,
        reduce: Callable[[np.ndarray, np.ndarray], np.ndarray],
        keep: bool,
    ) -> int:
        """Sum one chunk that has come down into `image`, leaving the result there: what the CPU
        path (channel._Staged) does with a tensor, on the chunk."""
        n = image.numel()
        if image.dtype == torch.bfloat16:
            src = self._host(self._stage, slot, np.float32, n)
            torch.from_numpy(src).copy_(image)  # exact: bfloat16 widens to float32
        else:
            src = image.numpy()
        out = self._host(self._kept, slot, src.dtype, n) if keep else src
        result = reduce(src, out)
        res = torch.from_numpy(result)
        if divide > 1:
            # apart from a result the fallback keeps (it may send it to ranks that lack it)
            res = res.div(divide) if keep else res.div_(divide)
        if res.data_ptr() != image.data_ptr() or res.dtype != image.dtype:
            image.copy_(res)  # converts float32 back to bfloat16, as the CPU path does
        return src.nbytes
