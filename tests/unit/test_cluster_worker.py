"""The end-to-end worker's plan items without root: `until` stops every rank after one round."""

from __future__ import annotations

import numpy as np

from xdp_agg.cluster.cluster_worker import _timed


class _Rank0:
    """Rank 0 of a job whose other ranks add 0 to the flag: an all-reduce returns what it gave.
    It creates the `until` file once `at` data all-reduces have run; `flags` records its
    decisions, which the other ranks' all-reduces return."""

    def __init__(self, until, at: int):
        self.until, self.at, self.data, self.flags = until, at, 0, []

    def barrier(self):
        pass

    def allreduce(self, x, sparse="auto"):
        if x.size == 1:  # the round's flag
            self.flags.append(int(x[0]))
        else:
            self.data += 1
            if self.data == self.at:
                self.until.touch()
        return x.copy()


class _Other:
    """Another rank: its flag all-reduces return rank 0's recorded decisions, in order."""

    def __init__(self, flags):
        self.flags = iter(flags)

    def barrier(self):
        pass

    def allreduce(self, x, sparse="auto"):
        return np.array([next(self.flags)], dtype=np.int32) if x.size == 1 else 2 * x


def test_until_runs_past_reps_until_rank0_sees_the_file(tmp_path):
    stop = tmp_path / "stop"
    x = np.ones(4, dtype=np.int32)
    r0 = _Rank0(stop, at=7)
    _, times, _ = _timed(r0, x, reps=3, until=str(stop), rank=0)
    assert len(times) == 7  # past the minimum of 3, until the file appeared
    assert r0.flags == [1] * (7 - 3) + [0]  # asked only past the minimum
    # another rank never looks at the file, yet stops after the same round
    out, times1, _ = _timed(_Other(r0.flags), x, reps=3, until=str(stop), rank=1)
    assert len(times1) == 7 and np.array_equal(out, 2 * x)


def test_until_never_stops_before_reps(tmp_path):
    stop = tmp_path / "stop"
    stop.touch()  # there from the start: the minimum still runs
    _, times, _ = _timed(_Rank0(stop, at=0), np.ones(2, dtype=np.int32), 4, str(stop), 0)
    assert len(times) == 4


def test_without_until_exactly_reps():
    _, times, _ = _timed(_Other([]), np.ones(2, dtype=np.int32), reps=5)
    assert len(times) == 5
