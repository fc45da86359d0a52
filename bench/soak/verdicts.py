"""The soak's verdicts: every check of a run's result (exact results, finished workers, data
paths, flat memory and descriptors, nothing left), each {"ok": bool, ...}, judged with
Thresholds."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from bench.soak_worker import SIZES


@dataclass(frozen=True)
class Thresholds:
    """What the verdicts allow: RSS growth of a process at cycle starts (MiB, second half's
    maximum over the first half's, after the warm-up)."""

    rss_growth_mib: int = 16


CYCLE = len(SIZES)  # all-reduces per cycle of sizes


def halves(values: list) -> tuple[list, list]:
    """First and second half of a series (the middle element, if any, goes to both)."""
    m = len(values) // 2
    return values[: m + (len(values) % 2)], values[m:]


def growth_verdict(series: dict[str, list[int]], limit: int, what: str, stat=max) -> dict:
    """Per process: stat (max or min) of the second half minus stat of the first half, passing
    when <= limit."""
    per, ok = {}, True
    for key, vals in series.items():
        if len(vals) < 2:
            per[key] = {"samples": len(vals), "growth": None}
            ok = False
            continue
        a, b = halves(vals)
        g = stat(b) - stat(a)
        per[key] = {"samples": len(vals), "first": vals[0], "last": vals[-1], "growth": g}
        ok &= g <= limit
    return {
        "what": what,
        "stat": stat.__name__,
        "limit": limit,
        "ok": bool(ok and per),
        "per_process": per,
    }


def slope_per_hour(ts: list[float], vals: list[float]) -> float:
    """Least-squares slope of vals over ts (seconds), per hour; 0 with fewer than 2 points."""
    if len(ts) < 2 or max(ts) == min(ts):
        return 0.0
    mt, mv = statistics.fmean(ts), statistics.fmean(vals)
    num = sum((t - mt) * (v - mv) for t, v in zip(ts, vals))
    den = sum((t - mt) ** 2 for t in ts)
    return num / den * 3600.0


def sampled_rss(res: dict) -> dict:
    """Informational, no verdict: the workers' RSS as sampled from /proc after the warm-up, per
    worker: min, max, max of each half, fitted slope. It swings by several times the tensor in
    flight (input, output, the float64 reference and the check's temporaries) with the phase of
    the sample, so a threshold on it would judge the sampling's luck, not a leak."""
    cfg = res["config"]
    out = {}
    for s in res["samples"]:
        if s["t_s"] < cfg["warmup_s"]:
            continue
        for k, u in s["procs"].items():
            if k != "server":
                out.setdefault(k, []).append((s["t_s"], u["rss_kib"] / 1024))
    info = {}
    for k, pts in out.items():
        a, b = halves([v for _, v in pts])
        info[k] = {
            "samples": len(pts),
            "min_mib": round(min(v for _, v in pts), 1),
            "max_mib": round(max(v for _, v in pts), 1),
            "max_first_half_mib": round(max(a), 1),
            "max_second_half_mib": round(max(b), 1),
            "slope_mib_per_hour": round(slope_per_hour(*zip(*pts)), 1) if len(pts) > 1 else 0.0,
        }
    return info


def data_path_verdict(res: dict) -> dict:
    """Every rank ran on the data path its job asked for (AF_XDP: afxdp-copy-* or -zc-*)."""
    asked = res["config"].get("data_paths", {})
    got, wrong = {}, {}
    for rk in res.get("ranks", []):
        done = rk.get("done") or {}
        key = f"{rk['job']}/{rk['rank']}"
        got[key] = path = [done.get("data_path"), done.get("data_path_reason")]
        if not str(path[0]).startswith(asked.get(rk["job"], "?")):
            wrong[key] = path
    return {
        "ok": bool(got) and not wrong,
        "asked": asked,
        "got": sorted({str(v[0]) for v in got.values()}),
        "wrong": wrong,
    }


def verdicts(res: dict, limits: Thresholds) -> dict:
    """Every check of the soak, each {"ok": bool, ...}."""
    cfg = res["config"]
    v: dict = {}
    reports = res.get("reports", {})
    all_reps = [r for reps in reports.values() for r in reps]
    wrong = [(k, r) for k, reps in reports.items() for r in reps if not r.get("ok")]
    v["results_exact"] = {
        "ok": not wrong and bool(all_reps),
        "checked": len(all_reps),
        "wrong": len(wrong),
        "first_wrong": [dict(r, rank=k) for k, r in wrong[:5]],
    }
    per_job = {}
    for rk in res.get("ranks", []):
        per_job.setdefault(rk["job"], []).append(rk["allreduces"])
    v["workers_finished"] = {
        "ok": all(rk["exit"] == 0 and rk["done"] for rk in res.get("ranks", []))
        and all(len(set(c)) == 1 and c[0] > 0 for c in per_job.values())
        and len(per_job) == len(cfg["jobs"]),
        "allreduces_per_job": {j: c[0] if len(set(c)) == 1 else c for j, c in per_job.items()},
        "failed": [
            {k: rk[k] for k in ("job", "rank", "exit", "stderr_tail")}
            for rk in res.get("ranks", [])
            if rk["exit"] != 0 or not rk["done"]
        ],
    }
    v["data_paths"] = data_path_verdict(res)
    post = [s for s in res["samples"] if s["t_s"] >= cfg["warmup_s"] and len(s["procs"]) > 1]
    series_rss, series_fds, times = {}, {}, {}
    for s in post:
        for k, u in s["procs"].items():
            series_rss.setdefault(k, []).append(u["rss_kib"])
            series_fds.setdefault(k, []).append(u["fds"])
            times.setdefault(k, []).append(s["t_s"])
    # Workers at the start of each cycle of sizes (their own reading, no tensor alive): the
    # comparable points of a process whose footprint swings by the tensor in flight.
    t0 = res.get("t_start", 0.0)
    cyc_rss, cyc_t = {}, {}
    for key, rs in reports.items():
        for r in rs:
            if r["k"] % CYCLE == 0 and r.get("at", 0) - t0 >= cfg["warmup_s"]:
                cyc_rss.setdefault(key, []).append(r["rss_kib"])
                cyc_t.setdefault(key, []).append(r["at"] - t0)
    if "server" in series_rss:
        cyc_rss["server"], cyc_t["server"] = series_rss["server"], times["server"]
    v["rss_flat"] = growth_verdict(cyc_rss, limits.rss_growth_mib << 10, "RSS KiB")
    v["rss_flat"]["slope_mib_per_hour"] = {
        k: round(slope_per_hour(cyc_t[k], [x / 1024 for x in vals]), 2)
        for k, vals in cyc_rss.items()
    }
    # the least of each half: a descriptor open for a moment (a worker reading its own /proc, a
    # control request in flight) is no leak, one that stays raises the least value
    v["fds_flat"] = growth_verdict(series_fds, 0, "open file descriptors", stat=min)
    v["fds_flat"]["max_per_process"] = {k: max(x) for k, x in series_fds.items()}
    attached = [s for s in res["samples"] if s["pinned_maps"]]
    mem = {(s["map_memlock_bytes"], s["map_kv_bytes"], s["pinned_maps"]) for s in attached}
    v["map_memory_flat"] = {
        "ok": len(mem) == 1,
        "distinct": sorted(mem),
        "samples": len(attached),
    }
    v["samples_clean"] = {
        "ok": bool(res["samples"]) and not any("sample_error" in s for s in res["samples"]),
        "samples": len(res["samples"]),
        "post_warmup": len(post),
        "errors": [s["sample_error"] for s in res["samples"] if "sample_error" in s][:3],
    }
    aw = res.get("after_workers", {})
    v["no_job_or_slot_left"] = {
        "ok": aw.get("jobs") == 0 and aw.get("slots_in_use") == 0,
        "jobs": aw.get("jobs"),
        "slots_in_use": aw.get("slots_in_use"),
    }
    at = res.get("after_teardown", {})
    v["nothing_left_after_teardown"] = {
        "ok": at.get("namespaces") == 0
        and not at.get("pin_dir_exists")
        and not at.get("state_file_exists")
        and not at.get("processes_left"),
        **at,
    }
    return v
