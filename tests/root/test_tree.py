"""Two-level aggregation end to end: 2 racks x 3 workers under one root aggregator.

Each worker is rank i of its rack's job; its rack aggregator forwards every completed slot to the
root as one contribution and sends the root's result down (docs/protocol.md section 3.7). Every
worker checks its result against the exact sum of all six workers' inputs (int32 bit-exact,
float32 within hostlib.scaling's bound for n = 6). Loss: 1% on every link, both ways (the
workers' links by the testbed's rules, the racks' and the root's on their bridge ports).
"""

import json

import pytest
from harness.trees import count_ok, parent_counters, rack_retransmissions, retransmissions

from xdp_agg.cluster.tree import TreeCluster, tree_hosts

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.slow]

RACKS, PER_RACK = 2, 3


def test_tree_without_loss(testbed_factory):
    tb = testbed_factory(workers=tree_hosts(RACKS, PER_RACK), topology="one-arm")
    plan = [
        {"dtype": "int32", "count": 10 * 256 + 3},
        {"dtype": "float32", "count": 50_000, "seed": 2},
        {"check": "counters"},
    ]
    with TreeCluster(tb, racks=RACKS, per_rack=PER_RACK) as tc:
        reports = tc.run_workers(plan, job="tree-clean")
        # the CLI: a rack job created by hand, its parent link in status, stats and job list
        root = tb.aggregator
        tc.cli(
            0,
            "job",
            "create",
            "9",
            "--workers",
            "3",
            "--slots",
            "200:16",
            "--agg-port",
            "48870",
            "--group",
            "198.18.0.255",
            "--parent-address",
            f"{root.ips[0]}:48871",
            "--parent-mac",
            root.macs[0],
            "--parent-slots",
            "300",
            "--worker-port",
            "40000",
            "--tree-workers",
            "6",
        )
        status = json.loads(tc.cli(0, "status", "--json").stdout)
        (j9,) = [j for j in status["jobs"] if j["job_id"] == 9]
        assert (j9["parent_ip"], j9["parent_port"], j9["parent_slot_base"]) == (
            root.ips[0],
            48871,
            300,
        )
        assert j9["parent"]["address"] == f"{root.ips[0]}:48871"
        assert j9["parent"]["uplink_port"] == 48870 and j9["worker_port"] == 40000
        assert j9["parent"]["counters"] == dict.fromkeys(
            ("forwarded_up", "resent_up", "parent_result", "stale_parent_result"), 0
        )
        text = tc.cli(0, "status").stdout + tc.cli(0, "stats").stdout
        assert text.count(f"parent {root.ips[0]}:48871 (uplink port 48870)") == 2, text
        tc.cli(0, "job", "delete", "9")
    assert count_ok(reports) == 2 * RACKS * PER_RACK
    for g, reps in enumerate(reports):
        c = next(r for r in reps if r.get("check") == "counters")
        # the endpoint's status shows the rack's parent link and its counters
        assert c["parent"]["address"] == f"{tb.aggregator.ips[0]}:48864", c["parent"]
        assert c["parent"]["counters"]["forwarded_up"] > 0
    for r in range(RACKS):
        pc = parent_counters(reports, r, PER_RACK)
        # without loss: every slot completed here went up once and its result came back once;
        # partials are re-sent only for the workers' (spurious, timer) retransmissions
        assert pc["forwarded_up"] == pc["parent_result"] > 0, pc
        # (every retransmission the counters saw came before its worker's counters check)
        retx = rack_retransmissions(reports, r, PER_RACK)
        assert pc["resent_up"] <= retx, (pc, retx)


def test_tree_exact_under_loss(testbed_factory):
    loss = 0.01
    tb = testbed_factory(
        workers=tree_hosts(RACKS, PER_RACK), topology="one-arm", loss_up=loss, loss_down=loss
    )
    mib = 1 << 20
    plan = [
        {"dtype": "int32", "count": 2 * mib // 4, "reps": 2, "seed": 3},
        {"dtype": "float32", "count": 2 * mib // 4, "reps": 2, "seed": 4},
        {"dtype": "int32", "count": 10 * 256 + 3, "seed": 5},
        {"check": "counters"},
    ]
    with TreeCluster(tb, racks=RACKS, per_rack=PER_RACK, loss=loss) as tc:
        reports = tc.run_workers(plan, job="tree-loss", timeout=60)
    assert count_ok(reports) == 3 * RACKS * PER_RACK
    retx = retransmissions(reports)
    assert retx > 0, "loss was configured but nothing was retransmitted"
    for r in range(RACKS):
        pc = parent_counters(reports, r, PER_RACK)
        # loss between the levels was recovered by re-sending partials up
        assert pc["forwarded_up"] > 0 and pc["resent_up"] > 0, pc
        assert pc["parent_result"] > 0, pc
