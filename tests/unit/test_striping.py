"""Striping a job over several aggregators (hostlib.striping), on loopback with soft aggregators.

The testbed tests (XDP aggregators in namespaces, loss on the links, an aggregator lost
mid-run) are in test_stripe_netns.py.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from harness.ranks import init, ok, run_ranks, soft_cluster
from test_hostlib import (
    AcceptingBackend,
    assert_within_scaling_bound,
    float_inputs,
    int_expected,
    int_inputs,
)

import hostlib
from hostlib.communicator import parse_controls
from hostlib.engine import Faults, _fastpath
from hostlib.striping import stripe_bounds

# --- splitting ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "length, elems, k, want",
    [
        (10 * 32, 32, 2, [(0, 160), (160, 320)]),
        # 11 packets over 3: 4, 4, 3; the last one partial (8 of 32 elements)
        (10 * 32 + 8, 32, 3, [(0, 128), (128, 256), (256, 328)]),
        # fewer packets than aggregators: the last stripes are empty
        (40, 32, 3, [(0, 32), (32, 40), (40, 40)]),
        (5, 32, 2, [(0, 5), (5, 5)]),
        (0, 32, 2, [(0, 0), (0, 0)]),
        (100, 32, 1, [(0, 100)]),
    ],
)
def test_stripe_bounds(length, elems, k, want):
    assert stripe_bounds(length, elems, k) == want


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_stripes_cover_the_tensor_in_whole_packets(k):
    rng = np.random.default_rng(k)
    for _ in range(200):
        elems = int(rng.choice([32, 64, 256]))
        length = int(rng.integers(0, 40 * elems))
        bounds = stripe_bounds(length, elems, k)
        assert len(bounds) == k
        assert bounds[0][0] == 0 and bounds[-1][1] == length
        assert all(b0[1] == b1[0] for b0, b1 in zip(bounds, bounds[1:]))  # contiguous
        assert all(a % elems == 0 for a, b in bounds if b > a)  # start on a packet
        packets = [-(-(b - a) // elems) for a, b in bounds]
        assert max(packets) - min(packets) <= 1  # as even as whole packets allow
        assert packets == sorted(packets, reverse=True)


def test_bad_stripe_arguments():
    with pytest.raises(ValueError):
        stripe_bounds(10, 32, 0)
    with pytest.raises(ValueError):
        stripe_bounds(-1, 32, 2)


def test_aggregator_lists():
    assert parse_controls("10.0.0.1:1,10.0.0.2") == [("10.0.0.1", 1), ("10.0.0.2", 48800)]
    assert parse_controls(["a:5", " b:6 "]) == [("a", 5), ("b", 6)]
    assert parse_controls("a:5") == [("a", 5)]
    for bad in ("", [], "a:5,a:5", "a:5,,b:6"):
        with pytest.raises(ValueError):
            parse_controls(bad)


# the C loop is compared against the numpy one: without it built (e.g. a copy of the modules
# run as nobody) those tests cannot run
needs_fastpath = pytest.mark.skipif(
    _fastpath is None, reason="hostlib._fastpath is not built (python setup.py build_ext --inplace)"
)

# --- all-reduces over k soft aggregators ------------------------------------------------------


def _run(cluster, n, fn, *, job="striped", **kw):
    """fn(comm) on ranks 0..n-1, each joined to every aggregator of `cluster`."""
    return run_ranks(cluster, n, fn, job=job, deadline=90.0, **kw)


@needs_fastpath
def test_int32_and_float32_over_two_aggregators_equal_one_aggregator():
    """Striped sums equal unstriped ones bit for bit (same packets, other aggregators), in the
    numpy loop and in the C loop alike, for odd lengths, a tensor of fewer packets than
    aggregators, and an empty one."""
    n, elems = 3, 32
    lengths = [elems * 40 + 7, elems * 9, 5, 0]

    def body(c):
        out = [c.allreduce(int_inputs(c.rank, L, seed=L)) for L in lengths]
        out += [c.allreduce(float_inputs(c.rank, L, elems)) for L in lengths]
        return out, c.stats_per_aggregator(), c.controls

    striped_out = {}
    for native in (False, True):
        with soft_cluster(aggregators=2) as st:
            res = ok(_run(st, n, body, elems=elems, window=8, native=native))
            endpoints = st.endpoints
        striped_out[native] = [out for out, _, _ in res]
        for out, per, aggs in res:
            assert aggs == endpoints
            for i, L in enumerate(lengths):
                assert np.array_equal(out[i], int_expected(n, L, seed=L))
            inputs = [float_inputs(r, lengths[0], elems) for r in range(n)]
            assert_within_scaling_bound(out[len(lengths)], inputs, elems)
            # both aggregators carried packets; the 5- and 0-element tensors only the first
            assert [p["control"] for p in per] == endpoints
            assert all(p["results"] > 0 for p in per)
            assert per[0]["allreduces"] == per[1]["allreduces"] + 2
    with soft_cluster() as st:
        single = ok(_run(st, n, lambda c: body(c)[0], elems=elems, window=8, native=True))
    for r in range(n):
        for i in range(2 * len(lengths)):
            assert np.array_equal(striped_out[False][r][i], single[r][i])
            assert np.array_equal(striped_out[True][r][i], single[r][i])


@needs_fastpath
def test_both_loops_in_one_striped_job_under_loss():
    """Rank 0 runs the numpy loop, the others the C loop; seeded loss both ways on every
    stripe: exact int32, float32 within the bound, retransmissions on both aggregators."""
    n, elems, L = 3, 64, 64 * 50 + 3

    def body(c):
        out = [c.allreduce(int_inputs(c.rank, L, seed=s)) for s in range(2)]
        out.append(c.allreduce(float_inputs(c.rank, L, elems)))
        return out, c.stats_per_aggregator(), c.stats

    with soft_cluster(aggregators=2) as st:
        results = _run(
            st,
            n,
            body,
            job="mixed",
            control_spec=",".join(st.endpoints),  # the environment's form
            elems=elems,
            window=16,
            retransmit=0.01,
            per_rank=lambda r: {
                "native": r != 0,
                "faults": Faults(send_loss=0.02, recv_loss=0.02, seed=r),
            },
        )
    inputs = [float_inputs(r, L, elems) for r in range(n)]
    retx = [0, 0]
    for out, per, total in ok(results):
        assert np.array_equal(out[0], int_expected(n, L, seed=0))
        assert np.array_equal(out[1], int_expected(n, L, seed=1))
        assert_within_scaling_bound(out[2], inputs, elems)
        for j in range(2):
            retx[j] += per[j]["retransmissions"]
        assert total["retransmissions"] == per[0]["retransmissions"] + per[1]["retransmissions"]
        assert total["allreduces"] == 3 and total["elements"] == 3 * L
    assert retx[0] > 0 and retx[1] > 0


def test_a_silent_aggregator_is_named_within_the_timeout():
    """The second aggregator takes the job but never answers: the all-reduce fails after about
    the stall timeout, naming that aggregator; the first one's stripe completed."""
    prefix_backend = AcceptingBackend()
    with soft_cluster(backends=[None, prefix_backend]) as st:
        t0 = time.monotonic()
        res = _run(st, 2, lambda c: c.allreduce(np.ones(32 * 20, np.int32)), timeout=1.5)
        took = time.monotonic() - t0
        bad = st.endpoints[1]
        good = st.endpoints[0]
    for err in res:
        assert isinstance(err, hostlib.AllreduceTimeout), err
        text = str(err)
        # "lane l of k at " first where the rank runs lanes (HostOptions.lanes)
        where = f"aggregator 1 of 2 (control endpoint {bad}, contributions to "
        assert re.match(rf"(lane \d+ of \d+ at )?{re.escape(where)}", text), text
        assert "no result at all" in text
        assert err.stripe == 1 and f"{err.endpoint[0]}:{err.endpoint[1]}" == bad
        assert good not in text
    assert took < 10


def test_torch_backend_striped_through_the_environment():
    """hostlib.pt's backend with XDP_AGG_CONTROL listing two aggregators: its collectives as on
    one (every dtype and op, through the aggregators or gloo as they should go)."""
    pytest.importorskip("torch", reason="torch is not importable: pip install 'xdp-agg[torch]'")
    from harness.torch_procs import check_backend as _check_backend
    from harness.torch_procs import collect_reports as _reports
    from harness.torch_procs import start_loopback as _start_loopback

    class TwoAsOne:  # what _start_loopback reads of a cluster
        def __init__(self, st) -> None:
            self.endpoint = ",".join(st.endpoints)
            self.worker_ip = st.worker_ip
            self.secret_file = st.secret_file

    with soft_cluster(aggregators=2) as st:
        procs = _start_loopback(TwoAsOne(st), 2, "backend", "--backend-spec", "cpu:xdpagg")
        _check_backend(_reports(procs), 2)
        # both aggregators summed contributions of both ranks
        for agg in st.aggs:
            per_worker = agg.worker_counters(0)
            assert sorted(per_worker) == [0, 1]
            assert all(c["contributions"] > 0 for c in per_worker.values()), per_worker


def test_an_unreachable_second_aggregator_is_named_at_init():
    with soft_cluster() as st:
        dead = f"{st.prefix}.201:9"  # nothing listens there
        t0 = time.monotonic()
        with pytest.raises(hostlib.RendezvousError) as ei:
            init(
                0,
                1,
                [st.endpoints[0], dead],
                job="half",
                ip=st.worker_ip(0),
                secret_file=st.secret_file,
            )
        assert time.monotonic() - t0 < 10
    assert str(ei.value).startswith(f"aggregator 1 ({dead}): cannot reach the control endpoint")
