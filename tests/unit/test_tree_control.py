"""Two-level trees, control side (no root needed): the rack job's spec, and rack endpoints that
join the parent's job (xdp_agg.ctl.tree.TreeBackend in front of each rack's backend)."""

from __future__ import annotations

import secrets
import time

import pytest
from harness.ranks import in_threads, loopback_prefix

from hostlib.errors import RendezvousError
from hostlib.rendezvous import ControlClient
from xdp_agg.ctl.endpoint import stand_up
from xdp_agg.ctl.tree import ParentLink, TreeBackend
from xdp_agg.proto import wire
from xdp_agg.proto.jobs import Delivery, JobSpec

# one deployment secret for the tree: the racks' endpoints prove it to the parent's
SECRET = secrets.token_bytes(32)

pytestmark = pytest.mark.timeout(60)


class Recorder:
    """A Backend that keeps what it was asked (the contract's vocabulary, no data path)."""

    def __init__(self) -> None:
        self.specs: dict[int, JobSpec] = {}
        self.workers: dict[int, dict[int, object]] = {}

    def create_job(self, spec: JobSpec) -> None:
        self.specs[spec.job_id] = spec
        self.workers[spec.job_id] = {}

    def delete_job(self, job_id: int) -> None:
        self.specs.pop(job_id, None)
        self.workers.pop(job_id, None)

    def add_worker(self, worker) -> None:
        self.workers[worker.job_id][worker.index] = worker

    def remove_worker(self, job_id: int, index: int) -> None:
        self.workers.get(job_id, {}).pop(index, None)

    def jobs(self) -> list[dict]:
        return [dict(s.to_dict(), workers=[]) for s in self.specs.values()]


def _spec(**kw) -> JobSpec:
    base = dict(job_id=0, num_workers=3, elems=64, slot_base=0, slot_count=8)
    return JobSpec(**{**base, **kw})


def test_rack_job_spec_checks():
    tree = dict(parent_ip="198.18.0.1", parent_port=wire.UDP_PORT, worker_port=40000)
    s = _spec(agg_port=wire.UDP_PORT + 2, **tree)
    assert s.has_parent and s.uplink_port == wire.UDP_PORT + 2  # default: our own port
    assert s.scale_workers == 3 and _spec(total_workers=6, **tree).scale_workers == 6
    assert not _spec().has_parent
    with pytest.raises(ValueError, match="worker_port"):
        _spec(parent_ip="198.18.0.1", parent_port=wire.UDP_PORT)
    with pytest.raises(ValueError, match="parent_port"):
        _spec(**{**tree, "parent_port": 5000})
    # the switch topology's per-port delivery is the target's to refuse (the XDP program's rack
    # jobs need one-arm: tests/root/test_xdp_cases.py); bmv2 delivers a rack's results per port
    assert _spec(delivery=Delivery.BROADCAST, **tree).has_parent
    with pytest.raises(ValueError, match="63"):
        _spec(num_workers=64, **tree)
    with pytest.raises(ValueError, match="total_workers"):
        _spec(total_workers=2, **tree)


def test_backends_without_two_levels_refuse_rack_jobs():
    from xdp_agg.targets.soft import SoftAggregator

    tree = dict(parent_ip="198.18.0.1", parent_port=wire.UDP_PORT, worker_port=40000)
    with pytest.raises(ValueError, match="two-level"):
        SoftAggregator(f"{loopback_prefix()}.1").create_job(_spec(**tree))


def test_racks_join_the_parents_job():
    p = loopback_prefix()
    parent_be, rack_be = Recorder(), [Recorder(), Recorder()]
    parent, _ = stand_up(
        parent_be, f"{p}.1", 0, {"agg_ip": f"{p}.1", "agg_mac": "02:00:00:00:00:01"}, secret=SECRET
    )
    parent.start()
    racks = []
    try:
        for r in range(2):
            link = ParentLink(parent.address, r, 2, barrier_timeout=10, secret=SECRET)
            d = {"agg_ip": f"{p}.{2 + r}", "agg_mac": f"02:00:00:00:00:0{2 + r}"}
            rack, _ = stand_up(TreeBackend(rack_be[r], link), f"{p}.{2 + r}", 0, d, secret=SECRET)
            racks.append(rack)
            racks[-1].start()
        # the second rack's endpoint takes another aggregator port: the uplink is rack 0's
        racks[1].backend.inner.create_job(_spec(job_id=5, agg_port=wire.UDP_PORT, slot_base=500))
        answers, clients = [None, None], []
        for r in range(2):
            clients.append(ControlClient(racks[r].address, timeout=15, secret=SECRET))

        def create(r):
            try:
                answers[r] = clients[r].job(
                    "create", job="j", world_size=3, elems=64, window=4, worker_port=40000
                )
            except RendezvousError as e:
                answers[r] = e

        assert not in_threads(create, 2, 30)
        assert all(not isinstance(a, Exception) for a in answers), answers
        (pspec,) = parent_be.specs.values()
        assert pspec.num_workers == 2
        uplinks = set()
        for r, a in enumerate(answers):
            s = a.spec  # the rack job's description carries the parent link to the hosts
            assert (s.parent_ip, s.parent_port) == (f"{p}.1", pspec.agg_port)
            assert s.parent_mac == "02:00:00:00:00:01" and s.parent_slot_base == pspec.slot_base
            assert s.worker_port == 40000 and s.total_workers == 6
            assert rack_be[r].specs[s.job_id] == s
            uplinks.add(s.uplink_port)
        assert uplinks == {answers[0].spec.agg_port}
        assert answers[1].spec.agg_port != answers[0].spec.agg_port
        ws = parent_be.workers[pspec.job_id]
        assert {w.index: (w.ip, w.port) for w in ws.values()} == {
            0: (f"{p}.2", answers[0].spec.agg_port),
            1: (f"{p}.3", answers[0].spec.agg_port),
        }
        # rack 0's job ends (its connection closes): it leaves the parent's job, which is then
        # closing; once rack 1's ends too, the parent's job is gone
        clients[0].close()
        probe = ControlClient(parent.address, timeout=5, secret=SECRET)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            st = probe.request("status", job="j")
            if st["state"] == "closing":
                break
            time.sleep(0.05)
        assert st["state"] == "closing" and st["left"] == [0], st
        probe.close()
        clients[1].close()
        deadline = time.monotonic() + 10
        while parent_be.specs and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not parent_be.specs, "the parent's job outlived its racks"
    finally:
        for s in racks:
            s.stop()
        parent.stop()


def test_rack_refused_when_the_parent_is_unreachable():
    p = loopback_prefix()
    link = ParentLink((f"{p}.1", 9), 0, 2, barrier_timeout=2, secret=SECRET)
    be = Recorder()
    backend = TreeBackend(be, link)
    s, _ = stand_up(backend, f"{p}.2", 0, {"agg_ip": f"{p}.2"}, secret=SECRET)
    with s:
        c = ControlClient(s.address, timeout=10, secret=SECRET)
        with pytest.raises(RendezvousError, match="parent"):
            c.job("create", job="j", world_size=3, elems=64, window=4, worker_port=40000)
        c.close()
    assert not be.specs
