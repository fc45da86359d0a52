"""The soak (bench.soak): a short run of the same code as `make soak`, and its verdicts' logic.

The short run: two jobs of 4 workers each on one XDP aggregator, 1% loss both ways, for 90 s
with tensors up to 2 MiB, sampled every 5 s: every result right, RSS/fds/map memory flat,
nothing left behind.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak import report, verdicts
from bench.soak.verdicts import Thresholds

ROOT = Path(__file__).resolve().parents[2]


def test_growth_verdict_catches_a_leak_and_passes_a_swing():
    """A series that only swings passes; one whose maximum climbs fails; too few samples fail."""
    swing = [100, 300, 100, 300, 100, 300, 100, 300]
    leak = [100, 110, 120, 130, 140, 150, 160, 170]
    v = verdicts.growth_verdict({"a": swing}, 16, "x")
    assert v["ok"] and v["per_process"]["a"]["growth"] == 0
    v = verdicts.growth_verdict({"a": swing, "b": leak}, 16, "x")
    assert not v["ok"] and v["per_process"]["b"]["growth"] == 40
    assert not verdicts.growth_verdict({"a": [1]}, 16, "x")["ok"]
    blips = [5, 6, 5, 5, 5, 5, 6, 5]  # a descriptor open for a moment
    assert verdicts.growth_verdict({"a": blips}, 0, "fds", stat=min)["ok"]
    assert not verdicts.growth_verdict({"a": [5, 5, 5, 6, 6, 6]}, 0, "fds", stat=min)["ok"]
    assert not verdicts.growth_verdict({}, 16, "x")["ok"]


def test_halves_and_slope():
    assert verdicts.halves([1, 2, 3, 4]) == ([1, 2], [3, 4])
    assert verdicts.halves([1, 2, 3]) == ([1, 2], [2, 3])
    assert verdicts.slope_per_hour([0, 1800, 3600], [10, 15, 20]) == pytest.approx(10.0)
    assert verdicts.slope_per_hour([5], [1]) == 0.0


def test_worker_plan_mixes_sizes_and_types():
    """The cycle covers 1 KiB .. 32 MiB, both dtypes, and --max-bytes caps it."""
    from bench.soak_worker import SIZES, plan_item

    items = [plan_item(k, 32 << 20) for k in range(2 * len(SIZES))]
    assert {d for d, _ in items} == {"int32", "float32"}
    assert min(c for _, c in items) * 4 == 1 << 10 and max(c for _, c in items) * 4 == 32 << 20
    assert max(plan_item(k, 1 << 20)[1] for k in range(len(SIZES))) * 4 == 1 << 20


def _synthetic_run(leak_kib: int = 0) -> dict:
    """What bench.soak.run returns, for one worker of one job over a minute; leak_kib: RSS the
    worker gains per cycle of sizes."""
    cycle = verdicts.CYCLE
    return {
        "config": {
            "minutes": 1,
            "interval_s": 5,
            "warmup_s": 0,
            "jobs": ["a"],
            "workers_per_job": 1,
            "loss_up": 0.01,
            "loss_down": 0.01,
            "elems": 256,
            "window": 128,
            "mtu": 1500,
            "max_bytes": 1 << 20,
            "aggregator": "x",
            "testbed_prefix": "xt00",
            "started": "start",
            "ended": "end",
            "elapsed_s": 60,
            "host": "h",
            "kernel": "k",
            "cpus": 2,
            "data_paths": {"a": "udp"},
        },
        "t_start": 0.0,
        "samples": [
            {
                "t_s": t,
                "procs": {"a/0": {"rss_kib": 1000, "fds": 5}, "server": {"rss_kib": 500, "fds": 9}},
                "map_memlock_bytes": 10,
                "map_kv_bytes": 5,
                "pinned_maps": 3,
                "pinned_progs": 1,
                "pins": 4,
                "namespaces": 3,
                "jobs": 1,
                "slots_in_use": 128,
                "agg_drops": 0,
                "allreduces": t,
                "wrong": 0,
                "gbit_s": 0.1,
                "retransmissions": 1,
                "retx_pct": 1.0,
            }
            for t in range(0, 60, 5)
        ],
        "after_workers": {"jobs": 0, "slots_in_use": 0, "stats": {}},
        "ranks": [
            {
                "job": "a",
                "rank": 0,
                "exit": 0,
                "allreduces": 4 * cycle,
                "done": {"done": True, "data_path": "udp"},
            }
        ],
        "reports": {
            "a/0": [
                {
                    "k": k,
                    "at": k * 60 / (4 * cycle),
                    "dtype": "int32" if k % 2 == 0 else "float32",
                    "bytes": 1024,
                    "seconds": 0.1,
                    "packets": 10,
                    "retransmissions": 0,
                    "rss_kib": 1000 + leak_kib * (k // cycle),
                    "fds": 5,
                    "ok": True,
                    "max_err_over_bound": 0.5,
                }
                for k in range(4 * cycle)
            ]
        },
        "after_teardown": {
            "namespaces": 0,
            "pin_dir_exists": False,
            "pins": 0,
            "state_file_exists": False,
            "processes_left": [],
        },
    }


def test_verdicts_and_report_of_a_clean_and_a_leaking_run(tmp_path):
    """The report's code end to end on a synthetic run: clean passes every verdict and writes
    the three files; a worker gaining 20 MiB per cycle fails rss_flat; a leftover namespace or
    a wrong result fails theirs."""
    limits = Thresholds()
    res = _synthetic_run()
    v = verdicts.verdicts(res, limits)
    assert all(x["ok"] for x in v.values()), {k: x for k, x in v.items() if not x["ok"]}
    report.write_report(res, v, tmp_path)
    assert (tmp_path / "summary.md").read_text().startswith("# Soak")
    assert json.loads((tmp_path / "soak.json").read_text())["verdicts"]["rss_flat"]["ok"]
    assert len((tmp_path / "samples.csv").read_text().splitlines()) == 13
    assert not verdicts.verdicts(_synthetic_run(leak_kib=20 << 10), limits)["rss_flat"]["ok"]
    bad = _synthetic_run()
    bad["after_teardown"]["namespaces"] = 1
    bad["reports"]["a/0"][3]["ok"] = False
    v = verdicts.verdicts(bad, limits)
    assert not v["nothing_left_after_teardown"]["ok"] and not v["results_exact"]["ok"]
    fell_back = _synthetic_run()  # the job asked for AF_XDP, hostlib fell back to UDP
    fell_back["config"]["data_paths"] = {"a": "afxdp"}
    fell_back["ranks"][0]["done"]["data_path_reason"] = "no CAP_NET_RAW"
    v = verdicts.verdicts(fell_back, limits)
    assert not v["data_paths"]["ok"] and v["data_paths"]["wrong"] == {
        "a/0": ["udp", "no CAP_NET_RAW"]
    }


@pytest.mark.root
@pytest.mark.bpf
@pytest.mark.netns
@pytest.mark.slow
def test_short_soak(tmp_path):
    """90 s of the soak (tensors up to 2 MiB): exit 0, every verdict true, the report written."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.soak",
            "--minutes",
            "1.5",
            "--interval",
            "5",
            "--warmup-min",
            "0.25",
            "--max-mib",
            "2",  # short cycles of sizes: enough cycle starts for the RSS verdict in 90 s
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
    # the default, --data-path mixed: one job on AF_XDP sockets, the other on kernel sockets
    assert doc["config"]["data_paths"] == {"soak-a": "afxdp", "soak-b": "udp"}
    assert [p.split("-")[0] for p in doc["verdicts"]["data_paths"]["got"]] == ["afxdp", "udp"]
    assert (tmp_path / "summary.md").read_text().startswith("# Soak")
    assert len((tmp_path / "samples.csv").read_text().splitlines()) == len(doc["samples"]) + 1
    assert "[" in r.stderr and "soak PASSED" in r.stderr  # progress lines and the verdict
