"""`python -m bench.training16`: DDP training with 16-bit gradients, several seeds, side by side.

Per model, one one-arm netns testbed of --workers namespaces with the XDP aggregator; for each
seed, each system launched by torchrun (one node per namespace), all running the unmodified
examples/train.py on float32 parameters and gradients:
- xdpagg-16: gloo as the process group, DDP's gradient buckets through the aggregator by
  xdp-agg's DDP hook at 16 bits (`--hook --hook-wire-bits 16`: float32 straight to the 16-bit
  wire, docs/protocol.md 5.6, and back to float32);
- xdpagg-32: the same hook at 32 bits (today's path);
- gloo-bf16: gloo with torch's own bf16_compress_hook (`--compress bf16`: the bucket cast to
  bfloat16, all-reduced by gloo's ring, copied back), what a PyTorch user compares against;
- gloo: gloo's float32 ring.

Models: digits (the MLP on scikit-learn's digits, real data: test accuracy) and recsys (the
embedding recommender: held-out accuracy). The question is whether 16 bits change training:
each system's final loss and accuracy against the spread of gloo float32 over the seeds (the
same seeds on every system: the same initial parameters and batches), and its time per step.

Writes --out (default bench/results/training16): results.json, results.md. Run as root.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench import md_table
from bench.training import ROOT, run_case

# (report key, --backend, serve options, train.py options): the systems of every seed
SYSTEMS = (
    ("xdpagg-16", "gloo", (), ("--hook", "--hook-wire-bits", "16")),
    ("xdpagg-32", "gloo", (), ("--hook", "--hook-wire-bits", "32")),
    ("gloo-bf16", "gloo", (), ("--compress", "bf16")),
    ("gloo", "gloo", (), ()),
)
MODELS = {
    "digits": ["--model", "digits", "--steps", "300"],
    "recsys": ["--model", "recsys", "--steps", "60", "--batch", "64", "--eval-every", "20"]
    + ["--warmup", "3", "--calib", "10"],
}


def seeded(seeds: list[int]) -> tuple[tuple, ...]:
    """Every system once per seed, keyed SYSTEM.sSEED (a torchrun run id)."""
    return tuple(
        (f"{key}.s{seed}", backend, serve, (*own, "--seed", str(seed)))
        for seed in seeds
        for key, backend, serve, own in SYSTEMS
    )


def summarize(reports: dict, seeds: list[int]) -> dict:
    """Per system: final loss and accuracy per seed, their mean and range, the median time per
    step over the seeds; and whether the mean is within gloo float32's range over the seeds
    (widened by the system's own half-range)."""
    out = {}
    for key, *_ in SYSTEMS:
        runs = [reports[f"{key}.s{seed}"] for seed in seeds]
        loss = [r["loss"][-1] for r in runs]
        acc = [r["final_accuracy"] for r in runs]
        out[key] = {
            "final_loss": loss,
            "final_accuracy": acc,
            "loss_mean": statistics.fmean(loss),
            "accuracy_mean": statistics.fmean(acc),
            "loss_range": [min(loss), max(loss)],
            "accuracy_range": [min(acc), max(acc)],
            "time_per_iter_s": statistics.median(r["time_per_iter_s"] for r in runs),
        }
    ref = out["gloo"]
    for s in out.values():
        s["within_gloo_spread"] = all(
            ref[f"{m}_range"][0] - _half(s[f"{m}_range"])
            <= s[f"{m}_mean"]
            <= ref[f"{m}_range"][1] + _half(s[f"{m}_range"])
            for m in ("loss", "accuracy")
        )
    return out


def _half(r: list[float]) -> float:
    return (r[1] - r[0]) / 2


def markdown(res: dict) -> str:
    """One table per model: per system, the final loss and accuracy per seed, their means, the
    time per step, and whether it trains as gloo float32 does."""
    meta = res["meta"]
    lines = [
        f"n = {meta['workers']} workers, seeds {', '.join(map(str, meta['seeds']))}, unshaped "
        "links, MTU 3500; examples/train.py on float32, every system on the same seeds (initial "
        "parameters and batches). 2 CPUs for every process and the kernel's forwarding.",
        "",
    ]
    for model in meta["models"]:
        summary = res[model]["summary"]
        lines += [f"{model}:", ""]
        lines += md_table(
            ["system", "final loss per seed", "mean", "accuracy per seed", "mean"]
            + ["ms per step", "within gloo fp32's spread"],
            [
                [key, _list(s["final_loss"]), f"{s['loss_mean']:.4f}"]
                + [_list(s["final_accuracy"]), f"{s['accuracy_mean']:.4f}"]
                + [f"{s['time_per_iter_s'] * 1e3:.1f}", "yes" if s["within_gloo_spread"] else "NO"]
                for key, s in summary.items()
            ],
        )
        lines.append("")
    return "\n".join(lines) + "\n"


def _list(xs: list[float]) -> str:
    return ", ".join(f"{x:.4f}" for x in xs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: digits, recsys")
    ap.add_argument("--window", type=int, default=64, help="xdp-agg slots per worker")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "training16"))
    args = ap.parse_args(argv)
    seeds = [int(x) for x in args.seeds.split(",")]
    models = args.models.split(",")
    if unknown := [m for m in models if m not in MODELS]:
        ap.error(f"unknown model(s): {', '.join(unknown)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"meta": {"workers": args.workers, "seeds": seeds, "models": models}}
    for model in models:
        print(f"{model}, n={args.workers}, seeds {seeds}:", flush=True)
        reports = run_case(
            f"t16-{model}",
            workers=args.workers,
            rate=None,
            mtu=3500,
            train_args=MODELS[model],
            env={"XDP_AGG_ELEMS": "768", "XDP_AGG_WINDOW": str(args.window)},
            out=out,
            log=lambda m: print(m, flush=True),
            systems=seeded(seeds),
        )
        res[model] = {"reports": reports, "summary": summarize(reports, seeds)}
    (out / "results.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (out / "results.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
