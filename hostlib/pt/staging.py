"""Device tensors (CUDA) through the aggregator: chunks staged through pinned host buffers, the
copies down, the aggregation on the host and the copies up overlapped.

The aggregator sums host memory (hostlib's numpy arrays), so a CUDA tensor must come down to the
host and its sum go back up. Done whole, the two copies and the aggregation run one after the
other; here the tensor is cut into chunks that take turns in a ring of SLOTS = 3 pinned slots
of `chunk_bytes` (CHUNK_BYTES, 16 MiB of 4-byte elements, rounded down to whole packets),
reused by every call of the channel. A chunk is the most whole packets of the all-reduce's
element width (16-bit packets carry twice the elements) that fill a slot: tensor_chunk. The
channel's thread runs, for chunk i in slot i mod 3:

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

Results are those of the CPU path, bit for bit: chunks are cut at whole packets of the
all-reduce's element width (the block scaling is per packet: hostlib.scaling; a 16-bit packet
carries twice the elements of a 32-bit one, docs/protocol.md 5.6), every dtype goes to hostlib
as the CPU path hands it over (host_array: bfloat16 as ml_dtypes' numpy bfloat16, or through a
float32 host array where ml_dtypes is missing), at the same width, and an average divides the
host result in the same dtype before it goes up. Every rank must stage the same way (all
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

import functools
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from xdp_agg.proto import wire
from xdp_agg.proto.wire import SIZE_CODE_ELEMS

CHUNK_BYTES = 16 << 20  # a slot: 16 MiB of 4-byte elements, rounded down to whole packets
SLOTS = 3  # chunk i+1 coming down, chunk i summed, chunk i-1 going up
WIRE_ITEMSIZE = 4  # int32 and float32: the largest element a slot holds
# a chunk of a multiple of this is a multiple of every packet size the wire has
PACKET_LCM = math.lcm(*SIZE_CODE_ELEMS.values())


@functools.cache
def np_bfloat16() -> np.dtype[Any] | None:
    """numpy's bfloat16 (ml_dtypes'; the test extra has it), through which bfloat16 tensors go
    to hostlib as they are; None without it, and bfloat16 goes through a float32 host copy.
    Looked up on first use: ml_dtypes takes 0.6-0.8 s to import, which every rank process would
    pay at its first group, bfloat16 or not."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def host_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor's elements are handed to hostlib in: their own, but bfloat16 as
    float32 where numpy has no bfloat16 (ml_dtypes missing). Both paths, CPU and staged, use it,
    so that their results are the same bits."""
    if dtype == torch.bfloat16 and np_bfloat16() is None:
        return torch.float32
    return dtype


def host_array(t: torch.Tensor) -> np.ndarray:
    """A numpy view of the contiguous CPU tensor `t` (of a host_dtype): bfloat16 as
    ml_dtypes.bfloat16, which torch.Tensor.numpy() refuses."""
    if t.dtype == torch.bfloat16:
        bf16 = np_bfloat16()
        assert bf16 is not None, "host_dtype sends bfloat16 as float32 without ml_dtypes"
        return t.view(torch.int16).numpy().view(bf16)
    return t.numpy()


def host_tensor(a: np.ndarray) -> torch.Tensor:
    """The tensor over the numpy array `a` (no copy): ml_dtypes.bfloat16 as torch.bfloat16,
    which torch.from_numpy refuses."""
    # by name: an array of ml_dtypes' bfloat16 exists only once ml_dtypes is imported, and a
    # float32 array must not pay for importing it
    if a.dtype.name == "bfloat16" and a.dtype == np_bfloat16():
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


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
    (a copy, on the tensor's stream, if the tensor is not contiguous), the event after which
    its data is ready, and the element width it travels at (16 or 32 bits)."""

    def __init__(self, tensor: torch.Tensor, device: StagingDevice, wire_bits: int = 32) -> None:
        t = tensor.detach()
        self.tensor = tensor
        self.device = device
        self.wire_bits = wire.check_wire_bits(wire_bits)
        self.contiguous = t.is_contiguous()
        self.flat = (t if self.contiguous else t.contiguous()).view(-1)
        self.ready = device.record(self.flat)


def chunk_elems(chunk_bytes: int, packet_elems: int) -> int:
    """A slot's size in 4-byte elements: `chunk_bytes` of them rounded down to whole 32-bit
    packets of `packet_elems`, at least two (so that a slot holds a 16-bit packet of float32:
    2 x packet_elems elements)."""
    return max(2, chunk_bytes // WIRE_ITEMSIZE // packet_elems) * packet_elems


def tensor_chunk(slot_elems: int, packet_elems: int, itemsize: int, wire_bits: int) -> int:
    """Elements of a tensor per chunk: the most whole packets of the all-reduce's width
    (`packet_elems` elements at 32 bits, twice as many at 16) whose `itemsize`-byte elements
    fit a slot of `slot_elems` 4-byte elements; at least one packet (chunk_elems makes slots
    that hold one). float32 at 32 bits: the slot itself; bfloat16 and float16 at 16 bits: twice
    its elements, in as many packets."""
    per_packet = packet_elems * wire.elems_per_word(wire_bits)
    return max(1, slot_elems * WIRE_ITEMSIZE // itemsize // per_packet) * per_packet


class StagingRing:
    """SLOTS pinned slots of `chunk` 4-byte elements, reused by every device tensor a channel
    stages on one device; `run` moves one tensor through them, in chunks of whole packets
    (tensor_chunk: `packet_elems` int32 words per packet; 1 cuts anywhere) that fill a slot.

    Beside its pinned bytes, a slot gets on first need a float32 host array (bfloat16 is summed
    as float32 where numpy has no bfloat16: host_dtype) and an array for results kept apart
    from the input (when a fallback is configured: see channel._Fallback). The slots rotate
    across calls, so two consecutive chunks, even of two tensors, never share a slot: the
    fallback may still need the previous chunk's result while the next one runs.
    """

    def __init__(
        self, device: StagingDevice, chunk: int, slots: int = SLOTS, packet_elems: int = 1
    ) -> None:
        if slots < 2:
            raise ValueError("the staging needs at least 2 slots")
        self.device = device
        self.chunk = chunk
        self.packet_elems = packet_elems
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
        new array, which it returns (the channel's aggregator-or-fallback step, at the job's
        wire_bits). keep_input: the sum goes apart from `src` (which a fallback may redo).
        Raises what `reduce` raises, once every copy already started has finished.
        """
        step = tensor_chunk(self.chunk, self.packet_elems, job.flat.element_size(), job.wire_bits)
        n = job.flat.numel()
        bounds = [(a, min(a + step, n)) for a in range(0, n, step)]
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
        """A slot's host array as `n` elements of `dtype` (made once, chunk * 4 bytes; twice
        that the first time a chunk needs more: the float32 of a 16-bit dtype's chunk, which
        holds twice the elements of a float32 one)."""
        need = n * np.dtype(dtype).itemsize
        host = arrays[slot]
        if host is None or host.nbytes < need:
            host = arrays[slot] = np.empty(max(need, self.slot_bytes), dtype=np.uint8)
        return host[:need].view(dtype)

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
        if host_dtype(image.dtype) != image.dtype:  # bfloat16 without ml_dtypes
            src = self._host(self._stage, slot, np.float32, n)
            torch.from_numpy(src).copy_(image)  # exact: bfloat16 widens to float32
        else:
            src = host_array(image)  # the pinned memory itself
        out = self._host(self._kept, slot, src.dtype, n) if keep else src
        result = reduce(src, out)
        res = host_tensor(result)
        if divide > 1:
            # apart from a result the fallback keeps (it may send it to ranks that lack it)
            res = res.div(divide) if keep else res.div_(divide)
        if res.data_ptr() != image.data_ptr() or res.dtype != image.dtype:
            image.copy_(res)  # float32 back to bfloat16 (host_dtype), as the CPU path does
        return src.nbytes
