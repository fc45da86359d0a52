"""bench.allreduce --topology: the option, the rows of each topology side by side, the switch rows'
ratios to one-arm and to gloo, and where the CPU went (no root: rows as run_config makes them)."""

import pytest

from bench import allreduce, topology


def _syscpu(host, fabric, agg):
    """A system's spans as bench.worker's rank 0 reports them: one repetition, in CPU seconds."""
    return [{"wall_s": 1.0, "busy_s": host + fabric + agg, "host_s": host, "fabric_s": fabric,
             "aggregator_s": agg, "bpf_runs": 1000}]  # fmt: skip


def _row(topo, xdp_agg, gloo, n=8, link="10gbit"):
    """A 64 MiB throughput row of `topo` with both systems' times (3 repetitions)."""
    return {"n": n, "link": link, "topology": topo, "bytes": 64 << 20, "kind": "throughput",
            "dtype": "float32", "xdp-agg": xdp_agg, "gloo": gloo, "xdp-agg cpu_s": [0.5] * 3,
            "gloo cpu_s": [0.4] * 3, "retransmissions": 10, "packets": 1000,
            "elems": topology.elems(topo, 2048)}  # fmt: skip


def test_l2switch_topology_option_parses_and_checks():
    assert topology.topologies("one-arm,switch") == ["one-arm", "switch"]
    assert topology.topologies("switch,switch") == ["switch"]
    with pytest.raises(ValueError, match="unknown topology"):
        topology.topologies("ring")
    assert allreduce._parser().parse_args([]).topology == "one-arm"
    args = allreduce._parser().parse_args(["--topology", "one-arm,switch"])
    assert args.topology == "one-arm,switch"
    assert topology.testbed_options("switch") == {"topology": "switch", "kernel_forwarding": True}
    assert topology.testbed_options("one-arm")["kernel_forwarding"] is False


def test_l2switch_jumbo_packets_become_single_buffer_ones_in_switch():
    """The devmap broadcast carries no multi-buffer frame: switch rows run 768 int32 where
    one-arm runs 1024 or 2048; sizes that fit a buffer stay as asked."""
    assert topology.SINGLE_BUFFER_ELEMS == 768
    assert [topology.elems("switch", e) for e in (256, 768, 1024, 2048)] == [256, 768, 768, 768]
    assert [topology.elems("one-arm", e) for e in (768, 2048)] == [768, 2048]


@pytest.mark.parametrize(
    "argv", [["--topology", "star"], ["--topology", "one-arm,switch", "--loss", "0.01"]]
)
def test_l2switch_bad_topology_options_are_refused_before_any_testbed(argv, capsys):
    with pytest.raises(SystemExit):
        allreduce.main(argv)
    assert "topology" in capsys.readouterr().err


def test_l2switch_switch_rows_compare_with_one_arm_and_gloo():
    one = _row("one-arm", [0.5, 0.6, 0.7], [0.45, 0.45, 0.5])
    sw = _row("switch", [0.3, 0.4, 0.5], [0.5, 0.5, 0.6])
    old = _row("one-arm", [0.5] * 3, [0.5] * 3, n=4)
    del old["topology"]  # a row from before --topology: one-arm
    cells = allreduce.summarize([one, sw, old])
    c1, c2, c3 = cells
    assert [c["topology"] for c in cells] == ["one-arm", "switch", "one-arm"]
    assert "vs_one_arm" not in c1 and "vs_one_arm" not in c3
    assert c2["vs_one_arm"] == {"xdp-agg": 0.6 / 0.4, "gloo": 0.45 / 0.5}
    assert c2["speedup"] == 0.5 / 0.4 and c1["speedup"] == 0.45 / 0.6
    assert c2["xdp-agg"]["of_bound"] == (64 << 20) * 8 / 10e9 / 0.4
    assert c2["gloo"]["of_bound"] == 2 * 7 / 8 * (64 << 20) * 8 / 10e9 / 0.5
    assert c2["vs_1_lane"] == 1.0  # the 1-lane cell of its own topology


def test_l2switch_markdown_puts_one_arm_beside_switch_with_the_cpu_split():
    sw = _row("switch", [0.3, 0.4, 0.5], [0.5, 0.5, 0.6])
    one = _row("one-arm", [0.5, 0.6, 0.7], [0.45, 0.45, 0.5])
    for row, (h, f, a) in ((one, (0.5, 0.4, 0.1)), (sw, (0.6, 0.2, 0.2))):
        row["syscpu"] = {s: _syscpu(h, f, a) for s in ("xdp-agg", "gloo")}
        row["background_cpu_per_s"] = 0.0
    cells = allreduce.summarize([sw, one])
    meta = {"when": "now", "reps": 3, "mtu": 9000, "elems": 2048, "window": 64,
            "topologies": ["one-arm", "switch"]}  # fmt: skip
    md = allreduce.markdown(cells, meta)
    assert "topologies one-arm, switch." in md
    assert "| n | link | topology | size |" in md  # the throughput table's column
    side = md[md.index("Topologies side by side") :]
    one_at = side.index("| 8 | 10gbit | 64 MiB | 1 | one-arm | 2048 |")
    sw_at = side.index("| 8 | 10gbit | 64 MiB | 1 | switch | 768 |")
    assert one_at < sw_at  # one-arm first, then its switch row
    assert "| 400 (200) | 500 (100) | 1.25x |" in side and "| 1.50x | 0.90x |" in side
    assert "| 50/40/10% | 50/40/10% |" in side and "| 60/20/20% | 60/20/20% |" in side
    assert "| 16.0 / 16.0 | 0.0 / 0.0 |" in side  # CPU s/GiB, then the background's
    # the run's own: 8 workers' getrusage (0.5 s, 0.4 s each) and the XDP programs', per GiB
    assert "| w 64.0 + x 1.6 / w 51.2 + x 1.6 |" in side
    assert "| 8 | 10gbit, switch | 64 MiB | xdp-agg |" in md  # the system-wide CPU table


def test_l2switch_one_topology_keeps_the_tables_as_they_were():
    md = allreduce.markdown(
        allreduce.summarize([_row("one-arm", [0.5] * 3, [0.5] * 3)]),
        {"when": "now", "reps": 3, "mtu": 3500, "elems": 768, "window": 64},
    )
    assert "Topologies side by side" not in md and "| topology |" not in md


def test_l2switch_tables_of_several_runs_again_from_their_json(tmp_path, capsys):
    """python -m bench.topology: each run's side-by-side table from its raw rows, headed by its
    MTU and load (the MTU 3500 and 9000 runs on one page)."""
    import json

    meta = {"mtu": 9000, "elems": 2048, "when": "now", "reps": 3, "seconds": 60, "cpus": 2,
            "load_before": [1.0, 1.0, 1.0], "load_after": [2.0, 1.0, 1.0]}  # fmt: skip
    rows = [_row("one-arm", [0.5] * 3, [0.5] * 3), _row("switch", [0.4] * 3, [0.5] * 3)]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"meta": meta, "raw": rows}))
    assert topology.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("MTU 9000, 2048 int32 per packet")
    assert "load average [1.0, 1.0, 1.0] before" in out
    assert "| 8 | 10gbit | 64 MiB | 1 | switch | 768 | 400 (0) | 500 (0) | 1.25x |" in out


def test_l2switch_latency_rows_say_their_topology():
    rows = [_row(t, [0.001] * 3, [0.002] * 3, n=4) for t in ("one-arm", "switch")]
    for r in rows:
        r.update(kind="latency", bytes=4 << 10)
    md = allreduce.markdown(allreduce.summarize(rows), {"when": "now", "reps": 3, "mtu": 3500,
                                                        "elems": 768, "window": 64})  # fmt: skip
    assert "| 4 | 10gbit | 4 KiB | 1.000 |" in md and "| 4 | 10gbit, switch | 4 KiB | 1.000 |" in md
