"""bench.perfmodel, the deployment model (where the time per packet goes at n workers): its fit
against the committed testbed run and the arithmetic of its predictions (no root, no network)."""

import math

import pytest

from bench import perfmodel
from xdp_agg.proto import wire


@pytest.fixture(scope="module")
def results():
    import json

    return json.loads(perfmodel.RESULTS.read_text())


def test_the_model_is_within_a_third_of_every_64_mib_testbed_cell_of_4_or_more(results):
    # n = 2 leaves CPU idle between round trips (the model has no latency term) and 4 MiB cells
    # are a few windows long. The committed run (2026-12-03 14:18) has every 64 MiB cell of
    # n >= 4 within 16%; the one before had one cell out of 25%: n = 8 at 1 Gbit/s, 29% slower
    # than the model, with neither bound reached (1.5 of the 2 CPUs busy, 51% of the line rate):
    # eight ranks take turns on two CPUs and a slot waits for the last one, a scheduling term the
    # model does not have
    rows = [r for r in perfmodel.check(results) if r["n"] >= 4 and r["size"] == 64 << 20]
    assert len(rows) == 6
    for r in rows:
        assert abs(r["xdp_error"]) < 0.33, r
        assert abs(r["gloo_error"]) < 0.33, r
    assert sorted(abs(r["xdp_error"]) for r in rows)[-2] < 0.25  # all but the one above


def test_the_fit_recovers_a_known_per_packet_cost():
    k, cpus, c, g = 768, 2, 8e-6, 0.7 / 2**30
    cells = []
    for n in (2, 4, 8):
        P = math.ceil((64 << 20) / (4 * k))
        ring = 2 * (n - 1) / n * (64 << 20)
        cells.append(
            {
                "kind": "throughput",
                "n": n,
                "link": "unshaped",
                "bytes": 64 << 20,
                "xdp-agg": {"median_s": n * P * c / cpus},
                "gloo": {"median_s": n * ring * g / cpus},
            }
        )
    fitted = perfmodel.fit({"meta": {"cpus": cpus, "elems": k}, "summary": cells})
    assert fitted == pytest.approx((c, g))


def test_with_a_free_host_and_aggregator_the_link_bounds_and_the_speedup_is_the_rings():
    free = perfmodel.Costs(0, 0, 0, 0, 0, 0)
    d = perfmodel.Deployment(n=8, rate=100e9, mtu=9000, agg_link=1e15)
    p = perfmodel.predict(d, 64 << 20, free)
    assert p["bound"] == "link"
    efficiency = 4 * d.k / perfmodel.wire_bytes(d.k)  # payload share of the line
    assert p["speedup"] == pytest.approx(2 * 7 / 8 * efficiency, rel=1e-3)


def test_steering_slots_saves_the_gather_and_the_line_transfers():
    c = perfmodel.Costs()
    spread = perfmodel.predict(perfmodel.Deployment(n=32, rate=25e9), 64 << 20, c)
    steered = perfmodel.predict(perfmodel.Deployment(n=32, rate=25e9, steered=True), 64 << 20, c)
    k = perfmodel.Deployment(n=32, rate=25e9).k
    P = math.ceil((64 << 20) / (4 * k))
    elem = c.xdp_elem_frags if k > perfmodel.INPLACE_ELEMS else c.xdp_elem
    saved = (32 * P * c.bounce + P * 15 * k * elem) / 16
    assert spread["agg_cpu"] - steered["agg_cpu"] == pytest.approx(saved)


def test_the_packet_size_is_the_largest_that_fits_the_mtu():
    for mtu in (1500, 3500, 9000):
        k = perfmodel.Deployment(n=2, rate=1e9, mtu=mtu).k
        assert wire.frame_len(k) - wire.ETH_HLEN <= mtu
        bigger = [e for e in wire.SIZE_CODE_ELEMS.values() if e > k]
        assert all(wire.frame_len(e) - wire.ETH_HLEN > mtu for e in bigger)


def test_the_host_split_is_fitted_from_two_packet_sizes():
    a, b = perfmodel.fit_host()
    assert 0 < a < 20e-6 and 0 < b < 5e-9  # seconds per packet, per byte


def _host_run(tmp_path, elems, rows):
    """A results.json of host rows: (dtype, lanes, CPU s per GiB)."""
    import json

    summary = [
        {"kind": "host", "dtype": d, "lanes": k, "cpu_s_per_gib": c, "bytes": 64 << 20}
        for d, k, c in rows
    ]
    f = tmp_path / f"k{elems}.json"
    f.write_text(json.dumps({"meta": {"elems": elems}, "summary": summary}))
    return f


def test_lane_scaling_is_fitted_from_the_host_rows(tmp_path):
    """fit_host takes the 1-lane rows only; fit_lanes the CPU per GiB of k lanes over 1 lane's,
    and measured_costs turns the 2-lane ratio into lane_extra."""
    a = _host_run(tmp_path, 768, [("float32", 1, 2.0), ("int32", 1, 1.6), ("float32", 2, 2.4)])
    b = _host_run(tmp_path, 2048, [("float32", 1, 1.4), ("int32", 1, 1.2), ("int32", 2, 1.5)])
    lanes = perfmodel.fit_lanes([a, b])
    assert lanes[1] == 1.0 and lanes[2] == pytest.approx((2.4 / 2.0 + 1.5 / 1.2) / 2)
    costs = perfmodel.measured_costs([a, b])
    assert costs.lane_extra == pytest.approx(lanes[2] - 1)
    assert (costs.host_packet, costs.host_byte) == pytest.approx(perfmodel.fit_host([a, b]))


def test_lanes_divide_the_host_time_less_their_contention():
    c = perfmodel.Costs(lane_extra=0.25)
    one, four = (
        perfmodel.predict(perfmodel.Deployment(n=8, rate=25e9, lanes=k), 64 << 20, c)
        for k in (1, 4)
    )
    assert four["host"] == pytest.approx(one["host"] * (1 + 0.25 * 3) / 4)


def test_main_prints_the_check_and_the_predictions(capsys):
    assert perfmodel.main([]) == 0
    out = capsys.readouterr().out
    assert "fitted" in out and "| 64 | 100 | 9000 | steered | 4 |" in out
