"""The soak (bench.soak): a short run of the same code as `make soak`, and its verdicts' logic.

The short run: two jobs of 4 workers each on one XDP aggregator, 1% loss both ways, for one
minute, sampled every 5 s: every result right, RSS/fds/map memory flat, nothing left behind.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import soak

ROOT = Path(__file__).resolve().parents[1]


def test_growth_verdict_catches_a_leak_and_passes_a_swing():
    """A series that only swings passes; one whose maximum climbs fails; too few samples fail."""
    swing = [100, 300, 100, 300, 100, 300, 100, 300]
    leak = [100, 110, 120, 130, 140, 150, 160, 170]
    v = soak.growth_verdict({"a": swing}, 16, "x")
    assert v["ok"] and v["per_process"]["a"]["growth"] == 0
    v = soak.growth_verdict({"a": swing, "b": leak}, 16, "x")
    assert not v["ok"] and v["per_process"]["b"]["growth"] == 40
    assert not soak.growth_verdict({"a": [1]}, 16, "x")["ok"]
    blips = [5, 6, 5, 5, 5, 5, 6, 5]  # a descriptor open for a moment
    assert soak.growth_verdict({"a": blips}, 0, "fds", stat=min)["ok"]
    assert not soak.growth_verdict({"a": [5, 5, 5, 6, 6, 6]}, 0, "fds", stat=min)["ok"]
    assert not soak.growth_verdict({}, 16, "x")["ok"]


def test_halves_and_slope():
    assert soak.halves([1, 2, 3, 4]) == ([1, 2], [3, 4])
    assert soak.halves([1, 2, 3]) == ([1, 2], [2, 3])
    assert soak.slope_per_hour([0, 1800, 3600], [10, 15, 20]) == pytest.approx(10.0)
    assert soak.slope_per_hour([5], [1]) == 0.0


def test_worker_plan_mixes_sizes_and_types():
    """The cycle covers 1 KiB .. 32 MiB, both dtypes, and --max-bytes caps it."""
    from bench.soak_worker import SIZES, plan_item

    items = [plan_item(k, 32 << 20) for k in range(2 * len(SIZES))]
    assert {d for d, _ in items} == {"int32", "float32"}
    assert min(c for _, c in items) * 4 == 1 << 10 and max(c for _, c in items) * 4 == 32 << 20
    assert max(plan_item(k, 1 << 20)[1] for k in range(len(SIZES))) * 4 == 1 << 20


@pytest.mark.root
@pytest.mark.bpf
@pytest.mark.netns
@pytest.mark.slow
def test_short_soak(tmp_path):
    """One minute of the soak: exit 0, every verdict true, the report written."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.soak",
            "--minutes",
            "1",
            "--interval",
            "5",
            "--warmup-min",
            "0.25",
            "--max-mib",
            "16",
            "--report",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((tmp_path / "soak.json").read_text())
    failed = {k: v for k, v in doc["verdicts"].items() if not v["ok"]}
    assert not failed, failed
    assert doc["verdicts"]["results_exact"]["checked"] >= 8 * 12  # a full cycle of sizes each
    assert len(doc["samples"]) >= 10
    assert {b["dtype"] for b in doc["results_by_size"]} == {"int32", "float32"}
    assert (tmp_path / "summary.md").read_text().startswith("# Soak")
    assert len((tmp_path / "samples.csv").read_text().splitlines()) == len(doc["samples"]) + 1
    assert "[" in r.stderr and "soak PASSED" in r.stderr  # progress lines and the verdict
