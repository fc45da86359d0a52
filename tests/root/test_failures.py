"""Failures end in a defined state within a bound, in the testbed.

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
import sys
import threading
import time

import pytest

from xdp_agg.app.options import attach_args
from xdp_agg.cluster.cluster import Cluster

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.slow]

TIMEOUT = 3.0  # the workers' all-reduce stall timeout in these tests
SLACK = 6.0  # what the diagnosis, the process exit and a loaded 2-core machine may add

# a first small all-reduce (its report line tells the test the job is running), then
# all-reduces until the failure the test makes ends them: `until` names a file nobody creates,
# so a fast machine cannot finish the job before the test is done with it
NEVER = "/nonexistent/xdp-agg-tests/never-created"
LONG_PLAN = [
    {"dtype": "int32", "count": 1000, "seed": 1},
    {"dtype": "int32", "count": 1_000_000, "reps": 20, "seed": 2, "verify": False, "until": NEVER},
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


def _control(cl, host: int, op: str, **fields) -> dict:
    """One request to the control endpoint from worker `host`'s namespace, proving the
    cluster's deployment secret."""
    code = (
        "import json, sys; from hostlib.rendezvous import ControlClient, load_secret; "
        "from hostlib.options import HostOptions; "
        "c = ControlClient((sys.argv[1], 48800), timeout=5, "
        "secret=load_secret(HostOptions.from_env().secret_file)); "
        "print(json.dumps(c.request(sys.argv[2], **json.loads(sys.argv[3]))))"
    )
    w = cl.tb.workers[host]
    argv = [sys.executable, "-c", code, w.agg_ip, op, json.dumps(fields)]
    r = cl.tb.run(w, argv, timeout=30, env=cl.worker_env())
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _wait_connected(cl, job: str, ranks: list[int], limit: float) -> float:
    """Seconds until every rank of `job` holds it through a live connection again."""
    t0 = time.monotonic()
    while True:
        st = _control(cl, 0, "status", job=job)
        if st["connected"] == ranks:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < limit, f"{job}: connected {st['connected']} after {limit} s"
        time.sleep(0.2)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill"])
def test_serve_restarted_while_jobs_run(testbed_factory, tmp_path, sig):
    """Job A keeps all-reducing through a restart of serve and ends exactly, leaving normally;
    job C's rank 1 is killed after the restart and C is freed all the same; job B registers
    with the restarted endpoint and runs exactly."""
    tb = testbed_factory(workers=4, topology="one-arm")
    a_done = tmp_path / "a-done"  # A all-reduces until the test has seen its ranks rejoin
    long_exact = [
        {"dtype": "int32", "count": 1000, "seed": 1},
        {"dtype": "int32", "count": 1_000_000, "reps": 20, "seed": 2, "until": str(a_done)},
    ]
    with Cluster(tb) as cl:
        a = cl.start_workers(long_exact, hosts=[0, 1], job="A", timeout=TIMEOUT)
        c = cl.start_workers(LONG_PLAN, hosts=[2, 3], job="C", timeout=TIMEOUT)
        for rank, p in a + c:
            _wait_line(p, f"rank {rank}")
        before = {j["job_id"] for j in _status(cl)["jobs"]}
        assert len(before) == 2
        err = cl.stop_server(sig)
        assert a[0][1].poll() is None and c[0][1].poll() is None  # the jobs go on without it
        time.sleep(1.0)  # all-reduces run with no control endpoint at all
        cl.start_server()
        assert {j["job_id"] for j in _status(cl)["jobs"]} == before
        took = {job: _wait_connected(cl, job, [0, 1], limit=15) for job in ("A", "C")}
        print(f"after the restart the ranks rejoined within {took} s; old serve said {err!r}")

        _kill(c[1][1])  # a crash after the restart still frees job C
        killed_at = time.monotonic()
        ((_, rc, _, err_c, when),) = _finish(c[:1], deadline=TIMEOUT + SLACK + 30)
        assert rc != 0 and when - killed_at <= TIMEOUT + SLACK, (when - killed_at, err_c[-1500:])
        assert "rank 1's control connection closed" in err_c, err_c[-2000:]

        b = cl.run_workers([{"dtype": "int32", "count": 100_000, "seed": 5}], hosts=[2, 3], job="B")
        assert all(r["ok"] for reps in b for r in reps), b

        assert a[0][1].poll() is None, "job A ended before the test let it"
        a_done.touch()
        ra = cl.collect(a, deadline=120)  # finished exactly, and left (leave after restart)
        assert all(r["ok"] for reps in ra for r in reps), ra
        deadline = time.monotonic() + 10
        while _status(cl)["jobs"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _status(cl)["jobs"] == [], "a job was not freed after the restart"


def test_aggregator_state_lost_mid_allreduce(testbed_factory):
    """`detach` refuses while job L runs; `detach --force` and `attach` again under the same
    name lose L's state: L's workers fail within their timeout with an error saying so, while a
    new job M made on the fresh aggregator, with L's workers still sending, is exact."""
    tb = testbed_factory(workers=4, topology="one-arm")
    with Cluster(tb) as cl:
        lost = cl.start_workers(LONG_PLAN, hosts=[0, 1], job="L", timeout=TIMEOUT)
        for rank, p in lost:
            _wait_line(p, f"rank {rank}")
        r = cl.tb.run("agg", [sys.executable, "-m", "xdp_agg.app.cli", "--name", cl.name, "detach"])
        assert r.returncode == 1, r.stderr
        assert "1 live job(s): job 0 'L' (2/2 workers)" in r.stderr and "--force" in r.stderr
        t0 = time.monotonic()
        cl.cli("detach", "--force")
        ended = []  # L's ranks are waited for while the aggregator is attached again and M runs
        waiter = threading.Thread(
            target=lambda: ended.extend(_finish(lost, deadline=TIMEOUT + SLACK + 60))
        )
        waiter.start()
        cl.cli("attach", *tb.agg_interfaces, *attach_args(cl.attach))
        m = cl.run_workers([{"dtype": "int32", "count": 200_000, "seed": 7}], hosts=[2, 3], job="M")
        assert all(x["ok"] for reps in m for x in reps), m
        waiter.join()
        assert len(ended) == 2
        for rank, rc, _, err, when in ended:
            took = when - t0
            print(
                f"job L rank {rank} failed {took:.2f} s after detach --force: "
                f"{err.splitlines()[-1]}"
            )
            assert rc != 0 and "AllreduceTimeout" in err, err[-2000:]
            assert "the aggregator lost this job" in err, err[-2000:]
            assert took <= TIMEOUT + SLACK, took


def _xdp_agg(tb, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    return tb.run("agg", [sys.executable, "-m", "xdp_agg.app.cli", *args], timeout=timeout)


def test_attach_twice_detach_with_jobs_two_serves(testbed_factory):
    tb = testbed_factory(workers=2, topology="switch")
    p0, p1 = tb.agg_interfaces[:2]
    with Cluster(tb) as cl:  # attached to both ports, serving
        # attach twice: the same name, on the same or another interface, is refused and the
        # message names the attachment there is; another name on a taken interface too
        for ifaces in ([p0, p1], [p1]):
            r = _xdp_agg(tb, "--name", cl.name, "attach", *ifaces)
            assert r.returncode == 1, r.stderr
            assert f"{cl.name!r} is already attached (to {p0}, {p1} (switch" in r.stderr
        r = _xdp_agg(tb, "--name", cl.name + "x", "attach", p0)
        assert r.returncode == 1 and f"already attached to {p0}" in r.stderr, r.stderr

        # a second serve of the same aggregator: exit 4 at once, naming the first one's pid
        t0 = time.monotonic()
        r = _xdp_agg(tb, "--name", cl.name, "serve", "--listen", "0.0.0.0:48801", timeout=60)
        assert r.returncode == 4, (r.returncode, r.stderr)
        assert f"pid {cl._server.pid}" in r.stderr and "already served" in r.stderr
        assert time.monotonic() - t0 < 30
        # a crashed serve's lock does not block the next one (the kernel drops the flock)
        cl.stop_server(signal.SIGKILL)
        cl.start_server()

        # detach with a live job: refused, listing it; --force detaches
        cl.cli("job", "create", "5", "--workers", "2", "--slots", "512:16")
        r = _xdp_agg(tb, "--name", cl.name, "detach")
        assert r.returncode == 1 and "1 live job(s): job 5 (0/2 workers)" in r.stderr, r.stderr
        assert _status(cl)["jobs"][0]["job_id"] == 5
        cl.stop_server()
        r = _xdp_agg(tb, "--name", cl.name, "detach", "--force", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["detached"] == [p0, p1]
        cl._attached[0] = False
