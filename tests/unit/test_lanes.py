"""Lanes (HostOptions.lanes): one all-reduce on k threads, each with its own socket, source port,
slot range, congestion window and timers (hostlib.striping), on loopback soft aggregators in
both topologies: results go to the completing request's source port (lane l of every worker
sends from the job's worker_port + l, so in the one-arm topology the group's copy at that port
reaches lane l everywhere).

The numpy loop is the single-lane reference: k C lanes are compared byte for byte with k numpy
lanes over the same slots, and with one lane (block scaling works per packet, and lanes cut the
tensor at whole packets, so every packet carries the same elements whatever k is).
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
from harness.ranks import ok, run_ranks, soft_cluster
from test_hostlib import float_inputs, int_expected, int_inputs

import hostlib
from hostlib import HostOptions
from hostlib.engine import Faults, _fastpath
from hostlib.striping import MIN_LANE_PACKETS, LaneGrid, lane_windows, part_bounds
from xdp_agg.proto.jobs import Delivery

SWITCH = {"delivery": Delivery.BROADCAST}
ELEMS = 32
# 601 packets, enough for 3 lanes (MIN_LANE_PACKETS each) or for 2 at each of two aggregators,
# the last partial; 300, two lanes at most; a few packets, one lane; fewer packets than lanes;
# empty
LENGTHS = [ELEMS * 600 + 7, ELEMS * 300, ELEMS * 5, 5, 0]

needs_fastpath = pytest.mark.skipif(
    _fastpath is None, reason="hostlib._fastpath is not built (python setup.py build_ext --inplace)"
)


def test_lane_windows():
    assert lane_windows(100, 8, 1) == [(100, 8)]
    assert lane_windows(100, 8, 2) == [(100, 4), (104, 4)]
    assert lane_windows(0, 8, 3) == [(0, 3), (3, 3), (6, 2)]
    assert lane_windows(5, 3, 3) == [(5, 1), (6, 1), (7, 1)]
    with pytest.raises(ValueError, match="at least 3 slots"):
        lane_windows(0, 2, 3)
    with pytest.raises(ValueError):
        lane_windows(0, 8, 0)


def test_small_tensors_use_fewer_lanes():
    """A lane gets MIN_LANE_PACKETS packets or none; the parts cover the tensor in order, whole
    packets, lane 0 first, at every aggregator."""
    m, e = MIN_LANE_PACKETS, 10
    assert part_bounds(5, e, 1, 2) == [(0, 0, 5)]
    assert part_bounds((2 * m - 1) * e, e, 1, 2) == [(0, 0, (2 * m - 1) * e)]
    assert part_bounds(2 * m * e, e, 1, 2) == [(0, 0, m * e), (1, m * e, 2 * m * e)]
    assert part_bounds(2 * m * e + 3, e, 1, 3) == [
        (0, 0, (m + 1) * e),
        (1, (m + 1) * e, 2 * m * e + 3),
    ]
    # two aggregators of 2 lanes: each stripe of 2m packets on both of its lanes
    parts = part_bounds(4 * m * e, e, 2, 2)
    assert [p[0] for p in parts] == [0, 1, 2, 3]
    assert [p[1] for p in parts] == [0, m * e, 2 * m * e, 3 * m * e] and parts[-1][2] == 4 * m * e
    assert part_bounds(0, e, 2, 2) == []


@pytest.mark.parametrize("bad", [0, -1, "2", 1.5, True, None])
def test_a_bad_lanes_value_is_refused(bad):
    with pytest.raises(ValueError, match="lanes must be an integer of at least 1"):
        HostOptions(lanes=bad)


def test_lanes_from_the_environment():
    assert HostOptions().lanes == 1
    assert HostOptions.from_env({"XDP_AGG_LANES": "3"}).lanes == 3
    assert HostOptions.from_env({"XDP_AGG_LANES": "Auto"}).lanes == "auto"
    with pytest.raises(ValueError, match="XDP_AGG_LANES='two'"):
        HostOptions.from_env({"XDP_AGG_LANES": "two"})
    with pytest.raises(ValueError, match="lanes must be"):
        HostOptions.from_env({"XDP_AGG_LANES": "0"})
    assert HostOptions(lanes=2, data_path="afxdp").lanes == 2  # a socket per lane, one UMEM
    with pytest.raises(ValueError, match="at most 64"):
        HostOptions(lanes=65)  # the AF_XDP program's map has a socket per lane


@pytest.mark.parametrize(
    "cpus, native, window, data_path, want",
    [({0, 1, 2, 3}, True, 64, "udp", 2), ({0}, True, 64, "udp", 1), ({0, 1}, False, 64, "udp", 1),
     ({0, 1}, True, 1, "udp", 1), ({0, 1}, True, 64, "auto", 2), ({0, 1}, True, 64, "afxdp", 2)],
)  # fmt: skip
def test_auto_lanes(monkeypatch, cpus, native, window, data_path, want):
    """lanes="auto": a lane per CPU the process may run on, at most AUTO_LANES_MAX and the window,
    on either data path; one with the numpy loop (it holds the GIL)."""
    from hostlib import options

    monkeypatch.setattr(options.os, "sched_getaffinity", lambda pid: cpus)
    opts = HostOptions(window=window, data_path=data_path)
    assert options.auto_lanes(opts, native) == want


@needs_fastpath
def test_auto_lanes_are_rank_0s_on_every_rank(monkeypatch):
    """Rank 0 chooses (here 2: the process may run on 4 CPUs); the other ranks with "auto" take
    the job's, whatever their own CPUs, and an explicit number must match it."""
    from hostlib import options

    monkeypatch.setattr(options.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    with soft_cluster() as st:
        auto = ok(run_ranks(st, 2, lambda c: c.stats["lanes"], elems=ELEMS, window=8, lanes="auto"))
        assert auto == [2, 2]
        res = run_ranks(
            st, 2, lambda c: c.stats["lanes"], job="three", elems=ELEMS, window=8,
            per_rank=lambda r: {"lanes": 3 if r == 0 else "auto"},
        )  # fmt: skip
        assert res == [3, 3]
        res = run_ranks(
            st, 2, lambda c: None, job="other", elems=ELEMS, window=8, rendezvous_timeout=3,
            per_rank=lambda r: {"lanes": "auto" if r == 0 else 1},
        )  # fmt: skip
    assert "runs 1 lane(s)" in str(res[1]) and "2: every rank must give the same" in str(res[1])


def _body(c):
    out = [c.allreduce(int_inputs(c.rank, L, seed=L)) for L in LENGTHS]
    out += [c.allreduce(float_inputs(c.rank, L, ELEMS)) for L in LENGTHS]
    lanes = getattr(c._engine, "engines", [c._engine])
    return out, [e.stats["results"] for e in lanes], {e.state.sock.address[1] for e in lanes}


def _run(n, *, lanes, native, aggregators=1, topology="switch", **kw):
    defaults = SWITCH if topology == "switch" else None  # None: the one-arm GROUP_TX
    with soft_cluster(aggregators=aggregators, defaults=defaults) as st:
        args = dict(elems=ELEMS, window=8, lanes=lanes, native=native, **kw)
        return ok(run_ranks(st, n, _body, deadline=90.0, **args))


@needs_fastpath
@pytest.mark.parametrize("topology", ["switch", "one-arm"])
@pytest.mark.parametrize("k", [2, 3])
def test_k_c_lanes_equal_k_numpy_lanes_and_one_lane(k, topology):
    """int32 exact; float32 byte for byte against k numpy lanes and against one lane; every
    lane carried results, each from its own source port: the job's worker_port + lane."""
    n = 3
    single = _run(n, lanes=1, native=True, topology=topology)
    ref = _run(n, lanes=k, native=False, topology=topology)
    got = _run(n, lanes=k, native=True, topology=topology)
    for r in range(n):
        out, results, ports = got[r]
        assert len(results) == k and all(x > 0 for x in results)
        assert ports == set(range(min(ports), min(ports) + k))
        for i, L in enumerate(LENGTHS):
            assert np.array_equal(out[i], int_expected(n, L, seed=L))
        for i in range(2 * len(LENGTHS)):
            assert out[i].tobytes() == ref[r][0][i].tobytes() == single[r][0][i].tobytes()


@needs_fastpath
@pytest.mark.parametrize("topology", ["switch", "one-arm"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_lanes_under_loss_and_duplication(k, topology):
    """Seeded loss and duplication both ways on every lane (its own seed): the C lanes still
    equal the numpy lanes byte for byte, and they retransmitted."""

    def faults(r):
        return {"faults": Faults(0.05, 0.05, 0.05, 0.05, seed=10 * r + 1)}

    n = 2
    ref = _run(n, lanes=k, native=False, per_rank=faults, topology=topology)
    got = _run(n, lanes=k, native=True, per_rank=faults, topology=topology)
    for r in range(n):
        for i, L in enumerate(LENGTHS):
            assert np.array_equal(got[r][0][i], int_expected(n, L, seed=L))
        for i in range(2 * len(LENGTHS)):
            assert got[r][0][i].tobytes() == ref[r][0][i].tobytes()


@needs_fastpath
def test_lanes_within_stripes():
    """Two aggregators, two lanes at each: four stripes, the same sums as one lane at one."""
    n = 2
    single = _run(n, lanes=1, native=True)
    got = _run(n, lanes=2, native=True, aggregators=2)
    for r in range(n):
        out, results, ports = got[r]
        assert len(results) == 4 and all(x > 0 for x in results)
        for i in range(2 * len(LENGTHS)):
            assert out[i].tobytes() == single[r][0][i].tobytes()


@needs_fastpath
@pytest.mark.parametrize("native", [False, True])
def test_early_loss_lanes_within_stripes_exact_under_loss(native):
    """Two aggregators, two lanes at each (four streams), loss and duplication both ways: each
    stream finds losses early by itself (docs/protocol.md 4.4), and the sums are one clean
    lane's byte for byte."""

    def body(c):
        out = _body(c)[0]
        return out, [st["early_losses"] for st in c.stats_per_lane()]

    def faults(r):
        return {"faults": Faults(0.05, 0.05, 0.05, 0.05, seed=7 * r + 3)}

    n = 2
    single = _run(n, lanes=1, native=True)
    with soft_cluster(aggregators=2, defaults=SWITCH) as st:
        args = dict(elems=ELEMS, window=8, lanes=2, native=native, per_rank=faults)
        got = ok(run_ranks(st, n, body, deadline=90.0, **args))
    for r in range(n):
        out, early = got[r]
        assert len(early) == 4 and all(e > 0 for e in early), early
        for i in range(2 * len(LENGTHS)):
            assert out[i].tobytes() == single[r][0][i].tobytes()


def test_a_taken_lane_port_is_named():
    """A rank that finds worker_port + 1 taken on its host says which port and what to do."""
    import socket

    with soft_cluster() as st:
        blocker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            blocker.bind((st.worker_ip(1), 0))  # where rank 1 binds its lanes' sockets
            base = blocker.getsockname()[1] - 1
            res = run_ranks(st, 2, lambda c: None, lanes=2, elems=ELEMS, window=8, port=base)
        finally:
            blocker.close()
    assert isinstance(res[1], hostlib.HostlibError), res
    msg = str(res[1])
    assert f"{base}..{base + 1} (one per lane)" in msg and f"{base + 1} is taken" in msg


def test_too_few_slots_for_the_lanes_are_refused():
    """Rank 0 refuses before it creates the job; a rank that finds a job of fewer slots than its
    lanes refuses too."""
    with soft_cluster(defaults=SWITCH) as st:
        (e,) = run_ranks(st, 1, lambda c: None, lanes=3, elems=ELEMS, window=2)
        assert isinstance(e, ValueError) and "at least 3 slots" in str(e)
        res = run_ranks(
            st, 2, lambda c: None, job="two", elems=ELEMS, window=2, rendezvous_timeout=3,
            per_rank=lambda r: {"lanes": 1 if r == 0 else 3},
        )  # fmt: skip
    assert isinstance(res[1], ValueError) and "at least 3 slots" in str(res[1])


def test_the_lanes_sockets_are_closed():
    """A communicator with lanes holds one socket per lane, each on its own port (its
    stats_per_lane says which), and close() releases them all: each port binds again."""
    with soft_cluster(defaults=SWITCH) as st:
        comms = run_ranks(st, 1, lambda c: c, lanes=2, elems=ELEMS, window=8)
    lanes = comms[0].stats_per_lane()
    assert [(x["aggregator"], x["lane"]) for x in lanes] == [(0, 0), (0, 1)]
    assert lanes[1]["port"] == lanes[0]["port"] + 1
    for x in lanes:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind(("0.0.0.0", x["port"]))


def test_the_lane_grid_numbers_engines_aggregator_by_aggregator():
    grid = LaneGrid(aggregators=2, lanes=3)
    assert len(grid) == 6
    assert list(grid.cells()) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [grid.index(j, lane) for j, lane in grid.cells()] == list(range(6))
    assert grid.place(4) == (1, 1) and grid.row(1) == range(3, 6)
    assert grid.port(40000, 1, 2) == 40005 and grid.port(40000, 1) == 40003
    assert LaneGrid(3).place(2) == (2, 0)


def test_torch_backend_with_lanes_through_the_environment():
    """hostlib.pt's backend with XDP_AGG_LANES=2: its collectives as with one lane, each rank's
    both ranks contributing."""
    pytest.importorskip("torch", reason="torch is not importable: pip install 'xdp-agg[torch]'")
    from harness.torch_procs import check_backend as _check_backend
    from harness.torch_procs import collect_reports as _reports
    from harness.torch_procs import start_loopback as _start_loopback

    with soft_cluster(defaults=SWITCH) as st:
        extra = {"XDP_AGG_LANES": "2", "XDP_AGG_WINDOW": "8"}
        procs = _start_loopback(st, 2, "backend", "--backend-spec", "cpu:xdpagg", **extra)
        _check_backend(_reports(procs), 2)
        per_worker = st.aggregator.worker_counters(0)
        assert sorted(per_worker) == [0, 1]
        assert all(c["contributions"] > 0 for c in per_worker.values()), per_worker


def test_ranks_with_different_lanes_are_refused():
    """A rank whose lanes differ from those of the ranks registered before it is refused by the
    control endpoint, naming both numbers (its lanes would put other parts of the tensor into
    the same slots); the others then time out at the barrier, naming it."""
    with soft_cluster(defaults=SWITCH) as st:
        res = run_ranks(
            st,
            2,
            lambda c: None,
            elems=ELEMS,
            window=8,
            rendezvous_timeout=5.0,
            per_rank=lambda r: {"lanes": 1 + r},
        )
    assert all(isinstance(e, hostlib.RendezvousError) for e in res), res
    refused = [str(e) for e in res if "every rank must give the same lanes" in str(e)]
    assert len(refused) == 1
    assert ("runs 1 lane(s)" in refused[0] and "before it 2" in refused[0]) or (
        "runs 2 lane(s)" in refused[0] and "before it 1" in refused[0]
    )


def _wire16_body(c):
    """float16 and bfloat16 at 16 bits (their default), float32 at 16: LENGTHS' tensors of
    twice the elements, so that the longest still has packets enough for every lane."""
    import ml_dtypes

    out = []
    for L in LENGTHS:
        x = float_inputs(c.rank, 2 * L, 2 * ELEMS) / np.float32(1e3)
        out += [c.allreduce(x.astype(np.float16)), c.allreduce(x.astype(ml_dtypes.bfloat16))]
        out.append(c.allreduce(x, wire_bits=16))
    lanes = getattr(c._companions[16]._engine, "engines", [c._companions[16]._engine])
    return out, [e.stats["results"] for e in lanes]


@needs_fastpath
def test_wire16_k_c_lanes_equal_k_numpy_lanes_and_one_lane():
    """16-bit all-reduces on the companion job, which has the main job's lanes: two C lanes
    give the bytes of two numpy lanes and of one lane, in each type; both lanes carried."""
    pytest.importorskip("ml_dtypes")
    n, k = 2, 2

    def run(lanes, native):
        with soft_cluster() as st:
            args = dict(elems=ELEMS, window=8, lanes=lanes, native=native)
            return ok(run_ranks(st, n, _wire16_body, deadline=90.0, **args))

    single, ref, got = run(1, True), run(k, False), run(k, True)
    for r in range(n):
        out, results = got[r]
        assert len(results) == k and all(x > 0 for x in results)
        for a, b, c in zip(out, ref[r][0], single[r][0]):
            assert a.dtype == b.dtype == c.dtype and a.tobytes() == b.tobytes() == c.tobytes()
