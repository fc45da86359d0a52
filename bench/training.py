"""`python -m bench.training`: DDP training through xdp-agg and through gloo, in one run.

Two cases, each on its own one-arm netns testbed of --workers namespaces with the XDP aggregator,
each system launched by torchrun, one node per namespace (xdp_agg.cluster.torchrun), running the
unmodified examples/train.py with --backend xdpagg, then --backend gloo:
- digits: the MLP on scikit-learn's digits (real data shipped in the package), unshaped links,
  MTU 3500 and 768 int32 per packet, --digits-steps steps: loss per step, test accuracy, final
  accuracy, time per iteration and its communication share, for both systems.
- wide: the 25.2 M-parameter MLP on synthetic inputs at 1 Gbit/s (tbf on every worker link),
  MTU 3500 and 768 int32 per packet as in the all-reduce benchmark: time per iteration of both
  systems (SwitchML's training-speedup table is the analog).
- sharded: the digits MLP, --sharded-steps steps, unshaped links, as DDP, FSDP2 (fully_shard on
  a 1-D mesh) and HSDP (a replicate 2 x shard 2 mesh), each on both systems: time per
  iteration and communication share (under xdpagg, FSDP2's reduce-scatter and all-gather go
  to gloo and only HSDP's replicate all-reduce through the aggregator; docs/pytorch.md).
- recsys: the EmbeddingBag recommender (8.4 M parameters, its embedding gradient mostly zero
  blocks) at 1 Gbit/s, --recsys-steps steps, three systems: xdp-agg on a sparse job (`serve
  --sparse`: the backend's all-reduces choose sparse by themselves), xdp-agg on a dense job,
  and gloo: time per iteration, losses (sparse and dense xdp-agg sum byte for byte alike),
  held-out accuracy, sparse all-reduces and bytes sent.

Writes --out (default bench/results/training): results.json (both systems' reports), results.md
(the tables), digits.png (loss and accuracy per step), wide.png (time per iteration).
Run as root (namespaces, XDP).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

from bench import md_table, unwind_on_sigterm

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "examples" / "train.py")


# (report key, --backend, `xdp-agg serve` options[, train.py options of this system alone]):
# each system a case runs
SYSTEMS = (("xdpagg", "xdpagg", ()), ("gloo", "gloo", ()))
# the recommender's: xdp-agg on a sparse job (the backend's all-reduces "auto": sparse while
# the union block density stays low), on a dense job, and gloo
RECSYS_SYSTEMS = (("xdpagg-sparse", "xdpagg", ("--sparse",)), *SYSTEMS)


def run_case(
    name: str,
    *,
    workers: int,
    rate,
    mtu: int,
    train_args: list[str],
    env: dict,
    out: Path,
    log,
    variants: tuple[str, ...] = ("",),
    systems: tuple[tuple, ...] = SYSTEMS,
) -> dict:
    """One testbed, each of `systems` in turn (for each --parallel of `variants`, "" meaning
    the script's default), the aggregator served once per set of serve options; {system: rank
    0's report}, or {"PARALLEL-system": ...} per variant. A system's fourth member, where it
    has one, is train.py options of its own (a hook, a seed)."""
    from netns_testbed.testbed import Testbed
    from xdp_agg.cluster.cluster import Cluster

    reports = {"date": time.strftime("%Y-%m-%d %H:%M"), "load": [os.getloadavg()[0]]}
    with Testbed(workers=workers, topology="one-arm", rate=rate, mtu=mtu) as tb:
        for serve_args in dict.fromkeys(s for _, _, s, *_ in systems):
            with Cluster(tb, serve_args=serve_args) as cl:
                for variant in variants:
                    for key, backend, s, *own in systems:
                        if s != serve_args:
                            continue
                        key = f"{variant}-{key}" if variant else key
                        args = [*train_args, *(own[0] if own else ())]
                        run = _run_one(tb, cl, name, key, backend, variant, args, env, out)
                        reports[key] = run.pop("report")
                        log(f"  {run['line']}  ({run['seconds']:.0f} s with start-up)")
    reports["load"].append(os.getloadavg()[0])
    return reports


def _run_one(tb, cl, name, key, backend, variant, train_args, env, out: Path) -> dict:
    """examples/train.py on every worker through torchrun with `backend`; rank 0's report, its
    summary line and the seconds the run took."""
    from xdp_agg.cluster.torchrun import start_torchrun, wait_all

    path = out / f".{name}-{key}.json"
    t0 = time.monotonic()
    extra = ["--parallel", variant] if variant else []
    procs = start_torchrun(
        tb,
        cl,
        TRAIN,
        ["--backend", backend, *extra, *train_args, "--out", str(path)],
        env=env,
        run_id=f"{name}-{key}-{os.getpid()}",
    )
    results = wait_all(procs, 900)
    bad = [f"node {i} exited {rc}: {se[-2500:]}" for i, (rc, _, se) in enumerate(results) if rc]
    if bad:
        raise RuntimeError(f"{name} {key}: " + "\n".join(bad))
    report = json.loads(path.read_text())
    path.unlink()
    return {"report": report, "line": results[0][1].strip(), "seconds": time.monotonic() - t0}


def markdown(res: dict) -> str:
    meta = res["meta"]
    lines = [
        f"n = {meta['workers']} workers, one torchrun node per netns worker namespace, the "
        f"unmodified examples/train.py with --backend xdpagg or gloo; 2 CPUs for every "
        f"process and the kernel's forwarding.",
        "",
    ]
    for note in meta.get("notes", []):
        lines += [note, ""]
    d = res["digits"]
    lines += [
        f"## digits: MLP 64-256-256-10 ({d['xdpagg']['params']:,} parameters) on scikit-learn's "
        f"load_digits, unshaped links, MTU 3500, 768 int32 per packet, "
        f"{d['xdpagg']['steps']} steps of "
        f"{d['xdpagg']['batch_per_rank']} samples per rank, SGD lr {d['xdpagg']['lr']} "
        f"momentum 0.9",
        *_systems_table(
            d,
            ["final test accuracy", "final loss", "time per iteration", "compute"],
            lambda r: [
                f"{r['final_accuracy']:.4f}",
                f"{r['loss'][-1]:.4f}",
                f"{r['time_per_iter_s'] * 1e3:.1f} ms",
                f"{r['compute_per_iter_s'] * 1e3:.1f} ms",
            ],
        ),
    ]
    gap = (d["xdpagg"]["final_accuracy"] - d["gloo"]["final_accuracy"]) * 100
    dloss = max(abs(a - b) for a, b in zip(d["xdpagg"]["loss"], d["gloo"]["loss"]))
    lines += [
        "",
        f"Accuracy difference xdpagg - gloo: {gap:+.2f} points; the largest difference "
        f"of the two systems' mean training loss at any step: {dloss:.2g}.",
        "",
    ]
    w = res["wide"]
    ratio = w["gloo"]["time_per_iter_s"] / w["xdpagg"]["time_per_iter_s"]
    lines += [
        f"## wide: MLP 4096-4096-2048-10 ({w['xdpagg']['params'] / 1e6:.1f} M parameters, "
        f"{w['xdpagg']['params'] * 4 / 1e6:.0f} MB of float32 gradients per step) on synthetic "
        f"inputs, 1 Gbit/s worker links, MTU 3500, 768 int32 per packet, "
        f"{w['xdpagg']['steps']} steps (median after {meta['wide_warmup']} warm-up)",
        *_systems_table(
            w,
            ["time per iteration", "compute"],
            lambda r: [
                f"{r['time_per_iter_s'] * 1e3:.0f} ms",
                f"{r['compute_per_iter_s'] * 1e3:.0f} ms",
            ],
        ),
    ]
    lines += ["", f"gloo / xdpagg time per iteration: {ratio:.2f}x.", ""]
    eng = w["xdpagg"].get("xdpagg", {}).get("engine")
    if eng:
        lines += [
            f"xdp-agg on rank 0 over the whole run: {eng['packets_sent']:,} packets, "
            f"{eng['retransmissions']:,} retransmissions "
            f"({eng['retransmissions'] / max(1, eng['packets_sent']):.1%}), "
            f"{eng['timeouts']:,} retransmission timer expiries, smoothed RTT "
            f"{eng['rtt'] * 1e3:.1f} ms.",
            "",
        ]
    n = meta["workers"]
    grad_bits = w["xdpagg"]["params"] * 4 * 8
    lines += [
        f"Bounds at 1 Gbit/s: in-network aggregation sends and receives the gradients once "
        f"({grad_bits / 1e9:.2f} s), a ring all-reduce 2(n-1)/n times "
        f"({2 * (n - 1) / n * grad_bits / 1e9:.2f} s), a ratio of {2 * (n - 1) / n:.2f}.",
        "",
    ]
    if "sharded" in res:
        lines += sharded_markdown(res["sharded"], meta["workers"])
    if "recsys" in res:
        lines += recsys_markdown(res["recsys"], meta["workers"])
    return "\n".join(lines)


def _systems_table(case: dict, columns: list[str], cells) -> list[str]:
    """A case's run time and a table of both systems: `columns` and their `cells(result)`, then
    the communication share."""
    rows = [[s, *cells(case[s]), f"{case[s]['comm_share']:.0%}"] for s in ("xdpagg", "gloo")]
    return ["", _when(case), "", *md_table(["system", *columns, "communication share"], rows)]


SHARDED = ("ddp", "fsdp", "hsdp")


def sharded_markdown(case: dict, n: int) -> list[str]:
    """The sharded case's table: DDP, FSDP2 and HSDP, each on both systems."""
    r0 = case["ddp-xdpagg"]
    lines = [
        f"## sharded: DDP, FSDP2 and HSDP, MLP 64-256-256-10 ({r0['params']:,} parameters) on "
        f"load_digits, unshaped links, MTU 3500, {r0['steps']} steps of {r0['batch_per_rank']} "
        f"samples per rank",
        "",
        _when(case),
        "",
        f"FSDP2: fully_shard per Linear and the root on a 1-D mesh of {n}; HSDP: a (replicate "
        f"2, shard {n // 2}) mesh. Under xdpagg only all-reduces go through the aggregator: all "
        f"of DDP's gradients, HSDP's replicate-dimension all-reduce of the reduce-scattered "
        f"shards; FSDP2's reduce-scatter and all-gather are gloo's (docs/pytorch.md).",
        "",
        "| parallelism | system | time per iteration | compute | communication share | "
        "final loss | aggregator all-reduces (rank 0) |",
        "|---|---|---|---|---|---|---|",
    ]
    for par in SHARDED:
        for s in ("xdpagg", "gloo"):
            r = case.get(f"{par}-{s}")
            if r is None:
                continue
            x = r.get("xdpagg", {})
            agg = x.get("replicate", x).get("channel", {}).get("allreduces", "-") if x else "-"
            lines.append(
                f"| {par} | {s} | {r['time_per_iter_s'] * 1e3:.1f} ms | "
                f"{r['compute_per_iter_s'] * 1e3:.1f} ms | {r['comm_share']:.0%} | "
                f"{r['loss'][-1]:.4f} | {agg} |"
            )
    return [*lines, ""]


def recsys_markdown(case: dict, n: int) -> list[str]:
    """The recommender's table: xdp-agg sparse, xdp-agg dense and gloo; the losses compared."""
    keys = [k for k, _, _ in RECSYS_SYSTEMS if k in case]
    r0 = case[keys[0]]
    lines = [
        f"## recsys: EmbeddingBag recommender ({r0['params'] / 1e6:.1f} M parameters, "
        f"{r0['params'] * 4 / 1e6:.1f} MB of float32 gradients per step, the embedding's mostly "
        f"zero) on synthetic sessions, 1 Gbit/s worker links, MTU 3500, 768 int32 per packet, "
        f"{r0['steps']} steps of {r0['batch_per_rank']} sessions per rank",
        "",
        _when(case),
        "",
        "xdpagg-sparse: the job is sparse (`xdp-agg serve --sparse`) and the backend's "
        'all-reduces choose for themselves (sparse="auto": sparse while the union block '
        "density stays below hostlib.sparsity.AUTO_DENSITY); xdpagg: a dense job.",
        "",
        "| system | time per iteration | compute | communication share | final loss | "
        "final test accuracy | largest loss difference from xdpagg | sparse all-reduces "
        "(rank 0) | MB sent per step (rank 0) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ref = case.get("xdpagg", r0)["loss"]
    for k in keys:
        r = case[k]
        eng = r.get("xdpagg", {}).get("engine", {})
        diff = max(abs(a - b) for a, b in zip(r["loss"], ref))
        sent = f"{eng['bytes_sent'] / r['steps'] / 1e6:.2f}" if eng else "-"
        acc = f"{r['final_accuracy']:.4f}" if r.get("final_accuracy") is not None else "-"
        lines.append(
            f"| {k} | {r['time_per_iter_s'] * 1e3:.1f} ms | {r['compute_per_iter_s'] * 1e3:.1f} "
            f"ms | {r['comm_share']:.0%} | {r['loss'][-1]:.4f} | {acc} | {diff:.3g} | "
            f"{eng.get('sparse_allreduces', '-') if eng else '-'} of "
            f"{eng.get('allreduces', '-') if eng else '-'} | {sent} |"
        )
    t = {k: case[k]["time_per_iter_s"] for k in keys}
    if {"xdpagg-sparse", "xdpagg", "gloo"} <= set(t):
        lines += [
            "",
            f"Time per iteration: xdpagg / xdpagg-sparse {t['xdpagg'] / t['xdpagg-sparse']:.2f}x,"
            f" gloo / xdpagg-sparse {t['gloo'] / t['xdpagg-sparse']:.2f}x (n = {n}).",
        ]
    return [*lines, ""]


def _when(case: dict) -> str:
    load = case.get("load", [])
    text = f"Run {case.get('date', '?')}"
    if len(load) == 2:
        text += f", load average {load[0]:.2f} before, {load[1]:.2f} after"
    return text + "."


def plots(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = res["digits"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for s, style in (("xdpagg", "-"), ("gloo", "--")):
        r = d[s]
        a.plot(range(1, len(r["loss"]) + 1), r["loss"], style, label=s, alpha=0.8)
        steps, acc = zip(*r["accuracy"])
        b.plot(steps, acc, style, label=s)
    a.set(
        xlabel="step",
        ylabel="training loss (mean over ranks)",
        yscale="log",
        title=f"digits, n = {res['meta']['workers']}",
    )
    b.set(xlabel="step", ylabel="test accuracy", title="held-out 20% of load_digits")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "digits.png", dpi=110)
    plt.close(fig)

    w = res["wide"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for s, style in (("xdpagg", "o-"), ("gloo", "s--")):
        t = w[s]["step_time_s"]
        label = f"{s} (median {w[s]['time_per_iter_s']:.2f} s)"
        ax.plot(range(1, len(t) + 1), t, style, label=label)
    ax.set(
        xlabel="step",
        ylabel="time per iteration (s)",
        ylim=(0, None),
        title=f"{w['xdpagg']['params'] / 1e6:.1f} M parameters, 1 Gbit/s, "
        f"n = {res['meta']['workers']}",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "wide.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--digits-steps", type=int, default=300)
    ap.add_argument("--wide-steps", type=int, default=8)
    ap.add_argument("--wide-warmup", type=int, default=2)
    ap.add_argument("--sharded-steps", type=int, default=40)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "training"))
    ap.add_argument("--recsys-steps", type=int, default=40)
    ap.add_argument("--only", choices=["digits", "wide", "sharded", "recsys"], default=None)
    ap.add_argument("--window", type=int, default=256, help="xdp-agg slots per worker")
    ap.add_argument(
        "--replot",
        action="store_true",
        help="only rewrite results.md and the plots from --out's results.json",
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        res = json.loads((out / "results.json").read_text())
        (out / "results.md").write_text(markdown(res))
        plots(res, out)
        return 0

    def log(msg):
        print(msg, flush=True)

    res = {}
    if args.only and (out / "results.json").exists():  # one case again: keep the other's
        res = json.loads((out / "results.json").read_text())
    res["meta"] = {**res.get("meta", {}), "workers": args.workers, "wide_warmup": args.wide_warmup}
    # what every case shares: the workers, the MTU, where results and the log go
    case = functools.partial(run_case, workers=args.workers, mtu=3500, out=out, log=log)
    if args.only in (None, "digits"):
        log(f"digits, n={args.workers}, unshaped:")
        res["digits"] = case(
            "digits",
            rate=None,
            env={"XDP_AGG_ELEMS": "768", "XDP_AGG_WINDOW": str(args.window)},
            train_args=["--model", "digits", "--steps", str(args.digits_steps)],
        )
    if args.only in (None, "wide"):
        log(f"wide, n={args.workers}, 1 Gbit/s:")
        res["wide"] = case(
            "wide",
            rate="1gbit",
            env={
                "XDP_AGG_ELEMS": "768",
                "XDP_AGG_WINDOW": str(args.window),
                "XDP_AGG_TIMEOUT": "60",
            },
            train_args=[
                "--model",
                "wide",
                "--steps",
                str(args.wide_steps),
                "--batch",
                "16",
                "--warmup",
                str(args.wide_warmup),
                "--calib",
                "4",
            ],
        )
    if args.only in (None, "sharded"):
        log(f"sharded (DDP, FSDP2, HSDP), n={args.workers}, unshaped:")
        res["sharded"] = case(
            "sharded",
            rate=None,
            # HSDP holds 5 jobs on the aggregator (the world, 2 replicate and 2 shard groups):
            # at most 128 slots each fit the testbed's pool of 1024
            env={"XDP_AGG_ELEMS": "768", "XDP_AGG_WINDOW": str(min(args.window, 128))},
            train_args=["--model", "digits", "--steps", str(args.sharded_steps)],
            variants=SHARDED,
        )
    if args.only in (None, "recsys"):
        log(f"recsys (xdp-agg sparse, dense, gloo), n={args.workers}, 1 Gbit/s:")
        res["recsys"] = case(
            "recsys",
            rate="1gbit",
            env={"XDP_AGG_ELEMS": "768", "XDP_AGG_WINDOW": str(args.window)},
            train_args=["--model", "recsys", "--steps", str(args.recsys_steps), "--batch", "64"]
            + ["--warmup", "3", "--calib", "10", "--eval-every", "10"],
            systems=RECSYS_SYSTEMS,
        )
    (out / "results.json").write_text(json.dumps(res, indent=1))
    if "digits" in res and "wide" in res:
        (out / "results.md").write_text(markdown(res))
        if args.only not in ("sharded", "recsys"):  # their tables only: the plots are the others'
            plots(res, out)
        log((out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    unwind_on_sigterm()  # a killed run still takes its testbed down
    sys.exit(main())
