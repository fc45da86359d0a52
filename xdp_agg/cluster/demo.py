"""The demo (`sudo make demo`): a verified 64 MiB float32 all-reduce through the XDP aggregator.

Builds a 4-worker one-arm testbed in network namespaces, attaches the XDP aggregator to the
aggregator's interface, starts its control endpoint, runs the all-reduce on every worker with the
host library, checks each result against numpy, prints time, ATE/s and retransmissions, and
removes everything it made.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from hostlib.options import DEFAULT_WINDOW
from xdp_agg.proto.reasons import drop_total


def _print_results(args, count: int, reports: list, agg: dict) -> bool:
    """The demo's table, from the workers' reports and the aggregator's counters; whether every
    result was right."""
    rs = [reps[0] for reps in reports]
    t = max(min(r["times"]) for r in rs)  # the slowest worker's best all-reduce
    retx = sum(r["stats"]["retransmissions"] for r in rs)
    sent = sum(r["stats"]["packets_sent"] for r in rs)
    ok = all(r["ok"] for r in rs)
    bits = rs[0]["stats"].get("wire_bits", 32)  # docs/protocol.md 5.6: 2 elements a word at 16
    size = count * (2 if args.dtype in ("float16", "bfloat16") else 4)  # the tensor's bytes
    print()
    print(
        f"  workers            {args.workers} ({args.topology}, {args.elems * 32 // bits} "
        f"{bits}-bit elements per packet, window {args.window or DEFAULT_WINDOW}, MTU {args.mtu})"
    )
    print(f"  tensor             {count:,} x {args.dtype} ({size / 2**20:g} MiB) per worker")
    best = f", best of {args.reps}" if args.reps > 1 else ""
    print(f"  all-reduce time    {t:.3f} s (slowest worker{best})")
    print(f"  ATE/s              {count / t:.3e} aggregated tensor elements per second")
    print(f"  goodput per worker {count * bits / t / 1e9:.2f} Gbit/s each way")
    gib = size / 2**30
    i = min(range(len(rs[0]["cpu_s"])), key=lambda j: rs[0]["cpu_s"][j])  # rank 0's best
    user, sys_ = rs[0]["cpu_user_s"][i] / gib, rs[0]["cpu_sys_s"][i] / gib
    loop = "C (hostlib._fastpath)" if all(r["native"] for r in rs) else "numpy"
    print(
        f"  worker CPU         {user + sys_:.2f} s/GiB (user {user:.2f} + sys {sys_:.2f}, "
        f"rank 0, {loop} loop)"
    )
    print(f"  packets sent       {sent:,}, retransmissions {retx:,}")
    print(f"  aggregator         {drop_total(agg['unattributed'])} unattributed drops")
    if args.dtype == "int32":
        print(
            "  verified           "
            f"{'bit-exact against numpy on every worker' if ok else 'MISMATCH'}"
        )
    else:
        worst = max(r.get("max_err_over_bound", 0) for r in rs)
        err = max(r.get("max_abs_err", 0) for r in rs)
        print(
            f"  verified           {'within' if ok else 'OUTSIDE'} the block-scaling bound "
            "on every worker "
            f"(max |error| {err:.2e}, {worst:.0%} of the bound)"
        )
    return ok


def main(argv=None) -> int:
    """Build, attach, all-reduce, print the results, tear down; the exit code."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument(
        "--mib", type=float, default=64.0, help="tensor size per worker, MiB of float32"
    )
    ap.add_argument("--topology", choices=["one-arm", "switch"], default="one-arm")
    ap.add_argument(
        "--elems",
        type=int,
        default=768,
        help="int32 per packet (768 needs --mtu >= 3110; SwitchML's largest is 256)",
    )
    ap.add_argument("--mtu", type=int, default=3500, help="MTU of every testbed link")
    ap.add_argument(
        "--window", type=int, default=None, help="slots per worker (default: hostlib's, 64)"
    )
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "int32", "float16", "bfloat16"],
        help="the tensor's; float16 and bfloat16 travel at 16 bits (docs/protocol.md 5.6)",
    )
    ap.add_argument("--reps", type=int, default=1, help="all-reduces in a row; the best is shown")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print(
            "the demo builds namespaces and attaches XDP: run it as root (sudo make demo)",
            file=sys.stderr,
        )
        return 3

    from netns_testbed.testbed import Testbed

    from .cluster import Cluster, ClusterError

    count = int(args.mib * 2**20) // 4
    say = lambda msg: print(f"[demo] {msg}", flush=True)  # noqa: E731
    say(f"building a {args.topology} testbed with {args.workers} workers")
    t_start = time.perf_counter()
    with Testbed(workers=args.workers, topology=args.topology, mtu=args.mtu) as tb:
        say(
            f"attaching the XDP aggregator to {', '.join(tb.agg_interfaces)} "
            f"in {tb.aggregator.netns}"
        )
        with Cluster(tb) as cl:
            say(
                f"all-reducing {args.mib:g} MiB of {args.dtype} ({count:,} elements) "
                "on every worker"
            )
            try:
                reports = cl.run_workers(
                    [{"dtype": args.dtype, "count": count, "seed": 2021, "reps": args.reps}],
                    job="demo",
                    elems=args.elems,
                    window=args.window,
                    timeout=60,
                    progress=True,
                )
            except ClusterError as e:
                say(f"FAILED: {e}")
                return 1
            agg = cl.stats()
        say("detached; removing the testbed")
    ok = _print_results(args, count, reports, agg)
    print(f"  total demo time    {time.perf_counter() - t_start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
