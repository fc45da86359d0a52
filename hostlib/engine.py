"""The stream engine: one worker's all-reduces as a self-clocked stream of packets
(docs/protocol.md section 4; floats: 5.2).

One stream state, two loops. hostlib.stream_state.StreamState holds what outlives an
all-reduce (the slot versions, the all-reduce counter that numbers packets on the wire, the
counters) and frames every all-reduce (numbering, version advance on failure too, the stall
error, progress). The loop that runs an all-reduce is a strategy: hostlib.numpy_loop (the
reference, vectorised numpy, the protocol written out in its docstring) or hostlib.native_loop
(the C extension hostlib._fastpath, which runs the whole stream with the GIL released and sends
the same bytes: tests/unit/test_fastpath.py compares them). StreamEngine uses the C loop when the
extension is built (EngineConfig.native; HostOptions.native=False forces numpy).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from . import native_loop
from .native_loop import NativeLoop, NativeSparseLoop, _fastpath  # noqa: F401  (_fastpath: tests)
from .numpy_loop import NumpyLoop
from .sparse_loop import SparseLoop
from .stream_state import STAT_NAMES, EngineConfig, Faults, StreamState
from .udp_io import DatagramSocket

__all__ = ["DTYPES", "STAT_NAMES", "Engine", "EngineConfig", "Faults", "StreamEngine", "dtype_kind"]


class Engine(Protocol):
    """What a Communicator runs its all-reduces on: a StreamEngine (one aggregator) or a
    hostlib.striping.StripedEngine (several). Not thread-safe: one all-reduce at a time."""

    native: bool  # whether the C loop runs the all-reduces

    @property
    def lanes(self) -> int:
        """The lanes at each aggregator (1: one engine per aggregator)."""

    @property
    def counter(self) -> int:
        """All-reduces started; changes when one starts (a failure after it is not a rejected
        input)."""

    @property
    def stats(self) -> dict[str, float]:
        """The counters of STAT_NAMES."""

    @property
    def timeout(self) -> float:
        """Seconds an all-reduce may go without progress (the configured stall timeout)."""

    @property
    def data_path(self) -> str:
        """How packets leave and arrive ("udp", "afxdp-...", comma-separated when striped)."""

    @property
    def data_path_reason(self) -> str:
        """Why AF_XDP was asked for and is not used; "" otherwise."""

    def stats_per_aggregator(self) -> list[dict[str, float]]:
        """Each aggregator's own counters, in stripe order (one entry unless striped)."""

    def stats_per_lane(self) -> list[dict[str, Any]]:
        """Each lane's own counters (STAT_NAMES) and where it runs: "aggregator" and "lane"
        (hostlib.striping.LaneGrid) and "port", its data socket's UDP port; in engine order."""

    @property
    def last_union(self) -> tuple[int, int] | None:
        """(blocks, of the tensor's blocks) that some worker had data in, in the last
        all-reduce, counted by the loop when it ran sparse: its results with data, the same on
        every rank; None after a dense one (or before any)."""

    def allreduce(
        self, src: np.ndarray, dst: np.ndarray, timeout: float | None = None, sparse: bool = False
    ) -> None:
        """Sum the flat `src` (int32, float32, bfloat16 or float16; int32 only on a 32-bit job)
        over the job into `dst` of its dtype (may be src); with `sparse`, as a sparse all-reduce
        (docs/protocol.md section 8)."""

    def close(self) -> None:
        """Release what the engine holds besides the kernel sockets (threads, AF_XDP sockets);
        after the last all-reduce."""


class StreamEngine:
    """Runs a communicator's all-reduces, one at a time, over its data socket (an Engine).

    `state` is the stream's state (socket, configuration, slot versions, counters), `loop` the
    loop that runs an all-reduce on it (C or numpy). Not thread-safe: the communicator calls it
    from one thread.
    """

    def __init__(
        self, sock: DatagramSocket, config: EngineConfig, faults: Faults | None = None
    ) -> None:
        self.state = StreamState(sock, config, faults)
        self.native = _use_native(config.native)
        if not self.native and config.data_path == "afxdp":
            raise ValueError("data_path='afxdp' needs the C loop (native)")
        self.loop: NativeLoop | NumpyLoop
        # sparse all-reduces: in the C loop when it runs the dense ones, else the numpy reference
        self.sparse_loop: NativeSparseLoop | SparseLoop
        if self.native:
            self.loop = NativeLoop(self.state)
            self.sparse_loop = NativeSparseLoop(self.loop)
        else:
            self.loop, self.sparse_loop = NumpyLoop(self.state), SparseLoop(self.state)
        self._port = sock.address[1]  # for stats_per_lane, after close too
        self._last_union: tuple[int, int] | None = None

    @property
    def data_path(self) -> str:
        """How packets leave and arrive: "udp" (the kernel socket) or "afxdp-..." (the AF_XDP
        socket's mode, hostlib.afxdp)."""
        return self.loop.data_path if isinstance(self.loop, NativeLoop) else "udp"

    @property
    def data_path_reason(self) -> str:
        """Why AF_XDP was asked for ("auto") and is not used; "" otherwise."""
        if isinstance(self.loop, NativeLoop):
            return self.loop.data_path_reason
        if self.state.cfg.data_path == "auto":
            return "the numpy loop sends through the kernel socket"
        return ""

    @property
    def counter(self) -> int:
        """All-reduces started; the low 8 bits of an all-reduce's number are its job_number."""
        return self.state.counter

    @property
    def stats(self) -> dict[str, float]:
        """The counters of STAT_NAMES (the state's own dict)."""
        return self.state.stats

    @property
    def timeout(self) -> float:
        """The configured stall timeout (EngineConfig.timeout)."""
        return self.state.cfg.timeout

    @property
    def lanes(self) -> int:
        """1: a StreamEngine is one lane (hostlib.striping.StripedEngine runs several)."""
        return 1

    def stats_per_aggregator(self) -> list[dict[str, float]]:
        """One aggregator: a copy of `stats`."""
        return [dict(self.state.stats)]

    def stats_per_lane(self) -> list[dict[str, Any]]:
        """One lane: a copy of `stats` with "aggregator" 0, "lane" (its lane of the job's,
        EngineConfig.lane) and "port" (its data socket's)."""
        return [
            {**self.state.stats, "aggregator": 0, "lane": self.state.cfg.lane, "port": self._port}
        ]

    @property
    def last_union(self) -> tuple[int, int] | None:
        """(blocks some worker had data in, blocks) of the last all-reduce if it ran sparse
        (Engine.last_union)."""
        return self._last_union

    def allreduce(
        self, src: np.ndarray, dst: np.ndarray, timeout: float | None = None, sparse: bool = False
    ) -> None:
        """Sum the flat `src` (int32, float32, bfloat16 or float16) over the job into `dst` of
        the same dtype (may be src): floats are quantised straight from their type into the
        job's width and back (no float32 copy of a 16-bit tensor)."""
        kind = dtype_kind(src, self.state.cfg.wire_bits)
        if dst.dtype != src.dtype or dst.size != src.size:
            raise ValueError(f"dst must be {src.size} elements of {src.dtype}, not {dst.dtype}")
        self._run(kind, src, dst, timeout, sparse)

    def _run(
        self, kind: str, src: np.ndarray, dst: np.ndarray, timeout: float | None, sparse: bool
    ) -> None:
        self._last_union = None
        if not sparse:
            self.loop.run(kind, src, dst, timeout)
            return
        sl = self.sparse_loop
        sl.run(kind, src, dst, timeout)
        self._last_union = (sl.union_blocks, sl.blocks) if src.size else None

    def close(self) -> None:
        """Release the C loop's data path (its AF_XDP socket: NativeLoop.close); the
        communicator closes the kernel socket after."""
        if isinstance(self.loop, NativeLoop):
            self.loop.close()


# the element types an engine all-reduces, by numpy's dtype name (bfloat16: ml_dtypes')
DTYPES = ("int32", "float32", "bfloat16", "float16")


def dtype_kind(src: np.ndarray, wire_bits: int = 32) -> str:
    """The name of src's element type (DTYPES); TypeError for another type, ValueError for
    int32 on a 16-bit job."""
    name = src.dtype.name
    if name not in DTYPES:
        raise TypeError(
            f"an engine all-reduces int32, float32, bfloat16 and float16 tensors, not {src.dtype}"
        )
    if name == "int32" and wire_bits == 16:
        raise ValueError("int32 is exact only at 32 bits: it cannot go on a 16-bit job")
    return name


def _use_native(native: bool | None) -> bool:
    """Whether to run the C loop: `native` if given, else when it is built (NativeLoop says
    how to build it when asked for without it)."""
    if native is None:
        return native_loop.available()
    return bool(native)
