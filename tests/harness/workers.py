"""What the testbed tests give xdp_agg.cluster's worker processes: a plan of mixed all-reduces, and
the check of their reports, and bench.soak_worker's processes for tests that all-reduce while
something else happens."""

import subprocess
import sys
import tempfile
import time

ODD = 10 * 256 + 3  # not a multiple of the packet size

# every dtype, a one-element tensor, an odd length (a partial last packet), and larger ones
MIXED_PLAN = [
    {"dtype": "int32", "count": 1},
    {"dtype": "int32", "count": ODD},
    {"dtype": "int32", "count": 200_000, "seed": 3},
    {"dtype": "float32", "count": 100_000, "seed": 4},
    {"dtype": "float16", "count": ODD, "seed": 5},
]


def assert_reports_ok(reports) -> None:
    """Every result every rank checked was right (xdp_agg.cluster.cluster_worker's reports)."""
    for rank, reps in enumerate(reports):
        for r in reps:
            if "ok" in r:
                assert r["ok"], f"rank {rank}: wrong result for {r['dtype']} x {r['count']}: {r}"


def start_soak_workers(tb, cl, *, world: int, job: str, stop, args: tuple[str, ...] = ()):
    """bench.soak_worker on the testbed's first `world` workers, all-reducing until the file
    `stop` exists (or ten minutes pass), with `args` added (e.g. --max-bytes). Each process's
    report lines are read as they come (bench.soak.run.Rank, a thread each) and its stderr goes
    to a file: a pipe read only at the end fills after some 64 KiB of reports, and its worker
    then blocks in print while the other ranks wait for its next contribution."""
    from bench.soak.run import Rank

    ranks = []
    for rank in range(world):
        cmd = [sys.executable, "-m", "bench.soak_worker", "--rank", str(rank), "--world",
               str(world), "--control", cl.control_address(tb.workers[rank]), "--job", job,
               "--stop-at", str(time.time() + 600), "--stop-file", str(stop), *args]  # fmt: skip
        err = tempfile.TemporaryFile()
        p = tb.popen(
            tb.workers[rank], cmd, env=cl.worker_env(), stdout=subprocess.PIPE, stderr=err,
            text=True,
        )  # fmt: skip
        ranks.append(Rank(job, rank, p, err))
    return ranks


def finish_soak_workers(ranks, deadline: float = 300.0) -> list[list[dict]]:
    """Wait for start_soak_workers' processes: per rank, its reports with its final "done"
    line last (as xdp_agg.cluster's Cluster.collect gives them); AssertionError with the stderr of
    every worker that failed or outlived the deadline."""
    end = time.monotonic() + deadline
    errors = []
    for rk in ranks:
        try:
            rk.proc.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            rk.proc.kill()
            rk.proc.wait()
            errors.append(f"rank {rk.rank}: not done within {deadline:g} s: {rk.stderr_tail()}")
            continue
        rk.thread.join(timeout=60)
        if rk.proc.returncode != 0:
            errors.append(f"rank {rk.rank} exited {rk.proc.returncode}: {rk.stderr_tail()}")
    assert not errors, "; ".join(errors)
    return [rk.reports + ([rk.done] if rk.done else []) for rk in ranks]
