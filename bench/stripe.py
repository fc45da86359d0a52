"""`python -m bench.stripe`: one aggregator against k = 2 striped, when the aggregator's link is the
limit.

One one-arm testbed with two aggregator namespaces (Testbed(aggregators=2)), each aggregator's
link shaped with tbf (`--agg-rate`, both directions of it) and the workers' links unshaped, an XDP
aggregator and a control endpoint in each (xdp_agg.cluster.Cluster). Then, alternately (`--rounds`
times, who goes first alternating too), n worker processes all-reduce a float32 tensor `--reps`
times through the first aggregator alone (k = 1), and n fresh ones through both, striped (k = 2).
Each run's first all-reduce is a warm-up (slot versions, ARP, congestion windows) and not
counted; an all-reduce's time is its slowest rank's, and every rank checks its result against
the exact sum (within hostlib.scaling's bound).

Bound: every worker's contributions cross the aggregator's link, n*S bytes for a tensor of S
bytes, so with k aggregators of R bit/s each an all-reduce takes at least n*S*8 / (k*R) (the
results leave by XDP_TX, which the tbf on the aggregator's own interface does not see, and reach
the workers over their unshaped links). The table gives each k's median time, spread, ATE/s, the
fraction of that bound, the retransmissions, and the ratio of the k = 2 throughput to k = 1's per
round and overall (two aggregators should give at least 1.7x one's).

Writes bench/results/stripe.{json,md} (or --out). Root and the XDP build, like bench.allreduce.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from bench import (
    alternating,
    alternating_parser,
    machine,
    spread,
    table_head,
    unwind_on_sigterm,
    write_results,
)


def tbf_drops(tb) -> dict[str, int]:
    """Packets the tbf qdiscs of the aggregators' bridge ports (towards the aggregators) have
    dropped so far, by port."""
    r = tb.run("sw", ["tc", "-s", "-j", "qdisc", "show"], check=True)
    ports = {"ag", *(f"ag{a.index}" for a in tb.aggregators[1:])}
    return {q["dev"]: q.get("drops", 0) for q in json.loads(r.stdout) if q["dev"] in ports}


def run_once(cl, k: int, args, tag: str) -> dict:
    """n workers, one job striped over the first k aggregators: per-rep times (slowest rank),
    retransmissions, and the drops of the shaped links' tbf during the run."""
    count = args.bytes // 4
    drops0 = tbf_drops(cl.tb)
    plan = [{"dtype": "float32", "count": count, "reps": args.reps + 1, "seed": 7}]
    reports = cl.run_workers(
        plan,
        job=f"stripe-{tag}",
        elems=args.elems,
        window=args.window,
        timeout=60,
        aggregators=k,
        deadline=args.deadline,
    )
    per_rank = [reps[0] for reps in reports]
    bad = [r["rank"] for r in per_rank if not r.get("ok")]
    if bad:
        raise RuntimeError(f"k={k}: wrong result on rank(s) {bad}: {per_rank[bad[0]]}")
    times = [max(r["times"][i] for r in per_rank) for i in range(1, args.reps + 1)]
    drops1 = tbf_drops(cl.tb)
    return {
        "tbf_drops": sum(drops1.values()) - sum(drops0.values()),
        "k": k,
        "times": times,
        "retransmissions": sum(r["stats"]["retransmissions"] for r in per_rank),
        # of those, the ones whose first copy's result came after all (late, not lost)
        "spurious": sum(r["stats"]["spurious"] for r in per_rank),
        "packets": sum(r["stats"]["packets_sent"] for r in per_rank),
        "per_aggregator_packets": [
            sum(r["per_aggregator"][j]["packets_sent"] for r in per_rank) for j in range(k)
        ],
        "cpu_s": statistics.fmean(statistics.fmean(r["cpu_s"][1:]) for r in per_rank),
        "max_err_over_bound": max(r["max_err_over_bound"] for r in per_rank),
    }


def summarize(runs: list[dict], args) -> dict:
    """Medians, spreads, bounds and ratios of the runs of each k."""
    S, n, R = args.bytes, args.workers, args.agg_rate_bits
    out = {"rounds": []}
    for k in (1, 2):
        times = spread([x for r in runs if r["k"] == k for x in r["times"]])
        med = times["median_s"]
        bound = n * S * 8 / (k * R)
        out[f"k{k}"] = {
            **times,
            "ate_per_s": (S / 4) / med,
            "bound_s": bound,
            "of_bound": bound / med,
            "retransmissions": sum(r["retransmissions"] for r in runs if r["k"] == k),
            "tbf_drops": sum(r["tbf_drops"] for r in runs if r["k"] == k),
            "spurious": sum(r["spurious"] for r in runs if r["k"] == k),
            "packets": sum(r["packets"] for r in runs if r["k"] == k),
            "cpu_s_per_rank": statistics.median(r["cpu_s"] for r in runs if r["k"] == k),
        }
    for i in range(0, len(runs), 2):  # a round: one run of each k
        pair = {r["k"]: statistics.median(r["times"]) for r in runs[i : i + 2]}
        if len(pair) == 2:
            out["rounds"].append(pair[1] / pair[2])
    out["ratio"] = out["k1"]["median_s"] / out["k2"]["median_s"]
    return out


def markdown(summary: dict, meta: dict) -> str:
    L = table_head(
        meta,
        f"each aggregator's link {meta['agg_rate']} (tbf), workers' links unshaped, "
        + alternating(meta, "k"),
        [
            "k",
            "ms (min-max)",
            "ATE/s",
            "% of bound n*S*8/(k*R)",
            "retx (% of sent)",
            "of them spurious",
            "tbf drops on the aggregators' links",
            "CPU s/rank",
        ],
    )
    for k in (1, 2):
        s = summary[f"k{k}"]
        retx = 100.0 * s["retransmissions"] / max(s["packets"], 1)
        L.append(
            f"| {k} | {s['median_s'] * 1e3:.0f} ({s['min_s'] * 1e3:.0f}-{s['max_s'] * 1e3:.0f}) "
            f"| {s['ate_per_s']:.3g} | {s['of_bound']:.0%} | {s['retransmissions']} "
            f"({retx:.2f}%) | {s['spurious']} | {s['tbf_drops']} | {s['cpu_s_per_rank']:.3f} |"
        )
    rounds = ", ".join(f"{r:.2f}" for r in summary["rounds"])
    L += [
        "",
        f"k = 2 / k = 1 throughput: **{summary['ratio']:.2f}x** (medians); per round: {rounds}.",
    ]
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = alternating_parser(__doc__, per="k", workers=4, nbytes=16 << 20, rounds=3, window=64)
    ap.add_argument("--agg-rate", default="300mbit", help="each aggregator's link (tbf)")
    ap.add_argument("--deadline", type=float, default=600)
    args = ap.parse_args(argv)

    from netns_testbed import shaping
    from netns_testbed.testbed import Testbed
    from xdp_agg.cluster.cluster import Cluster

    args.agg_rate_bits = shaping.parse_rate(args.agg_rate)
    log = lambda m: print(m, flush=True)  # noqa: E731
    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.time()
    runs = []
    with (
        Testbed(workers=args.workers, aggregators=2, agg_rate=args.agg_rate, mtu=args.mtu) as tb,
        Cluster(tb) as cl,
    ):
        for rnd in range(args.rounds):
            for k in (1, 2) if rnd % 2 == 0 else (2, 1):
                r = run_once(cl, k, args, f"{rnd}-{k}")
                log(
                    f"round {rnd} k={k}: "
                    + ", ".join(f"{x * 1e3:.0f}" for x in r["times"])
                    + f" ms, retx {r['retransmissions']} ({r['spurious']} spurious), "
                    f"tbf drops {r['tbf_drops']}, "
                    "packets per aggregator "
                    f"{r['per_aggregator_packets']}"
                )
                runs.append(r)
    # rounds as pairs in run order, whichever k went first
    summary = summarize(runs, args)
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "workers": args.workers,
        "bytes": args.bytes,
        "agg_rate": args.agg_rate,
        "mtu": args.mtu,
        "elems": args.elems,
        "window": args.window,
        "reps": args.reps,
        "rounds": args.rounds,
        "seconds": round(time.time() - t0),
        **machine(load_before),
    }
    doc = {"meta": meta, "summary": summary, "runs": runs}
    out = write_results(args.out, "stripe", doc, markdown(summary, meta))
    log(f"results in {out}/stripe.{{json,md}} ({meta['seconds']} s)")
    return 0


if __name__ == "__main__":
    unwind_on_sigterm()  # a killed run still takes its testbed down
    sys.exit(main())
