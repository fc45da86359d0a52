"""One worker of the soak (bench.soak): all-reduces of mixed sizes until rank 0 says stop.

Started by bench.soak inside a worker's namespace, one process per rank, for the whole soak:

    python -m bench.soak_worker --rank 0 --world 4 --control 198.18.0.1:48800 --job soak-a \
        --seed 1 --stop-at 1767000000.0 --max-bytes 33554432

All-reduce k uses size SIZES[k % len(SIZES)] (capped at --max-bytes), int32 for even k and
float32 for odd k, and inputs made from (seed * 1000003 + k, rank) by
xdp_agg.cluster.cluster_worker.make_input, so every rank rebuilds the exact sum locally: int32 must
match bit for bit (wrapping), float32 must lie within the block-scaling bound around the float64
sum of the float32 inputs.

Before each all-reduce the ranks all-reduce one int32, rank 0's "stop" flag (1 once the wall
clock passes --stop-at, or once --stop-file exists): all ranks see the same sum, so all stop
after the same all-reduce and leave the job together. That flag's all-reduce is checked too
(its sum must be 0 or 1).

One JSON line per all-reduce on stdout ({"k", "dtype", "bytes", "seconds", "ok", "rss_kib",
...}; rss_kib and fds are this process's just before the all-reduce's input is made, so their
values at the start of each cycle of sizes are comparable over the run), and a
final {"done": true, ...} line; exit status 1 if any result was wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from xdp_agg.cluster.cluster_worker import expected_sum, float_bound, join, make_input

# Tensor sizes in bytes, cycled through: mostly small and medium, a few tens of MiB.
SIZES = (
    4 << 10,
    64 << 10,
    256 << 10,
    1 << 20,
    16 << 10,
    4 << 20,
    128 << 10,
    16 << 20,
    1 << 10,
    2 << 20,
    512 << 10,
    32 << 20,
)


def plan_item(k: int, max_bytes: int) -> tuple[str, int]:
    """(dtype, element count) of all-reduce k."""
    nbytes = min(SIZES[k % len(SIZES)], max_bytes)
    return ("int32" if k % 2 == 0 else "float32"), max(1, nbytes // 4)


def own_usage() -> tuple[int, int]:
    """This process's RSS (KiB) and open file descriptors, from /proc/self."""
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss, len(os.listdir("/proc/self/fd"))


def check(out: np.ndarray, dtype: str, count: int, seed: int, world: int, elems: int) -> dict:
    """Whether `out` is the right sum of all ranks' inputs for (dtype, count, seed)."""
    want = expected_sum(dtype, count, seed, world)
    if dtype == "int32":
        bad = int(np.count_nonzero(out != want))
        return {"ok": bad == 0, "mismatches": bad}
    err = np.abs(out.astype(np.float64) - want)
    bound = float_bound(dtype, count, seed, world, elems, out)
    return {
        "ok": bool(np.all(err <= bound)),
        "max_abs_err": float(err.max()),
        "max_err_over_bound": float((err / bound).max()),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--control", required=True, help="HOST:PORT of xdp-agg serve")
    ap.add_argument("--job", required=True, help="the job's name (one per concurrent job)")
    ap.add_argument(
        "--seed", type=int, default=1, help="inputs of all-reduce k: (seed * 1000003 + k, rank)"
    )
    ap.add_argument("--stop-at", type=float, required=True, help="wall-clock time (epoch s)")
    ap.add_argument("--stop-file", help="rank 0 also stops once this file exists")
    ap.add_argument("--max-bytes", type=int, default=32 << 20)
    ap.add_argument("--elems", type=int, default=256)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args(argv)

    wrong = 0
    k = 0
    with join(args, timeout=args.timeout) as comm:
        flag = np.zeros(1, dtype=np.int32)
        while True:
            flag[0] = args.rank == 0 and (
                time.time() >= args.stop_at
                or (args.stop_file is not None and os.path.exists(args.stop_file))
            )
            stop = comm.allreduce(flag)
            if int(stop[0]) not in (0, 1):  # a wrong sum here would desynchronise the ranks
                print(json.dumps({"k": k, "flag_sum": int(stop[0]), "ok": False}), flush=True)
                return 1
            if stop[0]:
                break
            dtype, count = plan_item(k, args.max_bytes)
            seed = args.seed * 1_000_003 + k
            x = make_input(dtype, count, seed, args.rank)
            before = dict(comm.stats)
            rss_kib, fds = own_usage()  # before this all-reduce's buffers exist
            t0 = time.perf_counter()
            out = comm.allreduce(x)
            seconds = time.perf_counter() - t0
            after = comm.stats
            rep = {
                "k": k,
                "at": time.time(),
                "dtype": dtype,
                "bytes": count * 4,
                "seconds": seconds,
                "packets": after["packets_sent"] - before.get("packets_sent", 0),
                "retransmissions": after["retransmissions"] - before.get("retransmissions", 0),
                "rss_kib": rss_kib,
                "fds": fds,
                **check(out, dtype, count, seed, args.world, args.elems),
            }
            wrong += not rep["ok"]
            print(json.dumps(rep), flush=True)
            del x, out
            k += 1
        st = comm.stats  # the data path the engine chose, and why (hostlib.afxdp)
        done = {"done": True, "allreduces": k, "wrong": wrong}
        done.update({x: st.get(x) for x in ("data_path", "data_path_reason")})
        print(json.dumps(done), flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
