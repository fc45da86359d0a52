"""The per-CPU gather is exact on any number of CPUs (tests/harness/percpu_model.py): random
placements of a slot's contributions on up to 8192 CPUs, random interleavings of their steps
(each CPU runs one contribution at a time, as XDP does not nest on a CPU), many rounds over both
versions; every completed round's sum equals numpy's. The mutant that gathers a CPU once per
worker noted on it must be caught, so the check is known to see a double-counted partial."""

import numpy as np
import pytest
from harness.percpu_model import SlotVersion

K = 8


def _placements(rng, n: int) -> list[list[int]]:
    """CPU of each worker: all on one, all apart on large CPU numbers, and random mixes."""
    return [
        [0] * n,
        [int(c) for c in rng.choice(8192, size=n, replace=False)],
        [int(c) for c in rng.integers(0, 3, size=n)],
        [int(c) for c in rng.integers(0, 1024, size=n)],
        [int(c) for c in rng.integers(0, 8192, size=n)],
    ]


def _run_round(sv: SlotVersion, rng, cpus: list[int], values: np.ndarray) -> list[np.ndarray]:
    """One round: each contribution (row of values, on cpus[i]) in three steps (arrive, fold,
    finish), the steps of different CPUs interleaved at random, a CPU's own contributions one
    after the other."""
    pending = {c: [w for w in range(sv.n) if cpus[w] == c] for c in set(cpus)}
    running: dict[int, tuple] = {}  # CPU -> (worker, round, next step)
    results = []
    while pending or running:
        idle = [c for c in pending if c not in running]
        choices = list(running) + idle
        c = choices[rng.integers(len(choices))]
        if c not in running:
            w = pending[c].pop(0)
            if not pending[c]:
                del pending[c]
            running[c] = (w, *sv.arrive(), "fold")
            continue
        w, rnd, pos, step = running[c]
        if step == "fold":
            sv.fold(c, w if sv.by_worker else pos, rnd, values[w])
            running[c] = (w, rnd, pos, "finish")
            continue
        del running[c]
        out = sv.finish(c, rnd)
        if out is not None:
            results.append(out)
    return results


def _check(rng, n: int, dedupe: bool = True) -> int:
    """Rounds over every placement; the number of wrong sums."""
    wrong = 0
    for cpus in _placements(rng, n):
        sv = SlotVersion(n, dedupe=dedupe)
        for _ in range(6):
            values = rng.integers(-1000, 1000, size=(n, K))
            results = _run_round(sv, rng, cpus, values)
            assert len(results) == 1, "exactly one CPU completes the round"
            wrong += not np.array_equal(results[0], values.sum(axis=0))
    return wrong


@pytest.mark.parametrize("n", [1, 2, 3, 8, 40, 64])
def test_gather_is_exact_on_any_cpus(n):
    rng = np.random.default_rng(n)
    for _ in range(20):
        assert _check(rng, n) == 0


def test_the_check_catches_a_partial_gathered_twice():
    """Without the count marker a CPU holding two workers' contributions is added twice."""
    rng = np.random.default_rng(7)
    assert sum(_check(rng, 8, dedupe=False) for _ in range(5)) > 0


@pytest.mark.parametrize("by_worker", [False, True])
def test_a_worker_counted_twice_in_a_round_on_two_cpus(by_worker):
    """A worker whose seen bit the other version cleared (a late duplicate of its old round)
    contributes twice to one round, here from two CPUs, and another worker not at all: the
    round's n arrivals are still gathered exactly when CPUs are noted by arrival position, and
    not when noted by worker index (the first design, which tests/root/test_xdp_fuzz.py caught)."""
    rng = np.random.default_rng(3)
    wrong = 0
    for _ in range(50):
        sv = SlotVersion(3, by_worker=by_worker)
        values = rng.integers(-1000, 1000, size=(3, K))
        # contributions: worker 0 on CPU 5, worker 0 again on CPU 9, worker 2 on CPU 9
        order = [(5, 0, values[0]), (9, 0, values[1]), (9, 2, values[2])]
        results = []
        for cpu, worker, v in order:
            rnd, pos = sv.arrive()
            sv.fold(cpu, worker if by_worker else pos, rnd, v)
            out = sv.finish(cpu, rnd)
            results += [] if out is None else [out]
        wrong += not np.array_equal(results[0], values.sum(axis=0))
    assert (wrong > 0) == by_worker
