"""`xdp-agg bench --cpus`: how the stream is cut over K CPUs (no root), and a short run."""

import json
import os

import pytest

from xdp_agg.app.options import BenchOptions
from xdp_switch import cpu_bench

WORKERS, SLOTS, ROUNDS = 4, 16, 2


def _frames():
    """Stand-ins for the stream's frames, in its (round, slot, worker) order."""
    return [(r, s, w) for r in range(ROUNDS) for s in range(SLOTS) for w in range(WORKERS)]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("placement", cpu_bench.PLACEMENTS)
def test_every_frame_once_each_cpu_a_fair_share(placement, k):
    per_cpu = cpu_bench.split(_frames(), WORKERS, SLOTS, ROUNDS, k, placement)
    got = [f for cpu in per_cpu for rnd in cpu for f in rnd]
    assert sorted(got) == sorted(_frames())
    shares = [sum(len(rnd) for rnd in cpu) for cpu in per_cpu]
    # a lane is a K-th of the window: shares differ by at most a lane's slots of every round
    assert max(shares) - min(shares) <= WORKERS * ROUNDS * -(-SLOTS // k)
    for cpu in per_cpu:  # every frame in its own round
        assert all(f[0] == r for r, rnd in enumerate(cpu) for f in rnd)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_sdfn_spreads_a_slot_and_fn_keeps_it_on_one_cpu(k):
    def cpus_of_slots(placement):
        per_cpu = cpu_bench.split(_frames(), WORKERS, SLOTS, ROUNDS, k, placement)
        where: dict[int, set[int]] = {}
        for c, cpu in enumerate(per_cpu):
            for rnd in cpu:
                for _, s, _ in rnd:
                    where.setdefault(s, set()).add(c)
        return where

    assert all(len(c) == min(WORKERS, k) for c in cpus_of_slots("sdfn").values())
    assert all(len(c) == 1 for c in cpus_of_slots("fn").values())
    assert len(set().union(*cpus_of_slots("fn").values())) == k  # every CPU owns a lane


def test_cpu_counts_are_checked():
    assert BenchOptions(cpus="1,2,16").cpu_counts() == [1, 2, 16]
    for bad in ("", "x", "0", "1,,2"):
        with pytest.raises(ValueError, match="numbers of CPUs"):
            BenchOptions(cpus=bad).check()
    with pytest.raises(ValueError, match="choose one"):
        BenchOptions(cpus="2", slot_cpus=True).check()


@pytest.mark.root
@pytest.mark.bpf
def test_bench_cpus_runs_and_reports_scaling(xdp_agg):
    """A short run: one CPU, both placements on each count the machine has, the rest listed as
    not run; every pass completed every slot (the bench raises otherwise). On every CPU of the
    machine: an earlier test in this process (`xdp-agg bench` pins itself to CPU 0) may have
    left it on fewer."""
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, range(os.cpu_count()))
    try:
        r = xdp_agg("bench", "--cpus", "1,2,4096", "--rounds", "2", "--repeats", "1", "--json")
    finally:
        os.sched_setaffinity(0, pinned)
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["not_run"] == [k for k in (2, 4096) if k > os.cpu_count()]
    rows = rep["rows"]
    assert {(r["placement"], r["cpus"], r["elems_per_packet"]) for r in rows} >= {
        ("sdfn", 1, 256),
        ("sdfn", 1, 768),
    }
    assert all(r["packets_per_sec"] > 0 and r["scaling"] > 0 for r in rows)
    assert [r["scaling"] for r in rows if r["cpus"] == 1] == [1.0, 1.0]
