"""`xdp-agg bench --slot-cpus`: one slot's packets on two CPUs against each slot on one CPU.

Both with BPF_PROG_TEST_RUN, two processes pinned to CPUs 0 and 1 running at once, over the same
stream as microbench (a job of n workers, rounds over a window of slots in the protocol's order),
a barrier between rounds (a worker moves on to a slot's next round only after its result):
- "rss": what a NIC without a port hash (veth: the sender's CPU) does, the even workers'
  packets on CPU 0, the odd ones' on CPU 1: every slot's contributions on both, each completion
  gathering the other CPU's partial, the slot's counters' cache lines moving between the CPUs;
- "cpumap": the cpumap build, each slot's packets (every worker's) on the CPU that owns it
  (xdp_switch.slot_cpus.lane_cpu over the window), plus the steering program's own cost per
  packet (xdp_agg_steer, run on the same frames on one CPU). Not included: the cpumap's queue
  between the CPUs (an enqueue, a kthread wake-up and a dequeue per frame), which a test run
  does not reach; the testbed comparison (bench.slot_cpus) has it.
Reported per case: kernel-measured ns per packet summed over both CPUs (the CPU the aggregator
spends per packet) and the spread over repetitions.
"""

from __future__ import annotations

import os
import statistics

from xdp_agg import bpfsys

from . import cpu_bench, loader, microbench, slot_cpus

CPUS = (0, 1)


def _on_two_cpus(fd: int, per_cpu: list[list[list[bytes]]]) -> int:
    """per_cpu[c]: CPU c's rounds, each a list of frames. Both at once; total kernel ns."""
    return sum(cpu_bench.on_cpus(fd, list(CPUS), per_cpu))


def _split(frames: list[bytes], k_workers: int, slots: int, rounds: int, mode: str):
    """microbench's stream (round, slot, worker order) cut per CPU and round: by worker parity
    (rss) or by the slot's owner (cpumap)."""
    per_cpu = [[[] for _ in range(rounds)] for _ in CPUS]
    i = 0
    for r in range(rounds):
        for s in range(slots):
            for w in range(k_workers):
                c = w % 2 if mode == "rss" else slot_cpus.lane_cpu(s, slots, list(CPUS))
                per_cpu[c][r].append(frames[i])
                i += 1
    return per_cpu


def _pass(prog, mode: str, k: int, workers: int, slots: int, rounds: int, frames) -> float:
    """One pass on a fresh job: ns per packet over both CPUs. RuntimeError when the stream did
    not complete every slot."""
    maps = microbench.create_bench_job(prog, k, workers, slots)
    ns = _on_two_cpus(prog.progs[loader.PROG_INGRESS], _split(frames, workers, slots, rounds, mode))
    if maps.counters(0)["completed"] != slots * rounds:
        raise RuntimeError(f"{mode}: the two-CPU stream did not complete every slot")
    return ns / len(frames)


def run(sizes=(256, 768), workers: int = 4, slots: int = 64, rounds: int = 20, repeats: int = 5):
    """Both cases per size, alternating within each repetition; [{"case", "elems_per_packet",
    "ns_per_packet", "spread_ns", "steer_ns_per_packet"}]."""
    if len(os.sched_getaffinity(0)) < 2 or bpfsys.possible_cpus() < 2:
        raise RuntimeError("the two-CPU comparison needs CPUs 0 and 1")
    progs = {
        "rss": loader.load(pool_slots=max(slots, 64)),
        "cpumap": loader.load(pool_slots=max(slots, 64), slot_cpus="cpumap"),
    }
    cp = progs["cpumap"]
    slot_cpus.install(cp.maps, cp.progs[loader.PROG_CPUMAP], list(CPUS), cp.pool_slots)
    loader.prepare_test_runs(cp)
    out = []
    try:
        for k, frames, runs in microbench.alternating_per_size(
            sizes,
            progs,
            repeats,
            lambda m, k, frames: _pass(progs[m], m, k, workers, slots, rounds, frames),
            workers,
            slots,
            rounds,
        ):
            steer = microbench.measure(cp.progs[loader.PROG_STEER], frames)
            for m, ns in runs.items():
                extra = steer if m == "cpumap" else 0.0
                out.append(
                    {
                        "case": m,
                        "elems_per_packet": k,
                        "ns_per_packet": round(statistics.median(ns) + extra, 1),
                        "spread_ns": round(max(ns) - min(ns), 1),
                        "steer_ns_per_packet": round(extra, 1),
                    }
                )
    finally:
        for p in progs.values():
            p.close()
    return out


def table(rows: list[dict]) -> str:
    """The comparison as text."""
    lines = ["slot CPUs  elems/pkt  ns/pkt (2 CPUs)  (spread)  of which steering"]
    for r in rows:
        lines.append(
            f"{r['case']:9s}  {r['elems_per_packet']:9d}  {r['ns_per_packet']:15.0f}  "
            f"({r['spread_ns']:6.0f})  {r['steer_ns_per_packet']:17.0f}"
        )
    return "\n".join(lines)
