"""bench.allreduce --topology: the same cells in the one-arm and the switch topology, side by side.

one-arm: every host on one bridge; xdp-agg's results leave the aggregator's one port and the
bridge multicasts them to the job's members (IGMP snooping); gloo's ring crosses the bridge.
switch: a veth per worker into the aggregator's namespace (the box SwitchML's topology puts where
a ToR switch is); xdp-agg's results leave by the XDP program's devmap broadcast to every port,
and gloo's ring is routed by the kernel between the box's ports
(netns_testbed.kernel_forward: a route on each worker, forwarding on the ports).

Each switch cell is compared with the one-arm cell of the same setting in the same run
("vs_one_arm": per system, the one-arm median time over the switch one, so > 1 is faster in
switch); the table puts each one-arm row beside its switch row, with each system's speed against
the other and against its line-rate bound, and where the machine's CPU went (bench.cpustat:
host, fabric, aggregator).

Known difference (netns_testbed.testbed, LIMITATION): in switch, frames the XDP program sends out
of p<i> skip that port's qdisc, so the aggregator-to-worker direction of xdp-agg is not shaped;
each worker's upstream (its eth0's tbf) still is, and a result only follows its packets up.
"""

from __future__ import annotations

from bench import md_table
from xdp_agg.proto import wire

TOPOLOGIES = ("one-arm", "switch")
DEFAULT = "one-arm"


def topologies(text: str) -> list[str]:
    """--topology: "one-arm,switch" -> ["one-arm", "switch"], in the order given, each once.
    ValueError for a topology the testbed has not."""
    out: list[str] = []
    for t in text.split(","):
        if t not in TOPOLOGIES:
            raise ValueError(f"unknown topology {t!r}: one of {', '.join(TOPOLOGIES)}")
        if t not in out:
            out.append(t)
    return out


def of(cell: dict) -> str:
    """A cell's or row's topology (rows from before --topology are one-arm)."""
    return cell.get("topology", DEFAULT)


def testbed_options(topology: str) -> dict:
    """The Testbed keyword arguments a topology adds: switch's kernel forwarding, so that gloo's
    traffic between workers crosses the box."""
    return {"topology": topology, "kernel_forwarding": topology == "switch"}


# the largest packet whose frame fits one XDP buffer: what a devmap broadcast carries
SINGLE_BUFFER_ELEMS = max(
    e for c, e in wire.SIZE_CODE_ELEMS.items() if c not in wire.JUMBO_SIZE_CODES
)


def elems(topology: str, asked: int) -> int:
    """The int32 per packet a topology's rows run with: as asked, except that the switch
    topology's results leave by the devmap broadcast, which carries no multi-buffer frame (the
    aggregator refuses such a job: xdp_switch.backend), so a jumbo size (1024, 2048) becomes the
    largest single-buffer one, 768: at MTU 9000 one-arm runs 2048 and switch 768."""
    if topology == "switch" and asked > SINGLE_BUFFER_ELEMS:
        return SINGLE_BUFFER_ELEMS
    return asked


def _key(c: dict) -> tuple:
    return (c["n"], c["link"], c["bytes"], c["kind"], c["dtype"], c["wire_bits"], c["lanes"],
            c.get("loss", 0.0), c.get("early_loss", True))  # fmt: skip


def ratios(cells: list[dict]) -> None:
    """Each non-one-arm cell's "vs_one_arm": per system, the one-arm cell's median time over its
    own, in the same setting of the same run (absent where the run had no one-arm cell)."""
    one_arm = {_key(c): c for c in cells if of(c) == DEFAULT and c["kind"] != "host"}
    for c in cells:
        ref = one_arm.get(_key(c))
        if ref is None or ref is c:
            continue
        c["vs_one_arm"] = {
            s: ref[s]["median_s"] / c[s]["median_s"] for s in ("xdp-agg", "gloo") if s in c
        }


def _split(d: dict) -> str:
    """'45/40/15%': a system's machine CPU split host/fabric/aggregator, or '-'."""
    c = d.get("syscpu")
    if not c:
        return "-"
    agg = f"{c['aggregator_share'] * 100:.0f}" if c.get("bpf_stats", True) else "?"
    return f"{c['host_share'] * 100:.0f}/{c['fabric_share'] * 100:.0f}/{agg}%"


def _cpu(d: dict) -> str:
    c = d.get("syscpu")
    return f"{c['sys_cpu_s_per_gib']:.1f}" if c else "-"


def _background(d: dict, nbytes: int) -> str:
    """The rest of the machine's CPU over the all-reduce, per all-reduced GiB (in the total)."""
    c = d.get("syscpu") or {}
    return f"{c['background_cpu_s'] / (nbytes / 2**30):.1f}" if "background_cpu_s" in c else "-"


def _own(d: dict, n: int, nbytes: int) -> str:
    """'w 9.1 + x 0.4': this run's own CPU per all-reduced GiB, which other users' work on the
    machine does not enter: the n worker processes' (getrusage, all threads) and the XDP
    programs' (their BPF run time); '-' where not measured."""
    gib = nbytes / 2**30
    w = f"w {d['cpu_s_per_rank'] * n / gib:.1f}" if "cpu_s_per_rank" in d else "w -"
    c = d.get("syscpu") or {}
    x = f"x {c['aggregator_s'] / gib:.1f}" if c and c.get("bpf_stats", True) else "x -"
    return f"{w} + {x}"


def _row(s: dict, size) -> list:
    """One cell's line of markdown()'s table."""
    a, g = s["xdp-agg"], s["gloo"]
    fb = lambda d: f"{d['of_bound']:.0%}" if "of_bound" in d else "-"  # noqa: E731
    vs = s.get("vs_one_arm", {})
    vcell = lambda k: f"{vs[k]:.2f}x" if k in vs else "-"  # noqa: E731
    return [s["n"], s["link"], size(s["bytes"]), s["lanes"], of(s), s.get("elems", "-")] + [
        f"{a['median_s'] * 1e3:.0f} ({(a['max_s'] - a['min_s']) * 1e3:.0f})",
        f"{g['median_s'] * 1e3:.0f} ({(g['max_s'] - g['min_s']) * 1e3:.0f})",
        f"{s['speedup']:.2f}x",
        fb(a),
        fb(g),
        vcell("xdp-agg"),
        vcell("gloo"),
        f"{_cpu(a)} / {_cpu(g)}",
        f"{_background(a, s['bytes'])} / {_background(g, s['bytes'])}",
        f"{_own(a, s['n'], s['bytes'])} / {_own(g, s['n'], s['bytes'])}",
        _split(a),
        _split(g),
        f"{s.get('retx_pct', 0):.2f}%",
    ]


COLUMNS = [
    "n", "link", "size", "lanes", "topology", "int32/packet", "xdp-agg ms (spread)",
    "gloo ms (spread)",
    "xdp-agg vs gloo", "xdp-agg % of S/R", "gloo % of 2(n-1)/n S/R", "xdp-agg vs one-arm",
    "gloo vs one-arm", "CPU s/GiB xdp-agg / gloo", "of which background",
    "own CPU s/GiB, workers + XDP: xdp-agg / gloo", "xdp-agg CPU host/fabric/agg",
    "gloo CPU host/fabric/agg", "xdp-agg retx",
]  # fmt: skip


def markdown(summary: list[dict], size) -> list[str]:
    """The side-by-side table of the clean throughput cells, each one-arm row followed by the
    other topologies' rows of its setting; nothing unless more than one topology was run.
    `size` formats a byte count."""
    thr = [
        s
        for s in summary
        if s["kind"] == "throughput" and not s.get("loss") and s.get("early_loss", True)
    ]
    if len({of(s) for s in thr}) < 2:
        return []
    order = {t: i for i, t in enumerate(TOPOLOGIES)}
    thr.sort(key=lambda s: (*_key(s), order.get(of(s), len(order))))
    return [
        "",
        "Topologies side by side (median ms and spread; 'vs gloo' is gloo's time over xdp-agg's "
        "in the same topology; '% of' is each system's line-rate bound over its time; 'vs "
        "one-arm' is the one-arm time over this one; CPU s/GiB: the whole machine's per "
        "all-reduced GiB (/proc/stat, other users' work included: 'of which background' is the "
        "machine's rate before the set times the span), and its split host/fabric/aggregator; "
        "own CPU: the worker processes' (getrusage) and the XDP programs' (BPF run time) only):",
        "",
        *md_table(COLUMNS, [_row(s, size) for s in thr]),
    ]


def main(argv=None) -> int:
    """`python -m bench.topology RESULTS.json...`: the side-by-side table of each run again (from
    its raw rows, with this code's summary), headed by the run's MTU, time and load: the runs of
    several MTUs in one page."""
    import argparse
    import json
    from pathlib import Path

    from bench import allreduce  # late: bench.allreduce imports this module

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("results", nargs="+", help="results.json of bench.allreduce --topology runs")
    for path in ap.parse_args(argv).results:
        doc = json.loads(Path(path).read_text())
        meta = doc["meta"]
        print(
            f"MTU {meta['mtu']}, {meta['elems']} int32 per packet ({path}): ended {meta['when']}, "
            f"{meta['reps']} repetitions, {meta['seconds']} s; load average "
            f"{meta['load_before']} before, {meta['load_after']} after ({meta['cpus']} CPUs)."
        )
        print("\n".join(markdown(allreduce.summarize(doc["raw"]), allreduce._size)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
