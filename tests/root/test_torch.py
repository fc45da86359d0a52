"""PyTorch integration (hostlib.pt): the DDP hook, the 'xdpagg' backend, a lost aggregator.

Netns testbed tests (root, XDP): n = 2 and 4 worker namespaces, each rank a process running
tests/torch_worker.py with torch's env:// rendezvous over the testbed addresses:
- DDP with the hook ends k SGD steps with the parameters of DDP with gloo, within the bound the
  block scaling gives (per step lr * gmax/M plus rounding; the worker computes it from every
  rank's largest gradient), and each step's averaged gradients within that bound, for float32,
  bfloat16 and float16 buckets;
- the backend's all_reduce for every dtype and op, sync and async, through the aggregator for
  float32/float16/bfloat16/int32 SUM and AVG and through gloo otherwise (checked by whether the
  communicator sent packets), and the collectives it delegates to gloo;
- the aggregator detached mid-run: the next all_reduce raises AggregatorLost within the
  configured stall timeout, or, with XDP_AGG_FALLBACK=gloo, completes over gloo.
Loopback tests (no root): the same worker against the soft aggregator, the fallback's agreement
with ranks that failed at different all-reduces, and the torch.backends entry point.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not importable: pip install 'xdp-agg[torch]' (make test does)"
)

import numpy as np  # noqa: E402
from harness import torch_procs  # noqa: E402
from harness.pt_checks import ThreadGroup  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# the rank processes and the checks of their reports, shared with other files (tests/harness)
_reports, _check_ddp = torch_procs.collect_reports, torch_procs.check_ddp
_check_backend, _check_lost = torch_procs.check_backend, torch_procs.check_lost
_start_testbed, _start_loopback = torch_procs.start_testbed, torch_procs.start_loopback


# --- netns testbed ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4])
@torch_procs.in_testbed
def test_ddp_hook_and_backend_in_testbed(testbed_factory, n):
    """DDP with the hook matches DDP with gloo; the backend's collectives, n ranks."""
    with torch_procs.one_arm_cluster(testbed_factory, n) as (tb, cl):
        _check_ddp(_reports(_start_testbed(tb, cl, "ddp", "--job", f"ddp-{n}")), n)
        _check_backend(_reports(_start_testbed(tb, cl, "backend")), n)


def _lost(tb, cl, fallback: bool, timeout: float = 2.0):
    extra = {"XDP_AGG_TIMEOUT": timeout, "XDP_AGG_FALLBACK": "gloo" if fallback else ""}
    procs = _start_testbed(tb, cl, "lost", stdin=subprocess.PIPE, **extra)
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    cl.detach()  # the data path is gone; the control endpoint stays
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    _check_lost(_reports(procs, deadline=60), fallback, timeout)


@pytest.mark.parametrize("fallback,n", [(False, 2), (True, 4)])
@torch_procs.in_testbed
def test_aggregator_lost_in_testbed(testbed_factory, fallback, n):
    """The aggregator detached mid-run: AggregatorLost within the timeout, or gloo's sums."""
    with torch_procs.one_arm_cluster(testbed_factory, n) as (tb, cl):
        _lost(tb, cl, fallback)


# --- loopback, soft aggregator (no root) --------------------------------------------------
def test_backend_on_loopback():
    """The backend's collectives through the soft aggregator (2 ranks, 'cpu:xdpagg')."""
    from harness.ranks import soft_cluster

    with soft_cluster() as cl:
        _check_backend(
            _reports(_start_loopback(cl, 2, "backend", "--backend-spec", "cpu:xdpagg")), 2
        )


def test_ddp_hook_on_loopback():
    from harness.ranks import soft_cluster

    with soft_cluster() as cl:
        _check_ddp(_reports(_start_loopback(cl, 2, "ddp", "--steps", "2")), 2)


@pytest.mark.parametrize("scenario", ["lost", "lost-hook"])
@pytest.mark.parametrize("fallback", [False, True])
def test_aggregator_lost_on_loopback(fallback, scenario):
    """The soft aggregator stopped between two all-reduces: the backend's all_reduce (or DDP's
    backward with the hook) raises AggregatorLost, or with the fallback continues on gloo."""
    from harness.ranks import soft_cluster

    with soft_cluster() as cl:
        procs = _start_loopback(
            cl,
            2,
            scenario,
            stdin=subprocess.PIPE,
            XDP_AGG_TIMEOUT=2,
            XDP_AGG_FALLBACK="gloo" if fallback else "",
        )
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        cl.aggregator.stop()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        _check_lost(_reports(procs, deadline=60), fallback, 2.0)


def test_fallback_agreement_when_ranks_failed_at_different_all_reduces():
    """Rank 0 received all of all-reduce #5's results and failed at #6; ranks 1 and 2 failed at
    #5: they get #5's result from rank 0's copy, then all redo #6 over the fallback group."""
    from hostlib.pt.channel import _Fallback

    n = 3
    group = ThreadGroup(n)
    inputs5 = [np.full(10, r + 1, np.float32) for r in range(n)]
    inputs6 = [np.full(10, 10 * (r + 1), np.float32) for r in range(n)]
    want5, want6 = sum(inputs5), sum(inputs6)
    out: dict = {}

    def rank_main(r: int) -> None:
        fb = _Fallback(group.member(r), r, n)
        if r == 0:
            fb.completed(5, want5.copy())
            got6 = fb.recover(6, inputs6[r], RuntimeError("lost"), "test")
            out[r] = (want5, got6, fb.gloo_sum(inputs6[r]))
        else:
            got5 = fb.recover(5, inputs5[r], RuntimeError("lost"), "test")
            out[r] = (got5, fb.gloo_sum(inputs6[r]), fb.gloo_sum(inputs6[r]))
        assert fb.active

    group.run(rank_main)
    assert len(out) == n
    for r in range(n):
        got5, got6, later = out[r]
        np.testing.assert_array_equal(got5, want5)
        np.testing.assert_array_equal(got6, want6)
        np.testing.assert_array_equal(later, want6)  # the next all-reduce: gloo on every rank


def test_fallback_agreement_when_all_failed_at_the_same_all_reduce():
    from hostlib.pt.channel import _Fallback

    n = 2
    group = ThreadGroup(n)
    out = {}

    def rank_main(r):
        fb = _Fallback(group.member(r), r, n)
        fb.completed(2, np.zeros(4, np.float32))
        out[r] = fb.recover(3, np.full(4, r + 1.0, np.float32), RuntimeError("x"), "test")

    group.run(rank_main)
    for r in range(n):
        np.testing.assert_array_equal(out[r], np.full(4, 3.0, np.float32))


def test_entry_point_registers_the_backend(tmp_path):
    """A `torch.backends` entry point (as pyproject.toml declares it) makes 'xdpagg' known to an
    unmodified program that only imports torch."""
    import tomllib

    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    target = eps["torch.backends"]["xdpagg"]
    info = tmp_path / "xdp_agg_ep-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: xdp-agg-ep\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[torch.backends]\nxdpagg = {target}\n")
    code = (
        "import torch.distributed as d; print('xdpagg' in d.Backend.backend_list, "
        "d.Backend('xdpagg'))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "xdpagg"], r.stdout + r.stderr


def test_staging_is_zero_copy_for_cpu_float32_and_bfloat16(monkeypatch):
    """float32 and (with ml_dtypes) bfloat16 tensors go to hostlib as views of their own memory;
    without ml_dtypes bfloat16 goes through a float32 copy."""
    from hostlib.pt import staging
    from hostlib.pt.channel import _Staged

    t = torch.arange(10, dtype=torch.float32)
    s = _Staged(t, keep_input=False)
    assert s.src.ctypes.data == t.data_ptr()  # the tensor's own memory goes on the wire
    s.finish(s.src * 2, divide=2)
    assert torch.equal(t, torch.arange(10, dtype=torch.float32))
    b = torch.arange(8, dtype=torch.bfloat16)
    s = _Staged(b, keep_input=True)
    assert s.src.dtype.name == "bfloat16" and s.src.ctypes.data == b.data_ptr()
    assert s.out is not s.src
    s.finish(s.src * 3, divide=1)
    assert torch.equal(b, torch.arange(8, dtype=torch.bfloat16) * 3)
    monkeypatch.setattr(staging, "np_bfloat16", lambda: None)  # as without ml_dtypes
    s = _Staged(b, keep_input=True)
    assert s.src.dtype == np.float32 and s.src.ctypes.data != b.data_ptr()
    s.finish(s.src / 3, divide=1)
    assert torch.equal(b, torch.arange(8, dtype=torch.bfloat16))
    nc = torch.arange(12, dtype=torch.float16).reshape(3, 4).t()  # not contiguous
    s = _Staged(nc, keep_input=False)
    s.finish(s.src + 1, divide=1)
    assert torch.equal(nc, torch.arange(12, dtype=torch.float16).reshape(3, 4).t() + 1)


def test_channel_orders_all_reduces_and_skips_empty_tensors():
    """The channel runs submissions in order on its thread; an empty tensor needs no wire."""
    from hostlib.pt.channel import AllreduceChannel

    class Comm:  # a world of 2 whose "sum" doubles, recording the order
        rank, world_size = 0, 2

        def __init__(self):
            self.seen = []

        def allreduce(self, src, out, wire_bits=None):
            self.seen.append(float(src[0]))
            np.multiply(src, 2, out=out)

    comm = Comm()
    ch = AllreduceChannel(comm)
    ts = [torch.full((1000,), float(i)) for i in range(5)]
    futs = [ch.submit(t, average=i % 2 == 1) for i, t in enumerate(ts)]
    empty = ch.submit(torch.empty(0))
    assert empty.done() and empty.value().numel() == 0
    for i, f in enumerate(futs):
        assert f.wait() is ts[i]
        assert float(ts[i][0]) == (i if i % 2 else 2 * i)  # AVG divides the sum by 2
    assert comm.seen == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(TypeError):
        ch.submit(torch.zeros(3, dtype=torch.int64))
    ch.close()


def test_an_average_leaves_the_sum_the_fallback_keeps_undivided():
    """With a fallback, the channel keeps each all-reduce's result for ranks that lack it after
    a failure (_Fallback.recover broadcasts it, and they divide it themselves): AVG must divide
    the tensor, not that kept sum."""
    from hostlib.pt.channel import AllreduceChannel

    class Comm:  # a world of 2 whose "sum" doubles
        rank, world_size = 0, 2

        def allreduce(self, src, out, wire_bits=None):
            np.multiply(src, 2, out=out)

    ch = AllreduceChannel(Comm(), fallback=object())  # never called: nothing fails
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        t = torch.full((6,), 3.0, dtype=dtype)
        ch.submit(t, average=True).wait()
        assert torch.equal(t, torch.full((6,), 3.0, dtype=dtype))  # (3 + 3) / 2
        np.testing.assert_array_equal(ch._fallback._last, np.full(6, 6.0))  # the sum
    ch.close()


def test_elems_from_the_environment_take_auto_and_refuse_junk():
    from hostlib.options import HostOptions

    def elems(text):
        return HostOptions.from_env({"XDP_AGG_ELEMS": text}).elems

    assert elems("768") == 768 and elems("auto") == "auto" and elems(" AUTO ") == "auto"
    with pytest.raises(ValueError, match="XDP_AGG_ELEMS='lots'"):
        elems("lots")


def test_path_stats_count_every_call_and_warn_once_per_collective_op_and_dtype():
    """PathStats: counts per (collective, op, dtype, path); one FallbackWarning per
    (collective, op, dtype) however often it falls back, none for the aggregator's calls."""
    import warnings

    import torch.distributed as dist

    from hostlib.pt.paths import AGGREGATOR, GLOO, FallbackWarning, PathStats

    ps = PathStats("xdpagg (job t)")
    f32, f64 = torch.zeros(2), torch.zeros(2, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            ps.record("all_reduce", dist.ReduceOp.SUM, [f32], AGGREGATOR)
            ps.record("all_reduce", dist.ReduceOp.MAX, [f32], GLOO, "MAX")
            ps.record("all_reduce", dist.ReduceOp.SUM, [f64], GLOO, "float64")
        ps.record("broadcast", None, ([f32, f64], 3), GLOO)
    said = [str(w.message) for w in caught if w.category is FallbackWarning]
    assert len(said) == 2, said
    assert "all_reduce with MAX of float32" in said[0] and "float64" in said[1]
    assert ps.total(AGGREGATOR) == 3 and ps.total(GLOO) == 7
    assert {
        "collective": "broadcast",
        "op": "-",
        "dtype": "float32+float64",
        "path": GLOO,
        "wire_bits": "-",
        "calls": 1,
    } in ps.rows()
