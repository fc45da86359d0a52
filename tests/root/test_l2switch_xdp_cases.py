"""The forwarding cases (tests/harness/forward_cases.py) through the XDP program, by
BPF_PROG_TEST_RUN, in the aggregator namespace of a 4-worker switch-topology testbed (its ports
are real devices there, so bpf_fib_lookup finds the routes and the neighbours this fixture puts
in). For every step: the XDP action, the frame after the program (routed: MACs of the lookup,
TTL or hop limit one less, the IPv4 checksum still right; otherwise unchanged), the forwarding
counter it moves, and the serial model's verdict; after every case the table events and the
learned MAC table. The builds attach can make: the rss build's xdp_agg_ingress and the cpumap
build's xdp_agg_steer (the program on the interfaces there).
"""

from __future__ import annotations

import ctypes as ct
import os
import time

import pytest
from harness.forward_cases import (
    BOX_MACS,
    CASES,
    NEIGHBOURS,
    PORTS,
    V6_NEIGHBOURS,
    V6_PORT,
    FwdCase,
    FwdModel,
    Verdict,
    check_model,
    mac_for_ip,
)
from scapy.layers.inet import IP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether

from netns_testbed import Testbed
from netns_testbed.fixtures import skip_unless_root
from xdp_agg import bpfsys
from xdp_switch import forwarding, links, loader
from xdp_switch.ctl_maps import AggMaps

pytestmark = [pytest.mark.root, pytest.mark.bpf]

ACTIONS = {
    Verdict.FORWARD: bpfsys.XDP_REDIRECT,
    Verdict.FLOOD: bpfsys.XDP_REDIRECT,
    Verdict.TO_HOST: bpfsys.XDP_PASS,
    Verdict.DROP: bpfsys.XDP_DROP,
}
BUILDS = {"rss": loader.PROG_INGRESS, "cpumap": loader.PROG_STEER}
# IGMP snooping's hash maps (bpf/snoop.h) and their key types, emptied before each case
SNOOP_MAPS = {
    "fwd_groups": forwarding.FwdGroup,
    "fwd_group_any": ct.c_uint32,
    "fwd_mrouters": ct.c_uint32,
}


def _setns(fd: int) -> None:
    libc = ct.CDLL(None, use_errno=True)
    assert libc.setns(fd, 0x40000000) == 0, os.strerror(ct.get_errno())


def _prepare(tb: Testbed) -> None:
    """The neighbours forward_cases resolves, permanent; IPv6 on the ports it routes."""
    script = []
    for ip, (i, mac) in NEIGHBOURS.items():
        script.append(f"ip neigh replace {ip} lladdr {mac} dev p{i} nud permanent")
    for ip, (i, mac) in V6_NEIGHBOURS.items():
        script += [
            f"sysctl -qw net.ipv6.conf.p{i}.disable_ipv6=0",
            f"ip addr add {V6_PORT[i]}/64 dev p{i} nodad",
            f"ip -6 neigh replace {ip} lladdr {mac} dev p{i} nud permanent",
        ]
    r = tb.run(tb.aggregator, ["sh", "-ec", "\n".join(script)])
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def box():
    """(testbed, port infos): this process in its aggregator namespace, back out after."""
    skip_unless_root()
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    with Testbed(workers=PORTS, topology="switch") as tb:
        _prepare(tb)
        links.enter_netns(tb.aggregator.netns)
        try:
            infos = [links.addresses(f"p{i}") for i in range(PORTS)]
            before = forwarding.enable_kernel_forwarding([i["ifname"] for i in infos])
            yield tb, infos
            forwarding.restore_sysctls(before)
        finally:
            _setns(home)
            os.close(home)


@pytest.fixture(scope="module", params=sorted(BUILDS))
def agg(request, box):
    _, infos = box
    prog = loader.load(pool_slots=64, slot_cpus=request.param)
    try:
        maps = AggMaps(prog.maps, 64)
        for i, info in enumerate(infos):
            maps.set_port(i, info["ifindex"], prog.progs[loader.PROG_EGRESS])
        yield prog, maps, prog.progs[BUILDS[request.param]]
    finally:
        prog.close()


def _reset(case: FwdCase, prog, maps: AggMaps, infos) -> None:
    """The case's mode, timers and learned table; counters zero."""
    forwarding.install(prog.maps, case.mode, infos, prog.progs[loader.PROG_EGRESS])
    forwarding.set_timers(prog.maps, case.age_s, case.hold_s, case.leave_s)
    fd = prog.maps["fwd_macs"]
    for k in bpfsys.map_keys(fd, forwarding.FwdMac):
        bpfsys.map_delete(fd, k)
    for name, key in SNOOP_MAPS.items():
        for k in bpfsys.map_keys(prog.maps[name], key):
            bpfsys.map_delete(prog.maps[name], k)
    bpfsys.map_update(prog.maps["fwd_querier"], ct.c_uint32(0), ct.c_uint64(0))
    now = time.monotonic_ns()  # bpf_ktime_get_ns's clock
    for mac, port in case.table.items():
        v = forwarding.FwdLearned(infos[port]["ifindex"], 0, now)
        bpfsys.map_update(fd, forwarding._mac(mac), v)
    zero = (ct.c_uint64 * maps.ncpu)()
    for i in range(len(forwarding.COUNTERS)):
        bpfsys.map_update(prog.maps["fwd_stats"], ct.c_uint32(i), zero)


def _check_routed(step, out: bytes) -> None:
    req, got = Ether(step.frame), Ether(out)
    assert got.src == BOX_MACS[step.out_port], step.what
    if IP in req:
        assert got.dst == NEIGHBOURS[req[IP].dst][1], step.what
        assert got[IP].ttl == req[IP].ttl - 1, step.what
        check = got[IP].chksum
        del got[IP].chksum
        assert Ether(bytes(got))[IP].chksum == check, f"{step.what}: IPv4 checksum"
    else:
        assert got.dst == V6_NEIGHBOURS[req[IPv6].dst][1], step.what
        assert got[IPv6].hlim == req[IPv6].hlim - 1, step.what
    assert bytes(got[IP].payload if IP in got else got[IPv6].payload) == bytes(
        req[IP].payload if IP in req else req[IPv6].payload
    ), step.what


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_l2switch_xdp_case(box, agg, case: FwdCase):
    _, infos = box
    prog, maps, fd = agg
    _reset(case, prog, maps, infos)
    model = FwdModel(case)
    want = dict.fromkeys(forwarding.COUNTERS, 0)
    for step in case.steps:
        check_model(model, step)
        ifindex = infos[step.in_port]["ifindex"]
        action, out, _ = bpfsys.prog_test_run(fd, step.frame, ingress_ifindex=ifindex)
        want_action = ACTIONS[step.verdict]
        assert bpfsys.XDP_ACTIONS[action] == bpfsys.XDP_ACTIONS[want_action], step.what
        if step.verdict == Verdict.FORWARD and case.mode == "routed":
            _check_routed(step, out)
        else:
            assert out == step.frame, f"{step.what}: the frame was modified"
        if step.verdict == Verdict.FORWARD and case.mode == "switched":
            dst = Ether(step.frame).dst
            learned = forwarding.mac_table(prog.maps)
            assert learned[dst] == infos[step.out_port]["ifindex"], step.what
        want[step.counter] += 1
    for event, n in model.events.items():
        want[event] = n
    assert forwarding.counters(prog.maps, maps.ncpu) == want
    if case.mode == "switched":
        by_ifindex = {info["ifindex"]: i for i, info in enumerate(infos)}
        learned = {m: by_ifindex[x] for m, x in forwarding.mac_table(prog.maps).items()}
        assert learned == model.table
        snoop = forwarding.snooping(prog.maps)
        groups = {g: sorted(by_ifindex[x] for x in p) for g, p in snoop["groups"].items()}
        routers = sorted(by_ifindex[x] for x in snoop["router_ports"])
        assert (groups, routers) == model.snooped() == (case.groups, case.routers)
        assert snoop["querier"] == bool(case.routers)


def test_l2switch_xdp_mac_table_flood_is_bounded(box, agg):
    """More source MACs than the table holds: every frame flooded, the table at its size (the
    LRU evicts), each new address counted as learned."""
    _, infos = box
    prog, maps, fd = agg
    case = FwdCase("flood", "switched", [])
    _reset(case, prog, maps, infos)
    n = forwarding.MAC_TABLE_SIZE + 512
    for i in range(n):
        src = "02:aa:" + ":".join(f"{b:02x}" for b in i.to_bytes(4, "big"))
        frame = bytes(Ether(src=src, dst="02:bb:00:00:00:01") / IP(src="198.19.1.1") / (b"x" * 20))
        action, _, _ = bpfsys.prog_test_run(fd, frame, ingress_ifindex=infos[i % 2]["ifindex"])
        assert action == bpfsys.XDP_REDIRECT
    c = forwarding.counters(prog.maps, maps.ncpu)
    assert c["flooded"] == n and c["learned"] == n
    assert len(forwarding.mac_table(prog.maps)) <= forwarding.MAC_TABLE_SIZE


def test_l2switch_box_macs_are_the_testbeds(box):
    _, infos = box
    assert [i["mac"] for i in infos] == BOX_MACS
    assert [i["mac"] for i in infos] == [mac_for_ip(f"198.18.{i + 1}.1") for i in range(PORTS)]
