"""`xdp-agg bench`: the XDP program's cost per packet, measured with BPF_PROG_TEST_RUN.

For each packet size, a job of n workers streams rounds over a window of slots in the protocol's
order (so n-1 of n packets aggregate and the n-th completes, gathers and rewrites), and the
kernel's own per-run duration is summed. In the same run, on the same frames: both variants of
the program (per-CPU partial sums, and the spin-lock baseline) and the floor, a program that only
parses the frames and drops them; and the per-CPU program loaded as a multi-buffer (frags)
program (FRAGS_CASE), the only one that takes the jumbo sizes (1024 and 2048 int32, more than a
page: copied through a scratch map with bpf_xdp_load_bytes/store_bytes). Reported: ns per
packet, aggregated int32 elements per second per core (elements / ns), and the ratio to the
floor. The duration includes the test-run timer (tens of ns), the same for every program.

UNICAST_CASE is the per-CPU program with the job's results delivered by unicast (one copy per
worker, docs/protocol.md 3.5): the ingress program's run (which ends in the devmap broadcast's
XDP_REDIRECT, not sent by a test run) plus, for each result, the copy program's n runs (loaded
as a plain XDP program to be test-run), per packet: with n packets and n copies to a round, one
copy per packet. What the kernel adds per copy (the frame's clone, the queue, the transmit) is
not in it; `python -m bench.unicast` measures that in an all-reduce.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

import numpy as np

from xdp_agg import bpfsys
from xdp_agg.proto import wire
from xdp_agg.proto.jobs import Delivery, JobSpec, WorkerSpec
from xdp_agg.proto.scapy_layer import sml_frame

from . import loader
from .ctl_maps import AggMaps

BENCH_SIZES = (64, 256, 768, wire.MAX_ELEMS)


@dataclass
class BenchResult:
    variant: str
    elems: int
    packets: int
    ns_per_packet: float
    floor_ns_per_packet: float
    spread_ns: float  # max - min over repetitions

    @property
    def elems_per_sec(self) -> float:
        return self.elems / self.ns_per_packet * 1e9

    @property
    def ratio_to_floor(self) -> float:
        return self.ns_per_packet / self.floor_ns_per_packet

    def to_dict(self) -> dict:
        return {
            "variant": self.variant,
            "elems_per_packet": self.elems,
            "packets": self.packets,
            "ns_per_packet": round(self.ns_per_packet, 1),
            "spread_ns": round(self.spread_ns, 1),
            "elems_per_sec_per_core": self.elems_per_sec,
            "floor_ns_per_packet": round(self.floor_ns_per_packet, 1),
            "ratio_to_floor": round(self.ratio_to_floor, 2),
        }


def _load_floor():
    """The floor program (bpf/xdp_floor.c) loaded: (a function that unloads it, its fd)."""
    from . import objload

    obj = objload.load_floor()
    return obj.close, obj.prog_fd("xdp_floor")


# A measured case beside the program variants: the per-CPU program with a job that verifies UDP
# checksums, on the same stream with checksums filled in (docs/design.md, "UDP checksums").
CHECKSUM_CASE = "percpu+udp-csum"
UNICAST_CASE = "percpu-unicast"  # its results by unicast: the copy program's runs added
FRAGS_CASE = "percpu-frags"  # the per-CPU program as a multi-buffer (frags) program


def _jumbo(k: int) -> bool:
    """Frames of k elements are larger than a page: only a frags program takes them."""
    return wire.size_code_for(k) in wire.JUMBO_SIZE_CODES


def _load_cases(variants, slots: int, checksum: bool, frags: bool, unicast: bool) -> dict:
    """The measured cases: name -> (loaded program, its job's kind: JOB_KINDS)."""
    progs = {v: loader.load(pool_slots=max(slots, 64), variant=v) for v in variants}
    if frags:
        progs[FRAGS_CASE] = loader.load(pool_slots=max(slots, 64), variant="percpu", frags=True)
    cases = {v: (prog, "group") for v, prog in progs.items()}
    if checksum and "percpu" in progs:
        cases[CHECKSUM_CASE] = (progs["percpu"], "csum")
    if unicast and "percpu" in progs:
        cases[UNICAST_CASE] = (progs["percpu"], "unicast")
    return cases


# the benchmark job's kinds: results to the group, the same verifying UDP checksums, results
# by unicast
JOB_KINDS = ("group", "csum", "unicast")


def stream(elems: int, n: int, slots: int, rounds: int, udp_checksum: bool = False) -> list[bytes]:
    """The benchmark's frames: `rounds` rounds over `slots` slots, each slot's n workers in turn."""
    rng = np.random.default_rng(elems)
    vals = rng.integers(-(2**20), 2**20, size=(n, elems))
    return [
        bytes(
            sml_frame(
                src_ip=f"198.18.0.{10 + w}",
                src_mac=_mac(w),
                values=vals[w],
                slot=s,
                version=r % 2,
                tsi=r * slots + s,
                udp_checksum=udp_checksum,
            )
        )
        for r in range(rounds)
        for s in range(slots)
        for w in range(n)
    ]


def _mac(w: int) -> str:
    """Worker w's MAC: registered with it, so that the program matches it as on-link workers'."""
    return f"02:00:00:00:01:{10 + w:02x}"


def measure(fd: int, frames: list[bytes]) -> float:
    """Mean kernel-measured ns per run over the frames, in order."""
    return sum(bpfsys.prog_test_run(fd, f)[2] for f in frames) / len(frames)


def create_bench_job(prog, k: int, workers: int, slots: int, kind: str = "group") -> AggMaps:
    """Job 0 of the benchmark's stream (a fresh one: creating it clears its slots) of `kind`
    (JOB_KINDS) in loaded program `prog`, and its workers; the maps."""
    maps = AggMaps(prog.maps, prog.pool_slots)
    unicast = kind == "unicast"
    spec = JobSpec(
        0,
        workers,
        k,
        0,
        slots,
        delivery=Delivery.UNICAST if unicast else Delivery.GROUP_TX,
        agg_ip="198.18.0.1",
        group_ip="0.0.0.0" if unicast else "198.18.0.255",
        udp_checksum=kind == "csum",
    )
    # a test run returns the broadcast's XDP_REDIRECT without sending: any interface will do
    maps.create_job(
        spec, (loader.TEST_RUN_IFINDEX, prog.progs[loader.PROG_COPY]) if unicast else None
    )
    for w in range(workers):
        ws = WorkerSpec(0, w, f"198.18.0.{10 + w}", wire.UDP_PORT, mac=_mac(w))
        maps.add_worker(ws, copy_mac=ws.mac if unicast else None)
    return maps


def _measure_with_copies(prog, frames: list[bytes], n: int) -> float:
    """Mean ns per packet of the ingress program's runs and, for each result it broadcast, the
    copy program's n runs on it (on one CPU: the copies' cursor is per CPU)."""
    copy_fd = loader.test_runnable(prog, loader.PROG_COPY)
    try:
        total = 0
        for f in frames:
            action, out, ns = bpfsys.prog_test_run(prog.progs[loader.PROG_INGRESS], f)
            total += ns
            if action == bpfsys.XDP_REDIRECT:
                total += sum(bpfsys.prog_test_run(copy_fd, out)[2] for _ in range(n))
    finally:
        os.close(copy_fd)
    return total / len(frames)


def alternating(keys, passes: int, run_one, after_pass=None) -> dict:
    """Side by side: each of `passes` runs `run_one(key)` once per key, in the keys' order on
    even passes and reversed on odd ones, so that no case always runs first (warm caches, a
    neighbour's load); {key: [its result per pass]}. after_pass(p) follows pass p (progress)."""
    keys = list(keys)
    runs = {key: [] for key in keys}
    for p in range(passes):
        for key in keys if p % 2 == 0 else keys[::-1]:
            runs[key].append(run_one(key))
        if after_pass:
            after_pass(p)
    return runs


def alternating_per_size(sizes, keys, passes: int, run_one, workers, slots, rounds, progress=None):
    """For each size k of `sizes`, the bench stream of k (stream(k, workers, slots, rounds))
    and alternating() of `passes` over `keys` on it, each run run_one(key, k, frames);
    progress(k, pass, passes) after each pass. Yields (k, frames, {key: [result per pass]})."""
    for k in sizes:
        frames = stream(k, workers, slots, rounds)
        after = (lambda p: progress(k, p + 1, passes)) if progress else None
        yield k, frames, alternating(keys, passes, lambda key: run_one(key, k, frames), after)


def measure_pass(
    prog, k: int, workers: int, slots: int, rounds: int, frames: list[bytes], kind: str = "group"
) -> float:
    """One pass of a stream of `stream(k, workers, slots, rounds, kind == "csum")` through a
    loaded program, on a freshly created job of `kind`: the mean kernel-measured ns per packet
    (with unicast, the copies' too). Raises RuntimeError when the stream did not complete every
    slot (the program misbehaves)."""
    maps = create_bench_job(prog, k, workers, slots, kind)
    if kind == "unicast":
        ns = _measure_with_copies(prog, frames, workers)
    else:
        ns = measure(prog.progs[loader.PROG_INGRESS], frames)
    if maps.counters(0)["completed"] != slots * rounds:
        raise RuntimeError(
            f"{prog.options.get('variant')}: the bench stream did not complete every slot: "
            "the program misbehaves"
        )
    return ns


def run(
    sizes=BENCH_SIZES,
    workers: int = 4,
    slots: int = 64,
    rounds: int = 20,
    repeats: int = 5,
    cpu: int | None = 0,
    variants=tuple(loader.VARIANTS),
    progress=None,
    checksum: bool = True,
    frags: bool = True,
    unicast: bool = True,
) -> list[BenchResult]:
    """Measure each variant and packet size; `repeats` passes over the same stream, median
    reported; the floor is measured on the same frames in each pass. `checksum` adds
    CHECKSUM_CASE: the per-CPU program verifying UDP checksums; `frags` adds FRAGS_CASE, the
    only case measured at the jumbo sizes; `unicast` adds UNICAST_CASE."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})  # one core: the figure is per core
    close_floor, floor_fd = _load_floor()
    cases = _load_cases(variants, slots, checksum, frags, unicast)
    out = []
    try:
        for k in sizes:
            here = {v: c for v, c in cases.items() if not _jumbo(k) or c[0].options["frags"]}
            streams = {False: stream(k, workers, slots, rounds)}
            if any(kind == "csum" for _, kind in here.values()):
                streams[True] = stream(k, workers, slots, rounds, udp_checksum=True)
            frames = streams[False]
            runs = {v: [] for v in here}
            floors = []
            for rep in range(repeats):
                for v, (prog, kind) in here.items():
                    frames_v = streams[kind == "csum"]
                    runs[v].append(measure_pass(prog, k, workers, slots, rounds, frames_v, kind))
                floors.append(measure(floor_fd, frames))
                if progress:
                    progress(k, rep + 1, repeats)
            for v in here:
                out.append(
                    BenchResult(
                        v,
                        k,
                        len(frames),
                        statistics.median(runs[v]),
                        statistics.median(floors),
                        max(runs[v]) - min(runs[v]),
                    )
                )
    finally:
        for prog in {id(p): p for p, _ in cases.values()}.values():
            prog.close()
        close_floor()
    return out


def table(results: list[BenchResult]) -> str:
    lines = [
        "variant          elems/pkt  ns/pkt  (spread)  elems/s/core  floor ns/pkt  x floor",
    ]
    for r in sorted(results, key=lambda r: (r.elems, r.variant)):
        lines.append(
            f"{r.variant:15s}  {r.elems:9d}  {r.ns_per_packet:6.0f}  ({r.spread_ns:5.0f})  "
            f"{r.elems_per_sec:12.3g}  "
            f"{r.floor_ns_per_packet:12.0f}  {r.ratio_to_floor:7.2f}"
        )
    return "\n".join(lines)
