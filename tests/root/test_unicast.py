"""Unicast delivery (one-arm, docs/protocol.md 3.5): one copy of each result per worker, to its
own MAC and address, for hosts that join no group (p4app-switchML's).

As root, through BPF_PROG_TEST_RUN: the copy program (bpf/xdp_agg.c xdp_agg_copy, loaded a
second time as a plain XDP program, since the kernel test-runs no devmap program) gives copy k of
a result worker k's addresses, starts again at worker 0 for the next result and per CPU, drops
and counts a copy for a worker that is not registered, and the control plane gives each unicast
job its devmap of copies and takes it away. In the one-arm testbed, with every worker's end
receiving as a NIC without promiscuous mode (Testbed.own_mac_only): an all-reduce of a unicast
job is exact and every result frame that reaches a worker's bridge port passes its filter, on
the per-CPU and one-CPU-per-slot paths and with frags; a job of group delivery shows what the
filter costs such hosts (its results dropped, the all-reduce carried by retransmissions).
"""

from __future__ import annotations

import contextlib
import ctypes as ct
import os
import uuid

import numpy as np
import pytest
from harness.builds import unicast_copies
from harness.packet_cases import (
    AGG_IP,
    AGG_MAC,
    WORKER_PORT,
    complete_round,
    ip_checksum_ok,
    job,
    worker_ip,
    worker_mac,
    workers,
)
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import ARP, Ether

from xdp_agg import bpfsys
from xdp_agg.app import serving
from xdp_agg.app.options import AttachOptions, JobOptions
from xdp_agg.proto import wire
from xdp_agg.proto.jobs import Delivery
from xdp_agg.proto.reasons import Reason
from xdp_switch import loader

N = 3


@contextlib.contextmanager
def _copy_program(prog):
    """xdp_agg_copy of build `prog` loaded as a plain XDP program, which BPF_PROG_TEST_RUN runs
    (it refuses a program whose expected attach type is BPF_XDP_DEVMAP)."""
    fd = loader.test_runnable(prog, loader.PROG_COPY)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def _on_cpu(cpu: int):
    """Run on one CPU: the copy program's cursor is per CPU, as the kernel's bulk queues are."""
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {sorted(cpus)[cpu % len(cpus)]})
    try:
        yield
    finally:
        os.sched_setaffinity(0, cpus)


def _unicast_job(prog, maps, n=N, copied=None):
    """Job 0 of unicast delivery with n workers, those in `copied` (default all) with their MAC
    as their copies' destination, the others with none (as before the backend adds one)."""
    spec = job(n=n, delivery=Delivery.UNICAST)
    maps.create_job(spec, unicast_copies(prog, spec))
    for w in workers(0, n):
        maps.add_worker(w, copy_mac=w.mac if copied is None or w.index in copied else None)
    return spec


def _result(prog, maps, rng, slot: int, sport: int = WORKER_PORT) -> bytes:
    """Complete one round of `slot` through the ingress program, each request from UDP port
    `sport`: the result as it leaves for the devmap broadcast (addressed to the job's group)."""
    steps, _, _ = complete_round(rng, N, 32, slot=slot, sport=sport)
    with _on_cpu(0):
        for s in steps:
            action, out, _ = bpfsys.prog_test_run(prog.progs[loader.PROG_INGRESS], s.frame)
    assert bpfsys.XDP_ACTIONS[action] == "redirect"  # the broadcast to the job's copies
    return out


def _copy(fd, frame: bytes, cpu: int = 0) -> tuple[str, bytes]:
    with _on_cpu(cpu):
        action, out, _ = bpfsys.prog_test_run(fd, frame)
    return bpfsys.XDP_ACTIONS[action], out


def _check_copy(out: bytes, result: bytes, k: int) -> None:
    """Copy k: worker k's MAC and address, a right IPv4 checksum, the rest the result's."""
    got, was = Ether(out), Ether(result)
    assert (got.dst, got[IP].dst) == (worker_mac(k), worker_ip(k))
    assert (got.src, got[IP].src) == (AGG_MAC, AGG_IP)
    assert ip_checksum_ok(got)
    assert (got[UDP].sport, got[UDP].dport) == (was[UDP].sport, was[UDP].dport)
    assert out[wire.SWITCHML_OFFSET :] == result[wire.SWITCHML_OFFSET :]


@pytest.mark.root
@pytest.mark.bpf
def test_copy_k_goes_to_worker_k(agg):
    prog, maps = agg
    _unicast_job(prog, maps)
    rng = np.random.default_rng(1)
    first, second = _result(prog, maps, rng, 2), _result(prog, maps, rng, 5)
    with _copy_program(prog) as fd:
        for k in range(N):
            action, out = _copy(fd, first)
            assert action == "pass", k  # in a devmap program PASS transmits
            _check_copy(out, first, k)
        # the next result starts at worker 0 again, after any number of copies of the last
        for k in (0, 1):
            _check_copy(_copy(fd, second)[1], second, k)
        _check_copy(_copy(fd, first)[1], first, 0)
        # the same result broadcast once more: its copies again from worker 0
        for k in (1, 2, 0):
            _check_copy(_copy(fd, first)[1], first, k)
        # to a port outside the aggregator's range (p4app's hosts send from 4000 + thread)
        third = _result(prog, maps, rng, 11, sport=4001)
        assert Ether(third)[UDP].dport == 4001
        for k in range(N):
            _check_copy(_copy(fd, third)[1], third, k)
    c = maps.counters(0)
    assert c[Reason.EGRESS_SENT.name.lower()] == 12 and c[Reason.EGRESS_NO_WORKER.name.lower()] == 0


@pytest.mark.root
@pytest.mark.bpf
def test_each_cpu_copies_its_own_results(agg):
    """A broadcast enqueues its copies on the CPU that made it: two CPUs' copies interleaved in
    time do not disturb each other's count."""
    prog, maps = agg
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    _unicast_job(prog, maps)
    rng = np.random.default_rng(2)
    a, b = _result(prog, maps, rng, 3), _result(prog, maps, rng, 4)
    with _copy_program(prog) as fd:
        for k in range(N):
            _check_copy(_copy(fd, a, cpu=0)[1], a, k)
            _check_copy(_copy(fd, b, cpu=1)[1], b, k)


@pytest.mark.root
@pytest.mark.bpf
def test_a_copy_for_a_worker_not_registered_is_dropped_and_counted(agg):
    prog, maps = agg
    _unicast_job(prog, maps, copied={0, 2})
    rng = np.random.default_rng(3)
    r, r2 = _result(prog, maps, rng, 6), _result(prog, maps, rng, 7)
    with _copy_program(prog) as fd:
        got = [_copy(fd, r)[0] for _ in range(N)]
        assert got == ["pass", "drop", "pass"]
        maps.remove_worker(0, 2)  # gone after its round completed: its copy has nowhere to go
        assert [_copy(fd, r2)[0] for _ in range(N)] == ["pass", "drop", "drop"]
    c = maps.counters(0)
    assert c[Reason.EGRESS_NO_WORKER.name.lower()] == 3
    assert c[Reason.EGRESS_SENT.name.lower()] == 3


@pytest.mark.root
@pytest.mark.bpf
def test_what_is_not_a_copy_passes_unchanged(agg):
    """The kernel runs the egress program of a bulk queue's first frame on every frame of it
    (bpf/slot_cpus.h): where the cpumap build sends an answer back out of the interface, the copy
    program also sees that answer, and frames that are not results at all; it leaves them as
    they are and counts nothing, without moving its cursor."""
    prog, maps = agg
    _unicast_job(prog, maps)
    rng = np.random.default_rng(4)
    steps, _, _ = complete_round(rng, N, 32, slot=8)
    r = _result(prog, maps, rng, 9)
    with _on_cpu(0):
        for s in steps:
            bpfsys.prog_test_run(prog.progs[loader.PROG_INGRESS], s.frame)
        action, answer, _ = bpfsys.prog_test_run(prog.progs[loader.PROG_INGRESS], steps[0].frame)
    assert bpfsys.XDP_ACTIONS[action] in ("tx", "redirect")  # to its sender, addressed
    arp = bytes(Ether(dst="ff:ff:ff:ff:ff:ff", src=AGG_MAC) / ARP(pdst=worker_ip(0)))
    before = maps.counters(0)
    with _copy_program(prog) as fd:
        _check_copy(_copy(fd, r)[1], r, 0)
        for other in (answer, arp):
            assert _copy(fd, other) == ("pass", other)
        _check_copy(_copy(fd, r)[1], r, 1)  # the cursor did not move
    sent = Reason.EGRESS_SENT.name.lower()
    assert maps.counters(0)[sent] - before[sent] == 2


@pytest.mark.root
@pytest.mark.bpf
def test_each_unicast_job_has_its_devmap_until_it_ends(agg):
    prog, maps = agg
    with pytest.raises(ValueError, match="interface and copy program"):
        maps.create_job(job(n=N, delivery=Delivery.UNICAST))  # the backend gives both
    _unicast_job(prog, maps)
    inner = ct.c_uint32()
    assert bpfsys.map_lookup(maps.fds["job_copies"], ct.c_uint32(0), inner)
    assert inner.value != 0  # the devmap's id
    dest = maps.copy_dest(0, 1)
    assert (dest.ip, bytes(dest.mac)) == (
        int.from_bytes(bytes(map(int, worker_ip(1).split("."))), "little"),
        bytes.fromhex(worker_mac(1).replace(":", "")),
    )
    maps.delete_job(0)
    assert not bpfsys.map_lookup(maps.fds["job_copies"], ct.c_uint32(0), inner)
    assert all(maps.copy_dest(0, k).ip == 0 for k in range(N))
    # a group job has no devmap
    maps.create_job(job(n=N))
    assert not bpfsys.map_lookup(maps.fds["job_copies"], ct.c_uint32(0), inner)


# --- the choice: serve, job create, the control endpoint, p4app's sessions (no root) ----------


def _iface(multicast: bool) -> dict:
    return {"ifname": "eth9", "multicast": multicast, "ipv4_nets": ["198.18.0.1/24"]}


def test_unicast_needs_no_multicast_flag_and_says_what_it_does():
    warned = []
    for multicast in (True, False):
        assert serving._results_mode(_iface(multicast), "unicast", warned.append) == "unicast"
    assert warned == []
    opts = JobOptions(num_workers=2, results="unicast")
    assert serving._job_results("one-arm", _iface(True), 5, opts, warned.append) == (
        "0.0.0.0",
        Delivery.UNICAST,
    )
    # the switch topology addresses every copy to its port's worker already
    assert serving._job_results("switch", _iface(True), 5, opts, warned.append)[1] == (
        Delivery.BROADCAST
    )
    assert serving.describe_results({"delivery": Delivery.UNICAST}) == (
        "results to each worker by unicast"
    )


def test_a_unicast_endpoint_gives_jobs_no_group_and_their_ranks_one_port():
    from harness.ranks import soft_cluster

    from xdp_agg.ctl.fields import RequestError

    with soft_cluster(defaults={"delivery": Delivery.UNICAST}) as cl:
        reg = cl.server.registry
        spec = reg.open_job("me", "u", 2, 64, 4, 40000, port=wire.UDP_PORT, base=0)
        assert spec.delivery == Delivery.UNICAST and reg.live_job("u").group() is None
        with pytest.raises(RequestError, match="port the completing request came from"):
            reg.join_job("me", "u", 0, "127.0.0.9", 40001, "02:00:00:00:00:09", None)
        reg.join_job("me", "u", 0, "127.0.0.9", 40000, "02:00:00:00:00:09", None)


def test_p4app_sessions_are_unicast_where_jobs_would_go_to_a_group():
    from harness.ranks import soft_cluster

    with soft_cluster(defaults={"group_base": "239.18.0.0/24"}) as cl:
        reg = cl.server.registry
        spec = reg.open_job("p4app", "s", 2, 64, 8, 4000, port=wire.UDP_PORT, base=0, unicast=True)
        assert (spec.delivery, spec.group_ip) == (Delivery.UNICAST, "0.0.0.0")
        other = reg.open_job("h", "t", 2, 64, 8, 40000, port=wire.UDP_PORT + 1, base=8)
        assert other.delivery == Delivery.GROUP_TX and other.group_ip.startswith("239.18.0.")


# --- in the testbed ---------------------------------------------------------------------------

PLAN = [{"dtype": "int32", "count": 1 << 16, "reps": 2}, {"check": "counters"}]


def _cluster(tb, *serve_args, attach=None):
    from xdp_agg.cluster.cluster import Cluster

    name = f"u{uuid.uuid4().hex[:8]}"
    return Cluster(tb, name=name, serve_args=serve_args, attach=attach)


def _result_frames(count: dict) -> int:
    return sum(r["frames"] for r in count["results"].values())


def _run_filtered(tb, cl, elems=256):
    """One job of every worker, while each worker's bridge port (before its filter) and its
    eth0 (after) count result frames: (reports, before, after) by worker index."""
    n = len(tb.workers)
    before = {i: tb.sniff("sw", f"w{i}", sent=True) for i in range(n)}
    after = {i: tb.sniff(f"w{i}") for i in range(n)}
    try:
        reports = cl.run_workers(PLAN, job="unicast", elems=elems, deadline=300)
    finally:
        b = {i: s.stop() for i, s in before.items()}
        a = {i: s.stop() for i, s in after.items()}
    return reports, b, a


@pytest.mark.root
@pytest.mark.bpf
@pytest.mark.netns
@pytest.mark.parametrize(
    "attach",
    [AttachOptions(), AttachOptions(slot_cpus="cpumap"), AttachOptions(frags=True)],
    ids=["percpu", "cpumap", "frags"],
)
def test_unicast_results_reach_hosts_that_take_only_their_own_mac(testbed_factory, attach):
    tb = testbed_factory(workers=N)
    tb.own_mac_only()
    with _cluster(tb, "--results", "unicast", attach=attach) as cl:
        assert "results to each worker by unicast" in cl.serve_line
        reports, before, after = _run_filtered(tb, cl)
    assert all(r["ok"] for rank in reports for r in rank if "ok" in r), reports
    for i, w in enumerate(tb.workers):
        # every result frame that left the bridge toward the worker passed its filter, and
        # each was addressed to it
        assert _result_frames(after[i]) == _result_frames(before[i]) > 0, (i, before, after)
        assert set(after[i]["results"]) == {w.ip}, after[i]


@pytest.mark.root
@pytest.mark.bpf
@pytest.mark.netns
def test_group_results_do_not_reach_such_hosts(testbed_factory):
    """The control: the same hosts in a job of group delivery receive no group result; the
    all-reduce still ends exact, every packet's result answered to a retransmission."""
    tb = testbed_factory(workers=2)
    tb.own_mac_only()
    with _cluster(tb) as cl:  # multicast, the default
        reports, before, after = _run_filtered(tb, cl)
    assert all(r["ok"] for rank in reports for r in rank if "ok" in r), reports
    for i, w in enumerate(tb.workers):
        group = set(before[i]["results"]) - {w.ip}
        assert group and all(g.startswith("239.18.0.") for g in group), before[i]
        assert set(after[i]["results"]) == {w.ip}, after[i]  # answers to it alone, nothing else
    counters = [r for rank in reports for r in rank if r.get("check") == "counters"]
    assert all(c["worker"]["retransmissions"] > 0 for c in counters), counters
