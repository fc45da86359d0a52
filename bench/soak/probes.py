"""What one sample of the soak reads: each process's RSS and descriptors (/proc), the pinned
maps' memory (bpftool), the pins, the testbed's namespaces, the aggregator's jobs and drops, and
the workers' progress since the last sample."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from xdp_agg.proto import reasons


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
    """Every counter whose reason is a drop (xdp_agg.proto.reasons.DROPS), over unattributed and
    all jobs."""
    total = reasons.drop_total(stats.get("unattributed") or {})
    for j in (stats.get("jobs") or {}).values():
        total += reasons.drop_total(j.get("reasons") or {})
    return total


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
