"""Striping: one job over k aggregators, each tensor split into k contiguous stripes.

    comm = hostlib.init(rank, n, ["198.18.0.1:48800", "198.18.0.2:48800"], "j")

Each aggregator runs the job independently (its control endpoint created it and registered every
rank); this worker holds one data socket and one StreamEngine per aggregator. An all-reduce splits
the flat tensor into k stripes of whole packets (stripe_bounds) and runs stripe j as an ordinary
all-reduce on engine j, all k at once: engine 0 in the calling thread, the others on a thread each
(the C loop releases the GIL for the whole stream, so the stripes really run in parallel). So each
stripe has its own slots, window, congestion window, timers and loss recovery, and a stalled
aggregator fails its own stripe only: the all-reduce then raises that stripe's AllreduceTimeout,
which names the aggregator (its position, control endpoint and data address).

An all-reduce returns (or raises) only once every stripe has ended, so that no engine still runs
when the next all-reduce or close() comes: a Ctrl-C stops the calling thread's stripe at once,
but the others run on until they finish or stall (at most the stall timeout).

Lanes: with HostOptions.lanes = k, each aggregator's stripe is run on k lanes, each a part of the
stripe over the same aggregator: its own data socket on the job's worker_port + l (so its own UDP
source port, to which every aggregator returns the results of its slots: to the worker in the
switch topology, to the group in the one-arm topology), its own contiguous part of the job's window
(lane_windows) and its own StreamEngine, so its own congestion window and timers. A
StripedEngine of a aggregators with k lanes each runs a * k engines, a grid (LaneGrid, the one
place that numbers them): aggregator j's lanes are engines j*k .. j*k + k - 1, together its
stripe, a contiguous part of the tensor. A tensor too small to give every lane
MIN_LANE_PACKETS packets runs on fewer of them (on lane 0 alone below 2 * MIN_LANE_PACKETS):
handing a part to another thread costs more than it saves on a few packets (part_bounds).

Stripes are cut at multiples of the packet size, so every packet carries the same elements as
without striping: int32 sums are identical, and float32 sums too (block scaling works per packet:
the exponents agreed for a packet do not depend on which aggregator summed it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from .engine import STAT_NAMES, StreamEngine
from .errors import AllreduceTimeout

# Packets a lane must get before an all-reduce is spread over it: measured 2026-12-03 on this
# 2-core machine (bench/results, lanes 1 and 2): with 2 lanes, all-reduces of 2 to 86 packets
# per worker (4 KiB to 256 KiB at 768 int32) took 5-50% longer than on one lane, 1366 (4 MiB)
# mostly less; 128 keeps tensors under 2 x 128 packets on one lane.
MIN_LANE_PACKETS = 128

# stats that are not a sum over the lanes: the striped all-reduce's own (counted once), or
# a property of each stream (rtt: the slowest lane's; cwnd: the sum, packets in flight)
_OWN = ("allreduces", "elements", "elapsed")


def stripe_bounds(length: int, elems: int, k: int) -> list[tuple[int, int]]:
    """Element ranges [a, b) of the k stripes of a flat tensor of `length` elements.

    The tensor's P = ceil(length / elems) packets are dealt out in contiguous runs as evenly as
    whole packets allow (the first P mod k stripes get one packet more), so a stripe starts at a
    multiple of `elems` and only the last non-empty one may end with a partial packet. A tensor
    of fewer than k packets leaves the last stripes empty, (length, length).
    """
    if k < 1:
        raise ValueError("k must be at least 1")
    if elems < 1 or length < 0:
        raise ValueError("elems must be positive and length non-negative")
    packets = -(-length // elems)
    base, extra = divmod(packets, k)
    out, p = [], 0
    for j in range(k):
        q = p + base + (1 if j < extra else 0)
        out.append((min(p * elems, length), min(q * elems, length)))
        p = q
    return out


def lane_windows(slot_base: int, window: int, k: int) -> list[tuple[int, int]]:
    """The (slot_base, window) of each of k lanes sharing a worker's window of `window` slots
    from `slot_base`: contiguous sub-ranges, as even as whole slots allow (the first
    window mod k lanes get one more). ValueError if a lane would get no slot."""
    if k < 1:
        raise ValueError("lanes must be at least 1")
    if window < k:
        raise ValueError(
            f"lanes={k} needs a window of at least {k} slots (one per lane), the job has {window}"
        )
    base, extra = divmod(window, k)
    out, s = [], slot_base
    for lane in range(k):
        w = base + (1 if lane < extra else 0)
        out.append((s, w))
        s += w
    return out


@dataclass(frozen=True)
class LaneGrid:
    """A job's engines as a grid of `aggregators` rows of `lanes` lanes (after xdp-tools'
    xsk_socket_config, one socket per queue and lane): engine index(j, l) is lane l at
    aggregator j, and its data socket is on port(base, j, l). Rows follow the tensor: aggregator
    j's lanes are consecutive engines, together its stripe."""

    aggregators: int
    lanes: int = 1

    def __len__(self) -> int:
        return self.aggregators * self.lanes

    def index(self, aggregator: int, lane: int = 0) -> int:
        """The engine of lane `lane` at aggregator `aggregator`."""
        return aggregator * self.lanes + lane

    def place(self, index: int) -> tuple[int, int]:
        """(aggregator, lane) of engine `index`."""
        return divmod(index, self.lanes)

    def cells(self) -> Iterator[tuple[int, int]]:
        """(aggregator, lane) of every engine, in engine order."""
        return (self.place(i) for i in range(len(self)))

    def row(self, aggregator: int) -> range:
        """The engines of aggregator `aggregator`'s lanes."""
        return range(self.index(aggregator), self.index(aggregator + 1))

    def port(self, base: int, aggregator: int, lane: int = 0) -> int:
        """The UDP port of that lane's data socket: every engine has its own, from `base` on."""
        return base + self.index(aggregator, lane)


def part_bounds(
    length: int, elems: int, aggregators: int, lanes: int
) -> list[tuple[int, int, int]]:
    """(engine, a, b) of each non-empty part of a flat tensor of `length` elements on the
    LaneGrid(aggregators, lanes): one stripe per aggregator (stripe_bounds), each cut over as
    many of its lanes as get MIN_LANE_PACKETS packets each (at least one). Every rank cuts
    alike: it depends on the sizes only."""
    grid = LaneGrid(aggregators, lanes)
    out: list[tuple[int, int, int]] = []
    for j, (a, b) in enumerate(stripe_bounds(length, elems, aggregators)):
        used = max(1, min(lanes, -(-(b - a) // elems) // MIN_LANE_PACKETS))
        for lane, (c, d) in enumerate(stripe_bounds(b - a, elems, used)):  # the same cut again
            if d > c:
                out.append((grid.index(j, lane), a + c, a + d))
    return out


class StripedEngine:
    """The engines of a job striped over several aggregators, run as one (see module doc).

    An Engine (hostlib.engine) like the StreamEngines it runs. Not thread-safe, like
    StreamEngine: one all-reduce at a time.
    """

    def __init__(
        self, engines: list[StreamEngine], endpoints: list[tuple[str, int]], lanes: int = 1
    ) -> None:
        if len(engines) < 2 or len(engines) != len(endpoints) * lanes:
            raise ValueError("a striped engine needs `lanes` engines per endpoint, two or more")
        elems = {e.state.elems_per_packet for e in engines}
        if len(elems) != 1:
            raise ValueError(f"the aggregators' jobs disagree on elements per packet: {elems}")
        self.engines = engines
        self.endpoints = endpoints
        self.grid = LaneGrid(len(endpoints), lanes)
        self.native = engines[0].native  # every lane's (one HostOptions made them)
        self.elems = engines[0].state.elems_per_packet  # a packet's elements
        self._own = {"allreduces": 0, "elements": 0, "elapsed": 0.0}
        self._last_union: tuple[int, int] | None = None
        self._pool = ThreadPoolExecutor(
            max_workers=len(engines) - 1, thread_name_prefix="hostlib-lane"
        )

    @property
    def lanes(self) -> int:
        """The lanes at each aggregator."""
        return self.grid.lanes

    @property
    def timeout(self) -> float:
        """The stall timeout (every lane's)."""
        return self.engines[0].timeout

    @property
    def counter(self) -> int:
        """All-reduces started on any lane (changes when one starts, as StreamEngine's)."""
        return sum(e.counter for e in self.engines)

    @property
    def stats(self) -> dict[str, float]:
        """The lanes' counters added up; allreduces, elements and elapsed (wall time) are the
        striped all-reduces' own, rtt the slowest lane's, cwnd the sum."""
        out: dict[str, float] = {name: 0 for name in STAT_NAMES}
        for e in self.engines:
            for name in STAT_NAMES:
                if name not in _OWN:
                    out[name] += e.stats[name]
        out["rtt"] = max(e.stats["rtt"] for e in self.engines)
        out.update(self._own)
        return out

    @property
    def data_path(self) -> str:
        """The lanes' data paths (StreamEngine.data_path), comma-separated in engine order; the
        one path when every lane has it."""
        paths = [e.data_path for e in self.engines]
        return paths[0] if len(set(paths)) == 1 else ",".join(paths)

    @property
    def data_path_reason(self) -> str:
        """The lanes' reasons for not using AF_XDP, "; "-separated ("" when none has one)."""
        reasons = [(self._name(i), e.data_path_reason) for i, e in enumerate(self.engines)]
        return "; ".join(f"{where}: {r}" for where, r in reasons if r)

    def _name(self, i: int) -> str:
        """Engine i for a message: "aggregator j", or "lane l at aggregator j" with lanes."""
        j, lane = self.grid.place(i)
        return f"lane {lane} at aggregator {j}" if self.lanes > 1 else f"aggregator {j}"

    def stats_per_aggregator(self) -> list[dict[str, float]]:
        """Each aggregator's own counters (its lanes' StreamEngine.stats added up as `stats`
        adds them, allreduces its first lane's), in aggregator order."""
        if self.lanes == 1:
            return [dict(e.stats) for e in self.engines]
        out = []
        for j in range(self.grid.aggregators):
            lanes = [self.engines[i].stats for i in self.grid.row(j)]
            st = {name: sum(s[name] for s in lanes) for name in STAT_NAMES}
            st["allreduces"] = lanes[0]["allreduces"]
            st.update(rtt=max(s["rtt"] for s in lanes), elapsed=max(s["elapsed"] for s in lanes))
            out.append(st)
        return out

    def stats_per_lane(self) -> list[dict[str, Any]]:
        """Each lane's StreamEngine.stats_per_lane entry, "aggregator" its row, in engine
        order."""
        out = []
        for i, e in enumerate(self.engines):
            (st,) = e.stats_per_lane()
            out.append({**st, "aggregator": self.grid.place(i)[0]})
        return out

    def allreduce(
        self, src: np.ndarray, dst: np.ndarray, timeout: float | None = None, sparse: bool = False
    ) -> None:
        """Sum the flat `src` (int32, float32, bfloat16 or float16) over the job into `dst` of
        its dtype (may be src), in parts of whole packets of the job's width; with `sparse`,
        every part as a sparse all-reduce of its own (docs/protocol.md section 8.2)."""
        self._run(src, dst, timeout, sparse)

    @property
    def last_union(self) -> tuple[int, int] | None:
        """(blocks some worker had data in, blocks) of the last all-reduce if it ran sparse:
        its parts' added up (Engine.last_union)."""
        return self._last_union

    def _run(self, src: np.ndarray, dst: np.ndarray, timeout: float | None, sparse: bool) -> None:
        t0 = time.monotonic()
        self._last_union = None
        parts = part_bounds(src.size, self.elems, len(self.endpoints), self.lanes)
        if not parts:
            return

        def run(j: int, a: int, b: int) -> None:
            self.engines[j].allreduce(src[a:b], dst[a:b], timeout, sparse)

        futures = [(j, self._pool.submit(run, j, a, b)) for j, a, b in parts[1:]]
        errors: list[tuple[int, BaseException]] = []
        try:
            run(*parts[0])
        except BaseException as e:  # noqa: BLE001 - raised below, once the others finished
            errors.append((parts[0][0], e))
        for j, f in futures:  # every lane ends (done or its own timeout) before we return
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001
                errors.append((j, e))
        self._own["elapsed"] += time.monotonic() - t0
        if errors:
            # a stalled aggregator first: it is the cause; the others' errors follow from it
            errors.sort(key=lambda je: not isinstance(je[1], AllreduceTimeout))
            j, first = errors[0]
            if isinstance(first, AllreduceTimeout):
                raise self._name_stalled(j, first) from None
            raise first
        self._own["allreduces"] += 1
        self._own["elements"] += src.size
        unions = [u for j, _, _ in parts if (u := self.engines[j].last_union) is not None]
        if sparse and len(unions) == len(parts):
            self._last_union = (sum(u[0] for u in unions), sum(u[1] for u in unions))

    def _name_stalled(self, i: int, e: AllreduceTimeout) -> AllreduceTimeout:
        """e (of engine i), its message prefixed with which aggregator (and lane) stalled."""
        j, lane = self.grid.place(i)
        host, port = self.endpoints[j]
        data = self.engines[i].state.cfg.data_address
        which = f"lane {lane} of {self.lanes} at " if self.lanes > 1 else ""
        return e.copy(
            f"{which}aggregator {j} of {len(self.endpoints)} (control endpoint {host}:{port}, "
            f"contributions to {data[0]}:{data[1]}): {e.args[0]}",
            stripe=j,
            endpoint=(host, port),
        )

    def __len__(self) -> int:
        return len(self.engines)

    def close(self) -> None:
        """Stop the lanes' threads (after an all-reduce has returned) and close the engines."""
        self._pool.shutdown(wait=True)
        for e in self.engines:
            e.close()
