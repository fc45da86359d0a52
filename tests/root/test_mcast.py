"""Results only to a job's members (no other job's hosts, nor a stranger, get them).

Without root: the allocation of a group per job (xdp_agg.proto.groups), the control endpoint's use
of it, the choice between multicast and broadcast (xdp_agg.app.serving), the CLI's vocabulary, the
testbed's observers, and the frame counter's parsing (netns_testbed.sniff).

As root, in the one-arm testbed with the bridge snooping IGMP and a host in no job (an
observer), with the XDP aggregator and its control endpoint (xdp_agg.cluster.Cluster): a raw socket
on every host counts the result frames its link carries. Each member receives its own job's results
and no other job's, the observer none, and its membership report reaches the bridge before the
first result; with `--results broadcast` every host receives every job's results. An interface
without the multicast flag falls back to the broadcast with a warning, or is refused when
multicast is asked for.
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import time
import uuid

import pytest
from harness.cli import xdp_agg_cli
from harness.ranks import soft_cluster

from hostlib.rendezvous import ControlClient
from netns_testbed import plan, sniff
from xdp_agg.app import cli, serving
from xdp_agg.ctl.server import ControlEndpoint
from xdp_agg.errors import XdpAggError
from xdp_agg.proto import groups
from xdp_agg.proto.jobs import Delivery

# --- the allocation ---------------------------------------------------------------------------


def test_each_job_id_has_its_own_group_in_the_block():
    base = groups.DEFAULT_GROUP_BASE
    got = [groups.job_group(base, j) for j in range(64)]
    assert got[0] == "239.18.0.0" and got[5] == "239.18.0.5" and got[63] == "239.18.0.63"
    assert len(set(got)) == 64
    assert groups.job_group("239.255.4.0/26", 63) == "239.255.4.63"
    # distinct groups in one block also have distinct MACs (the low 23 bits differ)
    assert len({groups.group_mac(g) for g in got}) == 64


@pytest.mark.parametrize(
    "base, match",
    [
        ("198.18.0.0/24", "not multicast"),
        ("224.0.0.0/24", "224.0.0.0/24"),
        ("224.0.0.0/16", "224.0.0.0/24"),
        ("239.18.0.0/27", "fewer than the 64 job ids: use a /26"),
        ("239.18.0.1/24", "not an IPv4 network"),
        ("nonsense", "not an IPv4 network"),
    ],
)
def test_a_block_that_cannot_serve_every_job_is_refused(base, match):
    with pytest.raises(ValueError, match=match):
        groups.check_group_base(base)


def test_job_id_out_of_range_is_refused():
    with pytest.raises(ValueError, match="0..63"):
        groups.job_group(groups.DEFAULT_GROUP_BASE, 64)


def test_group_mac_is_the_rfc1112_mapping():
    assert groups.group_mac("239.18.0.5") == "01:00:5e:12:00:05"
    assert groups.group_mac("239.146.0.5") == "01:00:5e:12:00:05"  # bit 23 is not mapped
    assert groups.group_mac("198.18.0.255") == "ff:ff:ff:ff:ff:ff"
    assert serving.group_mac_for("239.1.2.3") == "01:00:5e:01:02:03"


# --- the control endpoint ---------------------------------------------------------------------


def _client(cl) -> ControlClient:
    return ControlClient(cl.server.address, timeout=5, source_ip=cl.worker_ip(0), secret=cl.secret)


def _create(c, job, worker_port=40000):
    return c.request("create", job=job, world_size=1, elems=64, window=4, worker_port=worker_port)[
        "job"
    ]


def test_the_endpoint_gives_each_job_its_own_group():
    defaults = {"group_base": "239.18.0.0/24", "group_ip": "10.0.0.255"}
    with soft_cluster(defaults=defaults) as cl:
        c = _client(cl)
        a, b = _create(c, "a", 40001), _create(c, "b", 40002)
        assert (a["job_id"], a["group_ip"], a["group_mac"]) == (
            0,
            "239.18.0.0",
            "01:00:5e:12:00:00",
        )
        assert (b["job_id"], b["group_ip"], b["group_mac"]) == (
            1,
            "239.18.0.1",
            "01:00:5e:12:00:01",
        )
        assert a["group"] == ["239.18.0.0", 40001] and b["group"] == ["239.18.0.1", 40002]
        # the backend was asked for exactly that
        by_id = {j["job_id"]: j for j in cl.aggregator.jobs()}
        assert by_id[1]["group_ip"] == "239.18.0.1"
        c.close()


def test_without_a_block_every_job_shares_the_fixed_group():
    with soft_cluster(defaults={"group_ip": "10.0.0.255"}) as cl:
        c = _client(cl)
        assert _create(c, "a")["group_ip"] == _create(c, "b")["group_ip"] == "10.0.0.255"
        c.close()


def test_the_switch_topology_has_no_group():
    defaults = {"group_base": "239.18.0.0/24", "delivery": Delivery.BROADCAST}
    with soft_cluster(defaults=defaults) as cl:
        c = _client(cl)
        job = _create(c, "a")
        assert job["group"] is None and job["group_ip"] == "0.0.0.0"
        c.close()


def test_the_endpoint_refuses_a_bad_block():
    with pytest.raises(ValueError, match="not multicast"):
        ControlEndpoint(object(), "127.0.0.1", 0, {"group_base": "10.0.0.0/24"}, secret=None)


# --- multicast or broadcast -------------------------------------------------------------------


def _iface(multicast: bool) -> dict:
    return {"ifname": "eth9", "multicast": multicast, "ipv4_nets": ["198.18.0.1/24"]}


def test_multicast_is_the_default_where_the_interface_has_it():
    warned = []
    assert serving._results_mode(_iface(True), None, warned.append) == "multicast"
    assert serving._results_mode(_iface(True), "broadcast", warned.append) == "broadcast"
    assert warned == []


def test_no_multicast_flag_falls_back_to_the_broadcast_with_a_warning():
    warned = []
    assert serving._results_mode(_iface(False), None, warned.append) == "broadcast"
    assert len(warned) == 1 and "eth9 has no multicast flag" in warned[0]
    assert "every host on the segment" in warned[0]
    # asked for explicitly: no silent downgrade
    with pytest.raises(XdpAggError, match="multicast on"):
        serving._results_mode(_iface(False), "multicast", warned.append)
    assert serving._results_mode(_iface(False), "broadcast", warned.append) == "broadcast"
    assert len(warned) == 1


def test_describe_results():
    assert "per job in 239.18.0.0/24" in serving.describe_results({"group_base": "239.18.0.0/24"})
    assert "198.18.0.255" in serving.describe_results({"group_ip": "198.18.0.255"})


@pytest.mark.parametrize("command", [["serve"], ["job", "create", "0", "--workers", "2"]])
def test_group_and_results_are_one_choice(command):
    r = xdp_agg_cli(*command, "--group", "239.1.1.1", "--results", "broadcast")
    assert r.exit_code == cli.EXIT_USAGE
    assert "either --group" in r.output
    r = xdp_agg_cli(*command, "--results", "anycast")
    assert r.exit_code == cli.EXIT_USAGE
    r = xdp_agg_cli(*command, "--group-base", "10.1.0.0/24")
    assert r.exit_code == cli.EXIT_USAGE and "not multicast" in r.output


def test_serve_help_names_the_results_options():
    out = xdp_agg_cli("serve", "--help").output
    assert "--results [multicast|broadcast|unicast]" in out and "--group-base" in out
    assert "IGMP snooping" in out


# --- the testbed's observers and the frame counter ----------------------------------------------


def test_observers_are_on_the_one_arm_bridge():
    p = plan.make_plan("xtab12", 2, "one-arm", observers=2)
    assert [(o.name, o.netns, o.ip) for o in p.observers] == [
        ("o0", "xtab12o0", "198.18.0.200"),
        ("o1", "xtab12o1", "198.18.0.201"),
    ]
    assert "xtab12o1" in p.namespaces
    assert plan.netns_name_re("xtab12").match("xtab12o1")
    links = [(v.ns_a, v.ns_b, v.if_b, v.bridge_b) for v in p.veths if v.ns_a == "xtab12o0"]
    assert links == [("xtab12o0", "xtab12sw", "o0", True)]
    with pytest.raises(ValueError, match="one-arm"):
        plan.make_plan("xtab12", 2, "switch", observers=1)
    with pytest.raises(ValueError, match="0..16"):
        plan.make_plan("xtab12", 2, "one-arm", observers=17)


def _eth(dst_mac: bytes, ip_payload: bytes, proto: int, dst: str) -> bytes:
    ip = struct.pack(
        "!BBHHHBBH4s4s",
        0x45,
        0,
        20 + len(ip_payload),
        0,
        0,
        1,
        proto,
        0,
        socket.inet_aton("198.18.0.10"),
        socket.inet_aton(dst),
    )
    return dst_mac + b"\x02" * 6 + b"\x08\x00" + ip + ip_payload


def test_the_counter_tells_results_from_igmp():
    mac = b"\x01\x00\x5e\x12\x00\x00"
    result = _eth(mac, struct.pack("!HHHH", 0xBEE3, 40000, 16, 0) + b"x" * 8, 17, "239.18.0.0")
    other_udp = _eth(mac, struct.pack("!HHHH", 5353, 0xBEE0, 16, 0) + b"x" * 8, 17, "239.18.0.0")
    v2_report = _eth(mac, bytes([0x16, 0, 0, 0]) + socket.inet_aton("239.18.0.0"), 2, "239.18.0.0")
    v2_leave = _eth(mac, bytes([0x17, 0, 0, 0]) + socket.inet_aton("239.18.0.0"), 2, "224.0.0.2")
    records = struct.pack("!BBH4s", 4, 0, 0, socket.inet_aton("239.18.0.1")) + struct.pack(
        "!BBH4s4s", 3, 0, 1, socket.inet_aton("239.18.0.2"), socket.inet_aton("198.18.0.1")
    )
    v3 = _eth(mac, bytes([0x22, 0, 0, 0, 0, 0, 0, 2]) + records, 2, "224.0.0.22")
    assert sniff.records(result) == [("result", "239.18.0.0")]
    assert sniff.records(result, outgoing=True) == []  # a worker sending from such a port
    assert sniff.records(other_udp) == []
    assert sniff.records(v2_report) == [("report", "239.18.0.0")]
    assert sniff.records(v2_leave) == [("leave", "239.18.0.0")]
    # a join record, then a CHANGE_TO_INCLUDE with a source (not a leave: it keeps one source)
    assert sniff.records(v3) == [("report", "239.18.0.1")]
    assert sniff.records(b"\x00" * 10) == []
    t = sniff.Tally()
    t.add(v2_report, now=t.started + 1.0)
    t.add(result, now=t.started + 1.5)
    t.add(result, now=t.started + 2.0)
    d = t.to_dict()
    assert d["results"]["239.18.0.0"] == {"frames": 2, "first": 1.5, "last": 2.0}
    assert d["igmp"]["239.18.0.0"] == {"reports": 1, "leaves": 0, "first": 1.0}


# --- in the testbed ---------------------------------------------------------------------------

PLAN = [{"dtype": "int32", "count": 1 << 17, "reps": 2}]


def _cluster(tb, *serve_args):
    from xdp_agg.cluster.cluster import Cluster

    return Cluster(tb, name=f"m{uuid.uuid4().hex[:8]}", serve_args=serve_args)


def _run_jobs(tb, cl, jobs: dict[str, list[int]]):
    """Run one job per entry (name -> testbed worker indices) at once while every host's link
    is counted: (the reports by job, the counts by host name)."""
    hosts = [w.name for w in tb.workers] + [o.name for o in tb.observers]
    sniffers = {h: tb.sniff(h) for h in hosts}
    try:
        started = {
            job: cl.start_workers(PLAN, hosts=members, job=job, elems=256)
            for job, members in jobs.items()
        }
        reports = {job: [r[0] for r in cl.collect(p, 120)] for job, p in started.items()}
    finally:
        counts = {h: s.stop() for h, s in sniffers.items()}
    for job, reps in reports.items():
        assert all(r["ok"] for r in reps), (job, reps)
    return reports, counts


def _frames(count: dict) -> dict[str, int]:
    return {dst: r["frames"] for dst, r in count["results"].items()}


def _mdb_groups(tb) -> dict[str, set[str]]:
    """The bridge's multicast database: group -> ports."""
    r = tb.run("sw", ["bridge", "-j", "mdb", "show"], check=True)
    out: dict[str, set[str]] = {}
    for dev in json.loads(r.stdout or "[]"):
        for e in dev.get("mdb", []):
            out.setdefault(e["grp"], set()).add(e["port"])
    return out


@pytest.mark.root
@pytest.mark.bpf
@pytest.mark.netns
def test_results_reach_the_members_and_no_other_host(testbed_factory):
    # two jobs at once (a: w0 w1, b: w2 w3), w4 in no job, and an observer o0
    tb = testbed_factory(workers=5, observers=1)
    with _cluster(tb) as cl:
        assert "multicast group per job in 239.18.0.0/24" in cl.serve_line and not cl.warnings
        reports, counts = _run_jobs(tb, cl, {"a": [0, 1], "b": [2, 3]})
        group = {job: reps[0]["group"][0] for job, reps in reports.items()}
        assert group["a"] != group["b"] and all(g.startswith("239.18.0.") for g in group.values())
        for job, members in (("a", [0, 1]), ("b", [2, 3])):
            g = group[job]
            for i, r in zip(members, reports[job]):
                c = counts[f"w{i}"]
                # every result of its job reached the member (one per packet it sent, less
                # those answered by retransmission, which are addressed to it alone), and no
                # other frame of ours did: not the other job's results
                assert (
                    _frames(c).get(g, 0)
                    >= r["stats"]["packets_sent"] - r["stats"]["retransmissions"]
                ), (i, c)
                assert set(_frames(c)) <= {g, tb.workers[i].ip}, (i, c)
                # its membership report was out before the first result arrived
                assert (
                    0 < c["igmp"][g]["reports"] and c["igmp"][g]["first"] < c["results"][g]["first"]
                )
        # the host in no job and the observer: not one result frame
        assert _frames(counts["w4"]) == {} and _frames(counts["o0"]) == {}
        # the members left their groups when they closed: the bridge forgets them (after two
        # unanswered last-member queries, 1 s apart)
        deadline = time.monotonic() + 10
        while set(group.values()) & set(_mdb_groups(tb)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not set(group.values()) & set(_mdb_groups(tb))


@pytest.mark.root
@pytest.mark.bpf
@pytest.mark.netns
def test_broadcast_results_reach_every_host(testbed_factory):
    tb = testbed_factory(workers=4, observers=1)
    with _cluster(tb, "--results", "broadcast") as cl:
        assert "198.18.0.255" in cl.serve_line
        reports, counts = _run_jobs(tb, cl, {"a": [0, 1], "b": [2, 3]})
        assert reports["a"][0]["group"][0] == "198.18.0.255"
        both = {
            job: min(r["stats"]["packets_sent"] - r["stats"]["retransmissions"] for r in reps)
            for job, reps in reports.items()
        }
        # every host, the observer included, received both jobs' results
        for h in ("w0", "w1", "w2", "w3", "o0"):
            assert _frames(counts[h]).get("198.18.0.255", 0) >= both["a"] + both["b"], h


@pytest.mark.root
@pytest.mark.bpf
@pytest.mark.netns
def test_without_the_multicast_flag_results_fall_back_to_the_broadcast(testbed_factory):
    tb = testbed_factory(workers=2, observers=1)
    tb.run("agg", ["ip", "link", "set", "eth0", "multicast", "off"], check=True)
    with _cluster(tb) as cl:
        assert len(cl.warnings) == 1 and "eth0 has no multicast flag" in cl.warnings[0]
        assert "results of every job to 198.18.0.255" in cl.serve_line
        # asked for explicitly, multicast is refused (exit 1) rather than silently downgraded
        cmd = [sys.executable, "-m", "xdp_agg.app.cli", "--name", cl.name]
        r = tb.run("agg", [*cmd, "serve", "--listen", "0.0.0.0:48801", "--results", "multicast"])
        assert r.returncode == 1 and "multicast on" in r.stderr, r.stderr
        # `job create` follows the same rule, and with the flag back gets the job's own group
        r = tb.run(
            "agg", [*cmd, "job", "create", "9", "--workers", "2", "--slots", "900:4", "--json"]
        )
        assert r.returncode == 0 and json.loads(r.stdout)["group_ip"] == "198.18.0.255"
        assert "no multicast flag" in r.stderr
        tb.run("agg", ["ip", "link", "set", "eth0", "multicast", "on"], check=True)
        cl.cli("job", "delete", "9")
        spec = json.loads(
            cl.cli("job", "create", "9", "--workers", "2", "--slots", "900:4", "--json").stdout
        )
        assert (spec["group_ip"], spec["group_mac"]) == ("239.18.0.9", "01:00:5e:12:00:09")
        cl.cli("job", "delete", "9")
        tb.run("agg", ["ip", "link", "set", "eth0", "multicast", "off"], check=True)
        reports, counts = _run_jobs(tb, cl, {"f": [0, 1]})
        assert reports["f"][0]["group"][0] == "198.18.0.255"
        assert _frames(counts["o0"]).get("198.18.0.255", 0) > 0  # the price of the fallback


def test_sniff_cli_usage():
    r = subprocess.run(
        [sys.executable, "-m", "netns_testbed.sniff"], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 2 and "usage" in r.stderr
