"""Striping in the testbed: K aggregator namespaces on the one-arm bridge, each with its own XDP
aggregator and control endpoint; and one aggregator serving a job of 32 workers.

Every worker checks its own result against the exact sum of all ranks' inputs (int32 bit-exact,
floats within hostlib.scaling's bound), as in test_e2e_xdp.py.
"""

from __future__ import annotations

import os
import time

import pytest
from harness.workers import MIXED_PLAN, ODD, assert_reports_ok

from netns_testbed import plan
from netns_testbed.fixtures import SKIP_REASON
from xdp_agg.cluster.cluster import Cluster, ClusterError

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason=SKIP_REASON)


def test_plan_with_several_aggregators():
    p = plan.make_plan("xt0001", 2, "one-arm", aggregators=3)
    assert p.namespaces == [
        "xt0001sw",
        "xt0001ag",
        "xt0001ag1",
        "xt0001ag2",
        "xt0001w0",
        "xt0001w1",
    ]
    assert [a.ips for a in p.aggregators] == [["198.18.0.1"], ["198.18.0.2"], ["198.18.0.3"]]
    assert [a.name for a in p.aggregators] == ["agg", "agg1", "agg2"]
    assert p.aggregator is p.aggregators[0]
    assert {w.agg_ip for w in p.workers} == {"198.18.0.1"}  # the first, as with one
    assert sorted(v.if_b for v in p.veths if v.worker is None) == ["ag", "ag1", "ag2"]
    assert [plan.aggregator_group_base(j) for j in range(2)] == ["239.18.0.0/24", "239.18.1.0/24"]
    assert all(plan.netns_name_re("xt0001").match(ns) for ns in p.namespaces)
    one = plan.make_plan("xt0001", 2, "one-arm")
    assert one.aggregators == [one.aggregator] and len(one.namespaces) == 4
    with pytest.raises(ValueError, match="one-arm"):
        plan.make_plan("xt0001", 2, "switch", aggregators=2)
    with pytest.raises(ValueError, match="1..9"):
        plan.make_plan("xt0001", 2, "one-arm", aggregators=10)


def test_cli_refuses_several_aggregators_outside_one_arm():
    from harness.cli import run_testbed_cli as run

    r = run("up", "--aggregators", "2", "--topology", "switch")
    assert r.exit_code == 2 and "one-arm" in r.output
    r = run("up", "--aggregators", "10")
    assert r.exit_code == 2 and "1<=x<=9" in r.output.replace(" ", "")
    assert "--aggregators" in run("up", "--help").output


# Receiver of one multicast group: prints "ready", then the payloads it got until `idle` s pass.
RECV_GROUP = r"""
import json, socket, sys
group, me, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", port))
mreq = socket.inet_aton(group) + socket.inet_aton(me)
s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
s.settimeout(1.5)
print("ready", flush=True)
got = []
try:
    while True:
        got.append(s.recv(100).decode())
except socket.timeout:
    pass
print(json.dumps(got), flush=True)
"""
SEND_GROUP = r"""
import socket, sys
group, me, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(me))
s.sendto(b"result", (group, port))
"""


def _receiver(tb, host, group, me, port):
    import json
    import subprocess
    import sys

    p = tb.popen(
        host,
        [sys.executable, "-c", RECV_GROUP, group, me, str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "ready"
    return lambda: json.loads(p.communicate(timeout=20)[0])


@pytest.mark.root
@pytest.mark.netns
@needs_root
def test_testbed_with_two_aggregators(testbed_factory):
    """Both aggregators answer every worker; a result multicast by one reaches every worker and
    not the other aggregator; --agg-rate shapes both aggregators' links."""
    import sys

    tb = testbed_factory(workers=2, aggregators=2, agg_rate="300mbit")
    assert [a.netns for a in tb.aggregators] == [f"{tb.prefix}ag", f"{tb.prefix}ag1"]
    for w in tb.workers:
        for a in tb.aggregators:
            cp = tb.run(w, ["ping", "-c", "1", "-W", "2", a.ips[0]])
            assert cp.returncode == 0, cp.stdout + cp.stderr
    group = "239.18.0.1"  # a group of aggregator 0's block, joined by the workers only
    rx = [_receiver(tb, w, group, w.ip, 5555) for w in tb.workers]
    cp = tb.run("agg", [sys.executable, "-c", SEND_GROUP, group, tb.aggregator.ips[0], "5555"])
    assert cp.returncode == 0, cp.stderr
    assert [r() for r in rx] == [["result"], ["result"]]
    # the bridge forwards the group to its members' ports only (IGMP snooping), and the other
    # aggregator's port floods no unregistered multicast either (mcast_flood off)
    mdb = tb.run("sw", ["bridge", "mdb", "show"]).stdout
    assert group in mdb and not any(group in ln and "port ag1" in ln for ln in mdb.splitlines())
    flags = tb.run("sw", ["bridge", "-d", "link", "show", "dev", "ag1"]).stdout
    assert "mcast_flood off" in flags, flags
    for a, port in zip(tb.aggregators, ["ag", "ag1"]):
        assert "rate 300Mbit" in tb.run(a, ["tc", "qdisc", "show", "dev", "eth0"]).stdout
        assert "rate 300Mbit" in tb.run("sw", ["tc", "qdisc", "show", "dev", port]).stdout
    st = tb.state()
    assert st["n_aggregators"] == 2 and len(st["aggregators"]) == 2


@pytest.mark.parametrize("loss", [0.01])
@pytest.mark.root
@pytest.mark.netns
@pytest.mark.bpf
@pytest.mark.slow
@needs_root
def test_striped_over_two_aggregators_exact_under_loss(testbed_factory, loss):
    """4 workers, 2 XDP aggregators, 1% loss both ways on every worker link: int32 bit-exact,
    float32 and float16 within the bound, both aggregators carried traffic and retransmitted."""
    tb = testbed_factory(workers=4, aggregators=2, loss_up=loss, loss_down=loss)
    work = MIXED_PLAN
    with Cluster(tb) as cl:
        reports = cl.run_workers(work, job="striped", aggregators=2, timeout=60)
        stats = [cl.stats(j) for j in range(2)]
    assert_reports_ok(reports)
    endpoints = [f"198.18.0.{1 + j}:48800" for j in range(2)]
    retx = [0, 0]
    for reps in reports:
        for r in reps:
            assert [p["control"] for p in r["per_aggregator"]] == endpoints
            if r["count"] >= 2 * 256:  # at least a packet for each
                assert all(p["results"] > 0 for p in r["per_aggregator"]), r
            for j, p in enumerate(r["per_aggregator"]):
                retx[j] += p["retransmissions"]
    assert retx[0] > 0 and retx[1] > 0, f"loss was configured, retransmissions {retx}"
    for st in stats:  # each aggregator saw contributions of this job and dropped none of ours
        assert st["unattributed"]["drop_unknown_source"] == 0


@pytest.mark.root
@pytest.mark.netns
@pytest.mark.bpf
@pytest.mark.slow
@needs_root
def test_a_lost_aggregator_is_named(testbed_factory):
    """Aggregator 1's XDP program is detached while the workers stream: every worker fails within
    its stall timeout (plus slack) with an error naming aggregator 1, its control endpoint and
    its data address."""
    tb = testbed_factory(workers=2, aggregators=2)
    work = [
        {"dtype": "int32", "count": ODD},
        {"dtype": "int32", "count": 100_000, "reps": 100_000, "verify": False},
    ]
    with Cluster(tb) as cl:
        procs = cl.start_workers(work, job="lose-one", aggregators=2, timeout=3)
        first = procs[0][1].stdout.readline()  # the first all-reduce completed: mid-run now
        assert '"ok": true' in first, first
        time.sleep(0.3)
        cl.detach(1)
        t0 = time.monotonic()
        with pytest.raises(ClusterError) as ei:
            cl.collect(procs, deadline=60)
        took = time.monotonic() - t0
    msg = str(ei.value)
    assert "rank 0 exited" in msg and "rank 1 exited" in msg
    named = "aggregator 1 of 2 (control endpoint 198.18.0.2:48800, contributions to 198.18.0.2:"
    assert msg.count(named) == 2, msg
    assert took < 3 + 15, f"the workers took {took:.1f} s to give up"


@pytest.mark.root
@pytest.mark.netns
@pytest.mark.bpf
@pytest.mark.slow
@needs_root
def test_thirty_two_workers_on_one_aggregator(testbed_factory):
    """The testbed's most workers (plan.MAX_TESTBED_WORKERS) in one job on one XDP aggregator, small
    tensors: every rank's int32 sum exact, float32 within the bound; the aggregator counted one
    contribution per result of every rank and dropped nothing."""
    n = plan.MAX_TESTBED_WORKERS
    tb = testbed_factory(workers=n)
    work = [
        {"dtype": "int32", "count": ODD, "reps": 2},
        {"dtype": "float32", "count": 4 * 256, "seed": 2},
        {"check": "counters"},
    ]
    with Cluster(tb) as cl:
        reports = cl.run_workers(work, job="thirty-two", window=16, timeout=60, deadline=600)
        st = cl.stats()
    assert len(reports) == n
    assert_reports_ok(reports)
    for rank, reps in enumerate(reports):
        c = next(r for r in reps if r.get("check") == "counters")
        assert c["aggregator"]["contributions"] == c["worker"]["results"], f"rank {rank}"
        assert c["aggregator"]["dropped"] == 0
    assert st["unattributed"]["drop_unknown_source"] == 0
