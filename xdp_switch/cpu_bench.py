"""`xdp-agg bench --cpus 1,2,4`: the XDP program on K CPUs at once over one job's slots.

A NIC's receive hash spreads a job's flows (each worker's lanes: docs/design.md "Lanes") over
its queues, and each queue's XDP runs on its own CPU. K processes, pinned to K CPUs, run
microbench's stream (a job of n workers, rounds over a window of slots in the protocol's order)
with BPF_PROG_TEST_RUN, a barrier between rounds (a worker moves on to a slot's next round only
after its result). Lane l holds the l-th K-th of the window. Two placements (PLACEMENTS), named
by the receive hash's fields (ethtool -n IFACE rx-flow-hash udp4) that give them:
- "sdfn" (addresses and ports, most NICs' default): flow (worker w, lane l) on CPU (w + l) mod
  K: the contributions of every slot land on min(n, K) CPUs, and the completing CPU gathers the
  others' partials (bpf/aggregate.h);
- "fn" (the ports alone, docs/operations.md): lane l of every worker (one source port) on CPU
  l mod K: each slot on one CPU, nothing to gather (what --slot-cpus cpumap gives, without its
  queue between CPUs). A real hash maps K lanes to K queues with collisions; this is the ideal.
Reported per K: the program's aggregate packets and int32
elements per second (packets over the busiest CPU's kernel-measured time: the CPUs run at
once), its scaling against one CPU, and the kernel ns each packet costs summed over the CPUs.
What a test run leaves out: the NIC and the queues between it and XDP, and most overlap, as each
run is one system call from Python (microseconds between runs): contention for the slots' cache
lines is what a real queue at line rate would see more of.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics

from xdp_agg import bpfsys

from . import loader, microbench

BARRIER_TIMEOUT = 120.0


def _drive(cpu, fd, rounds, barrier, conn):
    """One CPU's side: each round's frames once every CPU reached it; the kernel ns summed."""
    os.sched_setaffinity(0, {cpu})
    ns = 0
    for frames in rounds:
        barrier.wait(timeout=BARRIER_TIMEOUT)
        for f in frames:
            ns += bpfsys.prog_test_run(fd, f)[2]
    conn.send(ns)
    conn.close()


def on_cpus(fd: int, cpus: list[int], per_cpu: list[list[list[bytes]]]) -> list[int]:
    """per_cpu[i]: the rounds (each a list of frames) that cpus[i] runs, all CPUs at once and
    in step round by round; the kernel-measured ns each CPU spent."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(len(cpus))
    procs, pipes = [], []
    for cpu, rounds in zip(cpus, per_cpu):
        rd, wr = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_drive, args=(cpu, fd, rounds, barrier, wr))
        p.start()
        procs.append(p)
        pipes.append(rd)
    spent = [pipe.recv() for pipe in pipes]
    for p in procs:
        p.join(timeout=BARRIER_TIMEOUT)
    return spent


PLACEMENTS = ("sdfn", "fn")  # the module docstring's two placements


def split(frames: list[bytes], workers: int, slots: int, rounds: int, k: int, placement: str):
    """microbench's stream (round, slot, worker order) cut per CPU and round as `placement`
    puts flow (w, lane) on a CPU, lane = the slot's k-th of the window."""
    per_cpu = [[[] for _ in range(rounds)] for _ in range(k)]
    i = 0
    for r in range(rounds):
        for s in range(slots):
            lane = s * k // slots
            for w in range(workers):
                cpu = (w + lane) % k if placement == "sdfn" else lane % k
                per_cpu[cpu][r].append(frames[i])
                i += 1
    return per_cpu


def _pass(prog, case, cpus, elems: int, workers: int, slots: int, rounds: int, frames):
    """One pass of case (placement, k) on a fresh job over the first k CPUs: (ns of the
    busiest CPU, ns of all). RuntimeError when the stream did not complete every slot."""
    placement, k = case
    maps = microbench.create_bench_job(prog, elems, workers, slots)
    fd = prog.progs[loader.PROG_INGRESS]
    spent = on_cpus(fd, cpus[:k], split(frames, workers, slots, rounds, k, placement))
    if maps.counters(0)["completed"] != slots * rounds:
        raise RuntimeError(f"{placement} on {k} CPUs: the stream did not complete every slot")
    return max(spent), sum(spent)


def _row(case, elems: int, workers: int, packets: int, runs, base_pps: float) -> dict:
    """A result row of case (placement, k): runs are (busiest CPU's ns, all CPUs' ns)."""
    placement, k = case
    busiest = statistics.median(b for b, _ in runs)
    pps = packets / busiest * 1e9
    return {
        "placement": placement,
        "cpus": k,
        "workers": workers,
        "elems_per_packet": elems,
        "packets_per_sec": round(pps),
        "elems_per_sec": round(pps * elems),
        "scaling": round(pps / base_pps, 2) if base_pps else 1.0,
        "cpu_ns_per_packet": round(statistics.median(t for _, t in runs) / packets, 1),
        "spread_ns_per_packet": round(
            (max(b for b, _ in runs) - min(b for b, _ in runs)) / packets * k, 1
        ),
    }


def run(
    counts=(1, 2),
    sizes=(768,),
    workers: int = 8,
    slots: int = 64,
    rounds: int = 20,
    repeats: int = 5,
    progress=None,
) -> list[dict]:
    """Each placement on each number of CPUs in `counts` (the first K of those this process may
    run on; counts above them are left out, and `skipped` says so), per size, alternating within
    each repetition. One CPU is always measured: the scaling is against it."""
    cpus = sorted(os.sched_getaffinity(0))
    ks = sorted({1, *(k for k in counts if k <= len(cpus))})
    cases = [("sdfn", 1)] + [(p, k) for k in ks[1:] for p in PLACEMENTS]
    prog = loader.load(pool_slots=max(slots, 64), frags=any(microbench._jumbo(e) for e in sizes))
    out = []
    try:
        for elems, frames, runs in microbench.alternating_per_size(
            sizes,
            cases,
            repeats,
            lambda c, elems, frames: _pass(prog, c, cpus, elems, workers, slots, rounds, frames),
            workers,
            slots,
            rounds,
            progress,
        ):
            base = len(frames) / statistics.median(b for b, _ in runs[cases[0]]) * 1e9
            out += [_row(c, elems, workers, len(frames), runs[c], base) for c in cases]
    finally:
        prog.close()
    return out


def skipped(counts) -> list[int]:
    """The numbers of CPUs asked for that this process cannot run on."""
    return [k for k in counts if k > len(os.sched_getaffinity(0))]


def table(rows: list[dict], left_out: list[int]) -> str:
    """The scaling as text."""
    lines = ["hash  CPUs  elems/pkt  packets/s   elems/s  scaling vs 1  CPU ns/pkt (all CPUs)"]
    for r in rows:
        lines.append(
            f"{r['placement']:4s}  {r['cpus']:4d}  {r['elems_per_packet']:9d}  "
            f"{r['packets_per_sec']:9.3g}  "
            f"{r['elems_per_sec']:8.3g}  {r['scaling']:12.2f}  {r['cpu_ns_per_packet']:10.0f}"
        )
    if left_out:
        n = len(os.sched_getaffinity(0))
        lines.append(f"not run: {', '.join(map(str, left_out))} CPUs (this command may use {n})")
    return "\n".join(lines)
