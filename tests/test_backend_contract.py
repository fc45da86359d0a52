"""One backend contract: the job and worker checks of aggctl.backend, seen through each target.

The same sequence runs against the software aggregator (no root) and the XDP program's maps
(root, bcc); the bmv2 backend calls the same two functions (tests/test_bmv2_backend.py drives it
through a fake CLI). Every refusal is a ValueError naming what is wrong, and re-creating a job
replaces it.
"""

import dataclasses

import pytest
from harness.ranks import loopback_prefix

from aggctl.backend import check_job, check_worker
from aggproto import wire
from aggproto.jobs import JobSpec, WorkerSpec
from aggproto.limits import MAX_JOBS, MAX_WORKERS
from soft_switch import SoftAggregator

PORT = wire.UDP_PORT + 2


def spec(job_id=5, n=2, base=10, count=4, port=PORT) -> JobSpec:
    return JobSpec(
        job_id=job_id, num_workers=n, elems=32, slot_base=base, slot_count=count, agg_port=port
    )


def worker(index, ip, job_id=5, port=PORT) -> WorkerSpec:
    return WorkerSpec(job_id=job_id, index=index, ip=ip, port=40000 + index, agg_port=port)


def run_contract(backend, pool_slots: int) -> None:
    s = spec()
    backend.create_job(s)
    assert s == spec(), "a backend must not change the caller's spec"
    for bad, match in [
        (dataclasses.replace(s, job_id=MAX_JOBS), "job id"),
        (dataclasses.replace(s, job_id=6, num_workers=MAX_WORKERS + 1), "workers"),
        (
            dataclasses.replace(s, job_id=6, slot_base=pool_slots - 1, slot_count=2),
            "outside the pool",
        ),
        (dataclasses.replace(s, job_id=6, slot_base=12), "overlap job 5"),
    ]:
        with pytest.raises(ValueError, match=match):
            backend.create_job(bad)
    backend.add_worker(worker(0, "127.0.0.10"))
    backend.add_worker(worker(0, "127.0.0.10"))  # the same worker again: fine
    for bad, match in [
        (worker(2, "127.0.0.11"), "outside 0..1"),
        (worker(0, "127.0.0.11", job_id=9), "does not exist"),
        (worker(1, "127.0.0.10"), "already worker 0 of job 5"),
        (worker(0, "127.0.0.12"), "already has a worker 0"),
        (worker(1, "127.0.0.11", port=wire.UDP_PORT), "listens on"),
    ]:
        with pytest.raises(ValueError, match=match):
            backend.add_worker(bad)
    backend.remove_worker(5, 0)
    backend.add_worker(worker(0, "127.0.0.12"))  # index 0 is free again
    backend.create_job(dataclasses.replace(s, slot_base=30))  # re-created: replaced, no workers
    (job,) = backend.jobs()
    assert (job["slot_base"], job["workers"]) == (30, [])
    backend.delete_job(5)
    assert backend.jobs() == []


def test_soft_aggregator_keeps_the_contract():
    agg = SoftAggregator(f"{loopback_prefix()}.1").start()
    try:
        run_contract(agg, wire.MAX_SLOTS)
    finally:
        agg.stop()


@pytest.mark.root
@pytest.mark.bpf
def test_xdp_maps_keep_the_contract(agg):
    _, maps = agg
    run_contract(_MapsBackend(maps), maps.pool_slots)


class _MapsBackend:
    """The XDP maps as a Backend (xdp_switch.aggregator.XdpBackend without an attached link)."""

    def __init__(self, maps):
        self.maps = maps

    def create_job(self, spec):
        self.maps.create_job(spec)

    def delete_job(self, job_id):
        self.maps.delete_job(job_id)

    def add_worker(self, w):
        self.maps.add_worker(w)

    def remove_worker(self, job_id, index):
        self.maps.remove_worker(job_id, index)

    def jobs(self):
        from xdp_switch.aggregator import job_dict

        return [job_dict(j, job, self.maps) for j, job in self.maps.jobs().items()]


def test_the_checks_alone():
    check_job(spec(), {5: (0, 100)}, 1024)  # its own old range does not count
    with pytest.raises(ValueError, match="overlap job 4"):
        check_job(spec(), {4: (13, 1)}, 1024)
    check_worker(worker(1, "a"), spec(), {("a", PORT): (5, 1)})
