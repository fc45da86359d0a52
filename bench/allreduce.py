"""`make bench` / `python -m bench.allreduce`: xdp-agg against torch.distributed gloo, side by side.

For each number of workers n and each link setting (unshaped, 10 Gbit/s, 1 Gbit/s with tbf on both
directions of every worker link), one one-arm testbed, the XDP aggregator attached to the
aggregator's port, and n worker processes that each hold a hostlib communicator and a gloo
process group. For each tensor size, both systems' all-reduce run alternately (who goes first
alternates too) behind a gloo barrier, `--reps` times each; an all-reduce's time is its slowest
rank's. Small all-reduces (4 KiB, 64 KiB) are repeated many times for p50/p99 latency.

Bounds, for a tensor of S bytes on links of R bit/s:
- in-network aggregation: every worker sends S and receives S, once: S*8/R;
- ring all-reduce: every worker sends 2(n-1)/n * S: 2(n-1)/n * S*8/R.
The table gives each system's time as a fraction of its own bound ("% of bound" = bound / time).

gloo runs on the same namespaces and shaped links; the aggregator's XDP program stays attached,
but it sits on the aggregator's own port, which gloo's worker-to-worker traffic never crosses.

--topology one-arm,switch (bench.topology): each (n, link) runs once per topology, one-arm rows
beside switch rows. In switch every worker has a veth into the aggregator's namespace, which
routes gloo's traffic between its ports with the kernel's forwarding (netns_testbed's
kernel_forwarding) and runs the XDP program on every frame of it; xdp-agg's results leave by the
program's devmap broadcast instead of the bridge's multicast. Each switch cell also says its
time against the one-arm cell ("vs one-arm"), per system.

xdp-agg writes its sum into a preallocated array (allreduce(x, out=y)) and gloo sums in place, so
neither pays for allocating and faulting in an output tensor.

Host rows ("kind": "host"): one worker, unshaped, 64 MiB float32 and int32, xdp-agg alone: what
one worker's host library moves, in Gbit/s each way (S*8/time) and CPU seconds per GiB.

Dtypes and element widths (--dtype, --wire-bits; docs/protocol.md 5.6): every throughput, latency
and host row is run for each dtype and width asked, the tensor having the size's number of
float32 elements (64MiB: 16M elements, 32 MiB of bfloat16). Each row says its "dtype" and
"wire_bits" and gloo's ("gloo_dtype"): gloo all-reduces the same dtype, except for a float32
tensor at 16 bits, where it all-reduces a bfloat16 copy and copies it back, timed, as DDP's
bf16_compress_hook does: each system on the same information.

Every throughput and host cell also carries: retransmissions as % of the datagrams sent
("retx_pct") and their causes ("retx_causes", netns_testbed.counters: tbf qdisc, veth/XDP ring,
socket receive buffer, refused sends, aggregator drop reasons, injected loss, spurious), from
drop counters snapshotted by rank 0 around each xdp-agg all-reduce only; and, for both systems,
CPU seconds per rank per all-reduce (user + sys of each worker process, all threads, median
over the repetitions of the mean over ranks: gloo's threads and the kernel work done in the
process's context count, softirq work done elsewhere does not).

System-wide CPU (bench.cpustat, on unless --no-syscpu): for every cell and both systems, the
busy time of all CPUs over exactly each all-reduce (/proc/stat, user + nice + system + irq +
softirq, read by rank 0 behind barriers), in CPU seconds per all-reduce and per all-reduced GiB,
split into host (the workers' processes and their system calls), fabric (irq and softirq: the
emulated network's forwarding) and aggregator (the XDP programs' own run time from the kernel's
BPF statistics, kernel.bpf_stats_enabled = 1 for the run, restored after), with which of the
three took most ("mostly"), and the rest of the machine's rate measured over a quiet second
before each set ("background"): on a shared machine the total includes other users' work.

profile.txt (n=4, unshaped, 64 MiB): one more xdp-agg all-reduce, with a cProfile of rank 0's
Python and, where `perf` is installed, a system-wide perf sample of both CPUs over exactly that
all-reduce: how the machine's time splits between the workers' Python and numpy, the kernel's
forwarding and the XDP program.

Writes bench-results/{results.json, results.md, plot.png, profile.txt} (or --out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import (
    cpustat,
    density,
    lanes_option,
    lossrows,
    md_table,
    packet_options,
    topology,
    unwind_on_sigterm,
)

RATES = {"unshaped": None, "10gbit": 10e9, "1gbit": 1e9}
ITEMSIZE = {"float32": 4, "int32": 4, "bfloat16": 2, "float16": 2}
DTYPES = ("float32", "bfloat16", "float16")  # what --dtype takes (int32: the host rows)
SIZES = {"256KiB": 256 << 10, "4MiB": 4 << 20, "64MiB": 64 << 20}
LATENCY_SIZES = {"4KiB": 4 << 10, "64KiB": 64 << 10}
GLOO_PORT = 29500
SYSTEMS = ("xdp-agg", "gloo", density.SPARSE)  # a sparse row has all three, a host row one


def run_config(
    n: int, rate: str, args, log, plan: list[dict] | None = None, topo: str = topology.DEFAULT
) -> list[dict]:
    """One testbed for (n, rate) in topology `topo` (bench.topology) and on it one set of worker
    processes per lanes value (args.lanes), each running every selected size on both systems
    (or `plan`: the host rows)."""
    from netns_testbed.counters import Layout
    from netns_testbed.testbed import PLAIN_XDP_MAX_MTU, Testbed
    from xdp_agg.app.options import AttachOptions
    from xdp_agg.cluster.cluster import Cluster

    if plan is None:
        plan = [
            plan_item(SIZES[k] // 4, args.reps, "throughput", d, w)
            for k in args.sizes
            if k in SIZES and SIZES[k] <= args.max_bytes and "throughput" in args.rows
            for d, w in args.widths
        ]
        plan += [
            plan_item(LATENCY_SIZES[k] // 4, args.latency_reps, "latency", d, w)
            for k in args.sizes
            if k in LATENCY_SIZES and "latency" in args.rows
            for d, w in args.widths
        ]
        if "sparse" in args.rows:
            sizes = [SIZES[k] for k in args.sizes if k in SIZES and SIZES[k] <= args.max_bytes]
            plan += density.plan(sizes, args.density, args.patterns, args.reps)
        plan += lossrows.burst_items(plan, getattr(args, "burst_ms", 0.0))
    if not plan:
        return []
    with (
        Testbed(
            workers=n,
            **topology.testbed_options(topo),
            mtu=args.mtu,
            rate=RATES[rate] and rate,
            agg_queues=getattr(args, "agg_queues", 1),
            # loss on every frame, so that gloo's TCP crosses the same loss (bench.lossrows)
            loss_scope=getattr(args, "loss_scope", "all")
            if hasattr(args, "loss") and lossrows.lossy(args)
            else "aggregation",
            reorder_delay=getattr(args, "reorder_delay_ms", 0.5) / 1e3,
        ) as tb,
        # jumbo MTUs: multi-buffer XDP; bench.slot_cpus sets slot_cpus, bench.unicast serve_args
        Cluster(
            tb,
            attach=AttachOptions(
                frags=args.mtu > PLAIN_XDP_MAX_MTU, slot_cpus=getattr(args, "slot_cpus", "rss")
            ),
            serve_args=_serve_args(args, plan),
        ) as cl,
    ):
        layout = Layout.from_testbed(tb)
        rows = []
        # one testbed, a set of workers per (lanes, early loss detection, loss) setting
        for setting in _settings(args):
            tb.set_loss(setting["loss"], setting["loss"])
            tb.set_reorder(setting["reorder"])
            # a burst on a clean path only: on a lossy one it would measure both at once
            items = [i for i in plan if not (i["kind"] == "burst" and lossrows.disturbed(setting))]
            reports = _run_workers(tb, cl, layout, n, rate, setting, items, args)
            at = {
                **setting,
                "topology": tb.topology,
                "elems": topology.elems(tb.topology, args.elems),
            }
            rows += [
                _row(n, rate, at, item, [pr[i] for pr in reports], layout, log, args)
                for i, item in enumerate(items)
            ]
    return rows


def _settings(args) -> list[dict]:
    """The worker sets of one testbed: every lanes value, early-loss setting and loss, and each
    reordering without loss."""
    paths = [(loss, 0.0) for loss in getattr(args, "loss", [0.0])]
    paths += [(0.0, r) for r in getattr(args, "reorder", [])]
    return [
        {"lanes": lanes, "early_loss": early, "loss": loss, "reorder": reorder}
        for lanes in args.lanes
        for early in getattr(args, "early_loss", [True])
        for loss, reorder in paths
    ]


def plan_item(elements: int, reps: int, kind: str, dtype: str, wire_bits: int) -> dict:
    """A plan item of `elements` elements of `dtype` sent at `wire_bits`, with the dtype gloo
    all-reduces beside it (a bfloat16 copy for float32 at 16 bits, as bf16_compress_hook)."""
    gloo = "bfloat16" if dtype == "float32" and wire_bits == 16 else dtype
    return {
        "bytes": elements * ITEMSIZE[dtype],
        "elements": elements,
        "reps": reps,
        "kind": kind,
        "dtype": dtype,
        "wire_bits": wire_bits,
        "gloo_dtype": gloo,
    }


def widths(dtypes: str, wire_bits: str) -> list[tuple[str, int]]:
    """(dtype, wire_bits) of each row set: every dtype at every width asked; "auto" is
    hostlib's default for the dtype (16 for bfloat16 and float16, 32 for float32), and a width
    is listed once per dtype. ValueError for a dtype or width the rows do not take."""
    out: list[tuple[str, int]] = []
    for d in dtypes.split(","):
        if d not in DTYPES:
            raise ValueError(f"unknown dtype {d!r}: one of {', '.join(DTYPES)}")
        for w in wire_bits.split(","):
            if w not in ("auto", "16", "32"):
                raise ValueError(f"unknown width {w!r}: auto, 16 or 32")
            bits = int(w) if w != "auto" else (32 if d == "float32" else 16)
            if (d, bits) not in out:
                out.append((d, bits))
    return out


def _serve_args(args, plan: list[dict]) -> tuple[str, ...]:
    """`xdp-agg serve`'s options: the benchmark's (bench.unicast), and --sparse for the sparse
    rows (a sparse job runs dense all-reduces too: the dense rows' sparse=False)."""
    extra = ("--sparse",) if any(item["kind"] == "sparse" for item in plan) else ()
    return (*getattr(args, "serve_args", ()), *extra)


def _run_workers(tb, cl, layout, n: int, rate: str, setting, plan, args) -> list[list[dict]]:
    """One set of n worker processes (hostlib with the setting's lanes and early loss
    detection, and gloo) through the plan; each rank's reports, in plan order."""
    lanes = setting["lanes"]
    profile = rate == "unshaped" and n == 4 and args.profile and setting == _settings(args)[0]
    profile = profile and tb.topology == topology.DEFAULT  # one profile.txt, of one-arm
    job = f"bench-{n}-{rate}-{lanes}-{setting['loss']:g}-{int(setting['early_loss'])}"
    job += f"-r{setting['reorder']:g}" if setting["reorder"] else ""
    procs = []
    for r, w in enumerate(tb.workers):
        cmd = [
            sys.executable,
            "-m",
            "bench.worker",
            "--rank",
            str(r),
            "--world",
            str(n),
            "--control",
            cl.control_address(w),
            "--gloo",
            f"{tb.workers[0].ip}:{GLOO_PORT}",
            "--job",
            job,
            "--elems",
            str(topology.elems(tb.topology, args.elems)),
            "--window",
            str(args.window),
            "--plan",
            json.dumps(plan),
        ]
        if args.counters:
            cmd += ["--counted"]
            if r == 0:
                cmd += ["--layout", json.dumps(layout.to_dict())]
        if args.syscpu:
            cmd += ["--syscpu"]
        if r == 0 and (args.counters or args.syscpu):
            cmd += ["--agg-name", cl.name]
        if profile:
            out = str(Path(args.out).resolve() / "profile.txt")
            cmd += ["--profile", str(64 << 20), "--profile-out", out]
        # every set says its lanes, so hostlib's default never decides a row's
        env = {**cl.worker_env(), "XDP_AGG_LANES": str(lanes)}
        env["XDP_AGG_EARLY_LOSS"] = "1" if setting["early_loss"] else "0"
        procs.append(
            tb.popen(w, cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    per_rank, failed = [], []
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=args.deadline)
        if p.returncode != 0:
            failed.append(f"rank {r}: {err.strip()[-1500:]}")
        per_rank.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    if failed:  # every rank's: the first to fail is often not rank 0
        raise RuntimeError(f"n={n} {rate} {setting}: " + "\n".join(failed))
    return per_rank


def _row(n: int, rate: str, setting, item: dict, reports: list[dict], layout, log, args) -> dict:
    """One plan item's row from every rank's report: the slowest rank's times, the mean CPU,
    rank 0's system-wide CPU spans, the retransmissions and their causes; logged as one line."""
    lanes = setting["lanes"]
    row = {
        "n": n,
        "link": rate,
        "topology": setting.get("topology", topology.DEFAULT),
        "elems": setting.get("elems"),
        "bytes": item["bytes"],
        "kind": item["kind"],
        "dtype": item.get("dtype", "float32"),
        "wire_bits": item.get("wire_bits", 32),
        "gloo_dtype": item.get("gloo_dtype", item.get("dtype", "float32")),
        "elements": item.get("elements", item["bytes"] // 4),
        "lanes": lanes,
        "loss": setting["loss"],
        "reorder": setting["reorder"],
        "early_loss": setting["early_loss"],
        "loss_scope": getattr(args, "loss_scope", "all"),
    }
    if item["kind"] == "burst":
        row["burst_ms"] = item["burst_ms"]
        row["burst_spans"] = reports[0].get("burst_spans", [])
    systems = [s for s in SYSTEMS if s in reports[0]["times"]]
    for system in systems:
        # an all-reduce is done when its slowest rank is; its CPU is the mean over ranks
        reps = range(item["reps"])
        row[system] = [max(r["times"][system][k] for r in reports) for k in reps]
        row[f"{system} cpu_s"] = [
            statistics.fmean(r["cpu"][system][k] for r in reports) for k in reps
        ]
    row["retransmissions"] = sum(r["retransmissions"] for r in reports)
    row["packets"] = sum(r["packets"] for r in reports)
    row["engine"] = [r["engine"] for r in reports]
    if "syscpu" in reports[0]:  # rank 0's system-wide spans, per system and repetition
        row["syscpu"] = reports[0]["syscpu"]
        row["background_cpu_per_s"] = reports[0].get("background_cpu_per_s")
        row["bpf_stats"] = getattr(args, "bpf_stats", False)
    if item["kind"] == "sparse":
        row["sparse"] = density.row_fields(reports)
    if "counters" in reports[0]:
        a = attribute(reports[0]["counters"], layout, row["engine"])
        row["retx_causes"], row["retx_detail"] = a.causes, a.detail
    line = f"  n={n} {rate:8s} {row['topology']:7s} lanes={lanes} {item['kind']:10s}"
    line += f" {row['dtype']:8s}"
    if row["loss"] or not row["early_loss"]:
        line += f" loss {row['loss']:g}" + ("" if row["early_loss"] else " timers only")
    if row["reorder"]:
        line += f" reorder {row['reorder']:g}"
    line += f" {row['wire_bits']}b"
    if item["kind"] == "sparse":
        line += f" {item['pattern']:5s} {item['density']:5.0%}"
    line += f" {item['bytes']:>9d} B:"
    for system in systems:
        line += f" {system} {statistics.median(row[system]) * 1e3:8.2f} ms"
    log(
        line
        + f", retx {row['retransmissions']}"
        + (f" ({_top_causes(row['retx_causes'])})" if "retx_causes" in row else "")
    )
    return row


def attribute(delta: dict, layout, engine: list[dict]) -> "object":
    """bench.loss.attribute, imported late (the summary needs none of the testbed)."""
    from bench import loss

    return loss.attribute(delta, layout, engine)


def _top_causes(causes: dict, k: int = 2) -> str:
    """'spurious 95%, tbf_qdisc 5%': the k largest causes, as shares of the retransmissions."""
    total = sum(causes.values())
    if not total:
        return "none"
    top = sorted((kv for kv in causes.items() if kv[1]), key=lambda kv: -kv[1])[:k]
    return ", ".join(f"{c} {v / total:.0%}" for c, v in top)


def summarize(rows: list[dict]) -> list[dict]:
    """Per cell: medians, spread, bounds, speedup; retx_pct and retx_causes; CPU per rank; for
    host rows gbit_each_way and cpu_s_per_gib."""
    out = []
    for row in rows:
        n, rate_bps, S = row["n"], RATES[row["link"]], row["bytes"]
        s = {
            "n": n,
            "link": row["link"],
            "topology": topology.of(row),
            "elems": row.get("elems"),
            "bytes": S,
            "kind": row["kind"],
            "dtype": row.get("dtype", "float32"),
            "wire_bits": row.get("wire_bits", 32),
            "gloo_dtype": row.get("gloo_dtype", row.get("dtype", "float32")),
            "elements": row.get("elements", S // 4),
            "lanes": row.get("lanes", 1),
            "loss": row.get("loss", 0.0),
            "reorder": row.get("reorder", 0.0),
            "early_loss": row.get("early_loss", True),
            "loss_scope": row.get("loss_scope", "all"),
            "retransmissions": row["retransmissions"],
        }
        if row.get("engine"):
            s["engine_counts"] = lossrows.engine_counts(row["engine"])
        if row["kind"] == "burst":
            s["burst_ms"] = row["burst_ms"]
            spans = row.get("burst_spans") or [0.0]
            s["burst_actual_ms"] = statistics.median(spans) * 1e3
        if row.get("packets"):
            s["retx_pct"] = 100.0 * row["retransmissions"] / row["packets"]
        if "retx_causes" in row:
            s["retx_causes"] = row["retx_causes"]
        for system in (x for x in SYSTEMS if x in row):
            t = sorted(row[system])
            s[system] = {
                "median_s": statistics.median(t),
                "min_s": t[0],
                "max_s": t[-1],
                "p50_s": t[len(t) // 2],
                "p99_s": t[min(len(t) - 1, int(round(0.99 * (len(t) - 1))))],
                "ate_per_s": s["elements"] / statistics.median(t),
            }
            if f"{system} cpu_s" in row:
                s[system]["cpu_s_per_rank"] = statistics.median(row[f"{system} cpu_s"])
            if row.get("syscpu", {}).get(system):
                s[system]["syscpu"] = cpustat.cell(
                    row["syscpu"][system], S, row.get("background_cpu_per_s")
                )
                # without the kernel's BPF statistics the aggregator's share is unknown, not 0
                s[system]["syscpu"]["bpf_stats"] = row.get("bpf_stats", True)
        if row["kind"] == "host":
            s["gbit_each_way"] = S * 8 / s["xdp-agg"]["median_s"] / 1e9
            s["cpu_s_per_gib"] = s["xdp-agg"]["cpu_s_per_rank"] / (S / 2**30)
            s["cpu_ns_per_elem"] = s["xdp-agg"]["cpu_s_per_rank"] / s["elements"] * 1e9
            s["cpu_per_wall"] = s["xdp-agg"]["cpu_s_per_rank"] / s["xdp-agg"]["median_s"]
            out.append(s)
            continue
        s["speedup"] = s["gloo"]["median_s"] / s["xdp-agg"]["median_s"]
        if row["kind"] == "sparse":
            density.summarize(s, row, rate_bps)
        if rate_bps:
            # the bytes each system moves: xdp-agg's elements at its width, gloo's in its dtype
            wire = s["elements"] * s["wire_bits"] // 8
            ring = s["elements"] * ITEMSIZE[s["gloo_dtype"]]
            s["bound_ina_s"] = wire * 8 / rate_bps
            s["bound_ring_s"] = 2 * (n - 1) / n * ring * 8 / rate_bps
            s["xdp-agg"]["of_bound"] = s["bound_ina_s"] / s["xdp-agg"]["median_s"]
            s["gloo"]["of_bound"] = s["bound_ring_s"] / s["gloo"]["median_s"]
        out.append(s)
    _lane_ratios(out)
    lossrows.ratios(out)
    topology.ratios(out)
    return out


def _lane_ratios(cells: list[dict]) -> None:
    """Each cell's "vs_1_lane": xdp-agg's median time with 1 lane over its own, in the same
    (n, link, size, kind, dtype, width) of the same run; absent where no 1-lane cell was run."""
    key = lambda c: (c["n"], c["link"], topology.of(c), c["bytes"], c["kind"], c["dtype"],  # noqa: E731
                     c["wire_bits"])  # fmt: skip
    one = {key(c): c for c in cells if c["lanes"] == 1}
    for c in cells:
        if key(c) in one:
            c["vs_1_lane"] = one[key(c)]["xdp-agg"]["median_s"] / c["xdp-agg"]["median_s"]


def _size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def markdown(summary: list[dict], meta: dict) -> str:
    L = [
        f"Run {meta['when']}, {meta['reps']} repetitions each (median; spread = max-min), "
        f"MTU {meta['mtu']}, "
        f"{meta['elems']} int32 per packet, window {meta['window']}, "
        f"lanes {', '.join(map(str, meta.get('lanes', [1])))}"
        + (
            f", topologies {', '.join(meta['topologies'])}."
            if len(meta.get("topologies", [])) > 1
            else "."
        )
        + (
            f" {meta['cpus']} CPUs for every worker process and the kernel's forwarding; "
            "load average "
            f"{meta['load_before'][0]} before, {meta['load_after'][0]} after."
            if "load_before" in meta
            else ""
        ),
        "",
    ]
    L += _throughput_table(summary)
    L += topology.markdown(summary, _size)
    L += lossrows.markdown(summary, _size, _retx_cell)
    L += density.markdown(summary)
    L += _host_table(summary)
    L += _syscpu_table(summary)
    latency = _of_kind(summary, "latency")
    if latency:
        L += ["", "Small all-reduces (latency, ms):", ""]
        L += md_table(
            ["n", "link", "size", "xdp-agg p50", "xdp-agg p99", "gloo p50", "gloo p99"],
            [
                [s["n"], _link(s), _size(s["bytes"])]
                + [f"{d[p] * 1e3:.3f}" for d in (a, g) for p in ("p50_s", "p99_s")]
                for s, a, g in latency
            ],
        )
    return "\n".join(L) + "\n"


def _throughput_table(summary: list[dict]) -> list[str]:
    """The throughput rows: both systems' times, bounds, retransmissions and CPU (none without
    throughput rows)."""
    if not _of_kind(summary, "throughput"):
        return []
    fb = lambda d: f"{d['of_bound']:.0%}" if "of_bound" in d else "-"  # noqa: E731
    # the topology's column only where a run had another one than one-arm
    topo = any(topology.of(s) != topology.DEFAULT for s, _, _ in _of_kind(summary, "throughput"))
    tcol = lambda s: [topology.of(s)] if topo else []  # noqa: E731
    return md_table(
        [
            "n",
            "link",
            *(["topology"] if topo else []),
            "size",
            "dtype",
            "wire_bits",
            "gloo dtype",
            "lanes",
            "xdp-agg ms (spread)",
            "gloo ms (spread)",
            "speedup",
            "xdp-agg vs 1 lane",
            "xdp-agg ATE/s",
            "gloo ATE/s",
            "xdp-agg % of S/R",
            "gloo % of 2(n-1)/n S/R",
            "retx (% of sent; causes)",
            "CPU s/rank xdp-agg",
            "CPU s/rank gloo",
        ],
        [
            [s["n"], s["link"], *tcol(s), _size(s["bytes"]), s["dtype"], s["wire_bits"]]
            + [s["gloo_dtype"], s["lanes"], _ms(a), _ms(g)]
            + [f"{s['speedup']:.2f}x", _vs1(s), f"{a['ate_per_s']:.3g}", f"{g['ate_per_s']:.3g}"]
            + [fb(a), fb(g), _retx_cell(s), _cpu(a), _cpu(g)]
            for s, a, g in _of_kind(summary, "throughput")
        ],
    )


def _of_kind(summary: list[dict], kind: str) -> list[tuple[dict, dict, dict]]:
    """(cell, xdp-agg's figures, gloo's) of each clean cell of `kind` (throughput, latency):
    without loss and with early loss detection (the loss table has the others)."""
    return [(s, s["xdp-agg"], s["gloo"]) for s in _clean(summary) if s["kind"] == kind]


def _clean(summary: list[dict]) -> list[dict]:
    """The cells run without loss and with hostlib's default early loss detection."""
    return [s for s in summary if not lossrows.disturbed(s) and s.get("early_loss", True)]


def _host_table(summary: list[dict]) -> list[str]:
    """The host rows (n = 1, xdp-agg alone), when there are any."""
    host = [s for s in summary if s["kind"] == "host"]
    if not host:
        return []
    return [
        "",
        "One worker's host library (n = 1, unshaped, xdp-agg alone):",
        "",
        *md_table(
            ["dtype", "wire_bits", "size", "lanes", "ms (spread)", "Gbit/s each way", "vs 1 lane"]
            + [
                "CPU s per GiB",
                "CPU ns per element",
                "worker CPUs busy",
                "retx (% of sent; causes)",
            ],
            [
                [s["dtype"], s["wire_bits"], _size(s["bytes"]), s["lanes"], _ms(s["xdp-agg"])]
                + [f"{s['gbit_each_way']:.2f}", _vs1(s), f"{s['cpu_s_per_gib']:.2f}"]
                + [f"{s['cpu_ns_per_elem']:.2f}"]
                + [f"{s['cpu_per_wall']:.2f}", _retx_cell(s)]
                for s in host
            ],
        ),
    ]


def _syscpu_table(summary: list[dict]) -> list[str]:
    """Where each cell's CPU went, system-wide (bench.cpustat): per system, CPU seconds per
    all-reduce and per all-reduced GiB, split into host, fabric and aggregator."""
    cells = [
        (s, system, s[system]["syscpu"])
        for s in summary
        for system in SYSTEMS
        if system in s and s[system].get("syscpu")
    ]
    if not cells:
        return []
    L = [
        "",
        "System-wide CPU per all-reduce (all CPUs, /proc/stat user+nice+system+irq+softirq over "
        "each all-reduce, mean over the repetitions): host = the workers' processes and their "
        "system calls, fabric = irq + softirq (forwarding) less the aggregator, aggregator = the "
        "XDP programs' BPF run time; background = the rest of the machine's rate before the set "
        "times the span (included in the total and in host):",
        "",
    ]
    rows = []
    for s, system, c in cells:
        pct = lambda p: f"{c[p + '_s']:.3f} ({c[p + '_share']:.0%})"  # noqa: E731
        ns = f"{c['bpf_ns_per_run']:.0f}" if c.get("bpf_ns_per_run") else "-"
        agg = pct("aggregator") if c.get("bpf_stats", True) else "- (no BPF stats)"
        bg = f"{c['background_cpu_s']:.3f}" if c.get("background_cpu_s") is not None else "-"
        kind = f" ({s['kind']})" if s["kind"] != "throughput" else ""
        if (s["dtype"], s["wire_bits"]) != ("float32", 32):  # the default says nothing
            kind += f" {s['dtype']} at {s['wire_bits']} bits"
        if s["kind"] == "sparse":
            kind = f" (sparse {s['sparse']['pattern']} {s['sparse']['density']:.0%})"
        kind += f", {s['lanes']} lanes" if s.get("lanes", 1) > 1 else ""
        kind += f", {topology.of(s)}" if topology.of(s) != topology.DEFAULT else ""
        rows.append(
            [s["n"], f"{s['link']}{kind}", _size(s["bytes"]), system, f"{c['sys_cpu_s']:.3f}"]
            + [f"{c['sys_cpu_s_per_gib']:.2f}", pct("host"), pct("fabric"), agg, c["mostly"]]
            + [ns, bg]
        )
    columns = ["n", "link", "size", "system", "CPU s", "CPU s/GiB", "host s", "fabric s"]
    columns += ["aggregator s", "mostly", "aggregator ns/run", "background s"]
    return L + md_table(columns, rows)


def _link(s: dict) -> str:
    """A cell's link, with its topology when not one-arm: '10gbit', '10gbit, switch'."""
    t = topology.of(s)
    return s["link"] if t == topology.DEFAULT else f"{s['link']}, {t}"


def _ms(d: dict) -> str:
    """A system's time cell: its median ms and in brackets the spread (max - min), '12.3 (0.4)'."""
    return f"{d['median_s'] * 1e3:.1f} ({(d['max_s'] - d['min_s']) * 1e3:.1f})"


def _vs1(s: dict) -> str:
    return f"{s['vs_1_lane']:.2f}x" if "vs_1_lane" in s else "-"


def _retx_cell(s: dict) -> str:
    """'412 (0.61%; spurious 97%, tbf_qdisc 3%)'."""
    if "retx_pct" not in s:
        return str(s["retransmissions"])
    causes = (
        f"; {_top_causes(s['retx_causes'])}"
        if s.get("retx_causes") and s["retransmissions"]
        else ""
    )
    return f"{s['retransmissions']} ({s['retx_pct']:.2f}%{causes})"


def _cpu(d: dict) -> str:
    return f"{d['cpu_s_per_rank']:.3f}" if "cpu_s_per_rank" in d else "-"


def _style(ax, title: str, ylabel: str, ns: list[int]) -> None:
    """The axes of one panel: time against the number of workers."""
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("workers n")
    ax.set_ylabel(ylabel)
    ax.set_xticks(ns)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)


def plot(summary: list[dict], path: Path) -> None:
    """One panel per (tensor size, link): median ms against n, with the two bounds on shaped
    links; a last row with the small all-reduces' p50 latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    thr = [s for s in _clean(summary) if s["kind"] == "throughput"]
    lat = [s for s in _clean(summary) if s["kind"] == "latency"]
    if not thr and not lat:
        return
    sizes = sorted({s["bytes"] for s in thr})
    links = [lk for lk in RATES if any(s["link"] == lk and s["kind"] != "host" for s in summary)]
    if not links:
        return
    cpu_row = bool(thr) and any("cpu_s_per_rank" in s["xdp-agg"] for s in thr)
    rows = len(sizes) + (1 if lat else 0) + (1 if cpu_row else 0)
    fig, axes = plt.subplots(
        rows, len(links), figsize=(4.2 * len(links), 3.1 * rows), squeeze=False
    )
    colors = {"xdp-agg": "tab:blue", "gloo": "tab:orange"}
    for i, b in enumerate(sizes):
        for j, lk in enumerate(links):
            ax = axes[i][j]
            pts, ns = _plot_systems(ax, thr, b, lk, colors, lambda x: x["median_s"] * 1e3)
            if pts and "bound_ina_s" in pts[0]:
                for key, style, label in (
                    ("bound_ina_s", "k--", "bound S/R (in-network)"),
                    ("bound_ring_s", "k:", "bound 2(n-1)/n S/R (ring)"),
                ):
                    ax.plot(ns, [s[key] * 1e3 for s in pts], style, lw=1, label=label)
            _style(ax, f"{_size(b)} float32, {lk}", "ms per all-reduce (median)", ns)
            if i == 0:
                ax.legend(fontsize=7)
    if cpu_row:  # CPU per rank of the largest size, with xdp-agg's retransmissions
        b = sizes[-1]
        for j, lk in enumerate(links):
            ax = axes[len(sizes)][j]
            pts, ns = _plot_systems(ax, thr, b, lk, colors, _cpu_per_rank)
            for s in pts:
                if "retx_pct" in s:
                    ax.annotate(
                        f"retx {s['retx_pct']:.1f}%",
                        (s["n"], s["xdp-agg"].get("cpu_s_per_rank", 0)),
                        textcoords="offset points",
                        xytext=(4, 4),
                        fontsize=7,
                        color=colors["xdp-agg"],
                    )
            _style(
                ax, f"{_size(b)} float32, {lk}: CPU per rank", "CPU s per all-reduce and rank", ns
            )
            ax.legend(fontsize=7)
    if lat:  # the fewest lanes' (small all-reduces run on one lane: MIN_LANE_PACKETS)
        fewest = min(s["lanes"] for s in lat)
        _plot_latency(axes[rows - 1], [s for s in lat if s["lanes"] == fewest], links, colors)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _cpu_per_rank(system: dict) -> float:
    return system.get("cpu_s_per_rank", float("nan"))


def _plot_systems(ax, thr: list[dict], size: int, link: str, colors: dict, value):
    """Both systems' `value` (of a cell's per-system dict) against n, for the throughput cells
    of one size and link: xdp-agg once per lanes value, gloo from the fewest lanes' runs;
    returns those cells (the fewest lanes'), by n, and their n."""
    cells = [s for s in thr if s["bytes"] == size and s["link"] == link]
    all_lanes = sorted({s["lanes"] for s in cells}) or [1]
    by_lanes = {
        k: sorted((s for s in cells if s["lanes"] == k), key=lambda s: s["n"]) for k in all_lanes
    }
    pts = by_lanes[all_lanes[0]]
    ns = [s["n"] for s in pts]
    for k, style in zip(all_lanes, ("o-", "^--", "v-.", "d:")):
        label = "xdp-agg" + (f" ({k} lane{'s' if k > 1 else ''})" if len(all_lanes) > 1 else "")
        lane_ns = [s["n"] for s in by_lanes[k]]
        ax.plot(
            lane_ns,
            [value(s["xdp-agg"]) for s in by_lanes[k]],
            style,
            color=colors["xdp-agg"],
            label=label,
        )
    ax.plot(ns, [value(s["gloo"]) for s in pts], "s-", color=colors["gloo"], label="gloo")
    return pts, ns


def _plot_latency(axes, lat: list[dict], links: list[str], colors: dict) -> None:
    """The last row: the small all-reduces' p50 latency against n, per link."""
    for j, lk in enumerate(links):
        ax = axes[j]
        for b, style in zip(sorted({s["bytes"] for s in lat}), ("o-", "^--")):
            pts = sorted(
                (s for s in lat if s["bytes"] == b and s["link"] == lk), key=lambda s: s["n"]
            )
            ns = [s["n"] for s in pts]
            for system in ("xdp-agg", "gloo"):
                ax.plot(
                    ns,
                    [s[system]["p50_s"] * 1e3 for s in pts],
                    style,
                    color=colors[system],
                    label=f"{system} {_size(b)}",
                )
        _style(ax, f"small all-reduces, {lk}: p50 latency", "ms (p50)", ns)
        ax.legend(fontsize=7)


def _parser() -> argparse.ArgumentParser:
    """The command line's options."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", default="2,4,8", help="comma-separated n")
    ap.add_argument("--links", default=",".join(RATES), help="comma-separated: " + ", ".join(RATES))
    ap.add_argument(
        "--sizes",
        default=",".join([*SIZES, *LATENCY_SIZES]),
        help="comma-separated: " + ", ".join([*SIZES, *LATENCY_SIZES]),
    )
    ap.add_argument(
        "--rows",
        default="throughput,latency,host",
        help="row kinds, comma-separated: throughput, latency, host, sparse (sparse: at the "
        f"--density densities, {density.DEFAULT_DENSITIES} unless given)",
    )
    ap.add_argument(
        "--density",
        type=density.densities,
        default=None,
        help="the sparse rows' union block densities in percent, comma-separated, e.g. "
        f"{density.DEFAULT_DENSITIES}: sparse xdp-agg against dense xdp-agg and gloo "
        "(bench/density.py); alone, it runs only those rows, at 64 MiB",
    )
    ap.add_argument(
        "--patterns",
        default=",".join(density.PATTERNS),
        help="the sparse rows' non-zero blocks: the same on every worker (same), drawn per "
        "worker (indep), or both (default)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="one cell in about a minute: --workers 4 --links 1gbit --sizes 64MiB "
        "--rows throughput --reps 3 --no-profile (explicit options still win)",
    )
    for off, what in (
        ("counters", "drop counters, so no retransmission causes (saves a snapshot per run)"),
        (
            "syscpu",
            "system-wide CPU accounting (/proc/stat and BPF run time around each all-reduce)",
        ),
        ("profile", "profile.txt (a cProfile and perf sample of one more all-reduce)"),
    ):
        ap.add_argument(f"--no-{off}", dest=off, action="store_false", help=f"no {what}")
    ap.add_argument(
        "--dtype",
        default="float32",
        help=f"the tensors' dtypes, comma-separated: {', '.join(DTYPES)} (each row set runs "
        "every one; gloo on the same dtype)",
    )
    ap.add_argument(
        "--wire-bits",
        default="auto",
        help="element widths on the wire, comma-separated: auto (hostlib's default: 16 for "
        "bfloat16 and float16, 32 for float32), 16, 32; float32 at 16 bits runs against gloo "
        "on a bfloat16 copy",
    )
    lossrows.options(ap)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--latency-reps", type=int, default=100)
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    # 64: hostlib's default (256 overflowed the veth ring into the aggregator at n = 8)
    packet_options(ap, window=64)
    lanes_option(
        ap,
        "the hostlib lanes (XDP_AGG_LANES) of each set of workers, every set on the same testbed "
        "against gloo; e.g. --lanes 1,2 (each row says its lanes, and 'vs 1 lane' compares with "
        "the 1-lane row)",
    )
    ap.add_argument(
        "--agg-queues",
        type=int,
        default=1,
        help="receive queues of the aggregator's link (netns-testbed --agg-queues): flows hashed "
        "over them, each queue's XDP apart (several CPUs aggregate at once)",
    )
    ap.add_argument(
        "--topology",
        default=topology.DEFAULT,
        help="testbed topologies, comma-separated: one-arm (every host on one bridge), switch (a "
        "veth per worker into the aggregator, gloo's traffic routed by the kernel there); each "
        "set of workers runs in each, one after the other (bench/topology.py)",
    )
    ap.add_argument("--deadline", type=float, default=1800)
    ap.add_argument("--out", default="bench-results")
    return ap


def _given(given: set[str], opt: str) -> bool:
    """Whether the command line spelled out `opt` (--opt V or --opt=V)."""
    return any(g == opt or g.startswith(opt + "=") for g in given)


def _density_defaults(args, given: set[str]) -> None:
    """--density alone runs only the sparse rows, at 64 MiB; the sparse row kind alone, at the
    default densities. Explicit --rows and --sizes win."""
    if args.density is not None:
        if not _given(given, "--rows"):
            args.rows = "sparse"
        if not _given(given, "--sizes"):
            args.sizes = "64MiB"
    if args.density is None:
        args.density = density.densities(density.DEFAULT_DENSITIES)
    args.patterns = args.patterns.split(",")


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.quick:  # defaults only: what the user spelled out stays
        given = set(argv if argv is not None else sys.argv[1:])
        for opt, val in (
            ("--workers", "4"),
            ("--links", "1gbit"),
            ("--sizes", "64MiB"),
            ("--rows", "throughput"),
            ("--reps", 3),
        ):
            if not _given(given, opt):
                setattr(args, opt[2:], val)
        args.profile = False
    _density_defaults(args, set(argv if argv is not None else sys.argv[1:]))
    args.sizes = args.sizes.split(",")
    args.rows = args.rows.split(",")
    unknown = [x for x in args.sizes if x not in SIZES and x not in LATENCY_SIZES]
    unknown += [x for x in args.rows if x not in ("throughput", "latency", "host", "sparse")]
    unknown += [x for x in args.patterns if x not in density.PATTERNS]
    unknown += [x for x in args.links.split(",") if x not in RATES]
    if unknown:
        ap.error(f"unknown: {', '.join(unknown)}")
    try:
        args.widths = widths(args.dtype, args.wire_bits)
        args.topology = topology.topologies(args.topology)
    except ValueError as e:
        ap.error(str(e))
    if args.topology != [topology.DEFAULT] and lossrows.lossy(args):
        ap.error("--loss, --burst-ms and --reorder run in one-arm only (gloo's frames too)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda m: print(m, flush=True)  # noqa: E731
    rows = []
    t0 = time.time()
    load_before = [round(x, 2) for x in os.getloadavg()]
    # the kernel keeps BPF run times only while asked to: on for the run, restored after
    with cpustat.BpfStats() if args.syscpu else contextlib.nullcontext() as bpf_stats:
        args.bpf_stats = bool(bpf_stats and bpf_stats.enabled)
        if "host" in args.rows:
            log("host (n=1, unshaped):")
            host_plan = [plan_item(16 << 20, args.reps, "host", "int32", 32)]
            host_plan += [plan_item(16 << 20, args.reps, "host", d, w) for d, w in args.widths]
            rows += run_config(1, "unshaped", args, log, plan=host_plan)
        if {"throughput", "latency", "sparse"} & set(args.rows):
            for n in (int(x) for x in args.workers.split(",")):
                for rate in args.links.split(","):
                    for topo in args.topology:  # one-arm rows beside switch rows
                        log(f"n={n}, {rate}, {topo}:")
                        rows += run_config(n, rate, args, log, topo=topo)
    summary = summarize(rows)
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "reps": args.reps,
        "mtu": args.mtu,
        "elems": args.elems,
        "window": args.window,
        "lanes": args.lanes,
        "widths": args.widths,
        "loss": args.loss,
        "early_loss": args.early_loss,
        "burst_ms": args.burst_ms,
        "reorder": args.reorder,
        "reorder_delay_ms": args.reorder_delay_ms,
        "agg_queues": args.agg_queues,
        "topologies": args.topology,
        "seconds": round(time.time() - t0),
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "syscpu": args.syscpu,
        "bpf_stats": args.bpf_stats,
        "clk_tck": cpustat.ticks_per_second(),
    }
    (out / "results.json").write_text(
        json.dumps({"meta": meta, "summary": summary, "raw": rows}, indent=1)
    )
    md = markdown(summary, meta)
    (out / "results.md").write_text(md)
    try:
        for topo in args.topology:  # plot.png: the first topology's, plot-<topology>.png: others'
            name = "plot.png" if topo == args.topology[0] else f"plot-{topo}.png"
            plot([s for s in summary if topology.of(s) == topo], out / name)
        density.plot(summary, out / "sparse-plot.png")
    except ImportError:
        log("matplotlib is missing: no plot (pip install '.[bench]')")
    print(md)
    log(f"results in {out}/ ({meta['seconds']} s)")
    return 0


if __name__ == "__main__":
    unwind_on_sigterm()  # a killed run still takes its testbed down
    sys.exit(main())
