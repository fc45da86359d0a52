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
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

import numpy as np

import bpfsys
from aggproto import wire
from aggproto.jobs import JobSpec, WorkerSpec
from aggproto.scapy_layer import sml_frame

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
    bcc = loader.check_environment("the benchmark (it loads BPF programs)")

    text = loader.source_text(loader.BPF_DIR / "xdp_floor.c").encode()
    b = bcc.BPF(text=text, cflags=list(loader.WARNING_FLAGS))
    return b, b.load_func(b"xdp_floor", bcc.BPF.XDP).fd


# A measured case beside the program variants: the per-CPU program with a job that verifies UDP
# checksums, on the same stream with checksums filled in (docs/design.md, "UDP checksums").
CHECKSUM_CASE = "percpu+udp-csum"
FRAGS_CASE = "percpu-frags"  # the per-CPU program as a multi-buffer (frags) program


def _jumbo(k: int) -> bool:
    """Frames of k elements are larger than a page: only a frags program takes them."""
    return wire.size_code_for(k) in wire.JUMBO_SIZE_CODES


def _load_cases(variants, slots: int, checksum: bool, frags: bool) -> dict:
    """The measured cases: name -> (loaded program, whether its job verifies UDP checksums)."""
    progs = {v: loader.load(pool_slots=max(slots, 64), variant=v) for v in variants}
    if frags:
        progs[FRAGS_CASE] = loader.load(pool_slots=max(slots, 64), variant="percpu", frags=True)
    cases = {v: (prog, False) for v, prog in progs.items()}
    if checksum and "percpu" in progs:
        cases[CHECKSUM_CASE] = (progs["percpu"], True)
    return cases


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


def create_bench_job(maps: AggMaps, k: int, workers: int, slots: int, csum: bool = False) -> None:
    """Job 0 of the benchmark's stream (a fresh one: creating it clears its slots), and its
    workers."""
    maps.create_job(
        JobSpec(
            0,
            workers,
            k,
            0,
            slots,
            agg_ip="198.18.0.1",
            group_ip="198.18.0.255",
            udp_checksum=csum,
        )
    )
    for w in range(workers):
        maps.add_worker(WorkerSpec(0, w, f"198.18.0.{10 + w}", wire.UDP_PORT, mac=_mac(w)))


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


def measure_pass(
    prog, k: int, workers: int, slots: int, rounds: int, frames: list[bytes], csum: bool = False
) -> float:
    """One pass of a stream of `stream(k, workers, slots, rounds, csum)` through a loaded program,
    on a freshly created job: the mean kernel-measured ns per packet. Raises RuntimeError when the
    stream did not complete every slot (the program misbehaves)."""
    maps = AggMaps(prog.maps, prog.pool_slots)
    create_bench_job(maps, k, workers, slots, csum)
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
) -> list[BenchResult]:
    """Measure each variant and packet size; `repeats` passes over the same stream, median
    reported; the floor is measured on the same frames in each pass. `checksum` adds
    CHECKSUM_CASE: the per-CPU program verifying UDP checksums; `frags` adds FRAGS_CASE, the
    only case measured at the jumbo sizes."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})  # one core: the figure is per core
    floor_bpf, floor_fd = _load_floor()
    cases = _load_cases(variants, slots, checksum, frags)
    out = []
    try:
        for k in sizes:
            here = {v: c for v, c in cases.items() if not _jumbo(k) or c[0].options["frags"]}
            streams = {False: stream(k, workers, slots, rounds)}
            if any(csum for _, csum in here.values()):
                streams[True] = stream(k, workers, slots, rounds, udp_checksum=True)
            frames = streams[False]
            runs = {v: [] for v in here}
            floors = []
            for rep in range(repeats):
                for v, (prog, csum) in here.items():
                    runs[v].append(
                        measure_pass(prog, k, workers, slots, rounds, streams[csum], csum)
                    )
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
        floor_bpf.cleanup()
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
