"""bench.allreduce's summary and table of the host rows and the retransmission and CPU columns
(no root: rows as run_config makes them)."""

import argparse

import pytest

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
    assert "| int32 | 32 | 64 MiB | 1 | 250.0 (100.0) | 2.15 | 1.00x | 4.80 | 17.88 | 1.20 |" in md
    assert "Small all-reduces" not in md  # no latency rows were run


def test_lanes_rows_carry_their_lanes_and_the_ratio_to_one_lane():
    """Rows of 2 lanes beside those of 1 lane (the same n, link, size, kind and dtype): each cell
    says its lanes, and "vs 1 lane" is the 1-lane median over its own."""
    thr1, host1 = _rows()
    thr2, host2 = _rows()
    thr2.update(lanes=2, **{"xdp-agg": [0.35, 0.3, 0.4]})
    host2.update(lanes=2, **{"xdp-agg": [0.125, 0.1, 0.15]})
    cells = allreduce.summarize([thr1, host1, thr2, host2])
    assert [c["lanes"] for c in cells] == [1, 1, 2, 2]
    assert cells[2]["vs_1_lane"] == 0.7 / 0.35 and cells[3]["vs_1_lane"] == 0.25 / 0.125
    md = allreduce.markdown(cells, {"when": "now", "reps": 3, "mtu": 3500, "elems": 768,
                                    "window": 64, "lanes": [1, 2]})  # fmt: skip
    assert "lanes 1, 2." in md
    assert "| 4 | 1gbit | 64 MiB | float32 | 32 | float32 | 2 | 350.0 (100.0) | 900.0 (0.0) |" in md
    assert "| int32 | 32 | 64 MiB | 2 | 125.0 (50.0) | 4.29 | 2.00x |" in md


def test_lanes_option():
    assert allreduce._parser().parse_args(["--lanes", "1,2"]).lanes == [1, 2]
    assert allreduce._parser().parse_args([]).lanes == [1]


def test_wire16_rows_say_dtype_and_width_and_gloos_dtype():
    """--dtype and --wire-bits: each dtype at each width asked ("auto": hostlib's default), the
    tensor of the size's float32 elements; float32 at 16 bits runs against gloo on a bfloat16
    copy; ATE/s counts elements, the host rows CPU ns per element."""
    assert allreduce.widths("bfloat16,float32", "auto") == [("bfloat16", 16), ("float32", 32)]
    assert allreduce.widths("float32", "auto,16,32") == [("float32", 32), ("float32", 16)]
    for bad in (("int8", "auto"), ("float32", "8")):
        with pytest.raises(ValueError):
            allreduce.widths(*bad)
    item = allreduce.plan_item(16 << 20, 3, "throughput", "bfloat16", 16)
    assert (item["bytes"], item["gloo_dtype"]) == (32 << 20, "bfloat16")
    assert allreduce.plan_item(16 << 20, 3, "throughput", "float32", 16)["gloo_dtype"] == "bfloat16"
    row = _row(4, "1gbit", "throughput", "bfloat16", [0.3, 0.3, 0.3], [0.1] * 3,
               gloo=[0.45] * 3, retransmissions=0, packets=100)  # fmt: skip
    row.update(bytes=32 << 20, elements=16 << 20, wire_bits=16, gloo_dtype="bfloat16")
    host = _row(1, "unshaped", "host", "bfloat16", [0.2] * 3, [0.2] * 3, retransmissions=0,
                packets=100, bytes=32 << 20, elements=16 << 20, wire_bits=16)  # fmt: skip
    cell, hcell = allreduce.summarize([row, host])
    assert (cell["dtype"], cell["wire_bits"], cell["gloo_dtype"]) == ("bfloat16", 16, "bfloat16")
    assert cell["xdp-agg"]["ate_per_s"] == (16 << 20) / 0.3
    # the bounds count what crosses the wire: 2 bytes an element for both systems here
    assert cell["bound_ina_s"] == (32 << 20) * 8 / 1e9
    assert cell["bound_ring_s"] == 1.5 * (32 << 20) * 8 / 1e9
    f32 = dict(row, dtype="float32", bytes=64 << 20, gloo_dtype="bfloat16")
    assert allreduce.summarize([f32])[0]["bound_ina_s"] == cell["bound_ina_s"]
    assert hcell["cpu_ns_per_elem"] == 0.2 / (16 << 20) * 1e9
    md = allreduce.markdown([cell, hcell], {"when": "now", "reps": 3, "mtu": 3500, "elems": 768,
                                            "window": 64})  # fmt: skip
    assert "| 4 | 1gbit | 32 MiB | bfloat16 | 16 | bfloat16 | 1 | 300.0 (0.0) | 450.0 (0.0) |" in md
    assert "| bfloat16 | 16 | 32 MiB | 1 | 200.0 (0.0) |" in md


def _loss_row(loss, xdp, gloo, kind="throughput", **more):
    engine = [{"early_losses": 3, "timeouts": 1, "spurious": 0}] * 2
    return _row(4, "10gbit", kind, "float32", xdp, [0.1] * 3, gloo=gloo, retransmissions=8,
                packets=1000, loss=loss, early_loss=True, engine=engine, **more)  # fmt: skip


def test_early_loss_rows_say_their_loss_and_time_against_the_clean_one():
    """bench.lossrows: each lossy or burst cell's time over the same system's clean time in the
    same run; the loss table says the loss, the burst and the engine counters; the throughput
    table keeps the clean cells only."""
    rows = [
        _loss_row(0.0, [0.4] * 3, [0.2] * 3),
        _loss_row(0.01, [0.5] * 3, [0.3] * 3),
        _loss_row(0.0, [0.45] * 3, [0.5] * 3, kind="burst", burst_ms=50, burst_spans=[0.06]),
    ]
    clean, lossy, burst = allreduce.summarize(rows)
    assert "vs_clean" not in clean
    assert lossy["vs_clean"] == pytest.approx({"xdp-agg": 1.25, "gloo": 1.5})
    assert burst["vs_clean"] == pytest.approx({"xdp-agg": 1.125, "gloo": 2.5})
    assert burst["burst_actual_ms"] == pytest.approx(60)
    assert lossy["engine_counts"] == {"early_losses": 6, "timeouts": 2, "spurious": 0}
    md = allreduce.markdown([clean, lossy, burst], {"when": "now", "reps": 3, "mtu": 3500,
                                                    "elems": 768, "window": 64})  # fmt: skip
    assert "| on | 0.01 | 500.0 | 1.25x | 300.0 | 1.50x | 0.60x |" in md
    assert "burst 50 ms (measured 60)" in md
    throughput = md.split("Under loss")[0]
    assert "500.0" not in throughput  # the lossy cell is in the loss table only


def test_early_loss_options_parse():
    from bench import lossrows

    assert lossrows.probabilities("0.01,0") == [0.0, 0.01]
    assert lossrows.probabilities("0.05") == [0.0, 0.05]  # the clean row always runs
    assert lossrows.early_settings("on,off") == [True, False]
    with pytest.raises(Exception, match="in \\[0, 1\\)"):
        lossrows.probabilities("1")
    with pytest.raises(Exception, match="on, off"):
        lossrows.early_settings("maybe")


def test_early_loss_reorder_rows_compare_with_the_clean_path():
    """A reordering row (a share of frames held back, no loss) is its own row of the loss
    table, against the clean cell; the clean tables keep it out; --reorder parses like --loss
    without the clean value, and each reordering runs as its own setting without loss."""
    from bench import lossrows

    rows = [
        _loss_row(0.0, [0.4] * 3, [0.2] * 3),
        _loss_row(0.0, [0.44] * 3, [0.3] * 3, reorder=0.05),
    ]
    clean, reordered = allreduce.summarize(rows)
    assert reordered["vs_clean"] == pytest.approx({"xdp-agg": 1.1, "gloo": 1.5})
    assert "vs_clean" not in clean
    md = allreduce.markdown([clean, reordered], {"when": "now", "reps": 3, "mtu": 3500,
                                                 "elems": 768, "window": 64})  # fmt: skip
    assert "| on | reorder 0.05 | 440.0 | 1.10x | 300.0 | 1.50x |" in md
    assert "440.0" not in md.split("Under loss")[0]
    ap = argparse.ArgumentParser()
    lossrows.options(ap)
    args = ap.parse_args(["--loss", "0.01", "--reorder", "0.05,0"])
    assert args.reorder == [0.05] and args.reorder_delay_ms == 0.5
    args.lanes = [1]
    paths = [(s["loss"], s["reorder"]) for s in allreduce._settings(args)]
    assert paths == [(0.0, 0.0), (0.01, 0.0), (0.0, 0.05)]


def test_early_loss_scope_aggregation_leaves_gloo_out_of_the_loss_cells():
    """--loss-scope aggregation: only xdp-agg's datagrams are lost, so a lossy cell compares
    xdp-agg with its clean time and says nothing of gloo (its time there is a clean one)."""
    from bench import lossrows

    rows = [
        _loss_row(0.0, [0.4] * 3, [0.2] * 3, loss_scope="aggregation"),
        _loss_row(0.1, [0.8] * 3, [0.21] * 3, loss_scope="aggregation"),
    ]
    clean, lossy = allreduce.summarize(rows)
    assert lossy["vs_clean"] == pytest.approx({"xdp-agg": 2.0})
    md = allreduce.markdown([clean, lossy], {"when": "now", "reps": 3, "mtu": 3500,
                                             "elems": 768, "window": 64})  # fmt: skip
    assert "| on | 0.1 | 800.0 | 2.00x | - (no loss) | - | - |" in md
    ap = argparse.ArgumentParser()
    lossrows.options(ap)
    assert ap.parse_args([]).loss_scope == "all"
    assert ap.parse_args(["--loss-scope", "aggregation"]).loss_scope == "aggregation"


def test_a_benchmark_killed_by_sigterm_unwinds_its_with_blocks():
    """bench.unwind_on_sigterm: SIGTERM ends a benchmark by SystemExit(143), so the `with`
    blocks that hold its testbed and attached program run their exits (SIGTERM's default ends
    the process where it stands and leaves the namespaces behind). A child forked from it
    (pyroute2's namespace helpers) still ends on SIGTERM at once, as by default: raising in
    the child instead left testbed builds waiting for their helpers."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import contextlib, os, signal, time\n"
        "from bench import unwind_on_sigterm\n"
        "unwind_on_sigterm()\n"
        "@contextlib.contextmanager\n"
        "def testbed():\n"
        "    try:\n"
        "        yield\n"
        "    finally:\n"
        "        print('taken down', flush=True)\n"
        "with testbed():\n"
        "    r, w = os.pipe()\n"
        "    child = os.fork()\n"
        "    if child == 0:\n"
        "        os.write(w, b'up')\n"
        "        time.sleep(600)\n"
        "        os._exit(0)\n"
        "    os.read(r, 2)\n"
        "    os.kill(child, signal.SIGTERM)\n"
        "    status = os.waitpid(child, 0)[1]\n"
        "    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 'lived'\n"
        "    print('child', sig, flush=True)\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(600)\n"
    )
    root = Path(__file__).resolve().parents[2]
    p = subprocess.Popen(
        [sys.executable, "-c", script], cwd=root, stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout.readline() == f"child {int(signal.SIGTERM)}\n"
        assert p.stdout.readline() == "ready\n"  # the event: inside the with block
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
    finally:
        p.kill()
    assert out == "taken down\n"
    assert p.returncode == 128 + signal.SIGTERM
