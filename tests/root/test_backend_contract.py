"""One backend contract: the job and worker checks of xdp_agg.ctl.backend, seen through each target,
and each optional capability (xdp_agg.ctl.backend's protocols) checked on every target that claims
it.

The same sequence runs against the software aggregator and the bmv2 backend over a fake CLI (no
root) and the XDP program's maps (root, BPF). Every refusal is a ValueError naming what is
wrong, and re-creating a job replaces it. Each target claims exactly the capabilities of the
table in xdp_agg/ctl/backend.py; a TreeBackend claims every one and answers each as the backend
behind it does, or neutrally where that one has none.
"""

import dataclasses
import json

import pytest
from harness.p4 import PORTS, FakeCLI
from harness.ranks import loopback_prefix

from xdp_agg.ctl import backend as contract
from xdp_agg.ctl.backend import check_job, check_worker
from xdp_agg.ctl.tree import ParentLink, TreeBackend
from xdp_agg.proto import wire
from xdp_agg.proto.jobs import JobSpec, WorkerSpec
from xdp_agg.proto.limits import MAX_JOBS, MAX_WORKERS
from xdp_agg.proto.reasons import Reason
from xdp_agg.targets import bmv2
from xdp_agg.targets.soft import SoftAggregator

PORT = wire.UDP_PORT + 2
REASON_NAMES = {r.name.lower() for r in Reason}


def spec(job_id=5, n=2, base=10, count=4, port=PORT) -> JobSpec:
    return JobSpec(
        job_id=job_id, num_workers=n, elems=32, slot_base=base, slot_count=count, agg_port=port
    )


def worker(index, ip, job_id=5, port=PORT, extra=None) -> WorkerSpec:
    return WorkerSpec(
        job_id=job_id, index=index, ip=ip, port=40000 + index, agg_port=port, extra=extra or {}
    )


make_worker = worker  # run_contract's own `worker` adds the target's extra


def run_contract(backend, pool_slots: int, extra=None) -> None:
    """The sequence every target passes; `extra`: what its workers need (bmv2: their port)."""

    def worker(index, ip, job_id=5, port=PORT):
        return make_worker(index, ip, job_id, port, extra)

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


def test_bmv2_backend_keeps_the_contract():
    b = bmv2.Bmv2Backend(FakeCLI(), PORTS)
    run_contract(b, b.pool_slots, extra={"port": 0})


# --- the optional capabilities ---------------------------------------------------------------
def _xdp_backend_class():
    from xdp_switch.backend import XdpBackend

    return XdpBackend


CLAIMS = {
    "soft": (lambda: SoftAggregator, {"JobCounters", "WorkerCounters", "SparseJobs"}),
    "bmv2": (
        lambda: bmv2.Bmv2Backend,
        {"JobCounters", "ParentStatus", "ElemSizes", "CounterRows", "SparseJobs"},
    ),
    "xdp": (
        _xdp_backend_class,
        {
            "JobCounters",
            "WorkerCounters",
            "JobLoss",
            "Generation",
            "ParentStatus",
            "ElemSizes",
            "AllWorkerCounters",
            "ProgramStats",
            "SparseJobs",
            "ForwardingStats",
        },
    ),
    "tree": (lambda: TreeBackend, {c.__name__ for c in contract.CAPABILITIES}),
}


@pytest.mark.parametrize("target", sorted(CLAIMS))
def test_each_target_claims_the_capabilities_of_the_table(target):
    cls, claimed = CLAIMS[target]
    has = {c.__name__ for c in contract.CAPABILITIES if issubclass(cls(), c)}
    assert has == claimed, f"{target}: has {sorted(has)}, the table says {sorted(claimed)}"
    assert issubclass(cls(), contract.Backend) or target == "tree"


def _check_capabilities(backend, job_id: int) -> set[str]:
    """Each capability `backend` claims, called on its live job `job_id` (one worker, index 0,
    registered), with what the answer must be; the names checked."""
    checked = contract.capabilities(backend)
    if "JobCounters" in checked:
        reasons = backend.counters(job_id)
        assert set(reasons) <= REASON_NAMES, set(reasons) - REASON_NAMES
        assert all(isinstance(v, int) and v >= 0 for v in reasons.values())
    if "WorkerCounters" in checked:
        per = backend.worker_counters(job_id)
        assert all(isinstance(i, int) and "contributions" in c for i, c in per.items()), per
    if "JobLoss" in checked:
        assert backend.job_lost(job_id) is None  # a live job is not lost
    if "Generation" in checked:
        g = backend.generation()
        assert g == backend.generation() and json.loads(json.dumps(g)) == g
    if "ParentStatus" in checked:
        assert backend.parent_status(job_id) is None  # a job without a parent
    if "ElemSizes" in checked:
        sizes = backend.elem_sizes()
        assert sizes and set(sizes) <= set(wire.SIZE_CODE_ELEMS.values()), sizes
    if "CounterRows" in checked:
        assert backend.counter_rows([job_id]) == {job_id: backend.counters(job_id)}
    if "AllWorkerCounters" in checked:
        assert backend.all_worker_counters().get(job_id, {}) == backend.worker_counters(job_id)
    if "SparseJobs" in checked:
        sizes = backend.sparse_elems()
        assert set(sizes) <= set(contract.elem_sizes(backend)), sizes
        assert backend.pads_empty() in (True, False)
    if "ProgramStats" in checked:
        st = backend.program_stats()
        assert st is None or json.loads(json.dumps(st.to_dict())) == st.to_dict()
    return checked


def _with_a_job(backend, extra=None):
    backend.create_job(spec())
    backend.add_worker(worker(0, "127.0.0.10", extra=extra))
    return backend


def test_soft_aggregator_capabilities():
    agg = SoftAggregator(f"{loopback_prefix()}.1").start()
    try:
        assert _check_capabilities(_with_a_job(agg), 5) == CLAIMS["soft"][1]
    finally:
        agg.stop()


def test_bmv2_backend_capabilities():
    b = _with_a_job(bmv2.Bmv2Backend(FakeCLI(), PORTS), extra={"port": 0})
    assert _check_capabilities(b, 5) == CLAIMS["bmv2"][1]


class _Bare:
    """A Backend with no capability at all (every method of the contract, nothing more)."""

    def __init__(self):
        self.made: list = []

    def create_job(self, spec):
        self.made.append(spec)

    def delete_job(self, job_id):
        self.made = [s for s in self.made if s.job_id != job_id]

    def add_worker(self, worker):
        pass

    def remove_worker(self, job_id, index):
        pass

    def jobs(self):
        return [s.to_dict() for s in self.made]


def test_tree_backend_answers_as_its_inner_backend_or_neutrally():
    link = ParentLink(("127.0.0.1", 9), 0, 2)
    agg = SoftAggregator(f"{loopback_prefix()}.1").start()
    try:
        tree = _with_a_job(TreeBackend(agg, link))
        assert tree.counters(5) == agg.counters(5)
        assert tree.worker_counters(5) == agg.worker_counters(5)
        assert tree.jobs() == agg.jobs()
        assert tree.counter_rows([5]) == {5: agg.counters(5)}  # row by row: soft has no batch
        assert tree.all_worker_counters() == {5: agg.worker_counters(5)}
        assert tree.program_stats() is None
    finally:
        agg.stop()
    bare = TreeBackend(_Bare(), link)
    assert contract.capabilities(_Bare()) == set()
    bare.create_job(spec())
    assert (bare.counters(5), bare.worker_counters(5)) == ({}, {})
    assert (bare.job_lost(5), bare.generation(), bare.parent_status(5)) == (None, None, None)
    assert (bare.counter_rows([5]), bare.all_worker_counters()) == ({5: {}}, {})
    assert [j["job_id"] for j in bare.jobs()] == [5]


@pytest.mark.root
@pytest.mark.bpf
def test_xdp_maps_keep_the_contract(agg):
    _, maps = agg
    run_contract(_MapsBackend(maps), maps.pool_slots)


class _MapsBackend:
    """The XDP maps as a Backend (xdp_switch.backend.XdpBackend without an attached link)."""

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
        from xdp_switch.backend import job_dict

        return [job_dict(j, job, self.maps) for j, job in self.maps.jobs().items()]


def test_the_checks_alone():
    check_job(spec(), {5: (0, 100)}, 1024)  # its own old range does not count
    with pytest.raises(ValueError, match="overlap job 4"):
        check_job(spec(), {4: (13, 1)}, 1024)
    check_worker(worker(1, "a"), spec(), {("a", PORT): (5, 1)})


def test_the_table_names_every_capability():
    """The module's table (its docstring) has a row for each of CAPABILITIES, and no other."""
    rows = {
        line.split("|")[1].strip()
        for line in contract.__doc__.splitlines()
        if line.startswith("| ") and not line.startswith("| capability")
    }
    assert rows == {c.__name__ for c in contract.CAPABILITIES}


def test_typed_results_keep_their_json():
    """KernelStats and the endpoint's overview are dataclasses; to_dict is the JSON they were."""
    from xdp_agg.ctl.server import EndpointOverview, JobOverview

    prog = contract.KernelProgram(run_time_ns=5, run_cnt=2, memlock=4096, id=7, tag="00ff" * 4)
    st = contract.KernelStats(bpf_stats_enabled=True, programs={"ingress": prog}, maps={"m": 1})
    assert st.to_dict() == {
        "bpf_stats_enabled": True,
        "programs": {
            "ingress": {
                "run_time_ns": 5, "run_cnt": 2, "memlock": 4096, "id": 7, "tag": "00ff" * 4
            }
        },
        "maps": {"m": 1},
    }  # fmt: skip
    job = JobOverview("a", 3, "ready", 2, 2, 0, 0)
    ov = EndpointOverview(jobs=[job], connections=1, refusals={"auth": 0}, lease_expiries=0)
    assert json.dumps(ov.to_dict()) == (
        '{"jobs": [{"key": "a", "job_id": 3, "state": "ready", "world_size": 2, '
        '"registered": 2, "missing": 0, "gone": 0, "retransmissions": 0, "early_losses": 0, '
        '"timeouts": 0, "spurious": 0}], "connections": 1, '
        '"refusals": {"auth": 0}, "lease_expiries": 0}'
    )
