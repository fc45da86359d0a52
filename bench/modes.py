"""Two ways of running xdp-agg compared side by side in the testbed, alternately, with gloo in
the same runs (bench.slot_cpus: how slots meet CPUs; bench.unicast: how results leave).

Each run is one n-worker one-arm testbed (bench.allreduce's run_config: the workers' links
unshaped, MTU 3500, 768 int32 per packet) with the aggregator set up one way (`Compared.setup`
sets the attach or serve options), `--rounds` runs of each way, who goes first alternating too.
In each run the workers all-reduce a float32 tensor `--reps` times with xdp-agg and gloo
(bench.worker), rank 0 reading system-wide CPU time (/proc/stat) and the aggregator's BPF run
time around each, behind barriers (bench.cpustat): CPU seconds per all-reduce, not only wall
time, on a machine whose two CPUs other jobs share. gloo, in the same runs, shows how much the
machine's load moved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import allreduce, cpustat, machine, run_line, write_results

SYSTEMS = ("xdp-agg", "gloo")
KEYS = ("wall_s", "cpu_s", "bpf_s")


@dataclass
class Compared:
    """What a benchmark of this module compares: its `modes`, how a run is set up for a mode
    (`setup(args, mode)` on bench.allreduce's parsed options), and how its results are named."""

    name: str  # the results' file name (bench/results/NAME.{json,md})
    column: str  # the table's first column
    modes: tuple[str, str]
    setup: Callable[[argparse.Namespace, str], None]
    title: str  # what the table's first line says was run


def run_once(c: Compared, mode: str, n: int, args, log) -> dict:
    """One testbed run set up for `mode`: per system, the median wall time and system-wide CPU
    seconds per all-reduce and the aggregator's BPF seconds."""
    a = allreduce._parser().parse_args(
        ["--sizes", args.size, "--rows", "throughput", "--reps", str(args.reps), "--no-profile"]
    )
    a.sizes, a.rows, a.bpf_stats = [args.size], ["throughput"], True
    c.setup(a, mode)
    row = allreduce.run_config(n, "unshaped", a, log)[0]
    out = {"mode": mode, "n": n, "bytes": row["bytes"]}
    for system in SYSTEMS:
        spans = row.get("syscpu", {}).get(system, [])
        out[system] = {
            "wall_s": statistics.median(row[system]),
            "cpu_s": statistics.median(s["busy_s"] for s in spans) if spans else None,
            "bpf_s": statistics.median(s["aggregator_s"] for s in spans) if spans else None,
        }
    return out


def summarize(runs: list[dict], modes) -> dict:
    """Per mode and system: the median over runs and the spread (min, max) of wall and CPU."""
    out = {}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        for system in SYSTEMS:
            for key in KEYS:
                vals = [r[system][key] for r in mine if r[system][key] is not None]
                if vals:
                    out[f"{mode} {system} {key}"] = {
                        "median": statistics.median(vals),
                        "min": min(vals),
                        "max": max(vals),
                    }
    return out


def markdown(c: Compared, summary: dict, meta: dict) -> str:
    """The side-by-side table, and the ratio of the second mode to the first for xdp-agg."""
    lines = [
        run_line(meta, f"{c.title}, {meta['rounds']} runs each alternating"),
        "",
        f"| {c.column} | system | wall s per all-reduce | CPU s per all-reduce | "
        "aggregator BPF s |",
        "|---|---|---|---|---|",
    ]

    def fmt(key: str) -> str:
        v = summary.get(key)
        return f"{v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f})" if v else "-"

    for mode in c.modes:
        for system in SYSTEMS:
            k = f"{mode} {system}"
            lines.append(
                f"| {mode} | {system} | {fmt(k + ' wall_s')} | {fmt(k + ' cpu_s')} | "
                f"{fmt(k + ' bpf_s')} |"
            )
    lines.append("")
    lines.append("Medians over runs (each run's median over its all-reduces), min-max in brackets.")
    first, second = c.modes
    for key, what in (("wall_s", "wall time"), ("cpu_s", "CPU")):
        a, b = summary.get(f"{first} xdp-agg {key}"), summary.get(f"{second} xdp-agg {key}")
        if a and b and a["median"] > 0:
            lines.append(f"xdp-agg {what}, {second} / {first}: {b['median'] / a['median']:.3f}.")
    return "\n".join(lines) + "\n"


def main(c: Compared, doc: str, argv=None, workers: int = 4) -> int:
    """The command line of such a benchmark: run, summarize, write the results."""
    ap = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=workers)
    ap.add_argument("--size", default="64MiB", help=", ".join(allreduce.SIZES))
    ap.add_argument("--reps", type=int, default=5, help="all-reduces per run and system")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each mode, alternating")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    if args.size not in allreduce.SIZES:
        ap.error(f"--size {args.size}: one of {', '.join(allreduce.SIZES)}")
    log = lambda m: print(m, flush=True)  # noqa: E731
    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.time()
    runs = []
    with cpustat.BpfStats():
        for rnd in range(args.rounds):
            for mode in c.modes if rnd % 2 == 0 else c.modes[::-1]:
                r = run_once(c, mode, args.workers, args, log)
                log(f"round {rnd} {mode}: {r}")
                runs.append(r)
    summary = summarize(runs, c.modes)
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "workers": args.workers,
        "bytes": runs[0]["bytes"],
        "reps": args.reps,
        "rounds": args.rounds,
        "seconds": round(time.time() - t0),
        **machine(load_before),
    }
    doc_out = {"meta": meta, "summary": summary, "runs": runs}
    out = write_results(args.out, c.name, doc_out, markdown(c, summary, meta))
    log(f"results in {out}/{c.name}.{{json,md}} ({meta['seconds']} s)")
    return 0
