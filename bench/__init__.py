"""Benchmarks of xdp-agg against torch.distributed gloo on the same netns testbed."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
from pathlib import Path


def unwind_on_sigterm() -> None:
    """Make SIGTERM end this benchmark as Ctrl-C does, by an exception (SystemExit 143), so
    that its `with` blocks take down what they made: the testbed's namespaces, the attached
    program, the workers. SIGTERM's default ends the process at once and leaves them behind
    (`netns-testbed down --prefix` and `xdp-agg detach --force` by hand). In this process
    only: a child forked from it (pyroute2's namespace helpers, which are ended by SIGTERM)
    inherits the handler and takes the default, or it would not end and its parent would wait
    for it; and a second SIGTERM does not cut the unwinding short."""
    unwinding = False

    def _exit(signum, frame):
        nonlocal unwinding
        if not unwinding:
            unwinding = True
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
    os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))


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


def alternating_parser(
    doc: str, *, per: str, workers: int, nbytes: int, rounds: int, window: int
) -> argparse.ArgumentParser:
    """The command line of a benchmark of alternating rounds (alternating()): the options both
    such benchmarks take, with their defaults; `per` names what is compared (path, k)."""
    ap = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=workers)
    ap.add_argument("--bytes", type=int, default=nbytes, help="tensor size (float32)")
    ap.add_argument("--reps", type=int, default=3, help="timed all-reduces per run")
    ap.add_argument("--rounds", type=int, default=rounds, help=f"runs of each {per}, alternating")
    packet_options(ap, window=window)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    return ap


def packet_options(ap: argparse.ArgumentParser, *, window: int) -> None:
    """--elems, --mtu and --window of a benchmark on the testbed: its packets (768 int32 in
    frames of MTU 3500 by default) and the hosts' slots per worker (default `window`)."""
    ap.add_argument(
        "--elems",
        type=int,
        default=768,
        help="int32 per packet (768 needs --mtu >= 3110, 2048 --mtu >= 8230; above MTU 3506 the "
        "aggregator is attached as a multi-buffer (frags) program)",
    )
    ap.add_argument("--mtu", type=int, default=3500)
    ap.add_argument("--window", type=int, default=window, help="slots per worker")


def lanes_list(text: str) -> list[int]:
    """--lanes: "1,2" -> [1, 2]."""
    try:
        lanes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, not {text!r}") from None
    if any(k < 1 for k in lanes):
        raise argparse.ArgumentTypeError("every value is at least 1")
    return lanes


def lanes_option(ap: argparse.ArgumentParser, what: str) -> None:
    """--lanes L[,L...] (lanes_list; default [1]), whose help says `what` they are."""
    ap.add_argument("--lanes", type=lanes_list, default=[1], help=f"comma-separated: {what}")


def alternating(meta: dict, per: str) -> str:
    """The setting of a run of alternating rounds, for run_line: MTU, packet size, window, and
    the rounds of all-reduces per `per` (each variant compared)."""
    return (
        f"MTU {meta['mtu']}, {meta['elems']} int32 per packet, window {meta['window']}; "
        f"{meta['rounds']} rounds of {meta['reps']} all-reduces per {per}, alternating"
    )


def table_head(meta: dict, what: str, columns: list[str]) -> list[str]:
    """The first lines of a results table in Markdown: run_line(meta, what), a blank line, the
    header row of `columns` and its separator row."""
    return [run_line(meta, what), "", *md_table(columns)]


def md_table(columns: list[str], rows=()) -> list[str]:
    """A table in Markdown: the header row of `columns`, its separator row, then a line per row
    of `rows` (its cells, one per column; str() of each)."""
    return [_md_row(columns), "|" + "---|" * len(columns), *(_md_row(r) for r in rows)]


def _md_row(cells) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


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
