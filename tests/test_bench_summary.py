"""bench.allreduce's summary and table of the host rows and the retransmission and CPU columns
(no root: rows as run_config makes them)."""

from bench import allreduce


def _row(n, link, kind, dtype, xdp_agg, cpu_s, **more):
    """One row as run_config makes it: 64 MiB, xdp-agg's times and CPU seconds, then `more`."""
    return {"n": n, "link": link, "bytes": 64 << 20, "kind": kind, "dtype": dtype,
            "xdp-agg": xdp_agg, "xdp-agg cpu_s": cpu_s, **more}  # fmt: skip


def _rows():
    thr = _row(4, "1gbit", "throughput", "float32", [0.7, 0.6, 0.8], [0.4, 0.5, 0.6],
               gloo=[0.9, 0.9, 0.9], retransmissions=50, packets=10000,
               retx_causes={"spurious": 40, "tbf_qdisc": 10})  # fmt: skip
    thr["gloo cpu_s"] = [0.1, 0.1, 0.2]
    host = _row(1, "unshaped", "host", "int32", [0.25, 0.2, 0.3], [0.3, 0.2, 0.4],
                retransmissions=0, packets=22000)  # fmt: skip
    return [thr, host]


def test_summary_columns():
    thr, host = allreduce.summarize(_rows())
    assert thr["retx_pct"] == 0.5 and thr["retx_causes"]["spurious"] == 40
    assert thr["xdp-agg"]["cpu_s_per_rank"] == 0.5 and thr["gloo"]["cpu_s_per_rank"] == 0.1
    assert thr["speedup"] == 0.9 / 0.7 and thr["xdp-agg"]["of_bound"] == (64 << 20) * 8 / 1e9 / 0.7
    assert host["kind"] == "host" and host["dtype"] == "int32" and "gloo" not in host
    assert host["gbit_each_way"] == (64 << 20) * 8 / 0.25 / 1e9
    assert host["cpu_s_per_gib"] == 0.3 / 0.0625 and host["retx_pct"] == 0


def test_markdown_has_the_new_columns():
    md = allreduce.markdown(
        allreduce.summarize(_rows()),
        {"when": "now", "reps": 3, "mtu": 3500, "elems": 768, "window": 256},
    )
    assert "| 50 (0.50%; spurious 80%, tbf_qdisc 20%) | 0.500 | 0.100 |" in md
    assert "| int32 | 64 MiB | 250.0 (100.0) | 2.15 | 4.80 | 0 (0.00%) |" in md
    assert "Small all-reduces" not in md  # no latency rows were run
