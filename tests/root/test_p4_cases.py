"""The packet table (tests/harness/packet_cases.py) against the P4 program in simple_switch.

The same inputs as the XDP test, frame by frame, into a bmv2 switch on veths; what comes out of
every port is captured and checked:
- TO_ALL: one copy per worker of the job, out of that worker's port, addressed to it (the
  switch-mode delivery of the XDP program: dst MAC/IP = worker, dst port = the completing
  request's source port (the parent's result: the worker's port), src = our address there,
  UDP checksum 0, IPv4 checksum recomputed), with the expected sum, exponent and echoed fields;
- TO_SENDER: one frame, back out of the sender's port, addresses swapped;
- DROP: nothing out of any port;
- PASS: forwarded unchanged by the L2 table (or flooded to every other port);
and the per-reason counters move exactly as the steps say. The serial reference model must agree
with every verdict and every result's bytes.

Differences from the XDP test, by design:
- cases with 128, 512, 768, 1024 or 2048-element packets are skipped: the v1model program
  aggregates 32, 64 and 256 elements per packet (256 in four passes, recirculated: p4app-switchML's
  sizes); a jumbo size code on a frame to one of its jobs is a counted bad size;
- the P4 program always delivers results as switch mode does (one copy per worker through the
  job's multicast group), whatever the job's `delivery` says: a P4 switch has no "one-arm" port;
- plain traffic is switched (MAC table, flooding) instead of passed to a kernel;
- sparse cases of 256 elements and more are skipped: the bmv2 program runs sparse jobs of 32
  and 64 elements (Bmv2Backend.sparse_elems says why); its sparse results are as long as their
  kind, not as the request.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from harness import packet_cases as table
from harness.p4 import VethLab
from harness.packet_cases import (
    AGG_MAC,
    CASES,
    PARENT_IP,
    PARENT_MAC,
    Case,
    Step,
    check_result,
    check_to_parent,
    worker_ip,
    worker_mac,
)
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from xdp_agg.codegen.p4 import P4_ELEMS
from xdp_agg.proto import limits, wire
from xdp_agg.proto.model import Action
from xdp_agg.proto.reasons import Reason
from xdp_agg.targets.bmv2.backend import SPARSE_ELEMS

pytestmark = [pytest.mark.root, pytest.mark.netns, pytest.mark.p4]


WORKER_PORTS = 4  # worker host h is behind switch port h % 4
HOST_PORT = 4  # where AGG_MAC (the aggregator's own host) is: plain traffic to it goes here,
# and where the tree cases' parent aggregator is: partial sums go up there, its results come in
NPORTS = 5
HOSTS = 64  # worker host indexes the table uses (0..40, and 7 as a stranger)
HOST_OF_MAC = {worker_mac(h): h for h in range(HOSTS)}
HOST_OF_IP = {worker_ip(h): h for h in range(HOSTS)}


def port_of_host(h: int) -> int:
    return h % WORKER_PORTS


@pytest.fixture(scope="module")
def lab(p4_json, tmp_path_factory):
    lab = VethLab(p4_json, NPORTS, log_path=tmp_path_factory.mktemp("bmv2") / "switch.log")
    lab.up()
    try:
        backend = lab_backend(lab)
        backend.setup(unknown_unicast="flood")
        backend.add_mac(AGG_MAC, HOST_PORT)
        backend.set_parent_port(PARENT_IP, HOST_PORT)
        lab.backend = backend
        yield lab
    finally:
        lab.down()


def lab_backend(lab):
    from xdp_agg.targets.bmv2 import Bmv2Backend

    return Bmv2Backend(lab.switch.cli(), lab.ports)


def _owner(case: Case, req):
    """The (job spec, worker specs) a frame of ours belongs to, by (source address, port): a
    worker's, or a rack job's parent's."""
    for j in case.jobs:
        if j.has_parent and (j.parent_ip, j.uplink_port) == (req[IP].src, req[UDP].dport):
            return j, [x for x in case.workers if x.job_id == j.job_id]
    for w in case.workers:
        if (w.ip, w.agg_port) == (req[IP].src, req[UDP].dport):
            job = next(j for j in case.jobs if j.job_id == w.job_id)
            return job, [x for x in case.workers if x.job_id == w.job_id]
    raise AssertionError("a result for a packet of no registered worker")


def _expected_ports(case: Case, step: Step, in_port: int) -> list[int]:
    """Where the step's frame (or its copies) must come out, one entry per frame."""
    req = Ether(step.frame)
    if step.action == Action.DROP:
        return []
    if step.action == Action.TO_SENDER:
        return [in_port]
    if step.action == Action.TO_PARENT:
        return [HOST_PORT]
    if step.action == Action.TO_ALL:
        _, ws = _owner(case, req)
        return sorted(port_of_host(HOST_OF_IP[w.ip]) for w in ws)
    if req.dst == AGG_MAC:
        return [HOST_PORT]
    return sorted(p for p in range(NPORTS) if p != in_port)  # flooded


def _check_outputs(case: Case, step: Step, in_port: int, outs) -> None:
    want_ports = _expected_ports(case, step, in_port)
    assert sorted(p for p, _ in outs) == want_ports, (
        f"{step.what}: frames came out of the wrong ports"
    )
    req = Ether(step.frame)
    if step.action == Action.PASS:
        for _, data in outs:
            assert data == step.frame, f"{step.what}: a packet that is not ours was modified"
        return
    for port, data in outs:
        out = Ether(data)
        # a dense result is as long as its request; a sparse one as its kind (check_result
        # checks the IPv4 and UDP lengths it must have)
        want = len(step.frame) if step.sparse is None else wire.ETH_HLEN + out[IP].len
        assert len(data) == want, step.what
        check_result(step, req, out)
        if step.action == Action.TO_SENDER:
            assert (out.dst, out.src, out[IP].src, out[IP].dst) == (
                req.src,
                req.dst,
                req[IP].dst,
                req[IP].src,
            )
            assert (out[UDP].sport, out[UDP].dport) == (req[UDP].dport, req[UDP].sport)
        if step.action == Action.TO_PARENT:  # our partial, as the XDP rack sends it up
            check_to_parent(step, out)
    if step.action == Action.TO_ALL:
        job, ws = _owner(case, req)
        copies = {(Ether(d).dst, Ether(d)[IP].dst): (p, Ether(d)) for p, d in outs}
        assert len(copies) == len(ws), f"{step.what}: not one copy per worker"
        # a completion leaves from the port it came to, to the port the request came from (as
        # p4app-switchML's switch answers); the parent's result from the rack job's own port
        # (it came to the uplink port) to the port each worker registered
        ports = (req[UDP].dport, req[UDP].sport)
        for w in ws:
            if step.reason == Reason.PARENT_RESULT:
                ports = (job.agg_port, w.port)
            port, out = copies[(w.mac, w.ip)]
            assert port == port_of_host(HOST_OF_IP[w.ip])
            assert (out.src, out[IP].src) == (job.agg_mac, job.agg_ip)
            assert (out[UDP].sport, out[UDP].dport) == ports, step.what


def _case_id(c: Case) -> str:
    return c.name


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_packet_case(lab, case: Case):
    sparse_sizes = {j.elems for j in case.jobs if j.sparse} - set(SPARSE_ELEMS)
    if sparse_sizes:
        pytest.skip(
            f"sparse jobs of {sorted(sparse_sizes)} elements per packet: the bmv2 program's "
            f"are of {', '.join(map(str, SPARSE_ELEMS))} (Bmv2Backend.sparse_elems says why)"
        )
    unsupported = sorted({j.elems for j in case.jobs} - set(P4_ELEMS))
    if unsupported:
        pytest.skip(
            f"{unsupported} elements per packet: the v1model program aggregates "
            f"{', '.join(map(str, P4_ELEMS))} (p4app-switchML's sizes); 128, 512, 768 and the "
            "jumbo 1024 and 2048 are the XDP program's"
        )
    if any(j.udp_checksum for j in case.jobs):
        pytest.skip("UDP checksum verification is the XDP program's (the bmv2 backend refuses it)")
    backend = lab.backend
    for j in backend.jobs():
        backend.delete_job(j["job_id"])
    model = table.model_for(case)
    for j in case.jobs:
        backend.create_job(j)
    backend.add_workers(
        [
            dataclasses.replace(w, extra={**w.extra, "port": port_of_host(HOST_OF_IP[w.ip])})
            for w in case.workers
        ]
    )
    rows = sorted({j.job_id for j in case.jobs} | {limits.NO_JOB})
    before = backend.counter_rows(rows)
    copies = 0
    for step in case.steps:
        req = Ether(step.frame)  # a stranger's MAC with a worker's address: that worker's port
        if req.src == PARENT_MAC:  # the tree cases' parent (or a stranger with its MAC)
            in_port = HOST_PORT
        else:
            host = HOST_OF_MAC[req.src] if req.src in HOST_OF_MAC else HOST_OF_IP[req[IP].src]
            in_port = port_of_host(host)
        want = _expected_ports(case, step, in_port)
        outs = lab.exchange(in_port, step.frame, len(want))
        _check_outputs(case, step, in_port, outs)
        table.check_model(model, step, [data for _, data in outs])
        if step.action == Action.TO_ALL:
            copies += len(want)
    after = backend.counter_rows(rows)
    delta = Counter()
    for row in rows:
        for name, v in after[row].items():
            delta[name] += v - before[row][name]
    want = Counter(s.reason.name.lower() for s in case.steps)
    want[Reason.EGRESS_SENT.name.lower()] += copies  # one per result copy, counted in egress
    assert +delta == +want


def test_backend_refuses_what_the_program_cannot_serve(lab):
    """Sizes other than 32/64/256, slots past the pool, overlapping ranges, unknown jobs."""
    from harness.packet_cases import job, workers

    backend = lab.backend
    for j in backend.jobs():
        backend.delete_job(j["job_id"])
    for elems in (128, 512, 768):
        with pytest.raises(ValueError, match="32, 64 or 256"):
            backend.create_job(job(elems=elems))
    with pytest.raises(ValueError, match="outside the pool"):
        backend.create_job(job(base=backend.pool_slots - 4, count=8))
    backend.create_job(job(0, base=0, count=8))
    with pytest.raises(ValueError, match="overlap"):
        backend.create_job(job(1, base=4, count=8, port=wire.UDP_PORT + 1))
    with pytest.raises(ValueError, match="does not exist"):
        backend.add_worker(workers(5, 1)[0])
    w = dataclasses.replace(workers(0, 1)[0], extra={"port": 0})
    backend.add_worker(w)
    with pytest.raises(ValueError, match="already worker"):
        backend.add_worker(dataclasses.replace(w, index=1))
    assert [x["job_id"] for x in backend.jobs()] == [0]
    assert [x["index"] for x in backend.jobs()[0]["workers"]] == [0]
    backend.remove_worker(0, 0)
    assert backend.jobs()[0]["workers"] == []
    backend.delete_job(0)
    assert backend.jobs() == []
