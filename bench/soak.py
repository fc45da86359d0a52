"""`make soak` / `python -m bench.soak --minutes M --report DIR`: a long run that must stay exact
and flat.

Two jobs at once on one XDP aggregator, n workers each (default 4: 8 worker namespaces on a
one-arm testbed), 1% loss both ways on every worker link (the testbed's nftables loss), each
rank one long-lived bench.soak_worker process that all-reduces mixed sizes (1 KiB to 32 MiB,
int32 and float32, see bench.soak_worker.SIZES) until the time is up, checking every result:
int32 bit-exact, float32 within the block-scaling bound around the float64 sum.

Data paths (--data-path): "mixed" (the default) runs every even-numbered job's workers on
AF_XDP sockets and the others on kernel UDP sockets, so that one soak covers both of hostlib's
paths at once; "udp" or "afxdp" puts every job on one. A rank that did not get the path its job
asked for (hostlib falls back silently to UDP, with the reason in comm.stats) fails the
`data_paths` verdict. AF_XDP frames skip the worker's own nftables hooks, so whenever a job runs
on AF_XDP the loss sits on the bridge's worker ports (netns_testbed.faults.port_loss_script),
both ways, for every job alike, instead of on the workers' eth0.

Every --interval seconds (default 30) it samples: each worker's and the control endpoint's RSS
and open file descriptors (/proc/PID/status, /proc/PID/fd), the aggregator's map memory
(bpftool on every pinned map: memlock bytes, and key+value size x entries) and pinned map and
program count, the namespaces of the testbed, the pins, the jobs and slots in use (xdp-agg job
list), the aggregator's drop counters (xdp-agg stats), all-reduces done, throughput and
retransmissions since the last sample. A progress line per sample goes to stderr.

At the end the workers stop together (bench.soak_worker), the jobs must disappear from the
aggregator, then the aggregator is detached and the testbed removed, and nothing may be left:
no namespace of the testbed, no pin under /sys/fs/bpf/xdp-agg/NAME, no state file, no job, no
slot, no process. Flatness verdicts, after a warm-up (--warmup-min, default 25% of the run, at
most 5 minutes):
- RSS (rss_flat): per worker, its RSS at the start of each cycle of sizes (read by the worker
  itself when no tensor is alive: the comparable points), and the control endpoint's sampled
  RSS; the largest value of the second half of the post-warm-up series exceeds the largest of
  the first half by at most --rss-growth-mib (default 16 MiB); a fitted slope is reported too;
  (the workers' RSS sampled from /proc any time is reported too, without a verdict: it swings
  by several times the tensor in flight with the phase of the sample);
- file descriptors: per process (sampled), the second half's least value is no larger than the
  first half's (a descriptor open for a moment is no leak; one that stays raises the least);
- map memory and pinned map count: the same in every sample.

Writes DIR/summary.md (configuration, results, verdicts, the time series as a table),
DIR/samples.csv and DIR/soak.json (everything). Exit status 0 when every result is right and
every verdict holds, 1 otherwise (2: usage, 3: not root).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from bench.soak_worker import SIZES
from hostlib import afxdp

CYCLE = len(SIZES)  # all-reduces per cycle of sizes
DEFAULT_REPORT = Path(__file__).resolve().parent / "results" / "soak"


# --- sampling -------------------------------------------------------------------------------
def proc_usage(pid: int) -> dict | None:
    """RSS (KiB) and open file descriptors of a live process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None
    return {"rss_kib": rss, "fds": fds}


def map_memory(pin_dir: Path) -> dict:
    """Memory of the maps pinned under pin_dir/maps, from bpftool: memlock bytes (as the kernel
    reports them), key+value bytes x max_entries, and the pinned map and program counts."""
    out = {"map_memlock_bytes": 0, "map_kv_bytes": 0, "pinned_maps": 0, "pinned_progs": 0}
    maps = sorted((pin_dir / "maps").glob("*")) if (pin_dir / "maps").is_dir() else []
    for p in maps:
        r = subprocess.run(
            ["bpftool", "-j", "map", "show", "pinned", str(p)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if r.returncode != 0:
            continue
        m = json.loads(r.stdout)
        out["pinned_maps"] += 1
        out["map_memlock_bytes"] += int(m.get("bytes_memlock", 0))
        entries = int(m.get("max_entries", 0))
        out["map_kv_bytes"] += (int(m.get("bytes_key", 0)) + int(m.get("bytes_value", 0))) * entries
    if (pin_dir / "progs").is_dir():
        out["pinned_progs"] = len(list((pin_dir / "progs").iterdir()))
    return out


def count_pins(pin_dir: Path) -> int:
    """Files (pinned objects) under pin_dir, 0 if it does not exist."""
    return sum(len(files) for _, _, files in os.walk(pin_dir)) if pin_dir.exists() else 0


def count_namespaces(prefix: str) -> int:
    """Named network namespaces of the testbed with this prefix."""
    try:
        return sum(1 for n in os.listdir("/var/run/netns") if n.startswith(prefix))
    except FileNotFoundError:
        return 0


def drop_total(stats: dict) -> int:
    """Every counter whose reason is a drop, over unattributed and all jobs."""

    def drops(reasons: dict) -> int:
        return sum(v for k, v in reasons.items() if k.startswith("drop") or k == "dropped")

    total = drops(stats.get("unattributed") or {})
    for j in (stats.get("jobs") or {}).values():
        total += drops(j.get("reasons") or {})
    return total


# --- verdicts -------------------------------------------------------------------------------
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


# --- the run --------------------------------------------------------------------------------
class Rank:
    """One worker process of the soak, with a thread collecting its JSON lines."""

    def __init__(self, job: str, rank: int, proc: subprocess.Popen, errfile) -> None:
        self.job, self.rank, self.proc, self.errfile = job, rank, proc, errfile
        self.key = f"{job}/{rank}"
        self.reports: list[dict] = []
        self.done: dict | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if not line.startswith("{"):
                continue
            d = json.loads(line)
            if d.get("done"):
                self.done = d
            else:
                self.reports.append(d)

    def stderr_tail(self, n: int = 1500) -> str:
        self.errfile.seek(0)
        return self.errfile.read().decode(errors="replace")[-n:]


def _config(args, jobs: list[str], name: str, prefix: str, warmup: float) -> dict:
    """The soak's configuration, as the report gives it."""
    return {
        "minutes": args.minutes,
        "interval_s": args.interval,
        "warmup_s": warmup,
        "jobs": jobs,
        "workers_per_job": args.workers,
        "loss_up": args.loss,
        "loss_down": args.loss,
        "loss_on": "bridge ports" if _uses_afxdp(args) else "worker eth0",
        "data_paths": {j: job_data_path(args, i) for i, j in enumerate(jobs)},
        "elems": args.elems,
        "window": args.window,
        "mtu": args.mtu,
        "max_bytes": args.max_mib << 20,
        "aggregator": name,
        "testbed_prefix": prefix,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": os.uname().nodename,
        "kernel": os.uname().release,
        "cpus": os.cpu_count(),
        "load_before": [round(x, 2) for x in os.getloadavg()],
    }


def job_data_path(args, j: int) -> str:
    """The data path job number `j` asks for (see the module docstring)."""
    if args.data_path == "mixed":
        return "afxdp" if j % 2 == 0 else "udp"
    return args.data_path


def _uses_afxdp(args) -> bool:
    """Whether any job runs on AF_XDP ("mixed" puts job 0 there; --jobs is at least 1)."""
    return args.data_path != "udp"


def _start_ranks(cl, tb, args, jobs: list[str], stop_at: float, ranks: list) -> None:
    """One bench.soak_worker per worker namespace, args.workers per job, each appended to `ranks`
    as it starts (so that a failure part way still stops the ones started)."""
    for j, job in enumerate(jobs):
        for r in range(args.workers):
            w = tb.workers[j * args.workers + r]
            cmd = [
                sys.executable,
                "-m",
                "bench.soak_worker",
                "--rank",
                str(r),
                "--world",
                str(args.workers),
                "--control",
                cl.control_address(w),
                "--job",
                job,
                "--seed",
                str(j + 1),
                "--stop-at",
                repr(stop_at),
                "--max-bytes",
                str(args.max_mib << 20),
                "--elems",
                str(args.elems),
                "--window",
                str(args.window),
                "--timeout",
                str(args.allreduce_timeout),
            ]
            err = tempfile.TemporaryFile()
            env = cl.worker_env()
            env[afxdp.ENV] = job_data_path(args, j)
            if env[afxdp.ENV] == "afxdp":
                env["XDP_AGG_NATIVE"] = "1"  # AF_XDP is the C loop's
            p = tb.popen(w, cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
            ranks.append(Rank(job, r, p, err))


def _watch(cl, tb, ranks, server_pid, pin_dir, args, log, result, t_start, stop_at) -> None:
    """Sample every interval until the workers are done (or one failed, or overran)."""
    last = {"t": 0.0, "bytes": 0, "packets": 0, "retx": 0}
    next_sample = t_start
    while True:
        now = time.time()
        alive = [rk for rk in ranks if rk.proc.poll() is None]
        if now >= next_sample or not alive:
            s = sample(cl, tb, ranks, server_pid, pin_dir, now - t_start, last)
            result["samples"].append(s)
            log(progress_line(s, args.minutes))
            next_sample += args.interval
        if not alive:
            break
        failed = [rk for rk in ranks if rk.proc.poll() not in (None, 0)]
        if failed:
            log(f"soak: {failed[0].key} exited {failed[0].proc.returncode}; stopping")
            break
        if now > stop_at + args.drain_s:
            log(f"soak: workers still running {args.drain_s:g} s after the end; stopping")
            break
        time.sleep(min(1.0, max(0.05, next_sample - time.time())))


def _after_workers(cl, ranks, result: dict) -> None:
    """The jobs left once the workers are gone, and each rank's outcome."""
    # the jobs end when their workers leave: the control endpoint deletes them
    jobs_after, t_end = None, time.monotonic() + 20
    while time.monotonic() < t_end:
        jobs_after = json.loads(cl.cli("job", "list", "--json").stdout)
        if not jobs_after:
            break
        time.sleep(0.5)
    result["after_workers"] = {
        "jobs": len(jobs_after or []),
        "slots_in_use": sum(j["slot_count"] for j in jobs_after or []),
        "stats": cl.stats(),
    }
    result["ranks"] = [
        {
            "job": rk.job,
            "rank": rk.rank,
            "exit": rk.proc.returncode,
            "allreduces": len(rk.reports),
            "done": rk.done,
            "stderr_tail": rk.stderr_tail() if rk.proc.returncode else "",
        }
        for rk in ranks
    ]
    result["reports"] = {rk.key: rk.reports for rk in ranks}


def run(args, log) -> dict:
    """The soak; returns everything the report needs (raises on set-up failure)."""
    from aggcluster.cluster import Cluster
    from netns_testbed import faults, nsexec
    from netns_testbed.testbed import Testbed
    from xdp_switch import pins

    duration = args.minutes * 60.0
    warmup = args.warmup_min * 60.0 if args.warmup_min is not None else min(300.0, duration / 4)
    jobs = [f"soak-{chr(ord('a') + j)}" for j in range(args.jobs)]
    name = f"soak{uuid.uuid4().hex[:6]}"
    on_ports = _uses_afxdp(args)  # AF_XDP frames skip the worker's own nftables hooks
    tb = Testbed(
        workers=args.jobs * args.workers,
        topology="one-arm",
        mtu=args.mtu,
        loss_up=0.0 if on_ports else args.loss,
        loss_down=0.0 if on_ports else args.loss,
    )
    pin_dir = pins.pin_root() / name
    state_file = pins.state_dir() / f"{name}.json"
    result: dict = {"config": _config(args, jobs, name, tb.prefix, warmup), "samples": []}
    ranks: list[Rank] = []
    pids: list[int] = []
    with tb, Cluster(tb, name=name, pool_slots=max(1024, args.jobs * args.window)) as cl:
        server_pid = cl._server.pid
        pids.append(server_pid)
        if on_ports:
            ports = [f"w{w.index}" for w in tb.workers]
            faults.apply(tb.switch_netns, faults.port_loss_script(ports, args.loss))
        t_start = result["t_start"] = time.time()
        stop_at = t_start + duration
        try:
            _start_ranks(cl, tb, args, jobs, stop_at, ranks)
            pids += [rk.proc.pid for rk in ranks]
            log(
                f"soak: {len(jobs)} jobs x {args.workers} workers, loss {args.loss:.1%} both "
                f"ways, {args.minutes:g} min, aggregator {name}, testbed {tb.prefix}"
            )
            _watch(cl, tb, ranks, server_pid, pin_dir, args, log, result, t_start, stop_at)
        finally:
            nsexec.terminate([rk.proc for rk in ranks if rk.proc.poll() is None], grace=5)
            for rk in ranks:
                rk.thread.join(timeout=10)
        _after_workers(cl, ranks, result)
    # after Cluster and Testbed exit: nothing of ours may be left
    time.sleep(0.5)
    result["after_teardown"] = {
        "namespaces": count_namespaces(tb.prefix),
        "pin_dir_exists": pin_dir.exists(),
        "pins": count_pins(pin_dir),
        "state_file_exists": state_file.exists(),
        "processes_left": [p for p in pids if os.path.exists(f"/proc/{p}")],
    }
    result["config"]["ended"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    result["config"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
    result["config"]["elapsed_s"] = time.time() - t_start
    return result


def sample(cl, tb, ranks, server_pid: int, pin_dir: Path, t: float, last: dict) -> dict:
    """One row of the time series (see the module docstring); `last` carries the totals of the
    previous row, for the per-interval rates."""
    s: dict = {"t_s": round(t, 1), "procs": {}}
    for rk in ranks:
        u = proc_usage(rk.proc.pid) if rk.proc.poll() is None else None
        if u:
            s["procs"][rk.key] = u
    u = proc_usage(server_pid)
    if u:
        s["procs"]["server"] = u
    s.update(map_memory(pin_dir))
    s["pins"] = count_pins(pin_dir)
    s["namespaces"] = count_namespaces(tb.prefix)
    try:
        jobs = json.loads(cl.cli("job", "list", "--json").stdout)
        s["jobs"] = len(jobs)
        s["slots_in_use"] = sum(j["slot_count"] for j in jobs)
        s["agg_drops"] = drop_total(cl.stats())
    except Exception as e:  # noqa: BLE001 - a failed sample is recorded, not fatal
        s["sample_error"] = str(e)[:300]
    reports = [(rk, r) for rk in ranks for r in list(rk.reports)]
    s["allreduces"] = sum(1 for rk, _ in reports if rk.rank == 0)
    s["wrong"] = sum(1 for _, r in reports if not r.get("ok"))
    total_bytes = sum(r["bytes"] for rk, r in reports if rk.rank == 0)  # once per job
    packets = sum(r["packets"] for _, r in reports)
    retx = sum(r["retransmissions"] for _, r in reports)
    dt = max(1e-9, t - last["t"])
    s["gbit_s"] = round((total_bytes - last["bytes"]) * 8 / dt / 1e9, 4)
    dp = packets - last["packets"]
    s["retransmissions"] = retx - last["retx"]
    s["retx_pct"] = round(100.0 * s["retransmissions"] / dp, 3) if dp else 0.0
    last.update(t=t, bytes=total_bytes, packets=packets, retx=retx)
    return s


def progress_line(s: dict, minutes: float) -> str:
    w = [u for k, u in s["procs"].items() if k != "server"]
    rss = f"{min(u['rss_kib'] for u in w) >> 10}-{max(u['rss_kib'] for u in w) >> 10}" if w else "-"
    fds = f"{min(u['fds'] for u in w)}-{max(u['fds'] for u in w)}" if w else "-"
    return (
        f"[{s['t_s'] / 60:5.1f}/{minutes:g} min] all-reduces {s['allreduces']} "
        f"(wrong {s['wrong']}), {s['gbit_s']:.3f} Gbit/s, retx {s['retx_pct']:.2f}%, "
        f"worker RSS {rss} MiB, fds {fds}, maps {s['map_memlock_bytes'] / 2**20:.1f} MiB "
        f"({s['pinned_maps']} pinned), jobs {s.get('jobs', '?')}, slots "
        f"{s.get('slots_in_use', '?')}, namespaces {s['namespaces']}"
    )


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


def verdicts(res: dict, args) -> dict:
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
    v["rss_flat"] = growth_verdict(cyc_rss, args.rss_growth_mib << 10, "RSS KiB")
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


# --- the report -----------------------------------------------------------------------------
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
        lines.append(f"| {k} | {'yes' if x['ok'] else '**NO**'} | {_detail(k, x)} |")
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
        "no verdict, see bench/soak.py): "
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


def _detail(key: str, x: dict) -> str:
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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  sudo python -m bench.soak --minutes 30\n"
        "  sudo python -m bench.soak --minutes 1.5 --interval 5 --report /tmp/soak",
    )
    ap.add_argument("--minutes", type=float, default=30.0, help="length of the run")
    ap.add_argument("--report", type=Path, default=DEFAULT_REPORT, help="report directory")
    ap.add_argument("--interval", type=float, default=30.0, help="seconds between samples")
    ap.add_argument("--warmup-min", type=float, default=None, help="default: 25%%, at most 5")
    ap.add_argument("--loss", type=float, default=0.01, help="loss each way on worker links")
    ap.add_argument("--jobs", type=int, default=2, help="concurrent jobs")
    ap.add_argument("--workers", type=int, default=4, help="workers per job")
    ap.add_argument("--max-mib", type=int, default=32, help="largest tensor, MiB")
    ap.add_argument("--elems", type=int, default=256)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument(
        "--rss-growth-mib", type=int, default=16, help="RSS at cycle starts, control endpoint"
    )
    ap.add_argument(
        "--data-path",
        choices=("mixed", "udp", "afxdp"),
        default="mixed",
        help="hostlib's data path per job: mixed = AF_XDP for even-numbered jobs, kernel UDP "
        "sockets for the others (both paths in one soak), or one path for all",
    )
    ap.add_argument("--allreduce-timeout", type=float, default=60.0)
    ap.add_argument("--drain-s", type=float, default=300.0, help="wait for the last all-reduce")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.interval <= 0 or args.jobs < 1 or args.workers < 1:
        ap.error("--minutes, --interval, --jobs and --workers must be positive")
    if (args.jobs * args.workers) > 32:
        ap.error("the testbed has at most 32 workers: --jobs x --workers <= 32")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench.soak: needs root (namespaces, XDP)", file=sys.stderr)
        return 3

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    # SIGTERM (a CI timeout, kill PID) unwinds like an error: the testbed and aggregator go.
    # Only in this process: pyroute2 forks helpers (netns creation) that inherit the handler
    # and are stopped with SIGTERM; unwinding a forked copy of this stack would run the
    # testbed's teardown there and remove the namespaces under the build (seen: a hung build).
    main_pid = os.getpid()

    def on_term(signum, frame):
        if os.getpid() != main_pid:
            os._exit(128 + signum)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    res = run(args, log)
    try:
        v = verdicts(res, args)
        write_report(res, v, args.report)
    except Exception:
        # a long run's data is not lost to a bug in the report's code
        args.report.mkdir(parents=True, exist_ok=True)
        (args.report / "soak-raw.json").write_text(json.dumps(res, default=str) + "\n")
        log(f"soak: the report failed; raw results in {args.report / 'soak-raw.json'}")
        raise
    for k, x in v.items():
        log(f"  {k:28s} {'ok' if x['ok'] else 'FAILED'}: {_detail(k, x)}")
    ok = all(x["ok"] for x in v.values())
    log(f"soak {'PASSED' if ok else 'FAILED'}; report in {args.report}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
