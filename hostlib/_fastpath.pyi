"""Type stub of the C extension hostlib._fastpath (hostlib/_fastpath.c), as Python calls it.

Kept by hand: each signature is the extension's PyArg_Parse format and docstring. Buffers are
anything with the buffer protocol; numpy arrays are named as well, since numpy's stubs declare
their buffer protocol only for Python 3.12 and later.
"""

from collections.abc import Callable
from typing import Literal, TypedDict, final

import numpy as np
from _typeshed import ReadableBuffer, WriteableBuffer

_In = ReadableBuffer | np.ndarray
_Out = WriteableBuffer | np.ndarray
# dtype arguments name the element types of hostlib.engine.DTYPES ("int32", "float32",
# "bfloat16", "float16"; int32 only at 32 bits)

# the wire constants the extension was built with (hostlib/fp_wire.h, generated from
# xdp_agg.proto.wire), and WIRE, their names; hostlib.native_stream compares them with wire's
WIRE: tuple[str, ...]
EXPONENTS_AT: int
EXP_HLEN: int
VALUES_AT: int
POOL_VERSION_BIT: int
POOL_SLOT_MASK: int
SWITCHML_OFFSET: int
MAX_LANES: int
MSG_TYPE_SPARSE: int
MSG_TYPE_SPARSE_EMPTY: int
SPARSE_AT: int
SPARSE_HLEN: int
SPARSE_VALUES_AT: int

class _AllreduceResult(TypedDict):
    """Engine.allreduce's answer (a dict at run time; this name exists for type checkers only)."""

    status: Literal["done", "stalled", "bad_next"]
    ndone: int  # packets with their result
    results_here: int  # results this call received
    busy: list[int]  # slot offsets with a packet in flight
    counters: dict[str, int]  # this call's, by the names of fp_counters.h
    gso_refused: bool
    last_errno: int

class _SparseResult(_AllreduceResult):
    """Engine.allreduce_sparse's answer: allreduce's, and the sparse parts."""

    union_blocks: int  # results with data
    bad: tuple[int, int, int, int] | None  # status bad_next: slot offset, block, next, mine

@final  # not subclassable (no Py_TPFLAGS_BASETYPE)
class Engine:
    """The native stream of one worker over its non-blocking UDP socket `fd`."""

    def __init__(
        self,
        *,
        fd: int,
        host: str,
        port: int,
        elems: int,
        window: int,
        scaling_workers: int,
        type_size: int,
        slot_base: int,
        rto: float,
        rto_max: float,
        gso: bool = True,
        gro: bool = True,
        cwnd: str = "aimd",
        faults: tuple[float, float, float, float, int] | None = None,
        xsk: dict[str, object] | None = None,
        spin: bool = True,
        wire_bits: int = 32,
        early_loss: bool = True,
        rto_floor: float = 0.002,
        queue_delay: float = 0.004,
    ) -> None: ...
    def allreduce(
        self,
        dtype: str,
        src: _In,
        dst: _Out,
        P: int,
        w: int,
        job_number: int,
        versions: ReadableBuffer,
        exponents: _In | None,
        timeout: float,
        progress: Callable[[int, int], object] | None = None,
        progress_every: float = 1.0,
    ) -> _AllreduceResult: ...
    def allreduce_sparse(
        self,
        dtype: str,
        src: _In,
        dst: _Out,
        w: int,
        job_number: int,
        versions: ReadableBuffer,
        nonzero: _In,
        exponents: _In | None,
        rounds: _Out,
        timeout: float,
        progress: Callable[[int, int], object] | None = None,
        progress_every: float = 1.0,
        pad_empty: bool = False,
    ) -> _SparseResult: ...
    def close(self) -> None: ...
    @property
    def srtt(self) -> float: ...
    @property
    def min_rtt(self) -> float: ...
    @property
    def cwnd(self) -> float: ...
    @property
    def gso(self) -> bool: ...
    @property
    def data_path(self) -> str: ...
    @property
    def xsk_reason(self) -> str: ...

def chunk_exponents(x: _In, k: int, dtype: str = "float32", /) -> tuple[bytes, int]: ...
def block_scan(x: _In, k: int, dtype: str, /) -> tuple[bytes, bytes | None, int, int]: ...
def quantise(
    x: _In,
    exponents: _In,
    scaling_workers: int,
    k: int,
    dtype: str = "float32",
    wire_bits: int = 32,
    /,
) -> bytes: ...
def dequantise(
    sums: _In,
    exponents: _In,
    scaling_workers: int,
    k: int,
    dtype: str = "float32",
    wire_bits: int = 32,
    /,
) -> bytes: ...
def set_simd(name: str, /) -> str: ...
def simd() -> str: ...
def xsk_test_program(ports: list[int], queue: int, /) -> int: ...
