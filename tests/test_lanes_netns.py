"""Lanes through the XDP aggregator in the testbed's switch topology: each lane's results come
back to its own source port (the switch's rule), so k lanes all-reduce exactly, also with loss
on the links both ways. Each worker checks its results itself (int32 exact, floats within
hostlib.scaling's bound: harness.workers)."""

import pytest
from harness.workers import MIXED_PLAN, assert_reports_ok

from aggcluster.cluster import Cluster

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.slow]


@pytest.mark.parametrize("lanes, loss", [(2, 0.0), (3, 0.01)])
def test_lanes_in_the_switch_topology(testbed_factory, monkeypatch, lanes, loss):
    monkeypatch.setenv("XDP_AGG_LANES", str(lanes))  # the workers' environment (worker_env)
    tb = testbed_factory(workers=2, topology="switch", loss_up=loss, loss_down=loss)
    plan = [*MIXED_PLAN, {"check": "counters"}]
    with Cluster(tb) as cl:
        reports = cl.run_workers(plan, job=f"lanes-{lanes}", window=16)
    assert_reports_ok(reports)
    for rank, reps in enumerate(reports):
        c = next(r for r in reps if r.get("check") == "counters")
        # every packet got its result (one per packet, over all lanes)
        assert c["aggregator"]["contributions"] == c["worker"]["results"], f"rank {rank}: {c}"
        if loss:
            assert c["worker"]["retransmissions"] > 0
