"""One benchmark worker: joins both an xdp-agg job (hostlib) and a gloo process group, then times
both systems' all-reduce of the same float32 tensor, alternating, behind a common barrier.

Run by bench.allreduce inside a worker namespace; prints one JSON line per measurement set.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from datetime import timedelta

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--control", required=True)
    ap.add_argument("--gloo", required=True, help="HOST:PORT of rank 0 for gloo's TCP rendezvous")
    ap.add_argument("--job", required=True)
    ap.add_argument("--elems", type=int, default=256)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--plan", required=True, help='JSON: [{"bytes": N, "reps": R, "kind": "throughput"|"latency"}]')
    ap.add_argument("--profile", default=None, help="cProfile xdp-agg's all-reduces of this size into --profile-out")
    ap.add_argument("--profile-out", default=None)
    args = ap.parse_args(argv)

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    import torch
    import torch.distributed as dist

    import hostlib

    torch.set_num_threads(1)
    comm = hostlib.init(args.rank, args.world, args.control, job=args.job, elems=args.elems, window=args.window, timeout=60)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{args.gloo}", rank=args.rank, world_size=args.world, timeout=timedelta(seconds=120)
    )
    try:
        for item in json.loads(args.plan):
            nbytes, reps = int(item["bytes"]), int(item["reps"])
            count = max(1, nbytes // 4)
            x = np.random.default_rng([args.rank, count]).standard_normal(count).astype(np.float32)
            t = torch.from_numpy(x.copy())
            runs = {
                "xdp-agg": lambda: comm.allreduce(x),
                "gloo": lambda: dist.all_reduce(t),
            }
            for fn in runs.values():  # warm-up: connections, buffers, page faults
                dist.barrier()
                fn()
            times = {k: [] for k in runs}
            before = comm.stats
            for rep in range(reps):
                order = list(runs) if rep % 2 == 0 else list(runs)[::-1]  # alternate who goes first
                for name in order:
                    dist.barrier()
                    t0 = time.perf_counter()
                    runs[name]()
                    times[name].append(time.perf_counter() - t0)
            after = comm.stats
            out = {"rank": args.rank, "bytes": nbytes, "kind": item.get("kind", "throughput"), "times": times,
                   "retransmissions": after["retransmissions"] - before["retransmissions"],
                   "packets": after["packets_sent"] - before["packets_sent"]}
            if args.profile and int(args.profile) == nbytes and args.rank == 0:
                prof = cProfile.Profile()
                dist.barrier()
                prof.enable()
                t0 = time.perf_counter()
                comm.allreduce(x)
                wall = time.perf_counter() - t0
                prof.disable()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
                with open(args.profile_out, "w") as f:
                    f.write(f"cProfile of rank 0's xdp-agg all-reduce of {nbytes} bytes (wall {wall:.3f} s), by own time\n")
                    f.write(buf.getvalue())
            elif args.profile and int(args.profile) == nbytes:
                dist.barrier()
                comm.allreduce(x)
            print(json.dumps(out), flush=True)
    finally:
        dist.destroy_process_group()
        comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
