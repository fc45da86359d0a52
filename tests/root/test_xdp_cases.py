"""Table-driven BPF_PROG_TEST_RUN tests of the XDP program (tests/harness/packet_cases.py).

For every step: the XDP action, the output frame (addressing, checksums, echoed header fields,
result values, exponent), the counters, and the serial reference model's verdict must agree.
"""

from collections import Counter

import numpy as np
import pytest
from harness.builds import (
    AGG_BUILDS_CPUMAP,
    load_agg_build,
    unicast_copies,
)
from harness.cpus import on_each_cpu_in_turn
from harness.packet_cases import (
    AGG_IP,
    AGG_MAC,
    CASES,
    GROUP_IP,
    GROUP_MAC,
    RACK_WORKER_PORT,
    Case,
    Step,
    check_model,
    check_result,
    check_to_parent,
    model_for,
    result_udp_len,
)
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from xdp_agg import bpfsys
from xdp_agg.proto import limits, wire
from xdp_agg.proto.jobs import Delivery
from xdp_agg.proto.model import Action
from xdp_agg.proto.reasons import Reason
from xdp_agg.proto.scapy_layer import SwitchML
from xdp_switch import loader

pytestmark = [pytest.mark.root, pytest.mark.bpf]


@pytest.fixture(scope="module", params=AGG_BUILDS_CPUMAP)
def agg_prog(request):
    """conftest's builds and the one of --slot-cpus cpumap (its aggregator, as loaded for the
    cpumap's entries, is what these cases run)."""
    yield from load_agg_build(request.param)


def _sent(prog) -> int:
    """How the aggregator sends a frame back out of the interface it came in on: XDP_TX, or in
    the cpumap build (a cpumap program cannot XDP_TX) a redirect to that interface."""
    return bpfsys.XDP_REDIRECT if prog.options["slot_cpus"] == "cpumap" else bpfsys.XDP_TX


def _xdp_action(step: Step, delivery: Delivery, sent: int) -> int:
    if step.action == Action.PASS:
        return bpfsys.XDP_PASS
    if step.action == Action.DROP:
        return bpfsys.XDP_DROP
    if step.action == Action.TO_ALL and delivery != Delivery.GROUP_TX:
        return bpfsys.XDP_REDIRECT  # a devmap broadcast: to the switch's ports or the copies
    return sent  # TO_ALL one-arm, TO_SENDER, TO_PARENT


def _check_step(step: Step, delivery: Delivery, action: int, out_bytes: bytes, sent: int) -> None:
    want = _xdp_action(step, delivery, sent)
    assert bpfsys.XDP_ACTIONS[action] == bpfsys.XDP_ACTIONS[want], step.what
    if step.action == Action.PASS:
        assert out_bytes == step.frame, f"{step.what}: a packet that is not ours was modified"
        return
    if step.action == Action.DROP:
        return
    req, out = Ether(step.frame), Ether(out_bytes)
    k = wire.elems_for(req[SwitchML].size)
    # a sparse result's length is the result's, not the request's (docs/protocol.md 8.3)
    assert len(out_bytes) == wire.ETH_HLEN + wire.IPV4_HLEN + result_udp_len(step, k), step.what
    check_result(step, req, out)
    if step.action == Action.TO_ALL and delivery == Delivery.BROADCAST:
        return  # the devmap egress program addresses each copy (netns test)
    if step.action == Action.TO_PARENT:  # our partial, as our contribution to the parent
        check_to_parent(step, out)
        return
    if step.reason == Reason.PARENT_RESULT:  # the parent's sum, down to our workers' group
        assert (out.dst, out.src, out[IP].src, out[IP].dst) == (
            GROUP_MAC,
            AGG_MAC,
            AGG_IP,
            GROUP_IP,
        ), step.what
        # from the rack job's own port (the tree cases' job has the default one)
        assert (out[UDP].sport, out[UDP].dport) == (wire.UDP_PORT, RACK_WORKER_PORT), step.what
        return
    if step.action == Action.TO_ALL:
        want = (GROUP_MAC, AGG_MAC, AGG_IP, GROUP_IP)
    else:
        want = (req.src, req.dst, req[IP].dst, req[IP].src)
    assert (out.dst, out.src, out[IP].src, out[IP].dst) == want, step.what
    assert (out[UDP].sport, out[UDP].dport) == (req[UDP].dport, req[UDP].sport)


def _all_counters(maps) -> Counter:
    total = Counter()
    for row in list(range(limits.MAX_JOBS)) + [limits.NO_JOB]:
        for name, v in maps.counters(row).items():
            total[name] += v
    return total


@pytest.mark.parametrize("spread", [0, 1], ids=["one-cpu", "cpus-in-turn"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_packet_case(agg, case: Case, spread: int):
    """Each case's steps on one CPU, and on every CPU of the machine in turn (step i on CPU
    i mod CPUs): then a slot's contributions are folded into different CPUs' partials and the
    completing CPU gathers them (bpf/aggregate.h), which the results, counters and model check."""
    prog, maps = agg
    if any(wire.size_code_for(j.elems) in wire.JUMBO_SIZE_CODES for j in case.jobs):
        if not prog.options["frags"]:
            pytest.skip("jumbo frames (more than a page) reach a multi-buffer (frags) program only")
        if case.sparse:  # an empty request cannot grow into a jumbo result (ctl_maps)
            with pytest.raises(ValueError, match="cannot grow into a result larger than a page"):
                maps.create_job(case.jobs[0])
            pytest.skip("XDP refuses sparse jobs of jumbo sizes (docs/protocol.md 8.3)")
    fd = prog.progs["xdp_agg_ingress"]
    model = model_for(case)
    for j in case.jobs:
        maps.create_job(j, unicast_copies(prog, j))
    for w in case.workers:
        maps.add_worker(w)
    delivery = case.jobs[0].delivery
    before = _all_counters(maps)
    with on_each_cpu_in_turn() as run:
        for i, step in enumerate(case.steps):
            cpu = i * spread  # 0: every step on the first CPU
            action, out, _ = run(cpu, lambda: bpfsys.prog_test_run(fd, step.frame))
            _check_step(step, delivery, action, out, _sent(prog))
            check_model(model, step, [out])
    delta = _all_counters(maps) - before
    want = Counter(s.reason.name.lower() for s in case.steps)
    assert delta == want


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_steering_of_each_case(agg, case: Case):
    """The cpumap build's program on the interfaces: a frame that is not ours (the cases'
    PASS steps: ARP, ICMP, TCP, other UDP ports, fragments) passes untouched and is counted as
    passed; every other frame is redirected, untouched, to its slot's CPU."""
    prog, maps = agg
    if prog.options["slot_cpus"] != "cpumap":
        pytest.skip("only the cpumap build steers")
    fd = prog.progs[loader.PROG_STEER]
    before = maps.counters(limits.NO_JOB)["pass"]
    for step in case.steps:
        action, out, _ = bpfsys.prog_test_run(fd, step.frame)
        want = bpfsys.XDP_PASS if step.action == Action.PASS else bpfsys.XDP_REDIRECT
        assert bpfsys.XDP_ACTIONS[action] == bpfsys.XDP_ACTIONS[want], step.what
        assert out == step.frame, f"{step.what}: the steering program changed the frame"
    passed = sum(s.action == Action.PASS for s in case.steps)
    assert maps.counters(limits.NO_JOB)["pass"] - before == passed


def test_worker_counters(agg):
    """Per-worker counters follow the packets: contributions, duplicates, answers, drops."""
    from harness.packet_cases import frame, job, workers

    prog, maps = agg
    fd = prog.progs["xdp_agg_ingress"]
    maps.create_job(job(n=2))
    for w in workers(0, 2):
        maps.add_worker(w)
    a = np.arange(32)
    for f in (frame(0, a), frame(0, a), frame(1, a), frame(0, a), frame(0, np.arange(64))):
        bpfsys.prog_test_run(fd, f)
    assert maps.worker_counters(0, 0) == {
        "packets": 4,
        "contributions": 1,
        "duplicates": 2,
        "answered": 1,
        "dropped": 1,
    }
    assert maps.worker_counters(0, 1)["contributions"] == 1
    assert maps.counters(0)[Reason.COMPLETED.name.lower()] == 1


def test_job_listing_speaks_the_backend_vocabulary(agg):
    """jobs() entries carry every JobSpec field (the control endpoint relies on it)."""
    from harness.packet_cases import job, workers

    from xdp_switch.backend import job_dict

    _, maps = agg
    spec = job(n=2, port=wire.UDP_PORT + 3)
    maps.create_job(spec)
    for w in workers(0, 2, port=wire.UDP_PORT + 3):
        maps.add_worker(w)
    d = job_dict(0, maps.get_job(0), maps)
    assert set(spec.to_dict()) <= set(d)
    assert d["agg_port"] == wire.UDP_PORT + 3 and d["slot_count"] == spec.slot_count
    assert [w["index"] for w in d["workers"]] == [0, 1]


def test_rack_jobs_need_the_one_arm_topology(agg):
    """Up, down and answers of a rack job all leave with XDP_TX through the one interface."""
    from harness.packet_cases import job

    _, maps = agg
    with pytest.raises(ValueError, match="one-arm"):
        maps.create_job(job(tree=True, delivery=Delivery.BROADCAST))
    assert maps.get_job(0) is None


def test_bench_measures_jumbo_sizes_with_the_frags_program_only():
    """`xdp-agg bench` at 2048 elements: only the multi-buffer program takes the frames; every
    measured stream completes every slot (microbench checks the counters)."""
    from xdp_switch import microbench

    res = microbench.run(
        sizes=(768, 2048),
        workers=2,
        slots=4,
        rounds=2,
        repeats=1,
        cpu=None,
        variants=("percpu",),
        checksum=False,
    )
    assert {(r.variant, r.elems) for r in res} == {
        ("percpu", 768),
        (microbench.UNICAST_CASE, 768),
        (microbench.FRAGS_CASE, 768),
        (microbench.FRAGS_CASE, 2048),
    }
    assert all(r.ns_per_packet > 0 and r.packets == 2 * 4 * 2 for r in res)


def test_the_program_builds_without_shadowed_names():
    """Every build of bpf/ has -Wshadow on and every warning an error (bpfbuild.CFLAGS): a
    shadowed name fails the build, so no object that attach loads has one."""
    from xdp_switch import bpfbuild

    assert {"-Wshadow", "-Werror"} <= set(bpfbuild.CFLAGS)
