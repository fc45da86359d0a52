"""Lanes through the XDP aggregator in the testbed's two topologies: each lane's results come
back to its own source port (switch: the devmap copy to each worker; one-arm: the group's one
copy at that port, where lane l of every worker listens), so k lanes all-reduce exactly, also
with loss on the links both ways. Each worker checks its results itself (int32 exact, floats within
hostlib.scaling's bound: harness.workers)."""

import pytest
from harness.workers import MIXED_PLAN, assert_reports_ok

from xdp_agg.cluster.cluster import Cluster

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.slow]


@pytest.mark.parametrize(
    "topology, lanes, loss, data_path",
    [
        ("switch", 2, 0.0, "udp"),
        ("switch", 3, 0.01, "udp"),
        ("one-arm", 2, 0.0, "udp"),
        ("one-arm", 3, 0.01, "udp"),
        ("one-arm", 3, 0.0, "afxdp"),
    ],
)
def test_lanes_through_the_xdp_aggregator(
    testbed_factory, monkeypatch, topology, lanes, loss, data_path
):
    """AF_XDP: each lane's socket on the worker's veth queue, one UMEM (hostlib/_xsk.c); one-arm
    only, as AF_XDP workers run in the testbed (netns_testbed.xdp_pass: in the switch topology
    the worker's veth needs the testbed's own program). tests/root/test_afxdp_netns.py runs AF_XDP
    lanes under loss and duplication."""
    monkeypatch.setenv("XDP_AGG_LANES", str(lanes))  # the workers' environment (worker_env)
    monkeypatch.setenv("XDP_AGG_DATA_PATH", data_path)
    tb = testbed_factory(workers=3, topology=topology, loss_up=loss, loss_down=loss)
    plan = [*MIXED_PLAN, {"check": "counters"}]
    with Cluster(tb) as cl:
        reports = cl.run_workers(plan, job=f"lanes-{lanes}", window=16)
    assert_reports_ok(reports)
    for rank, reps in enumerate(reports):
        for r in reps:
            if "stats" in r:  # every lane on the path asked for (comma-separated if not)
                assert r["stats"]["lanes"] == lanes
                # a 16-bit all-reduce (float16 here) runs on the companion job, on the main
                # job's data path (AF_XDP: its sockets share the queue, hostlib/_xsk.c)
                assert r["stats"]["data_path"].split("-copy-")[0] == data_path, r["stats"]
        c = next(r for r in reps if r.get("check") == "counters")
        # every packet got its result (one per packet, over all lanes)
        assert c["aggregator"]["contributions"] == c["worker"]["results"], f"rank {rank}: {c}"
        if loss:
            assert c["worker"]["retransmissions"] > 0
