"""`python -m bench.slot_cpus`: --slot-cpus rss against cpumap, side by side, in the testbed.

One n-worker one-arm testbed per run (bench.allreduce's run_config: the workers' links unshaped,
MTU 3500, 768 int32 per packet), the aggregator attached with --slot-cpus rss (the per-CPU
merge: on veth a packet is aggregated on its sender's CPU) or cpumap (each slot on the CPU that
owns it), alternately, `--rounds` runs of each, who goes first alternating too. In each run the
workers all-reduce a float32 tensor `--reps` times with xdp-agg and gloo (bench.worker), rank 0
reading system-wide CPU time (/proc/stat) and the aggregator's BPF run time around each, behind
barriers (bench.cpustat): CPU seconds per all-reduce, not only wall time, on a machine whose two
CPUs other jobs share. gloo, in the same runs, shows how much the machine's load moved.

Writes bench/results/slot-cpus.{json,md} (or --out). Root, bcc and the XDP build.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from bench import allreduce, cpustat, machine, run_line, write_results

MODES = ("rss", "cpumap")


def run_once(mode: str, n: int, args, log) -> dict:
    """One testbed run with the aggregator attached --slot-cpus `mode`: per system, the median
    wall time and system-wide CPU seconds per all-reduce and the aggregator's BPF seconds."""
    a = allreduce._parser().parse_args(
        ["--sizes", args.size, "--rows", "throughput", "--reps", str(args.reps), "--no-profile"]
    )
    a.sizes, a.rows, a.slot_cpus = [args.size], ["throughput"], mode
    a.bpf_stats = True
    rows = allreduce.run_config(n, "unshaped", a, log)
    row = rows[0]
    out = {"mode": mode, "n": n, "bytes": row["bytes"]}
    for system in ("xdp-agg", "gloo"):
        spans = row.get("syscpu", {}).get(system, [])
        out[system] = {
            "wall_s": statistics.median(row[system]),
            "cpu_s": statistics.median(s["busy_s"] for s in spans) if spans else None,
            "bpf_s": statistics.median(s["aggregator_s"] for s in spans) if spans else None,
        }
    return out


def summarize(runs: list[dict]) -> dict:
    """Per mode and system: the median over runs and the spread (min, max) of wall and CPU."""
    out = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        for system in ("xdp-agg", "gloo"):
            for key in ("wall_s", "cpu_s", "bpf_s"):
                vals = [r[system][key] for r in mine if r[system][key] is not None]
                if vals:
                    out[f"{mode} {system} {key}"] = {
                        "median": statistics.median(vals),
                        "min": min(vals),
                        "max": max(vals),
                    }
    return out


def markdown(summary: dict, meta: dict) -> str:
    """The side-by-side table."""
    lines = [
        run_line(meta, f"--slot-cpus rss against cpumap, {meta['rounds']} runs each alternating"),
        "",
        "| slot CPUs | system | wall s per all-reduce | CPU s per all-reduce | aggregator BPF s |",
        "|---|---|---|---|---|",
    ]

    def fmt(key: str) -> str:
        v = summary.get(key)
        return f"{v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f})" if v else "-"

    for mode in MODES:
        for system in ("xdp-agg", "gloo"):
            k = f"{mode} {system}"
            lines.append(
                f"| {mode} | {system} | {fmt(k + ' wall_s')} | {fmt(k + ' cpu_s')} | "
                f"{fmt(k + ' bpf_s')} |"
            )
    lines.append("")
    lines.append("Medians over runs (each run's median over its all-reduces), min-max in brackets.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--size", default="16MiB", help="one of bench.allreduce's sizes")
    ap.add_argument("--reps", type=int, default=5, help="all-reduces per run and system")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each mode, alternating")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    log = lambda m: print(m, flush=True)  # noqa: E731
    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.time()
    runs = []
    with cpustat.BpfStats():
        for rnd in range(args.rounds):
            for mode in MODES if rnd % 2 == 0 else MODES[::-1]:
                r = run_once(mode, args.workers, args, log)
                log(f"round {rnd} {mode}: {r}")
                runs.append(r)
    summary = summarize(runs)
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "workers": args.workers,
        "bytes": runs[0]["bytes"],
        "reps": args.reps,
        "rounds": args.rounds,
        "seconds": round(time.time() - t0),
        **machine(load_before),
    }
    out = write_results(
        args.out,
        "slot-cpus",
        {"meta": meta, "summary": summary, "runs": runs},
        markdown(summary, meta),
    )
    log(f"results in {out}/slot-cpus.{{json,md}} ({meta['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
