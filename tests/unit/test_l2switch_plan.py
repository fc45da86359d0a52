"""The testbed's switch topology routes each worker to the others through its port (issue 53):
198.18.0.0/15 only, by the port's address; one-arm has no such routes. No root."""

from netns_testbed.plan import SWITCH_ROUTE, make_plan


def test_l2switch_workers_route_the_benchmark_range_through_their_port():
    plan = make_plan("xt0001", 3, "switch")
    assert plan.worker_routes() == [
        (f"xt0001w{i}", "198.18.0.0/15", f"198.18.{i + 1}.1") for i in range(3)
    ]
    assert SWITCH_ROUTE == "198.18.0.0/15"
    assert make_plan("xt0001", 3, "one-arm").worker_routes() == []
