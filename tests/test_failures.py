"""Failures end in a defined state within a bound (issue 12, item 1), in the testbed.

- a worker killed mid-all-reduce: the others raise, within their timeout (+ slack), an error
  naming the lost rank; the job's id, slots and port are freed; a new job of the same name and
  size starts right after and is exact;
- the aggregator's state lost mid-all-reduce (`detach --force`, then `attach` under the same
  name): the workers raise a clear error within their timeout (+ slack), never a wrong sum or a
  hang;
- `xdp-agg serve` restarted while a job runs: its all-reduces keep running, the restarted
  endpoint recovers the job table (pinned maps + its state file), leave and new registrations
  work, and a later crash of a worker still frees the job;
- `attach` twice, `detach` with live jobs, two `serve` on one aggregator: each refused with a
  clear message and a documented exit code.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from aggcluster.cluster import Cluster

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.slow]

TIMEOUT = 3.0  # the workers' all-reduce stall timeout in these tests
SLACK = 6.0  # what the diagnosis, the process exit and a loaded 2-core machine may add

# a first small all-reduce (its report line tells the test the job is running), then a long one
LONG_PLAN = [
    {"dtype": "int32", "count": 1000, "seed": 1},
    {"dtype": "int32", "count": 1_000_000, "reps": 40, "seed": 2, "verify": False},
]


def _wait_line(proc, what: str, limit: float = 60.0) -> str:
    """The next stdout line of a worker process (its first report: the job is running)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if line.startswith("{"):
            return line
        if not line and proc.poll() is not None:
            raise AssertionError(f"{what} ended ({proc.returncode}): {proc.stderr.read()}")
    raise AssertionError(f"{what}: no report within {limit} s")


def _kill(proc) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # popen starts each in its own session
    proc.wait(timeout=10)


def _finish(procs, deadline: float) -> list[tuple[int, int, str, str, float]]:
    """Wait for each (rank, proc): (rank, returncode, stdout, stderr, when it ended)."""
    out = []
    end = time.monotonic() + deadline
    for rank, p in procs:
        try:
            so, se = p.communicate(timeout=max(0.5, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill(p)
            raise AssertionError(f"rank {rank} still running after {deadline} s: a hang") from None
        out.append((rank, p.returncode, so, se, time.monotonic()))
    return out


def _status(cl) -> dict:
    return json.loads(cl.cli("status", "--json").stdout)


def test_worker_killed_mid_allreduce(testbed_factory):
    tb = testbed_factory(workers=4, topology="one-arm")
    with Cluster(tb) as cl:
        procs = cl.start_workers(LONG_PLAN, job="killed", timeout=TIMEOUT)
        for rank, p in procs:
            _wait_line(p, f"rank {rank}")
        time.sleep(0.5)  # into the long all-reduces
        _kill(procs[2][1])
        killed_at = time.monotonic()
        ended = _finish([rp for rp in procs if rp[0] != 2], deadline=TIMEOUT + SLACK + 30)
        for rank, rc, _, err, when in ended:
            assert rc != 0, f"rank {rank} finished although rank 2 was killed"
            took = when - killed_at
            print(
                f"rank {rank} failed {took:.2f} s after rank 2 was killed: {err.splitlines()[-1]}"
            )
            assert took <= TIMEOUT + SLACK, f"rank {rank} took {took:.1f} s to fail"
            assert "AllreduceTimeout" in err, err[-2000:]
            assert "rank 2's control connection closed" in err, err[-2000:]
            assert "behind by" in err, err[-2000:]
        # once the survivors closed, the job is gone from the aggregator: id, slots, port free
        deadline = time.monotonic() + 10
        while _status(cl)["jobs"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _status(cl)["jobs"] == []
        # and a new job of the same name and size runs at once, exactly
        t0 = time.monotonic()
        reports = cl.run_workers([{"dtype": "int32", "count": 100_000}], job="killed", deadline=60)
        assert time.monotonic() - t0 < 60
        assert all(r["ok"] for reps in reports for r in reps), reports
