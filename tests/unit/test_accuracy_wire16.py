"""bench.accuracy's core (issue item 5), no root: the 16-bit and 32-bit all-reduces computed as
the hosts compute them stay within scaling.error_bound + the result's rounding on random
gradients and on a small model's real ones (n = 2 and 4), the metrics are computed, a violated
bound is reported loudly, DDP's buckets are mirrored, and (n = 2, a few seconds) real gloo."""

import time

import numpy as np
import pytest

from bench import accuracy

torch = pytest.importorskip("torch", reason="bench.accuracy needs torch (pip install -e .[test])")


def heavy_tailed(n: int, length: int, seed: int) -> np.ndarray:
    """(n, L) float32 like gradients: magnitudes spread over ~12 binades within a chunk, random
    signs, a few all-zero stretches, and ranks that differ (so that sums cancel)."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(0.0, 2.0, size=length))  # per element, shared by the ranks
    x = (rng.standard_normal((n, length)) * scale).astype(np.float32) * np.float32(1e-3)
    x[:, 1400:3200] = 0.0  # the whole second chunk of 1536 (and of 768: two), and parts
    x[0, 5] = np.float32(3e-41)  # a subnormal
    return x


def test_round_bf16_matches_torch_on_float32():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(100_000) * np.exp(rng.normal(0, 20, 100_000))).astype(np.float32)
    x = np.concatenate([x, np.float32([0.0, -0.0, 1e-40, 1.0 + 2**-8, 1.0 + 3 * 2**-8])])
    assert np.array_equal(accuracy.round_bf16(x.astype(np.float64)), accuracy.to_bf16(x))


def test_round_bf16_rounds_once():
    # just above the midpoint between 1 and 1 + 2^-7: float32 first would make it a tie (to 1)
    x = np.array([1.0 + 2.0**-8 + 2.0**-30])
    assert accuracy.round_bf16(x)[0] == np.float32(1.0 + 2**-7)
    assert accuracy.round_bf16(x.astype(np.float32).astype(np.float64))[0] == 1.0


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("elems", [64, 768])
def test_random_gradients_stay_within_the_bound(n, elems):
    x = heavy_tailed(n, 3 * 1536 + 77, seed=n)  # the last chunk zero-padded
    xb = accuracy.to_bf16(x)
    s32 = x.sum(axis=0, dtype=np.float64)
    sbf = xb.sum(axis=0, dtype=np.float64)
    for way, (bits, src, out) in accuracy.XDP_WAYS.items():
        errs = accuracy.Errors(bounded=True)
        r, info = accuracy.xdpagg_allreduce(xb if src == "bf16" else x, bits, elems, out)
        assert r.dtype == np.float32 and r.shape == (x.shape[1],)
        if out == "bf16":
            assert np.array_equal(accuracy.to_bf16(r), r), "a bfloat16 result holds bf16 values"
        errs.add(r, sbf if src == "bf16" else s32, (x != 0).any(axis=0), info, out)
        m = errs.result()
        assert m["bound_ok"], (way, m)
        assert 0 < m["max_bound_use"] <= 1.0, (way, m)
        assert m["elements"] == x.shape[1] and m["active"] == x.shape[1] - 1800
        assert 0 <= m["above_ulp"] <= 1
        limit = {"xdp16-bf16": 1e-2, "xdp16-f32": 1e-2, "xdp32-f32": 1e-6}[way]
        assert 0 < m["rel_l2"] < limit, (way, m)
        assert m["max_rel"] < limit
        assert not r[1536:3072].any(), "all-zero chunks sum to zeros"


def test_the_study_core_on_real_gradients():
    """score_point on the digits MLP's gradients, each rank its own batch, in DDP's buckets."""
    pytest.importorskip("sklearn", reason="the digits come with scikit-learn")
    train = accuracy.load_train()
    model = train.make_model("digits")
    data = accuracy.model_data(train, "digits")
    buckets = accuracy.ddp_buckets(model)
    assert buckets == [[5, 4, 3, 2, 1, 0]]  # reverse parameter order, one bucket (340 KB)
    bounds = accuracy.bucket_bounds(model, buckets)
    for n in (2, 4):
        x = np.stack(
            [
                accuracy.flat_gradient(
                    model, buckets, *accuracy.rank_batch(train, "digits", data, n, r, 3, 32)
                )
                for r in range(n)
            ]
        )
        assert not np.array_equal(x[0], x[1]), "each rank has its own batch"
        row = accuracy.score_point(x, None, bounds, 768)
        assert set(row["ways"]) == set(accuracy.XDP_WAYS)
        assert not accuracy.violations([{"model": "digits", "point": "init", "n": n, **row}])
        ways = row["ways"]
        assert ways["xdp32-f32"]["rel_l2"] < ways["xdp16-f32"]["rel_l2"] < 1e-2
        assert ways["xdp16-bf16"]["rel_l2"] < 1e-2
        assert row["checks"]["int_sums_exact"]


def test_ddp_buckets_mirror_torch():
    """The wide MLP's two buckets: the first closed past 1 MiB, as DDP's rebuilt ones."""
    train = accuracy.load_train()
    with torch.device("meta"):  # shapes only: no 100 MB of parameters
        model = train.make_model("wide")
    assert accuracy.ddp_buckets(model) == [[5, 4, 3, 2], [1, 0]]
    sizes = [b - a for a, b in accuracy.bucket_bounds(model, accuracy.ddp_buckets(model))]
    assert sizes == [10 + 20480 + 2048 + 2048 * 4096, 4096 + 4096 * 4096]


def test_a_violated_bound_is_loud():
    x = heavy_tailed(2, 1536, seed=7)
    s = x.sum(axis=0, dtype=np.float64)
    r, info = accuracy.xdpagg_allreduce(x, 16, 768, "f32")
    r[100] += np.float32(1e-2)  # an error far beyond the bound
    errs = accuracy.Errors(bounded=True)
    errs.add(r, s, np.ones(s.shape, bool), info, "f32")
    m = errs.result()
    assert not m["bound_ok"] and m["violations"] == 1
    assert m["first_violation"]["index"] == 100
    row = {"model": "m", "point": "init", "n": 2, "ways": {"xdp16-f32": m}, "checks": {}}
    assert accuracy.violations([row])


def test_markdown_has_the_table_and_the_reading():
    x = heavy_tailed(2, 4000, seed=3)
    rows = []
    for n in (2, 4):
        xs = np.concatenate([x, x * 0.5])[:n]
        res = np.stack([accuracy.to_bf16(xs).sum(0), xs.sum(0), accuracy.to_bf16(xs).sum(0) / n])
        row = accuracy.score_point(xs, res.astype(np.float32), [(0, 4000)], 768)
        rows.append({"model": "random", "point": "init", "n": n, **row})
        row["checks"]["gloo_ranks_agree"] = True
    meta = {
        "torch": "x", "cpus": 2, "load_before": [0], "load_after": [0], "wall_s": 1,
        "batch_per_rank": 32, "steps": 0, "lr": 0.05, "train_world": 4, "elems": 768,
        "chunk_elements": {"16": 1536, "32": 768},
    }  # fmt: skip
    md = accuracy.markdown({"meta": meta, "models": {}, "rows": rows})
    assert "| random | init | 2 |" in md and "xdp16-bf16 L2" in md and "gloo-hook L2" in md
    assert "- n = 4: xdp16-bf16 / gloo-bf16" in md
    assert "VIOLATED" not in md


def test_gloo_n2(tmp_path):
    """Real gloo, 2 ranks, a small tensor in two buckets: results as the float64 sums say."""
    x = heavy_tailed(2, 5000, seed=11)
    np.save(tmp_path / "x.npy", x[None])
    t0 = time.monotonic()
    res, agree = accuracy.gloo_allreduces(str(tmp_path), 2, [(0, 3000), (3000, 5000)])
    assert agree
    res = np.asarray(res[0])
    assert np.array_equal(res[1], x[0] + x[1])  # two float32: one rounding, either order
    xb = accuracy.to_bf16(x)
    assert np.array_equal(res[0], accuracy.round_bf16(xb.sum(0, dtype=np.float64)))
    assert np.array_equal(res[2], accuracy.round_bf16(xb.sum(0, dtype=np.float64) / 2))
    assert time.monotonic() - t0 < 120  # a hang, not a timing
