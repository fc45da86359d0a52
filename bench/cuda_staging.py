"""CUDA tensors through the xdpagg backend against CPU tensors, side by side: a torchrun script.

    sudo .venv/bin/python -m xdp_agg.cluster.torchrun --workers 2 --mtu 3500 -- \\
        bench/cuda_staging.py --mib 64 --out bench-results/cuda-staging.json

or under any torchrun with XDP_AGG_CONTROL set (a soft aggregator, `python -m
xdp_agg.app.soft_endpoint`, works too, but its Python aggregation is so slow that it hides the
copies). Each rank joins the group "xdpagg" and measures, timed on rank 0 behind a barrier,
median of --reps:

1. the chunk sweep, on the host, on any machine: one float32 all-reduce of --mib MiB through
   the group's hostlib communicator, whole and as the consecutive all-reduces of chunks of
   --chunks-mib MiB that the staging makes of a CUDA tensor (hostlib.pt.staging), with no device
   at all: what cutting a tensor into chunks costs the aggregation (each chunk starts and
   drains its own window), per chunk beyond the first;
2. where torch.cuda is available (rank 0 says when not, and stops there): dist.all_reduce (AVG)
   of the same float32 tensor on the CPU and on CUDA, alternately, for each chunk size
   (channel.chunk_bytes, the same on every rank); the CUDA time includes the copies down and
   up (the all-reduce returns with the sum on the device) and the ratio cuda / cpu is what
   docs/pytorch.md's 1.2x target is about. The row "whole" takes the tensor as one chunk: the
   staging without overlap (one copy down, the aggregation, one copy up).

Rank 0 prints both tables and writes --out (JSON) if given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from hostlib.pt.staging import chunk_elems

AVG = dist.ReduceOp.AVG  # the tensors stay of one magnitude however often they are reduced


def _timed(fn, reps: int) -> list[float]:
    """fn() `reps` times, each after a barrier; seconds of each."""
    out = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def chunk_sweep(comm, mib: int, chunks_mib: list[float], reps: int) -> list[dict]:
    """Rows of the host sweep: a float32 all-reduce of `mib` MiB, whole, then in chunks. Each
    repetition times every size once, in an order rotated by one each time, so that a machine
    getting busier or quieter during the run weighs on every size alike."""
    n = mib * (1 << 20) // 4
    x = np.random.default_rng(comm.rank).standard_normal(n, dtype=np.float32)
    y = np.empty_like(x)
    elems = int(comm.stats["elems"])
    steps = [n] + [chunk_elems(int(c * (1 << 20)), elems) for c in chunks_mib]

    def run(step: int) -> None:
        for a in range(0, n, step):
            comm.allreduce(x[a : a + step], out=y[a : a + step])

    run(n)  # warm-up
    times: list[list[float]] = [[] for _ in steps]
    for i in range(reps):
        for k in range(len(steps)):
            j = (k + i) % len(steps)
            times[j] += _timed(lambda s=steps[j]: run(s), 1)
    rows = []
    for j, (step, ts) in enumerate(zip(steps, times)):
        rows.append(
            {
                "chunk_mib": None if j == 0 else step * 4 / (1 << 20),
                "chunks": -(-n // step),
                "median_s": statistics.median(ts),
                "min_s": min(ts),
                "max_s": max(ts),
                "all_s": ts,
            }
        )
    whole = rows[0]["median_s"]
    for r in rows:
        r["vs_whole"] = r["median_s"] / whole
        extra = r["chunks"] - 1
        r["per_extra_chunk_ms"] = (r["median_s"] - whole) / extra * 1e3 if extra else None
    return rows


def cuda_vs_cpu(channel, mib: int, chunks_mib: list[float], reps: int, rank: int) -> list[dict]:
    """Rows of dist.all_reduce of `mib` MiB float32 on the CPU and on CUDA, per chunk size, and
    with the whole tensor as one chunk (chunk_mib None: no overlap)."""
    n = mib * (1 << 20) // 4
    g = torch.Generator().manual_seed(rank)
    host = torch.randn(n, generator=g)
    dev = host.cuda()
    rows = []
    for c in [*chunks_mib, None]:
        channel.chunk_bytes = int(c * (1 << 20)) if c is not None else 2 * n * 4
        for t in (host, dev):  # warm-up: the ring, the streams, the pinned memory
            dist.all_reduce(t, op=AVG)
        torch.cuda.synchronize()
        cpu, cuda = [], []
        for i in range(reps):  # alternately, who goes first alternating too
            pair = [("cpu", host, cpu), ("cuda", dev, cuda)]
            for _, t, acc in pair if i % 2 == 0 else pair[::-1]:
                acc += _timed(lambda t=t: dist.all_reduce(t, op=AVG), 1)
        rows.append(
            {
                "chunk_mib": c,
                "cpu_s": statistics.median(cpu),
                "cuda_s": statistics.median(cuda),
                "ratio": statistics.median(cuda) / statistics.median(cpu),
                "cpu_all_s": cpu,
                "cuda_all_s": cuda,
            }
        )
    return rows


def _print_sweep(rows: list[dict]) -> None:
    print("host chunk sweep (hostlib all-reduce of the tensor as the staging cuts it, no device):")
    print(f"  {'chunk':>9} {'chunks':>6} {'median':>9} {'vs whole':>8} {'per extra chunk':>16}")
    for r in rows:
        c = "whole" if r["chunk_mib"] is None else f"{r['chunk_mib']:.2f} MiB"
        extra = "-" if r["per_extra_chunk_ms"] is None else f"{r['per_extra_chunk_ms']:.2f} ms"
        print(f"  {c:>9} {r['chunks']:>6} {r['median_s']:>8.4f}s {r['vs_whole']:>8.3f} {extra:>16}")


def _print_cuda(rows: list[dict]) -> None:
    print("dist.all_reduce, float32, cpu tensor vs cuda tensor (xdpagg):")
    print(f"  {'chunk':>9} {'cpu':>9} {'cuda':>9} {'cuda/cpu':>8}")
    for r in rows:
        c = "whole" if r["chunk_mib"] is None else f"{r['chunk_mib']:g} MiB"
        print(f"  {c:>9} {r['cpu_s']:>8.4f}s {r['cuda_s']:>8.4f}s {r['ratio']:>8.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mib", type=int, default=64, help="tensor size (float32)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument(
        "--chunks-mib",
        default="1,2,4,8,16,32",
        help="chunk sizes, MiB, comma-separated (the staging's default: 16); the whole tensor "
        "as one chunk is measured too",
    )
    ap.add_argument("--out", default=None, help="JSON results (rank 0)")
    a = ap.parse_args(argv)
    chunks = [float(c) for c in a.chunks_mib.split(",") if c]

    import hostlib.pt  # noqa: F401 - registers "xdpagg" if the entry point did not

    hostlib.pt.register_backend()
    dist.init_process_group("xdpagg")
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = dist.distributed_c10d._get_default_group()
    comm, channel = pg.comm, pg.channel
    report = {
        "world": world,
        "mib": a.mib,
        "reps": a.reps,
        "elems": comm.stats["elems"],
        "cuda": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "sweep": chunk_sweep(comm, a.mib, chunks, a.reps),
    }
    if rank == 0:
        print(
            f"xdpagg staging bench: {world} ranks, {a.mib} MiB float32, "
            f"{report['elems']} int32 per packet, median of {a.reps} (rank 0's clock)"
        )
        _print_sweep(report["sweep"])
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        report["cuda_vs_cpu"] = cuda_vs_cpu(channel, a.mib, chunks, a.reps, rank)
        if rank == 0:
            _print_cuda(report["cuda_vs_cpu"])
    elif rank == 0:
        print("no CUDA device here: the cuda vs cpu comparison needs one (torch.cuda)")
    if rank == 0 and a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
