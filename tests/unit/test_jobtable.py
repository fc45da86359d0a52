"""The control endpoint's job table across a restart (xdp_agg.ctl.jobtable, hostlib.control_link),
on loopback with the software aggregator: no root needed.

The endpoint is stopped with keep_jobs (the jobs stay in the aggregator, whose data plane runs
on), a new one on the same address restores the saved table, the ranks' control links
reconnect and rejoin by themselves, all-reduces go on exactly, and leaving frees the job.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
from harness.ranks import Cluster, loopback_prefix, ok, run_ranks

from xdp_agg.ctl import jobtable
from xdp_agg.ctl.endpoint import stand_up
from xdp_agg.proto import control
from xdp_agg.targets.soft import SoftAggregator


def _secret(tmp_path) -> tuple[bytes, str]:
    """A deployment secret (auth on, as `xdp-agg serve` runs): rejoin must carry the token."""
    file = str(tmp_path / "secret")
    control.create_secret(file)
    return control.load_secret(file), file


def _server(agg, host, port, path, secret, *, generation="g1", grace=30.0):
    """The endpoint as `xdp-agg serve` stands it up: the table at `path` restored, then saved on
    every change; (the started server, the keys it recovered)."""
    s, restored = stand_up(
        agg,
        host,
        port,
        {"agg_ip": host, "barrier_timeout": 20.0},
        secret=secret,
        table=path,
        generation=generation,
        grace=grace,
    )
    return s.start(), restored


def _wait(cond, limit: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit, f"{what} not within {limit} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def _connected(server, key):
    with server.registry.cond:
        job = server.registry.jobs.get(key)
        return [] if job is None else server._summary(job, ("0", 0))["connected"]


def test_restart_recovers_the_job_and_the_ranks_rejoin(tmp_path):
    secret, secret_file = _secret(tmp_path)
    prefix = loopback_prefix()
    path = tmp_path / "agg.jobs"
    with SoftAggregator(f"{prefix}.1") as agg:
        first, _ = _server(agg, f"{prefix}.1", 0, path, secret)
        host, port = first.address
        cl = Cluster(prefix, [first], [agg], secret, secret_file)
        restarted = threading.Event()
        reached = threading.Barrier(3)
        both = threading.Barrier(2)

        def body(c):
            a = np.arange(1000, dtype=np.int32) * (c.rank + 1)
            before = c.allreduce(a)
            reached.wait(20)  # the endpoint restarts now
            assert restarted.wait(20)
            _wait(lambda: c._ctl.reconnects == 1, 10, f"rank {c.rank} rejoining")
            after = c.allreduce(a)
            connected = c.status()["connected"]
            both.wait(20)  # neither leaves before the other has looked
            return before, after, connected

        box = {}

        def restart():
            reached.wait(20)
            saved = jobtable.load(path)
            assert [j["key"] for j in saved["jobs"]] == ["test"]
            assert saved["jobs"][0]["token"] == first.registry.jobs["test"].token  # rejoin needs it
            first.stop()
            assert [j["job_id"] for j in agg.jobs()] == [0]  # the job outlives its endpoint
            box["server"], box["restored"] = _server(agg, host, port, path, secret)
            restarted.set()

        t = threading.Thread(target=restart)
        t.start()
        results = ok(run_ranks(cl, 2, body, elems=64, window=8))
        t.join(30)
        second = box["server"]
        try:
            assert box["restored"] == ["test"]
            want = np.arange(1000, dtype=np.int32) * 3
            for before, after, connected in results:
                assert np.array_equal(before, want) and np.array_equal(after, want)
                assert connected == [0, 1]
            # the ranks left (close): the job is freed in the aggregator and in the table
            _wait(lambda: agg.jobs() == [], 5, "the job being freed")
            assert json.loads(path.read_text())["jobs"] == []
        finally:
            second.stop()


def test_a_rank_that_never_rejoins_frees_the_job(tmp_path):
    secret, secret_file = _secret(tmp_path)
    """A worker that died while the endpoint was down: after the grace period the recovered
    job is freed."""
    prefix = loopback_prefix()
    path = tmp_path / "agg.jobs"
    with SoftAggregator(f"{prefix}.1") as agg:
        first, _ = _server(agg, f"{prefix}.1", 0, path, secret)
        cl = Cluster(prefix, [first], [agg], secret, secret_file)
        gate = threading.Event()

        def body(c):
            c.allreduce(np.ones(10, np.int32))
            first.stop()  # both connections close with it; keep_jobs: the job stays
            gate.wait(20)
            c._ctl._closed.set()  # as if this worker died: its link never rejoins

        t = threading.Thread(target=lambda: ok(run_ranks(cl, 2, body, elems=64, window=4)))
        t.start()
        _wait(lambda: first.registry.stopping, 20, "the first endpoint stopping")
        gate.set()
        t.join(30)
        assert [j["job_id"] for j in agg.jobs()] == [0]
        t0 = time.monotonic()
        second, restored = _server(agg, *first.address, path, secret, grace=0.5)
        try:
            assert restored == ["test"]
            _wait(lambda: agg.jobs() == [], 5, "the expired job being freed")
            took = time.monotonic() - t0
            assert 0.4 <= took <= 3.0, took  # the grace (0.5 s), not sooner, not much later
            # the table is saved right after the backend's delete
            _wait(lambda: json.loads(path.read_text())["jobs"] == [], 2, "the table saved")
        finally:
            second.stop()


def test_a_table_of_another_attachment_is_not_restored(tmp_path):
    secret, secret_file = _secret(tmp_path)
    """The aggregator was attached again (another generation): its jobs are gone, none is
    restored, and the stale table is replaced."""
    prefix = loopback_prefix()
    path = tmp_path / "agg.jobs"
    with SoftAggregator(f"{prefix}.1") as agg:
        s, _ = _server(agg, f"{prefix}.1", 0, path, secret, generation="g1")
        cl = Cluster(prefix, [s], [agg], secret, secret_file)
        ok(run_ranks(cl, 1, lambda c: (c.allreduce(np.ones(4, np.int32)), s.stop()), window=4))
        saved = jobtable.load(path)
        assert len(saved["jobs"]) == 1
        s2, restored = _server(agg, *s.address, path, secret, generation="g2")
        try:
            assert restored == []
        finally:
            s2.stop()


def test_save_replaces_the_file_whole(tmp_path):
    path = tmp_path / "t.jobs"
    jobtable.save(path, {"format": 1, "generation": 7, "jobs": []})
    jobtable.save(path, {"format": 1, "generation": 8, "jobs": []})
    assert jobtable.load(path)["generation"] == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jobs"]  # no temporary file left
    assert path.stat().st_mode & 0o777 == 0o600  # it holds the jobs' tokens
    path.write_text("{half")
    assert jobtable.load(path) is None  # unreadable: nothing restored, logged
