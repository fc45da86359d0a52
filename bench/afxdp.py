"""`python -m bench.afxdp`: the C loop's two data paths side by side, the kernel's UDP socket
(sendmmsg + GSO, recvmmsg + GRO) and an AF_XDP socket (hostlib/_xsk.c, copy mode on veth), each
with every number of lanes of `--lanes` (default 1; `--lanes 1,2`: an AF_XDP socket per lane,
sharing one UMEM).

One one-arm testbed, links unshaped, an XDP aggregator and a control endpoint
(xdp_agg.cluster.Cluster). Alternately (`--rounds` times, who goes first alternating too), n fresh
worker processes all-reduce a float32 tensor `--reps` times over one path, then over the other
(XDP_AGG_DATA_PATH=udp / afxdp), at each number of lanes (XDP_AGG_LANES). Each run's first
all-reduce is a warm-up and not counted; an all-reduce's time is its slowest rank's, and every
rank checks its result against the exact sum.

Per path: the median time and the throughput (tensor bytes per second), each rank's CPU seconds
(user, sys: the worker process, all its threads) per GiB of tensor, and the system calls per
packet sent. On this one-machine testbed a worker's sys time also holds softirq work done in its
system calls (the veth, the bridge, the aggregator's XDP program), as bench.allreduce says.

Writes bench/results/afxdp.{json,md} (or --out). Root and the XDP build, like
bench.allreduce.
"""

from __future__ import annotations

import os
import statistics
import time

from bench import (
    alternating,
    alternating_parser,
    lanes_option,
    machine,
    spread,
    table_head,
    unwind_on_sigterm,
    write_results,
)

PATHS = ("udp", "afxdp")


def variants(lanes: list[int]) -> list[tuple[str, int]]:
    """What the rounds compare: each data path at each number of lanes."""
    return [(path, k) for k in lanes for path in PATHS]


def name(path: str, lanes: int) -> str:
    """A variant's key in the summary: "udp", "afxdp" (one lane), "afxdp/2"."""
    return path if lanes == 1 else f"{path}/{lanes}"


def run_once(cl, path: str, lanes: int, args, tag: str) -> dict:
    """n workers over data path `path` on `lanes` lanes: per-rep times (slowest rank), CPU per
    rank and rep, and the counters of the timed all-reduces."""
    os.environ["XDP_AGG_DATA_PATH"] = path
    os.environ["XDP_AGG_LANES"] = str(lanes)
    plan = [{"dtype": "float32", "count": args.bytes // 4, "reps": 1, "seed": 7}]
    plan.append({**plan[0], "reps": args.reps})  # the first item is the warm-up
    reports = cl.run_workers(
        plan, job=f"afxdp-{tag}", elems=args.elems, window=args.window, timeout=60
    )
    timed = [reps[1] for reps in reports]
    bad = [r["rank"] for reps in reports for r in reps if not r.get("ok")]
    if bad:
        raise RuntimeError(f"{path}: wrong result on rank(s) {bad}")
    st = [r["stats"] for r in timed]
    return {
        "path": path,
        "lanes": lanes,
        "data_path": sorted({s["data_path"] for s in st}),
        "times": [max(r["times"][i] for r in timed) for i in range(args.reps)],
        "cpu_user_s": statistics.fmean(x for r in timed for x in r["cpu_user_s"]),
        "cpu_sys_s": statistics.fmean(x for r in timed for x in r["cpu_sys_s"]),
        "packets": sum(s["packets_sent"] for s in st),
        "send_calls": sum(s["send_calls"] for s in st),
        "recv_calls": sum(s["recv_calls"] for s in st),
        "retransmissions": sum(s["retransmissions"] for s in st),
    }


def summarize(runs: list[dict], args) -> dict:
    """Per path and lanes: median time, throughput, CPU per GiB, system calls per packet."""
    gib = args.bytes / 2**30
    out = {}
    for path, lanes in variants(args.lanes):
        rs = [r for r in runs if (r["path"], r["lanes"]) == (path, lanes)]
        times = spread([x for r in rs for x in r["times"]])
        med = times["median_s"]
        user = statistics.median(r["cpu_user_s"] for r in rs)
        sys_ = statistics.median(r["cpu_sys_s"] for r in rs)
        packets = sum(r["packets"] for r in rs)
        out[name(path, lanes)] = {
            "path": path,
            "lanes": lanes,
            "data_path": sorted({p for r in rs for p in r["data_path"]}),
            **times,
            "gib_per_s": gib / med,
            "cpu_user_s_per_gib": user / gib,
            "cpu_sys_s_per_gib": sys_ / gib,
            "cpu_s_per_gib": (user + sys_) / gib,
            "send_calls_per_packet": sum(r["send_calls"] for r in rs) / packets,
            "recv_calls_per_packet": sum(r["recv_calls"] for r in rs) / packets,
            "retransmissions": sum(r["retransmissions"] for r in rs),
            "packets": packets,
        }
    return out


def markdown(summary: dict, meta: dict) -> str:
    """The table of bench/results/afxdp.md."""
    L = table_head(
        meta,
        "links unshaped, " + alternating(meta, "path"),
        [
            "path",
            "lanes",
            "mode",
            "ms (min-max)",
            "GiB/s",
            "CPU s/GiB per rank (user + sys)",
            "send calls / packet",
            "recv calls / packet",
            "retx",
        ],
    )
    for s in summary.values():
        L.append(
            f"| {s['path']} | {s['lanes']} | {', '.join(s['data_path'])} | "
            f"{s['median_s'] * 1e3:.0f} ({s['min_s'] * 1e3:.0f}-{s['max_s'] * 1e3:.0f}) | "
            f"{s['gib_per_s']:.3f} | "
            f"{s['cpu_s_per_gib']:.2f} ({s['cpu_user_s_per_gib']:.2f} + "
            f"{s['cpu_sys_s_per_gib']:.2f}) | {s['send_calls_per_packet']:.3f} | "
            f"{s['recv_calls_per_packet']:.3f} | {s['retransmissions']} |"
        )
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    """Run the rounds, write the JSON and the table."""
    ap = alternating_parser(__doc__, per="path", workers=2, nbytes=32 << 20, rounds=2, window=128)
    lanes_option(ap, "the numbers of lanes to run each path with (e.g. 1,2)")
    args = ap.parse_args(argv)

    from netns_testbed.testbed import Testbed
    from xdp_agg.cluster.cluster import Cluster

    load_before = [round(x, 2) for x in os.getloadavg()]
    runs = []
    with Testbed(workers=args.workers, topology="one-arm", mtu=args.mtu) as tb, Cluster(tb) as cl:
        for rnd in range(args.rounds):
            order = variants(args.lanes)
            for path, lanes in order if rnd % 2 == 0 else order[::-1]:
                r = run_once(cl, path, lanes, args, f"{rnd}-{path}-{lanes}")
                times = ", ".join(f"{x * 1e3:.0f}" for x in r["times"])
                print(f"round {rnd} {name(path, lanes)} {r['data_path']}: {times} ms", flush=True)
                runs.append(r)
    summary = summarize(runs, args)
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        **{k: getattr(args, k) for k in ("workers", "bytes", "mtu", "elems", "window")},
        **{k: getattr(args, k) for k in ("reps", "rounds", "lanes")},
        **machine(load_before),
    }
    doc = {"meta": meta, "summary": summary, "runs": runs}
    write_results(args.out, "afxdp", doc, markdown(summary, meta))
    return 0


if __name__ == "__main__":
    unwind_on_sigterm()  # a killed run still takes its testbed down
    raise SystemExit(main())
