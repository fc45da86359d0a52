"""One worker's stream state, whichever loop runs its all-reduces (hostlib.engine).

What an all-reduce of this worker leaves for the next one lives here: the slot versions (a
slot's version keeps alternating from one use to the next whatever tensor uses it), the
all-reduce counter (its low 8 bits are the wire job_number), and the counters. Every loop, the
numpy references (hostlib.numpy_dense, hostlib.numpy_sparse) and the C loop's
(hostlib.native_dense, hostlib.native_sparse), runs an all-reduce inside
`StreamState.allreduce`, which numbers it, advances the versions by the slots' uses (on failure
too, so that this worker stays lined up with the ranks that completed), keeps the socket's
counters and shows progress; and they raise the same AllreduceTimeout (`stalled`).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from xdp_agg.proto import wire

from .errors import AllreduceTimeout
from .udp_io import DatagramSocket

STAT_NAMES = (
    "allreduces",  # all-reduces completed
    "elements",  # tensor elements all-reduced
    "packets_sent",  # datagrams sent, first transmissions and retransmissions
    "retransmissions",  # datagrams sent again: found lost early, or after a timer expired
    "timeouts",  # packets whose timer expired at least once
    "early_losses",  # resends of packets that later packets' results showed lost (4.4)
    "results",  # results accepted (one per packet)
    "duplicates",  # results ignored because that packet was already done
    "stale",  # results of another all-reduce, or not matching the packet's slot/version
    "malformed",  # datagrams of the wrong length
    "bytes_sent",
    "bytes_received",
    "send_calls",  # system calls (one GSO call sends many datagrams)
    "recv_calls",
    "send_errors",  # sends the kernel refused (full buffer, no route): the timers recover
    "receive_drops",  # results the kernel dropped at this socket (its receive buffer was full)
    "fault_drops",  # packets and results dropped by the Faults test hook
    "elapsed",  # seconds spent in all-reduces
    "rtt",  # smoothed round trip of a packet (send to result), seconds
    "spurious",  # retransmissions that were not needed: the first copy's result came after it
    "cwnd",  # congestion window at the end of the last all-reduce, packets
    # sparse all-reduces (docs/protocol.md section 8, hostlib.numpy_sparse)
    "sparse_allreduces",  # all-reduces run sparse
    "blocks_skipped",  # blocks of this worker's tensors it sent no payload for (all zero)
    "empty_sent",  # header-only contributions (first transmissions)
)


@dataclass
class Faults:
    """Test hook: seeded random loss and duplication inside the engine.

    send_loss / send_duplicate act on outgoing contributions (first sends and retransmissions),
    recv_loss / recv_duplicate on received results. Lets loss recovery be tested without root
    or a lossy link.
    """

    send_loss: float = 0.0
    recv_loss: float = 0.0
    send_duplicate: float = 0.0
    recv_duplicate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("send_loss", "recv_loss", "send_duplicate", "recv_duplicate"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"Faults.{name} must be in [0, 1)")


@dataclass
class EngineConfig:
    """What the engine needs to know about its job (from the control endpoint)."""

    job_id: int
    scaling_workers: int  # the n of float scaling: all workers summed (under the root of a tree)
    elems: int  # int32 words per packet
    slot_base: int
    window: int  # slots of this worker: slot_base .. slot_base + window - 1
    data_address: tuple[str, int]  # where contributions go (the aggregator's data address)
    rto: float = 0.015  # the timer before a round trip is measured, then its floor's ceiling
    # resend on evidence of later results (docs/protocol.md 4.4), not on timers alone
    early_loss: bool = True
    rto_floor: float = 0.002  # with early_loss, the least timer once round trips are measured
    # the C loop's window halves for a loss only where the standing round trip (the least of
    # the last 4) is this far above the least round trip (and twice it): a queue, not random
    # loss nor other ranks' resends (docs/protocol.md 4.4). 4 ms: above a busy
    # host's scheduling noise (its round trips of 1-3 ms under load), below the queues that drop
    queue_delay: float = 0.004
    rto_max: float = 0.25
    timeout: float = 30.0  # seconds without progress before AllreduceTimeout
    progress: bool = False  # progress line on stderr for long all-reduces
    # the C loop (hostlib._fastpath): None = when built
    native: bool | None = None
    cwnd: str = "aimd"  # congestion window of the C loop: "aimd", or "fixed" (= window)
    # the C loop's data path (hostlib.afxdp): "udp", "auto", "afxdp"
    data_path: str = "udp"
    # busy-poll briefly near an all-reduce's end (both loops, self-limiting: NumpyDenseLoop._spin)
    spin: bool = True
    # this stream's lane of the lanes at its aggregator (hostlib.striping): with AF_XDP the
    # lanes' sockets (and a companion job's) share one UMEM on the interface queue (hostlib/_xsk.c)
    lane: int = 0
    lanes: int = 1
    # a sparse job's empty contributions carry a block's room of zeros (JobSpec.pad_empty)
    pad_empty: bool = False
    # the job's element width (JobSpec.wire_bits): 32, or 16 (two elements a word: floats only)
    wire_bits: int = 32


@dataclass
class Allreduce:
    """One all-reduce while a loop runs it: what StreamState.allreduce numbered and timed, and
    what the loop reports back (packets done, for the progress line)."""

    number: int  # of this worker's all-reduces; its low 8 bits are the wire job_number
    packets: int  # P
    window: int  # w: slots used, slot_base .. slot_base + w - 1
    timeout: float  # seconds without a new result before AllreduceTimeout
    t0: float
    printer: _Progress | None
    ndone: int = 0  # packets with their result
    # rounds each slot ran, when not the dense ceil((packets - s) / window) (a sparse all-reduce)
    uses: np.ndarray | None = None

    @property
    def job_number(self) -> int:
        return self.number & 0xFF


class StreamState:
    """The state of one worker's stream that outlives an all-reduce: socket, job config,
    packet shape, slot versions, all-reduce counter and counters (STAT_NAMES)."""

    def __init__(
        self, sock: DatagramSocket, config: EngineConfig, faults: Faults | None = None
    ) -> None:
        if config.cwnd not in ("aimd", "fixed"):
            raise ValueError(f"cwnd must be 'aimd' or 'fixed', not {config.cwnd!r}")
        self.sock, self.cfg, self.faults = sock, config, faults
        self.size_code = wire.size_code_for(config.elems)
        self.plen = wire.udp_payload_len(config.elems)
        self.type_size = wire.type_size(wire.MSG_TYPE_DATA, self.size_code, config.wire_bits)
        # a packet's elements: a chunk of block scaling, a block of a sparse all-reduce
        self.elems_per_packet = config.elems * wire.elems_per_word(config.wire_bits)
        self.versions = np.zeros(config.window, dtype=np.uint8)  # next version of each slot
        self.counter = 0  # all-reduces started
        self.stats: dict[str, float] = {name: 0 for name in STAT_NAMES}
        # Room for a few windows of results (and of packets) however late this process drains
        # its socket; a datagram takes about plen + 768 bytes of buffer (its skb).
        sock.ensure_buffers(
            rcvbuf=4 * config.window * (self.plen + 768),
            sndbuf=2 * config.window * (self.plen + 768),
        )

    @contextlib.contextmanager
    def allreduce(
        self, packets: int, window: int, timeout: float | None, elements: int
    ) -> Iterator[Allreduce]:
        """Run one all-reduce of `packets` packets over `window` slots (yields its Allreduce);
        counted as completed when the block ends without an exception."""
        number = self.counter
        self.counter += 1
        t0 = time.monotonic()
        printer = _Progress(number, packets, self.plen, t0) if self.cfg.progress else None
        timeout = self.cfg.timeout if timeout is None else timeout
        ar = Allreduce(number, packets, window, timeout, t0, printer)
        st = self.stats
        try:
            yield ar
            st["allreduces"] += 1
            st["elements"] += elements
        finally:
            # Advance every slot's version by its uses in this all-reduce, even on failure, so
            # that the next all-reduce of this worker lines up with the ranks that completed.
            uses = (packets - np.arange(window) + window - 1) // window
            if ar.uses is not None:
                uses = ar.uses
            self.versions[:window] = (self.versions[:window] + uses) & 1
            st["elapsed"] += time.monotonic() - t0
            st["send_calls"] = self.sock.send_calls
            st["recv_calls"] = self.sock.recv_calls
            st["send_errors"] = self.sock.send_errors
            st["receive_drops"] = self.sock.receive_drops() or 0
            if printer:
                printer.close(time.monotonic(), ar.ndone, st["retransmissions"])

    def stalled(
        self, ar: Allreduce, results_here: int, busy: Sequence[int] | np.ndarray
    ) -> AllreduceTimeout:
        """The AllreduceTimeout of a stalled all-reduce; `busy`: the slot offsets (0..w-1)
        with a packet in flight."""
        cfg, P, timeout = self.cfg, ar.packets, ar.timeout
        slots = tuple(int(cfg.slot_base + s) for s in busy)
        agg = f"{cfg.data_address[0]}:{cfg.data_address[1]}"
        outstanding = P - results_here
        if results_here == 0:
            never = " (it has never answered this worker)" if self.stats["results"] == 0 else ""
            msg = (
                f"all-reduce #{ar.number} got no result at all from the aggregator at {agg} "
                f"(job id {cfg.job_id}) within {timeout:g} s{never}: {P} packet(s), "
                f"{len(busy)} in flight in slot(s) {_ranges(slots)}. Either the aggregator is "
                f"not running, has no such job or does not know this worker's address, or "
                f"another rank is not contributing."
            )
        else:
            msg = (
                f"all-reduce #{ar.number} made no progress for {timeout:g} s: {outstanding} of "
                f"{P} packet(s) without a result, {len(busy)} in flight in slot(s) "
                f"{_ranges(slots)} ({results_here} results received from {agg})."
            )
        if self.sock.last_send_error is not None:
            msg += f" Last send error: {self.sock.last_send_error}."
        return AllreduceTimeout(
            msg,
            data_address=cfg.data_address,
            packets=P,
            outstanding=outstanding,
            outstanding_slots=slots,
            results=results_here,
        )


def _ranges(values: tuple[int, ...]) -> str:
    """'3-5, 9' for (3, 4, 5, 9)."""
    if not values:
        return "none"
    out, start, prev = [], values[0], values[0]
    for v in values[1:] + (None,):
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
        if v is not None:
            start = prev = v
    return ", ".join(out)


class _Progress:
    """Progress of a long all-reduce on stderr, shown once it runs for over a second.

    On a terminal, one line rewritten in place twice a second; otherwise (a log file, a pipe)
    whole lines, one every 5 seconds and a last one at the end, so that logs stay readable.
    """

    def __init__(self, number: int, packets: int, plen: int, t0: float) -> None:
        self.number, self.packets, self.plen, self.t0 = number, packets, plen, t0
        self.next = t0 + 1.0
        self.shown = False
        try:
            self.tty = sys.stderr.isatty()
        except (AttributeError, ValueError):  # replaced or closed stderr
            self.tty = False
        self.every = 0.5 if self.tty else 5.0

    def _line(self, now: float, done: int, retx: float) -> str:
        rate = done * self.plen / max(now - self.t0, 1e-9) / 1e6
        return (
            f"hostlib all-reduce #{self.number}: {done}/{self.packets} packets "
            f"({100 * done // self.packets}%), {rate:.1f} MB/s, {int(retx)} retransmissions"
        )

    def show(self, now: float, done: int, retx: float) -> None:
        line = self._line(now, done, retx)
        sys.stderr.write(f"\r{line}" if self.tty else f"{line}\n")
        sys.stderr.flush()
        self.shown = True
        self.next = now + self.every

    def close(self, now: float, done: int, retx: float) -> None:
        if self.shown:
            self.show(now, done, retx)
            if self.tty:
                sys.stderr.write("\n")
