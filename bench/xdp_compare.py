"""The XDP program per packet, this work tree's against another revision's, side by side.

`xdp-agg bench` measures one build. Comparing two builds in separate runs on a loaded machine
mostly measures the load, so this loads both (the revision's bpf/ extracted with `git archive`
into a temporary directory) and measures them in the same run, on the same frames, alternating
which goes first in each pass: for each packet size and variant, `--passes` passes of the
microbench's stream (n workers over 64 slots, `--rounds` rounds; xdp_switch/microbench.py) per
build, on one core. Reported per build: the median ns per packet, its min and max over the
passes, elements per second per core at the median, and the new/old ratio of the medians.

Run as root: `.venv/bin/python -m bench.xdp_compare --against main [--json out.json]`.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from xdp_switch import loader
from xdp_switch import microbench as mb

ROOT = Path(__file__).resolve().parent.parent
LEGACY_FLAG = "-DAGG_LIBBPF"


def extract_bpf(rev: str, into: Path) -> Path:
    """bpf/ of git revision `rev` under `into`; returns the path of its xdp_agg.c."""
    tar = subprocess.run(
        ["git", "archive", rev, "bpf"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        for m in t.getmembers():  # our own repository's files; no links, nothing outside bpf/
            if (
                not (m.isfile() or m.isdir())
                or not (m.name + "/").startswith("bpf/")
                or ".." in m.name
            ):
                raise ValueError(f"unexpected member in git archive of {rev}: {m.name}")
        t.extractall(into)
    return into / "bpf" / "xdp_agg.c"


def summary(ns: list[float], elems: int) -> dict:
    med = statistics.median(ns)
    return {
        "ns_per_packet": round(med, 1),
        "min_ns": round(min(ns), 1),
        "max_ns": round(max(ns), 1),
        "elems_per_sec_per_core": elems / med * 1e9,
        "passes": [round(x, 1) for x in ns],
    }


def compare(
    sources: dict[str, Path],
    sizes=mb.BENCH_SIZES,
    variants=tuple(loader.VARIANTS),
    workers: int = 4,
    slots: int = 64,
    rounds: int = 20,
    passes: int = 7,
    cpu: int | None = 0,
    progress=None,
) -> list[dict]:
    """Rows of (variant, elems, and per build label the summary of its passes)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    labels = list(sources)
    progs = {
        # another revision's xdp_agg.c compiled here by clang; -DAGG_LIBBPF picks clang's side
        # of the revisions that still built with bcc too (ignored since)
        (lab, v): loader.load(
            pool_slots=max(slots, 64),
            variant=v,
            source=src,
            cflags=(LEGACY_FLAG,) if src != loader.SOURCE else (),
        )
        for lab, src in sources.items()
        for v in variants
    }
    rows = []
    try:
        for k, _, runs in mb.alternating_per_size(
            sizes,
            progs,
            passes,
            lambda key, k, frames: mb.measure_pass(progs[key], k, workers, slots, rounds, frames),
            workers,
            slots,
            rounds,
            progress,
        ):
            for v in variants:
                row = {"variant": v, "elems_per_packet": k}
                for lab in labels:
                    row[lab] = summary(runs[(lab, v)], k)
                rows.append(row)
    finally:
        for prog in progs.values():
            prog.close()
    return rows


def table(rows: list[dict], old: str, new: str) -> str:
    def cell(s):
        return f"{s['ns_per_packet']:6.0f} ({s['min_ns']:4.0f}-{s['max_ns']:4.0f})"

    lines = [
        f"{'':9s}{'':6s}  {old[:22]:>22s}  {new[:22]:>22s}",
        f"{'variant':9s}{'elems':>6s}  {'ns/pkt (min-max)':>22s}  {'ns/pkt (min-max)':>22s}"
        f"  new/old  elems/s/core old -> new",
    ]
    for r in rows:
        a, b = r[old], r[new]
        lines.append(
            f"{r['variant']:9s}{r['elems_per_packet']:6d}  {cell(a):>22s}  {cell(b):>22s}"
            f"  {b['ns_per_packet'] / a['ns_per_packet']:7.3f}"
            f"  {a['elems_per_sec_per_core']:.3g} -> {b['elems_per_sec_per_core']:.3g}"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default="main", help="git revision to compare with (main)")
    ap.add_argument("--sizes", default=",".join(map(str, mb.BENCH_SIZES)))
    ap.add_argument("--variants", default=",".join(loader.VARIANTS))
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--json", help="also write the rows (every pass's figure) to this file")
    a = ap.parse_args(argv)
    new = "work tree"
    with tempfile.TemporaryDirectory() as tmp:
        sources = {a.against: extract_bpf(a.against, Path(tmp)), new: loader.SOURCE}
        rows = compare(
            sources,
            sizes=[int(x) for x in a.sizes.split(",")],
            variants=a.variants.split(","),
            workers=a.workers,
            rounds=a.rounds,
            passes=a.passes,
            progress=lambda k, i, n: print(f"  {k} elems: pass {i}/{n}", file=sys.stderr),
        )
    print(table(rows, a.against, new))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
