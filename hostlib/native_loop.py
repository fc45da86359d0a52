"""The C loop: one all-reduce run by the extension hostlib._fastpath with the GIL released.

It sends the same packets as the numpy loop (hostlib.numpy_loop; tests/unit/test_fastpath.py
compares them byte for byte): P, w and the exponents as its transfers make them. Only the C
loop has a congestion window (EngineConfig.cwnd): AIMD, starting at 16 packets, slow start up
to the slot window, halved once per loss event (a timer expiry).

Sparse all-reduces (docs/protocol.md section 8) run in the same C loop (hostlib/fp_sparse.c),
with the same timers and window, and send the bytes of the numpy reference
hostlib.sparse_loop (tests/unit/test_sparse_host.py compares them): NativeSparseLoop.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from types import ModuleType

import numpy as np

from xdp_agg.proto import wire

from . import afxdp, scaling
from .errors import HostlibError
from .options import simd_from_env
from .sparse_loop import bad_next_error
from .stream_state import Allreduce, EngineConfig, StreamState
from .udp_io import DatagramSocket

try:
    from . import _fastpath
except ImportError:  # not built (a source checkout without build_ext): the numpy loop only
    # mypy cannot spell "this module or None"; every use below checks `_fastpath is None` first
    _fastpath = None  # type: ignore[assignment]


def _check_wire(fast: ModuleType) -> None:
    """ImportError unless the extension's wire constants (from its generated header,
    hostlib/fastpath/wire.h) are xdp_agg.proto.wire's: a stale build would send other bytes."""
    want = {name: getattr(wire, name) for name in fast.WIRE}
    got = {name: getattr(fast, name) for name in fast.WIRE}
    wrong = {name: (got[name], want[name]) for name in want if got[name] != want[name]}
    if wrong:
        text = ", ".join(
            f"{n} {g} (xdp_agg.proto.wire: {w})" for n, (g, w) in sorted(wrong.items())
        )
        raise ImportError(
            f"hostlib._fastpath was built from another wire layout: {text}; rebuild it "
            "(`python setup.py build_ext --inplace`, or pip install)"
        )


_SIMD = simd_from_env()  # XDP_AGG_SIMD: the kernels chosen by the environment
if _fastpath is not None:
    _check_wire(_fastpath)
    if _SIMD:
        _fastpath.set_simd(_SIMD)

# the counters the C loop reports per all-reduce that add up in StreamState.stats as they are
# (the socket's system calls and errors go through the DatagramSocket's own counters)
_COUNTED = (
    "packets_sent",
    "retransmissions",
    "timeouts",
    "early_losses",
    "results",
    "duplicates",
    "stale",
    "malformed",
    "bytes_sent",
    "bytes_received",
    "fault_drops",
    "spurious",
    "empty_sent",
)


def available() -> bool:
    """Whether the extension is built."""
    return _fastpath is not None


class NativeLoop:
    """Runs a StreamState's all-reduces through one _fastpath.Engine (kept for the state's
    life: it holds the C loop's RTT estimate and congestion window)."""

    def __init__(self, state: StreamState) -> None:
        if _fastpath is None:
            raise ImportError(
                "EngineConfig(native=True) but hostlib._fastpath is not built: run "
                "`python setup.py build_ext --inplace` (or pip install) in the source tree"
            )
        self.state = state
        cfg, f = state.cfg, state.faults
        sock = state.sock
        path = cfg.data_path
        xsk, self.data_path_reason = _xsk_spec(path, sock, cfg)
        self._fast = _fastpath.Engine(
            fd=sock.fileno(),
            host=cfg.data_address[0],
            port=cfg.data_address[1],
            elems=cfg.elems,
            window=cfg.window,
            scaling_workers=cfg.scaling_workers,
            type_size=state.type_size,
            slot_base=cfg.slot_base,
            rto=cfg.rto,
            rto_max=cfg.rto_max,
            gso=sock.gso,
            gro=sock.gro,
            cwnd=cfg.cwnd,
            early_loss=cfg.early_loss,
            rto_floor=cfg.rto_floor,
            queue_delay=cfg.queue_delay,
            spin=cfg.spin,
            wire_bits=cfg.wire_bits,
            faults=None
            if f is None
            else (f.send_loss, f.recv_loss, f.send_duplicate, f.recv_duplicate, f.seed),
            xsk=xsk,
        )
        if xsk is not None:
            self.data_path_reason = self._fast.xsk_reason
        if path == "afxdp" and self.data_path == "udp":
            raise HostlibError(f"data_path='afxdp' cannot run: {self.data_path_reason}")

    def close(self) -> None:
        """Close the AF_XDP socket now (not when the Engine is collected): its port's results
        go to the kernel socket from then, and a later socket on the port can take AF_XDP."""
        self._fast.close()

    @property
    def data_path(self) -> str:
        """ "udp", or the AF_XDP socket's mode: "afxdp-copy-drv", "afxdp-zerocopy-drv", ..."""
        return self._fast.data_path

    def run(self, kind: str, src: np.ndarray, dst: np.ndarray, timeout: float | None) -> None:
        """One all-reduce of the flat `src` into `dst`, both of dtype `kind` (engine.DTYPES):
        the C loop quantises from that type and dequantises into it directly."""
        state, k, L = self.state, self.state.elems_per_packet, src.size
        Pd = -(-L // k)
        w = min(state.cfg.window, Pd)
        exps = None
        is_float = kind != "int32"
        if is_float:
            exps, bad = _fastpath.chunk_exponents(src, k, kind)  # before anything is sent
            if bad >= 0:
                raise scaling.nonfinite_error(src[bad], bad)
        P = Pd + w if is_float else Pd
        if P == 0:
            return
        with state.allreduce(P, w, timeout, elements=L) as ar:
            res: _fastpath._AllreduceResult | None = None
            try:
                res = self._fast.allreduce(
                    kind,
                    src,
                    dst,
                    P,
                    w,
                    ar.job_number,
                    state.versions[:w].tobytes(),
                    exps,
                    ar.timeout,
                    progress=_shower(ar),
                    progress_every=0.25,
                )
                if res["status"] != "done":
                    raise state.stalled(ar, res["results_here"], res["busy"])
            finally:
                self._account(res, ar)

    def _account(self, res: _fastpath._AllreduceResult | None, ar: Allreduce) -> None:
        """The C loop's counters of one all-reduce into the state's (and the socket's)."""
        st, sock = self.state.stats, self.state.sock
        if res is not None:
            c = res["counters"]
            for name in _COUNTED:
                st[name] += c[name]
            sock.send_calls += c["send_calls"]
            sock.recv_calls += c["recv_calls"]
            sock.send_errors += c["send_errors"]
            if res["last_errno"]:
                sock.last_send_error = OSError(res["last_errno"], os.strerror(res["last_errno"]))
            if res["gso_refused"]:
                sock.gso = False
            ar.ndone = res["ndone"]
        st["rtt"] = self._fast.srtt
        st["cwnd"] = self._fast.cwnd


def _xsk_spec(
    path: str, sock: DatagramSocket, cfg: EngineConfig
) -> tuple[dict[str, object] | None, str]:
    """The Engine's xsk argument for data path `path` (None: the kernel socket) and, when AF_XDP
    was asked for but has nothing to run on, why."""
    if path == "udp":
        return None, ""
    try:
        found = afxdp.spec(sock.sock, cfg.data_address, cfg.lane, cfg.lanes)
    except Exception as e:  # netlink refused, no route: the kernel socket, and why
        return None, f"finding the interface towards {cfg.data_address[0]}: {e}"
    return (None, found) if isinstance(found, str) else (found, "")


def _shower(ar: Allreduce) -> Callable[[int, int], None] | None:
    """The C loop's progress callback for `ar`'s progress line (None without one)."""
    printer = ar.printer
    if printer is None:
        return None

    def show(ndone: int, retx: int) -> None:
        now = time.monotonic()
        if now >= printer.next:
            printer.show(now, ndone, retx)

    return show


class NativeSparseLoop:
    """Runs a StreamState's sparse all-reduces (docs/protocol.md section 8) in the C loop of
    its NativeLoop, sharing its _fastpath.Engine (the RTT estimate and congestion window of the
    dense all-reduces). The blocks are found in C too (_fastpath.block_scan: one pass over the
    tensor, before the all-reduce starts); hostlib.sparse_loop.SparseLoop is the reference."""

    def __init__(self, native: NativeLoop) -> None:
        self.native = native
        self.state = native.state
        self.union_blocks = 0  # blocks of the last all-reduce whose result had data
        self.blocks = 0  # and its blocks

    def run(self, kind: str, src: np.ndarray, dst: np.ndarray, timeout: float | None) -> None:
        """One sparse all-reduce of the flat `src` into `dst`, both of dtype `kind`
        (engine.DTYPES); a block is a packet's elements."""
        state = self.state
        if src.size == 0:
            return
        nonzero, exps, bad, count = _fastpath.block_scan(src, state.elems_per_packet, kind)
        if bad >= 0:  # before anything is sent
            raise scaling.nonfinite_error(src[bad], bad)
        B = len(nonzero)
        w = min(state.cfg.window, B)
        rounds = np.ones(w, dtype=np.int64)  # the C loop counts each slot's rounds in here
        self.union_blocks, self.blocks = 0, B
        with state.allreduce(B, w, timeout, elements=src.size) as ar:
            ar.uses = rounds  # versions advance by the rounds each slot ran (8.2), also on failure
            state.stats["sparse_allreduces"] += 1
            res = None
            try:
                res = self.native._fast.allreduce_sparse(
                    kind,
                    src,
                    dst,
                    w,
                    ar.job_number,
                    state.versions[:w].tobytes(),
                    nonzero,
                    exps,
                    rounds,
                    ar.timeout,
                    progress=_shower(ar),
                    progress_every=0.25,
                    pad_empty=state.cfg.pad_empty,
                )
                self.union_blocks = res["union_blocks"]
                if res["status"] == "stalled":
                    raise state.stalled(ar, res["results_here"], res["busy"])
                if res["status"] == "bad_next" and res["bad"] is not None:
                    s, p, q, mine = res["bad"]
                    raise bad_next_error(state.cfg.slot_base + s, p, q, mine, s, B, w)
            finally:
                self.native._account(res, ar)
            state.stats["blocks_skipped"] += B - count
