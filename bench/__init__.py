"""Benchmarks of xdp-agg against torch.distributed gloo on the same netns testbed."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path


def machine(load_before: list[float]) -> dict:
    """The meta fields every run records about the machine: its CPUs and its load average
    before (`load_before`, taken at the start) and now."""
    return {
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }


def run_line(meta: dict, what: str) -> str:
    """The first line of a results table: the run's time, `what` was run, and the machine's
    CPUs and load (machine())."""
    return (
        f"Run {meta['when']}: {meta['workers']} workers, float32 {meta['bytes'] >> 20} MiB, "
        f"{what}; {meta['cpus']} CPUs, load average {meta['load_before']} before, "
        f"{meta['load_after']} after."
    )


def table_head(meta: dict, what: str, columns: list[str]) -> list[str]:
    """The first lines of a results table in Markdown: run_line(meta, what), a blank line, the
    header row of `columns` and its separator row."""
    return [
        run_line(meta, what),
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]


def spread(times: list[float]) -> dict:
    """The median, shortest and longest of `times` (seconds), as a summary's fields."""
    t = sorted(times)
    return {"median_s": statistics.median(t), "min_s": t[0], "max_s": t[-1]}


def write_results(out: str | Path, name: str, doc: dict, md: str) -> Path:
    """`doc` as out/NAME.json and the table `md` as out/NAME.md (printed too); returns out."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    (out / f"{name}.md").write_text(md)
    print(md)
    return out
