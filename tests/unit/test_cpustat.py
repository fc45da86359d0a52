"""bench.cpustat: /proc/stat parsing and deltas, the host/fabric/aggregator split, a cell's
summary, and bench.allreduce's columns built from it (no root)."""

import pytest

from bench import allreduce, cpustat

STAT_A = """cpu  1000 10 500 90000 40 7 300 0 0 0
cpu0 500 5 250 45000 20 3 150 0 0 0
cpu1 500 5 250 45000 20 4 150 0 0 0
intr 123456 0 0
ctxt 99
"""
STAT_B = """cpu  1100 12 560 90100 40 9 390 0 0 0
cpu0 550 6 280 45050 20 4 195 0 0 0
cpu1 550 6 280 45050 20 5 195 0 0 0
intr 123999 0 0
"""


def test_parse_takes_the_all_cpu_line():
    a = cpustat.parse_proc_stat(STAT_A)
    assert a["user"] == 1000 and a["nice"] == 10 and a["system"] == 500
    assert a["idle"] == 90000 and a["irq"] == 7 and a["softirq"] == 300 and a["guest_nice"] == 0


def test_parse_old_kernels_with_fewer_fields():
    a = cpustat.parse_proc_stat("cpu  1 2 3 4\nintr 0\n")
    assert a["system"] == 3 and a["idle"] == 4 and a["softirq"] == 0 and a["steal"] == 0


def test_parse_without_a_cpu_line_fails():
    with pytest.raises(ValueError):
        cpustat.parse_proc_stat("cpu0 1 2 3 4\n")


def test_delta_in_seconds_and_backwards_refused():
    a, b = cpustat.parse_proc_stat(STAT_A), cpustat.parse_proc_stat(STAT_B)
    d = cpustat.delta_seconds(a, b, 100)
    assert d["user"] == 1.0 and d["nice"] == 0.02 and d["system"] == 0.6
    assert d["irq"] == 0.02 and d["softirq"] == 0.9 and d["idle"] == 1.0
    with pytest.raises(ValueError):
        cpustat.delta_seconds(b, a, 100)


def test_split_subtracts_the_aggregator_from_softirq():
    d = cpustat.delta_seconds(cpustat.parse_proc_stat(STAT_A), cpustat.parse_proc_stat(STAT_B), 100)
    s = cpustat.split(d, aggregator_ns=300_000_000)
    assert s["busy_s"] == pytest.approx(1.0 + 0.02 + 0.6 + 0.02 + 0.9)
    assert s["host_s"] == pytest.approx(1.62)
    assert s["aggregator_s"] == 0.3
    assert s["fabric_s"] == pytest.approx(0.92 - 0.3)
    assert s["host_s"] + s["fabric_s"] + s["aggregator_s"] == pytest.approx(s["busy_s"])
    assert cpustat.dominant(s) == "host"


def test_split_clamps_fabric_when_ticks_undercount():
    cpu = {f: 0.0 for f in cpustat.FIELDS} | {"softirq": 0.01, "user": 0.02}
    s = cpustat.split(cpu, aggregator_ns=50_000_000)  # BPF time exact, softirq a tick short
    assert s["fabric_s"] == 0.0 and s["aggregator_s"] == 0.05
    assert cpustat.dominant(s) == "aggregator"


def _span(busy, host, fabric, agg, wall=0.5, runs=1000):
    return {
        "busy_s": busy,
        "host_s": host,
        "fabric_s": fabric,
        "aggregator_s": agg,
        "wall_s": wall,
        "bpf_runs": runs,
    }


def test_cell_means_per_gib_shares_and_background():
    spans = [_span(1.0, 0.5, 0.4, 0.1), _span(2.0, 1.0, 0.6, 0.4, wall=1.5, runs=3000)]
    c = cpustat.cell(spans, 512 << 20, background_per_s=0.2)
    assert c["sys_cpu_s"] == 1.5 and c["sys_cpu_s_per_gib"] == 3.0
    assert c["host_s"] == 0.75 and c["fabric_s"] == 0.5 and c["aggregator_s"] == 0.25
    assert c["host_share"] == 0.5 and c["mostly"] == "host"
    assert c["bpf_runs"] == 2000 and c["bpf_ns_per_run"] == pytest.approx(125_000.0)
    assert c["span_s"] == 1.0 and c["background_cpu_s"] == pytest.approx(0.2)
    assert cpustat.cell([], 1) == {}


def test_cell_without_bpf_runs():
    c = cpustat.cell([_span(0.2, 0.1, 0.1, 0.0, runs=0)], 1 << 30)
    assert c["bpf_ns_per_run"] is None and "background_cpu_s" not in c
    assert c["mostly"] in ("host", "fabric")


def _rows():
    return [
        {
            "n": 2,
            "link": "10gbit",
            "bytes": 16 << 20,
            "kind": "throughput",
            "dtype": "float32",
            "xdp-agg": [0.2, 0.3],
            "gloo": [0.1, 0.1],
            "xdp-agg cpu_s": [0.1, 0.1],
            "gloo cpu_s": [0.05, 0.05],
            "retransmissions": 0,
            "packets": 100,
            "syscpu": {
                "xdp-agg": [_span(0.4, 0.2, 0.1, 0.1), _span(0.6, 0.3, 0.2, 0.1)],
                "gloo": [_span(0.2, 0.1, 0.1, 0.0, runs=0)] * 2,
            },
            "background_cpu_per_s": 0.1,
        }
    ]


def test_summary_and_markdown_carry_the_system_wide_columns():
    (s,) = allreduce.summarize(_rows())
    a, g = s["xdp-agg"]["syscpu"], s["gloo"]["syscpu"]
    assert a["sys_cpu_s"] == pytest.approx(0.5) and a["sys_cpu_s_per_gib"] == pytest.approx(32.0)
    assert a["aggregator_s"] == pytest.approx(0.1) and a["mostly"] == "host"
    assert g["aggregator_s"] == 0.0 and g["bpf_ns_per_run"] is None
    md = allreduce.markdown(
        [s], {"when": "now", "reps": 2, "mtu": 3500, "elems": 768, "window": 64}
    )
    assert "System-wide CPU per all-reduce" in md
    assert (
        "| 2 | 10gbit | 16 MiB | xdp-agg | 0.500 | 32.00 | 0.250 (50%) | 0.150 (30%) "
        "| 0.100 (20%) | host | 100000 | 0.050 |" in md
    )
    assert "| 2 | 10gbit | 16 MiB | gloo | 0.200 | 12.80 |" in md
    rows = _rows()
    rows[0]["bpf_stats"] = False  # not root: no BPF statistics, so no aggregator share
    md = allreduce.markdown(
        allreduce.summarize(rows),
        {"when": "now", "reps": 2, "mtu": 3500, "elems": 768, "window": 64},
    )
    assert "| - (no BPF stats) |" in md


def test_bpf_stats_sysctl_restored(tmp_path):
    f = tmp_path / "bpf_stats_enabled"
    f.write_text("0\n")
    with cpustat.BpfStats(f) as st:
        assert st.enabled and f.read_text() == "1\n"
    assert f.read_text() == "0\n"
    with cpustat.BpfStats(tmp_path / "missing" / "x") as st:
        assert not st.enabled
