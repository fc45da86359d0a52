"""The native transport: a StreamState's all-reduces run by the extension hostlib._fastpath
with the GIL released (the C loop, kernel UDP or AF_XDP).

NativeStream holds the stream's one _fastpath.Engine (its transport, RTT estimate and
congestion window: only the C loop has one, EngineConfig.cwnd: AIMD, starting at 16 packets,
slow start up to the slot window, halved once per loss event); the two round strategies run on
it, as the C loop runs them through its RoundOps (hostlib/fp_run.h): hostlib.native_dense
(hostlib/fp_dense.c) and hostlib.native_sparse (hostlib/fp_sparse.c). They send the bytes of the
numpy loops, hostlib.numpy_dense and hostlib.numpy_sparse (tests/unit/test_fastpath.py and
tests/unit/test_sparse_host.py compare them).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from types import ModuleType

from xdp_agg.proto import wire

from . import afxdp
from .errors import HostlibError
from .options import simd_from_env
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


class NativeStream:
    """A StreamState's one _fastpath.Engine (kept for the state's life: it holds the C loop's
    transport, RTT estimate and congestion window), which the dense and the sparse loop share."""

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

    @property
    def fast(self) -> _fastpath.Engine:
        """The extension's Engine the round loops call."""
        return self._fast

    def account(self, res: _fastpath._AllreduceResult | None, ar: Allreduce) -> None:
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


def shower(ar: Allreduce) -> Callable[[int, int], None] | None:
    """The C loop's progress callback for `ar`'s progress line (None without one)."""
    printer = ar.printer
    if printer is None:
        return None

    def show(ndone: int, retx: int) -> None:
        now = time.monotonic()
        if now >= printer.next:
            printer.show(now, ndone, retx)

    return show
