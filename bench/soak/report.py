"""The soak's report: DIR/summary.md (configuration, results, verdicts, the time series as a
table), DIR/samples.csv and DIR/soak.json (everything)."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

from .verdicts import CYCLE, sampled_rss

CSV_FIELDS = [
    "t_s",
    "allreduces",
    "wrong",
    "gbit_s",
    "retransmissions",
    "retx_pct",
    "worker_rss_min_kib",
    "worker_rss_max_kib",
    "worker_fds_min",
    "worker_fds_max",
    "server_rss_kib",
    "server_fds",
    "map_memlock_bytes",
    "map_kv_bytes",
    "pinned_maps",
    "pinned_progs",
    "pins",
    "namespaces",
    "jobs",
    "slots_in_use",
    "agg_drops",
]


def flat_row(s: dict) -> dict:
    w = [u for k, u in s["procs"].items() if k != "server"]
    srv = s["procs"].get("server", {})
    row = {k: s.get(k, "") for k in CSV_FIELDS}
    row.update(
        worker_rss_min_kib=min((u["rss_kib"] for u in w), default=""),
        worker_rss_max_kib=max((u["rss_kib"] for u in w), default=""),
        worker_fds_min=min((u["fds"] for u in w), default=""),
        worker_fds_max=max((u["fds"] for u in w), default=""),
        server_rss_kib=srv.get("rss_kib", ""),
        server_fds=srv.get("fds", ""),
    )
    return row


def write_report(res: dict, v: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = [flat_row(s) for s in res["samples"]]
    with open(out / "samples.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        wr.writeheader()
        wr.writerows(rows)
    t0 = res.get("t_start", 0.0)
    cycles = {
        key: [[round(r["at"] - t0, 1), r["rss_kib"], r["fds"]] for r in rs if r["k"] % CYCLE == 0]
        for key, rs in res.get("reports", {}).items()
    }
    doc = {k: x for k, x in res.items() if k != "reports"}
    doc.update(
        results_by_size=by_size(res),
        cycle_start_usage=cycles,
        sampled_worker_rss=sampled_rss(res),
        verdicts=v,
    )
    (out / "soak.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "summary.md").write_text(summary_md(res, v, rows))


def by_size(res: dict) -> list[dict]:
    """Checked results by (dtype, bytes): count, wrong, median seconds, worst float error."""
    by: dict = {}
    for rs in res.get("reports", {}).values():
        for r in rs:
            b = by.setdefault((r["dtype"], r["bytes"]), {"n": 0, "wrong": 0, "s": [], "e": 0.0})
            b["n"] += 1
            b["wrong"] += not r["ok"]
            b["s"].append(r["seconds"])
            b["e"] = max(b["e"], r.get("max_err_over_bound", 0.0))
    return [
        {
            "dtype": dt,
            "bytes": nb,
            "results": b["n"],
            "wrong": b["wrong"],
            "median_s": statistics.median(b["s"]),
            "max_err_over_bound": b["e"],
        }
        for (dt, nb), b in sorted(by.items())
    ]


def _load(cfg: dict, key: str) -> str:
    """The 1-minute load average of the machine at the soak's start or end, as recorded."""
    x = cfg.get(key)
    return f"{x[0]:.2f}" if x else "?"


def summary_md(res: dict, v: dict, rows: list[dict]) -> str:
    cfg = res["config"]
    ok_all = all(x["ok"] for x in v.values())
    lines = [
        "# Soak (bench.soak)",
        "",
        f"**{'PASS' if ok_all else 'FAIL'}**: {cfg['started']} to {cfg.get('ended', '?')} "
        f"({cfg.get('elapsed_s', 0) / 60:.1f} min) on {cfg['host']} (kernel {cfg['kernel']}, "
        f"{cfg['cpus']} CPUs, load average {_load(cfg, 'load_before')} before, "
        f"{_load(cfg, 'load_after')} after).",
        "",
        f"{len(cfg['jobs'])} jobs at once ({', '.join(cfg['jobs'])}) on one XDP aggregator, "
        f"{cfg['workers_per_job']} workers each (one namespace per worker, one-arm), "
        f"{cfg['loss_up']:.1%} loss on every worker link both ways (on the "
        f"{cfg.get('loss_on', 'worker eth0')}), data paths "
        f"{', '.join(f'{j}: {p}' for j, p in cfg.get('data_paths', {}).items()) or 'udp'}, "
        f"{cfg['elems']} elements "
        f"per packet, window {cfg['window']}, MTU {cfg['mtu']}; sizes 1 KiB to "
        f"{cfg['max_bytes'] >> 20} MiB, int32 and float32; sampled every "
        f"{cfg['interval_s']:g} s, warm-up {cfg['warmup_s'] / 60:.1f} min.",
        "",
        "## Verdicts",
        "",
        "| check | ok | detail |",
        "|---|---|---|",
    ]
    for k, x in v.items():
        lines.append(f"| {k} | {'yes' if x['ok'] else '**NO**'} | {detail(k, x)} |")
    lines += ["", "## Results", ""]
    lines += [
        "Checked results (every rank's), by dtype and size; seconds: median over ranks and "
        "repetitions; float32: largest error as a fraction of its bound.",
        "",
        "| dtype | bytes | results | wrong | median s | max err/bound |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for b in by_size(res):
        eob = f"{b['max_err_over_bound']:.2f}" if b["dtype"] != "int32" else "exact"
        lines.append(
            f"| {b['dtype']} | {b['bytes']:,} | {b['results']} | {b['wrong']} | "
            f"{b['median_s']:.4f} | {eob} |"
        )
    lines += ["", *_retx_lines(res)]
    lines += [
        "",
        "## Memory per process",
        "",
        "RSS at the start of each cycle of sizes (workers' own reading; the control endpoint: "
        "sampled), after the warm-up: first, last, growth of the maximum (second half over "
        "first half), least-squares slope.",
        "",
        "| process | samples | first MiB | last MiB | growth MiB | slope MiB/h |",
        "|---|---:|---:|---:|---:|---:|",
        *[
            f"| {k} | {p['samples']} | {p.get('first', 0) / 1024:.1f} | "
            f"{p.get('last', 0) / 1024:.1f} | {(p['growth'] or 0) / 1024:.1f} | "
            f"{v['rss_flat']['slope_mib_per_hour'].get(k, 0):.1f} |"
            for k, p in v["rss_flat"]["per_process"].items()
        ],
        "",
        "Workers' RSS as sampled from /proc after the warm-up (any phase of an all-reduce; "
        "no verdict, see bench/soak/verdicts.py): "
        + ", ".join(
            f"{k} {i['min_mib']:.0f}-{i['max_mib']:.0f} MiB (halves' max "
            f"{i['max_first_half_mib']:.0f}/{i['max_second_half_mib']:.0f})"
            for k, i in sampled_rss(res).items()
        )
        + ".",
        "",
        "## Time series",
        "",
        "RSS in MiB over the workers (min-max), fds over the workers, the control endpoint "
        "(server); map memory: the pinned maps' memlock; Gbit/s: tensor bytes all-reduced per "
        "second, both jobs, each job counted once. Full series: samples.csv, soak.json.",
        "",
        "| t (min) | all-reduces | wrong | Gbit/s | retx % | worker RSS | worker fds | server "
        "RSS | server fds | map MiB | maps | pins | netns | jobs | slots |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_series_line(r) for r in rows]
    return "\n".join(lines) + "\n"


def _retx_lines(res: dict) -> list[str]:
    """Datagrams and retransmissions per job (with its data path) and in all."""
    cfg, reports = res["config"], res.get("reports", {})
    lines = []
    for job in cfg["jobs"]:
        jr = [r for k, rs in reports.items() if k.split("/")[0] == job for r in rs]
        jp, jx = sum(r["packets"] for r in jr), sum(r["retransmissions"] for r in jr)
        lines.append(
            f"{job} ({cfg.get('data_paths', {}).get(job, 'udp')}): {len(jr):,} results, "
            f"{jp:,} datagrams, {jx:,} retransmissions ({100.0 * jx / max(1, jp):.2f}%)."
        )
    reps = [r for rs in reports.values() for r in rs]
    pk, rx = sum(r["packets"] for r in reps), sum(r["retransmissions"] for r in reps)
    injected = 1 - (1 - cfg["loss_up"]) * (1 - cfg["loss_down"])  # contribution or result lost
    return lines + [
        "",
        f"Datagrams sent {pk:,}, retransmissions {rx:,} ({100.0 * rx / max(1, pk):.2f}%; the "
        f"injected loss alone would cause about {100 * injected:.1f}%).",
    ]


def _series_line(r: dict) -> str:
    """One row of the time series table, from a samples.csv row."""
    rss = (
        f"{r['worker_rss_min_kib'] / 1024:.0f}-{r['worker_rss_max_kib'] / 1024:.0f}"
        if r["worker_rss_min_kib"] != ""
        else "-"
    )
    fds = f"{r['worker_fds_min']}-{r['worker_fds_max']}" if r["worker_fds_min"] != "" else "-"
    srss = f"{r['server_rss_kib'] / 1024:.0f}" if r["server_rss_kib"] != "" else "-"
    return (
        f"| {r['t_s'] / 60:.1f} | {r['allreduces']} | {r['wrong']} | {r['gbit_s']:.3f} | "
        f"{r['retx_pct']:.2f} | {rss} | {fds} | {srss} | {r['server_fds']} | "
        f"{r['map_memlock_bytes'] / 2**20:.2f} | {r['pinned_maps']} | {r['pins']} | "
        f"{r['namespaces']} | {r['jobs']} | {r['slots_in_use']} |"
    )


def detail(key: str, x: dict) -> str:
    """One line on verdict `key`'s result `x`, for the summary and the log."""
    if key == "results_exact":
        return f"{x['checked']} results checked, {x['wrong']} wrong"
    if key == "workers_finished":
        return f"all-reduces per job {x['allreduces_per_job']}; failed: {len(x['failed'])}"
    if key in ("rss_flat", "rss_peak_flat", "fds_flat"):
        g = [p["growth"] for p in x["per_process"].values() if p["growth"] is not None]
        unit = 1 if key == "fds_flat" else 1024
        worst = max(g) / unit if g else None
        lim = x["limit"] / unit
        u = "" if key == "fds_flat" else " MiB"
        s = f"largest growth {worst:.1f}{u} (limit {lim:g}{u})" if g else "no samples"
        if key != "fds_flat":
            sl = x.get("slope_mib_per_hour", {}).values()
            if sl:
                s += f"; fitted slope {min(sl):.1f} to {max(sl):.1f} MiB/h"
        return s + f", {len(x['per_process'])} processes"
    if key == "map_memory_flat":
        d = [
            f"{m / 2**20:.2f} MiB memlock, {kv / 2**20:.2f} MiB key+value, {n} maps"
            for m, kv, n in x["distinct"]
        ]
        return f"{'; '.join(d)} in {x['samples']} samples"
    if key == "samples_clean":
        return f"{x['samples']} samples ({x['post_warmup']} after warm-up), errors {x['errors']}"
    if key == "data_paths":
        return f"asked {x['asked']}; got {', '.join(x['got'])}; wrong: {x['wrong'] or 'none'}"
    if key == "no_job_or_slot_left":
        return f"jobs {x['jobs']}, slots {x['slots_in_use']} after the workers left"
    if key == "nothing_left_after_teardown":
        return (
            f"namespaces {x.get('namespaces')}, pin dir {x.get('pin_dir_exists')}, state file "
            f"{x.get('state_file_exists')}, processes {x.get('processes_left')}"
        )
    return ""
