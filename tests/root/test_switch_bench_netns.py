"""bench.allreduce --topology one-arm,switch end to end at a tiny size (root): a row per topology,
both systems' all-reduces counted in each, gloo's ring routed through the switch box
(netns_testbed.kernel_forward) and xdp-agg's results broadcast by its devmap. Counts, not times."""

import json

import pytest

from bench import allreduce

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.slow]


def test_l2switch_bench_rows_run_in_both_topologies(tmp_path):
    argv = ["--workers", "2", "--links", "1gbit", "--sizes", "256KiB", "--rows", "throughput",
            "--reps", "2", "--topology", "one-arm,switch", "--no-profile",
            "--out", str(tmp_path)]  # fmt: skip
    assert allreduce.main(argv) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["meta"]["topologies"] == ["one-arm", "switch"]
    raw = {r["topology"]: r for r in doc["raw"]}
    assert sorted(raw) == ["one-arm", "switch"]
    for row in raw.values():
        assert row["n"] == 2 and row["kind"] == "throughput"
        assert len(row["xdp-agg"]) == 2 and len(row["gloo"]) == 2  # every repetition, both
        assert row["packets"] > 0
        assert set(row["syscpu"]) >= {"xdp-agg", "gloo"}
    cells = {c["topology"]: c for c in doc["summary"]}
    assert "vs_one_arm" not in cells["one-arm"]
    assert set(cells["switch"]["vs_one_arm"]) == {"xdp-agg", "gloo"}
    md = (tmp_path / "results.md").read_text()
    assert "Topologies side by side" in md and "| 2 | 1gbit | 256 KiB | 1 | switch |" in md
