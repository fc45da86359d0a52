"""Job leases (xdp_agg.ctl.lease) on loopback with the soft aggregator (no root).

A job whose members all went quiet (no request on their control connections, no traffic the
aggregator counts) for the lease is deleted, its slots, port and id freed; a request of a
member, the aggregator's count of new contributions, hostlib's control-link pings and a job
still in its register barrier each keep it. The torchrun restart in the testbed is in
tests/root/test_torch_fsdp.py.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from harness.ranks import ok, run_ranks, soft_cluster

import hostlib.control_link
from hostlib.errors import RendezvousError
from hostlib.rendezvous import ControlClient
from xdp_agg.ctl.auth import Limits

pytestmark = pytest.mark.timeout(60)

JOB = dict(world_size=1, elems=64, window=4, worker_port=40000)


def _holder(cl, job: str) -> ControlClient:
    """A rank 0 that created and registered `job` (world size 1) and then says nothing."""
    c = ControlClient(cl.server.address, timeout=5, secret=cl.secret)
    c.request("create", job=job, **JOB)
    c.request("register", job=job, rank=0, port=40000, ip=cl.worker_ip(0))
    return c


def _wait_gone(cl, job: str, limit: float) -> float:
    t0 = time.monotonic()
    while job in cl.server.registry.jobs:
        assert time.monotonic() - t0 < limit, f"job {job!r} still there after {limit} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_a_quiet_job_expires_after_its_lease_and_frees_its_slots():
    with soft_cluster(limits=Limits(job_lease=1.0)) as cl:
        quiet = _holder(cl, "quiet")
        job_id = cl.server.registry.jobs["quiet"].spec.job_id
        talking = _holder(cl, "talking")
        t0 = time.monotonic()
        while "quiet" in cl.server.registry.jobs:
            talking.request("ping")  # a member's request renews its job only
            assert time.monotonic() - t0 < 5, "the quiet job outlived its lease by far"
            time.sleep(0.2)
        assert time.monotonic() - t0 >= 1.0
        assert "talking" in cl.server.registry.jobs and cl.server.lease.expired == ["quiet"]
        assert cl.server.overview().lease_expiries == 1  # the metrics' counter
        assert job_id not in {j["job_id"] for j in cl.aggregator.jobs()}  # gone from the backend
        with pytest.raises(RendezvousError, match="no job 'quiet'"):
            quiet.request("status", job="quiet")
        again = _holder(cl, "next")  # the freed id, slots and port are handed out again
        assert cl.server.registry.jobs["next"].spec.job_id == job_id
        for c in (quiet, talking, again):
            c.close()


def test_traffic_renews_the_lease_and_the_job_expires_once_it_stops(monkeypatch):
    """Two hostlib ranks all-reduce for 3 leases (their link's pings turned off): the
    aggregator's contribution counters keep the job; once they only wait, it expires. The lease
    is 2 s: the ranks, the soft aggregator and the lease share one process (and its GIL), and a
    loaded 2-core machine has stalled them for over a second (a 1 s lease expired mid-traffic)."""
    monkeypatch.setattr(hostlib.control_link, "RENEW_INTERVAL", 1e9)
    lease = 2.0
    with soft_cluster(limits=Limits(job_lease=lease)) as cl:
        # a count, not a time: both ranks must run the same number of all-reduces (each rank
        # reading its own clock once ran one more than the other, which then waited for it
        # in vain); the sleeps alone make it last 3 leases
        rounds = int(3 * lease / 0.05)

        def rank(comm):
            t0 = time.monotonic()
            for _ in range(rounds):
                comm.allreduce(np.ones(512, np.float32))
                time.sleep(0.05)
            alive = "traffic" in cl.server.registry.jobs
            took = time.monotonic() - t0
            _wait_gone(cl, "traffic", 5 * lease)
            return took, alive

        for took, alive in ok(run_ranks(cl, 2, rank, job="traffic")):
            assert took >= 3 * lease and alive
        assert cl.server.lease.expired == ["traffic"]


def test_hostlib_control_link_pings_keep_an_idle_job(monkeypatch):
    monkeypatch.setattr(hostlib.control_link, "RENEW_INTERVAL", 0.2)
    lease = 2.0  # ten pings a lease: a loaded machine's stalls do not lapse it
    with soft_cluster(limits=Limits(job_lease=lease)) as cl:

        def rank(comm):
            time.sleep(3 * lease)  # no all-reduce for three leases
            return "idle" in cl.server.registry.jobs

        assert ok(run_ranks(cl, 2, rank, job="idle")) == [True, True]
        assert cl.server.lease.expired == []


def test_a_job_in_its_register_barrier_does_not_expire():
    with soft_cluster(limits=Limits(job_lease=0.5)) as cl:
        c = ControlClient(cl.server.address, timeout=5, secret=cl.secret)
        c.request("create", job="wait", **{**JOB, "world_size": 2})
        time.sleep(2.0)  # rank 1 is late: the barrier's own timeout governs
        assert "wait" in cl.server.registry.jobs
        c.close()


def test_lease_zero_turns_leases_off():
    with soft_cluster(limits=Limits(job_lease=0)) as cl:
        c = _holder(cl, "kept")
        time.sleep(1.0)
        assert cl.server.lease.sweep() == [] and "kept" in cl.server.registry.jobs
        assert not cl.server.lease.enabled
        c.close()


def test_early_loss_pings_report_each_rank_recovery_to_the_endpoint(monkeypatch):
    """docs/protocol.md 4.4: a rank's pings carry its loss recovery counters; the endpoint's
    overview (the metrics' endpoint_host_* families) sums the ranks' last reports."""
    from hostlib.engine import Faults

    monkeypatch.setattr(hostlib.control_link, "RENEW_INTERVAL", 0.1)
    names = ("retransmissions", "early_losses", "timeouts", "spurious")
    mine: dict[int, dict] = {}
    with soft_cluster() as cl:

        def seen() -> dict:
            (job,) = [j for j in cl.server.overview().jobs if j.key == "lossy"]
            return {k: getattr(job, k) for k in names}

        together = threading.Barrier(2)  # the ranks are threads: no traffic of their own

        def rank(comm):
            for _ in range(4):
                comm.allreduce(np.ones(8192, np.float32))
            mine[comm.rank] = {k: comm.stats[k] for k in names}  # final: no more traffic
            together.wait(timeout=30)
            if comm.rank == 0:  # until a ping of each rank said its final counters
                want = {k: sum(m[k] for m in mine.values()) for k in names}
                deadline = time.monotonic() + 20
                while seen() != want and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert seen() == want
            together.wait(timeout=30)  # the others stay in the job until rank 0 looked
            return mine[comm.rank]

        faults = lambda r: {"faults": Faults(0.05, 0.05, seed=r)}  # noqa: E731
        per = ok(run_ranks(cl, 2, rank, job="lossy", per_rank=faults))
    assert sum(p["early_losses"] for p in per) > 0


def test_early_loss_a_ping_with_bad_recovery_counters_is_refused():
    with soft_cluster() as cl:
        c = ControlClient(cl.server.address, timeout=5, secret=cl.secret)
        with pytest.raises(RendezvousError, match="recovery"):
            c.request("ping", recovery={"early_losses": -1})
        with pytest.raises(RendezvousError, match="recovery"):
            c.request("ping", recovery=[1, 2])
        # a counter this endpoint does not know (a newer hostlib's) is left out, not refused
        assert c.request("ping", recovery={"early_losses": 3, "newer": 1})["ok"]
        c.close()
