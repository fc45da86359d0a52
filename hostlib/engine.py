"""The stream engine: one worker's all-reduces as a self-clocked stream of packets
(docs/protocol.md section 4; floats: 5.2).

One stream state, loops named on two axes. hostlib.stream_state.StreamState holds what outlives
an all-reduce (the slot versions, the all-reduce counter that numbers packets on the wire, the
counters) and frames every all-reduce (numbering, version advance on failure too, the stall
error, progress). The loop that runs an all-reduce is a transport and a round strategy:

    round, transport    numpy (the reference: the socket)   native (the C loop, hostlib._fastpath)
    dense (chunks)      numpy_dense.NumpyDenseLoop          native_dense.NativeDenseLoop
    sparse (8)          numpy_sparse.NumpySparseLoop        native_sparse.NativeSparseLoop

The numpy loops are vectorised numpy with the protocol written out in their docstrings; the
native ones share one hostlib.native_stream.NativeStream (the C loop's Engine: its transport, RTT
estimate and congestion window), which runs the whole stream with the GIL released through the
C round strategy of the same name (hostlib/fp_dense.c, hostlib/fp_sparse.c) and sends the same
bytes (tests/unit/test_fastpath.py and tests/unit/test_sparse_host.py compare them).
StreamEngine uses the native transport when the extension is built (EngineConfig.native;
HostOptions.native=False forces numpy), for both rounds.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from . import native_stream
from .native_dense import NativeDenseLoop
from .native_sparse import NativeSparseLoop
from .native_stream import NativeStream, _fastpath  # noqa: F401  (_fastpath: tests)
from .numpy_dense import NumpyDenseLoop
from .numpy_sparse import NumpySparseLoop
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


class RoundLoop(Protocol):
    """What runs one kind of all-reduce on a stream (one cell of the module's table)."""

    def run(self, kind: str, src: np.ndarray, dst: np.ndarray, timeout: float | None) -> None:
        """One all-reduce of the flat `src` into `dst`, both of dtype `kind` (DTYPES)."""


class SparseRoundLoop(RoundLoop, Protocol):
    """A sparse RoundLoop: it counts the blocks of its last all-reduce."""

    union_blocks: int  # blocks of the last all-reduce whose result had data
    blocks: int  # and its blocks


def round_loops(
    state: StreamState, native: bool
) -> tuple[NativeStream | None, RoundLoop, SparseRoundLoop]:
    """The transport's stream (None for numpy: the loops use the state's socket) and its dense
    and sparse loops, for the native transport (the C loop) or numpy."""
    if native:
        stream = NativeStream(state)
        return stream, NativeDenseLoop(stream), NativeSparseLoop(stream)
    return None, NumpyDenseLoop(state), NumpySparseLoop(state)


class StreamEngine:
    """Runs a communicator's all-reduces, one at a time, over its data socket (an Engine).

    `state` is the stream's state (socket, configuration, slot versions, counters), `native`
    the C loop's stream on it (None: numpy), `dense_loop` and `sparse_loop` the round loops
    that run an all-reduce on it, both of the one transport. Not thread-safe: the communicator
    calls it from one thread.
    """

    def __init__(
        self, sock: DatagramSocket, config: EngineConfig, faults: Faults | None = None
    ) -> None:
        self.state = StreamState(sock, config, faults)
        self.native = _use_native(config.native)
        if not self.native and config.data_path == "afxdp":
            raise ValueError("data_path='afxdp' needs the C loop (native)")
        # sparse all-reduces on the transport of the dense ones: one window, one RTT estimate
        self.stream, self.dense_loop, self.sparse_loop = round_loops(self.state, self.native)
        self._port = sock.address[1]  # for stats_per_lane, after close too
        self._last_union: tuple[int, int] | None = None

    @property
    def data_path(self) -> str:
        """How packets leave and arrive: "udp" (the kernel socket) or "afxdp-..." (the AF_XDP
        socket's mode, hostlib.afxdp)."""
        return self.stream.data_path if self.stream is not None else "udp"

    @property
    def data_path_reason(self) -> str:
        """Why AF_XDP was asked for ("auto") and is not used; "" otherwise."""
        if self.stream is not None:
            return self.stream.data_path_reason
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
            self.dense_loop.run(kind, src, dst, timeout)
            return
        sl = self.sparse_loop
        sl.run(kind, src, dst, timeout)
        self._last_union = (sl.union_blocks, sl.blocks) if src.size else None

    def close(self) -> None:
        """Release the C loop's data path (its AF_XDP socket: NativeStream.close); the
        communicator closes the kernel socket after."""
        if self.stream is not None:
            self.stream.close()


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
    """Whether to run the C loop: `native` if given, else when it is built (NativeStream says
    how to build it when asked for without it)."""
    if native is None:
        return native_stream.available()
    return bool(native)
