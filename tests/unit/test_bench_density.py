"""bench.allreduce's sparse rows (bench/density.py, bench/worker.py): the inputs' densities, the
check that sparse equals dense, the summary with the issue's targets, and the options (no root:
rows as run_config makes them)."""

import numpy as np
import pytest

from bench import allreduce, density, worker

MIB64 = 64 << 20


def test_densities_are_percent():
    assert density.densities("100,50,10,1") == [1.0, 0.5, 0.1, 0.01]
    with pytest.raises(ValueError):
        density.densities("0")
    with pytest.raises(ValueError):
        density.densities("101")


def test_plan_has_one_cell_at_full_density():
    items = density.plan([MIB64], [1.0, 0.1], ["same", "indep"], reps=3)
    assert [(i["density"], i["pattern"]) for i in items] == [
        (1.0, "same"),
        (0.1, "same"),
        (0.1, "indep"),
    ]
    assert all(i["kind"] == "sparse" and i["reps"] == 3 for i in items)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("union", [0.5, 0.1, 0.01])
def test_independent_blocks_make_the_union_the_target(n, union):
    p = worker.per_worker_density(union, n, same=False)
    assert 1 - (1 - p) ** n == pytest.approx(union)
    assert worker.per_worker_density(union, n, same=True) == union
    # and the tensors drawn so have that union (16,384 blocks of 256: within 1.5 points)
    item = {"bytes": 16 << 20, "kind": "sparse", "density": union, "pattern": "indep"}
    blocks = np.zeros((16 << 20) // 4 // 256, dtype=bool)
    for rank in range(n):
        x = worker._inputs(item, rank, n, 256).reshape(-1, 256)
        blocks |= np.any(x != 0, axis=1)
    assert abs(blocks.mean() - union) < 0.015


def test_same_blocks_on_every_rank():
    item = {"bytes": 1 << 20, "kind": "sparse", "density": 0.1, "pattern": "same"}
    nz = [np.any(worker._inputs(item, r, 4, 256).reshape(-1, 256) != 0, axis=1) for r in range(4)]
    assert all((z == nz[0]).all() for z in nz) and 0.05 < nz[0].mean() < 0.15


def test_nonzero_blocks_counts_blocks_with_data_and_the_short_tail():
    from hostlib.sparsity import nonzero_blocks

    y = np.zeros(10 * 8 + 3, dtype=np.float32)
    y[0] = y[17] = y[81] = 1.0
    assert nonzero_blocks(y, 8) == (3, 11)
    assert nonzero_blocks(np.zeros(16, dtype=np.float32), 8) == (0, 2)


def test_sparse_check_counts_equal_results_and_per_allreduce_counts():
    dense, sparse = np.arange(8, dtype=np.float32), np.arange(8, dtype=np.float32)
    c = worker._SparseCheck(dense, sparse)
    c.count({k: 0 for k in c.COUNTS}, {k: 10 for k in c.COUNTS})
    c.check()
    sparse[3] = -1  # a wrong sparse result is counted, not hidden
    c.count({k: 10 for k in c.COUNTS}, {k: 30 for k in c.COUNTS})
    c.check()
    r = c.report({"density": 0.5, "pattern": "same"}, world=4, block=4)
    assert (r["checked"], r["equal_to_dense"], r["blocks"], r["union_blocks"]) == (2, 1, 2, 2)
    assert r["packets_sent"] == 15.0  # (10 + 20) / 2 sparse all-reduces


def _sparse_row(d, pattern, link, sparse_s, dense_s, gloo_s, equal=3):
    sp = {"density": d, "pattern": pattern, "per_worker_density": d, "blocks": 1000,
          "union_blocks": int(d * 1000), "union_agrees": True, "checked": 3,
          "equal_to_dense": equal, "packets_sent": 100.0, "bytes_sent": 2.0**20,
          "empty_sent": 10.0, "blocks_skipped": 5.0, "sparse_retransmissions": 0}  # fmt: skip
    return {"n": 8, "link": link, "bytes": MIB64, "kind": "sparse", "dtype": "float32",
            "xdp-agg": [dense_s] * 3, "gloo": [gloo_s] * 3, density.SPARSE: [sparse_s] * 3,
            "retransmissions": 0, "packets": 300, "sparse": sp}  # fmt: skip


def test_summary_judges_the_targets():
    cells = allreduce.summarize(
        [
            _sparse_row(0.1, "same", "1gbit", 0.1, 0.55, 0.95),  # 5.5x dense, 9.5x gloo
            _sparse_row(0.1, "indep", "1gbit", 0.2, 0.55, 0.95),  # 2.75x dense: missed
            _sparse_row(1.0, "same", "10gbit", 0.62, 0.6, 1.0, equal=2),  # 3.3% slower
        ]
    )
    met = [c["sparse"]["targets"] for c in cells]
    assert met[0] == {"vs_dense >= 4": True, "vs_gloo >= 5": True}
    assert met[1] == {"vs_dense >= 4": False, "vs_gloo >= 5": False}
    assert met[2] == {"vs_dense >= 0.952": True}
    assert [c["sparse"]["exact"] for c in cells] == [True, True, False]
    assert cells[0]["xdp-agg sparse"]["of_bound"] == pytest.approx(0.1 * MIB64 * 8 / 1e9 / 0.1)
    md = allreduce.markdown(cells, {"when": "now", "reps": 3, "mtu": 3500, "elems": 768,
                                    "window": 64})  # fmt: skip
    assert "| 8 | 1gbit | 64 MiB | same | 10% | 10.0% | 10.00% | 100.0 (0.0) | 550.0 (0.0) |" in md
    assert "vs_dense >= 4: MISSED, vs_gloo >= 5: MISSED" in md
    assert "| NO |" in md  # the cell whose sparse result differed once
    assert "xdp-agg ms (spread)" not in md  # no throughput rows: no empty table


def test_density_alone_runs_only_the_sparse_rows_at_64_mib():
    def parsed(*argv):
        args = allreduce._parser().parse_args(list(argv))
        allreduce._density_defaults(args, set(argv))
        return args

    a = parsed("--density", "10,1")
    assert (a.rows, a.sizes, a.density, a.patterns) == ("sparse", "64MiB", [0.1, 0.01], [
        "same", "indep"])  # fmt: skip
    b = parsed("--density=10", "--rows", "throughput,sparse", "--sizes", "4MiB")
    assert (b.rows, b.sizes) == ("throughput,sparse", "4MiB")
    c = parsed("--rows", "sparse", "--patterns", "same")
    assert c.density == [1.0, 0.5, 0.1, 0.01] and c.patterns == ["same"]


def test_serve_is_sparse_only_for_sparse_rows():
    class A:
        serve_args = ("--results", "unicast")

    assert allreduce._serve_args(A(), [{"kind": "sparse"}]) == ("--results", "unicast", "--sparse")
    assert allreduce._serve_args(A(), [{"kind": "throughput"}]) == ("--results", "unicast")


def test_recsys_table_compares_the_three_systems():
    from bench import training

    def rep(t, loss, eng=None):
        r = {"params": 8_400_000, "steps": 40, "batch_per_rank": 64, "time_per_iter_s": t,
             "compute_per_iter_s": 0.05, "comm_share": 1 - 0.05 / t, "loss": loss,
             "final_accuracy": 0.6}  # fmt: skip
        if eng:
            r["xdpagg"] = {"engine": eng}
        return r

    eng = {"bytes_sent": 40 * 5e6, "allreduces": 40, "sparse_allreduces": 40}
    case = {"date": "now", "load": [1.0, 1.0],
            "xdpagg-sparse": rep(0.1, [0.7, 0.6], eng),
            "xdpagg": rep(0.4, [0.7, 0.6], {**eng, "sparse_allreduces": 0}),
            "gloo": rep(0.5, [0.7, 0.6000001])}  # fmt: skip
    md = "\n".join(training.recsys_markdown(case, 4))
    row = "| xdpagg-sparse | 100.0 ms | 50.0 ms | 50% | 0.6000 | 0.6000 | 0 | 40 of 40 | 5.00 |"
    assert row in md
    assert "| xdpagg | 400.0 ms |" in md and "| 0 of 40 |" in md
    assert "xdpagg / xdpagg-sparse 4.00x, gloo / xdpagg-sparse 5.00x (n = 4)" in md
