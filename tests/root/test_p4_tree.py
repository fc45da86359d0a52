"""Two levels with the P4 program: a bmv2 rack beside an XDP rack, under an XDP root.

xdp_agg.cluster.tree.TreeCluster on a one-arm testbed, 2 racks x 3 workers: rack 0 runs
p4/switchml.p4 in simple_switch on its host's one interface (`xdp-agg serve --target bmv2
--parent-endpoint ...`), rack 1 the XDP program, the root the XDP program. Rack 0 creates the
root's job, and both racks' partial sums meet there: a bmv2 rack's contributions must be the
bytes an XDP rack sends, and it must take the root's result as an XDP rack does
(docs/protocol.md section 3.7). Every worker checks its result against the exact sum of all six
workers' inputs (int32 bit-exact, float32 within hostlib.scaling's bound for n = 6), under 1%
loss on every link, both ways (the workers' links by the testbed's rules, the racks' and the
root's on their bridge ports), so partial sums and results between the levels are lost too.
"""

import pytest
from harness.p4 import p4_skip_reason
from harness.trees import count_ok, parent_counters, retransmissions

from xdp_agg.cluster.tree import TreeCluster, tree_hosts

pytestmark = [
    pytest.mark.root,
    pytest.mark.bpf,
    pytest.mark.netns,
    pytest.mark.p4,
    pytest.mark.slow,
]

RACKS, PER_RACK = 2, 3
BMV2_RACK = 0


def test_bmv2_rack_under_an_xdp_root_exact_under_loss(testbed_factory, tmp_path):
    reason = p4_skip_reason()
    if reason:
        pytest.skip(reason)
    loss = 0.01
    tb = testbed_factory(
        workers=tree_hosts(RACKS, PER_RACK), topology="one-arm", loss_up=loss, loss_down=loss
    )
    plan = [
        {"dtype": "int32", "count": 1024 * 256 + 3, "seed": 8},  # 1025 packets per worker
        {"dtype": "float32", "count": 64 * 256, "seed": 9},
        {"check": "counters"},
    ]
    with TreeCluster(
        tb,
        racks=RACKS,
        per_rack=PER_RACK,
        loss=loss,
        bmv2_racks=(BMV2_RACK,),
        workdir=str(tmp_path),
    ) as tc:
        reports = tc.run_workers(plan, job="p4-tree", window=32, timeout=60)
    assert count_ok(reports) == 2 * RACKS * PER_RACK
    assert retransmissions(reports) > 0, "loss was configured but nothing was retransmitted"
    for r in range(RACKS):
        pc = parent_counters(reports, r, PER_RACK)
        # every slot completed in the rack went up, and the root's results came down
        assert pc["forwarded_up"] > 0 and pc["parent_result"] > 0, (r, pc)
    for g in range(BMV2_RACK * PER_RACK, (BMV2_RACK + 1) * PER_RACK):
        c = next(x for x in reports[g] if x.get("check") == "counters")
        # the bmv2 rack's endpoint reports its parent link as an XDP rack's does
        assert c["parent"]["address"] == f"{tb.aggregator.ips[0]}:48864", c["parent"]
        assert c["parent"]["switch_port"] == 0
    # loss between the levels was recovered through the bmv2 rack: partials re-sent up on its
    # workers' retransmissions
    assert parent_counters(reports, BMV2_RACK, PER_RACK)["resent_up"] > 0
