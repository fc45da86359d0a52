"""System-wide CPU over one all-reduce, and where it went (what bounds the all-reduce on a CPU-bound
testbed).

Three sources, read by rank 0 of bench.worker just before and just after each all-reduce (behind
barriers, so that the span holds exactly that all-reduce on every rank):

- /proc/stat's first line: every CPU's user, nice, system, irq and softirq time, in USER_HZ
  ticks (sampled by the scheduler tick: each reading is good to about a tick per CPU, so a cell
  reports the mean over its repetitions, not a median of a few dozen ticks);
- the kernel's BPF run-time statistics (run_time_ns, run_cnt of the aggregator's programs,
  kept while kernel.bpf_stats_enabled = 1; bench.allreduce turns it on for the run and restores
  it after), read through bpfsys (BPF_OBJ_GET_INFO_BY_FD);
- a background rate: /proc/stat over a quiet second before each measurement set, while every
  rank waits, for what the rest of the machine (other users' processes) burns meanwhile.

The split of the busy time (user + nice + system + irq + softirq):
- host: user + nice + system: the workers' processes (Python, numpy, the C fast path, gloo),
  their system calls and the kernel work done in their context;
- aggregator: the BPF run time of the aggregator's programs (XDP ingress, devmap egress);
- fabric: irq + softirq less the aggregator: the emulated network's forwarding (veth, bridge,
  tbf, the UDP/TCP receive path run from softirq). XDP runs in the veth's NAPI poll, a softirq,
  so its time is inside softirq; the subtraction is clamped at zero, the two being measured
  differently (ticks against nanoseconds).
Parsing and the split need no root (tests/unit/test_cpustat.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from xdp_agg import bpfsys

PROC_STAT = Path("/proc/stat")
BPF_STATS_SYSCTL = Path(bpfsys.BPF_STATS_SYSCTL)
# the fields of /proc/stat's cpu lines, in order (proc(5)); guest time is inside user already
FIELDS = (
    "user",
    "nice",
    "system",
    "idle",
    "iowait",
    "irq",
    "softirq",
    "steal",
    "guest",
    "guest_nice",
)
BUSY = ("user", "nice", "system", "irq", "softirq")
PARTS = ("host", "fabric", "aggregator")


def parse_proc_stat(text: str) -> dict[str, int]:
    """The all-CPU `cpu` line of /proc/stat as {field: ticks} (fields a kernel lacks are 0)."""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            vals = [int(x) for x in parts[1:]]
            return {f: (vals[i] if i < len(vals) else 0) for i, f in enumerate(FIELDS)}
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def ticks_per_second() -> int:
    return os.sysconf("SC_CLK_TCK")


def delta_seconds(a: dict[str, int], b: dict[str, int], hz: int) -> dict[str, float]:
    """CPU seconds per field between two parsed /proc/stat readings (b later than a)."""
    d = {f: (b[f] - a[f]) / hz for f in FIELDS}
    if any(v < 0 for v in d.values()):
        raise ValueError(f"/proc/stat went backwards: {d}")
    return d


def split(cpu: dict[str, float], aggregator_ns: int) -> dict[str, float]:
    """Busy seconds of one span split into host, fabric and aggregator (see the module doc)."""
    busy = sum(cpu[f] for f in BUSY)
    agg = aggregator_ns / 1e9
    return {
        "busy_s": busy,
        "host_s": cpu["user"] + cpu["nice"] + cpu["system"],
        "fabric_s": max(0.0, cpu["irq"] + cpu["softirq"] - agg),
        "aggregator_s": agg,
    }


def dominant(parts: dict[str, float]) -> str:
    """Which of host, fabric and aggregator took the most time."""
    return max(PARTS, key=lambda p: parts[f"{p}_s"])


def cell(spans: list[dict], nbytes: int, background_per_s: float | None = None) -> dict:
    """One benchmark cell of one system from its all-reduces' spans (each as Meter.span returns
    it): the mean CPU seconds per all-reduce, system-wide and split, per all-reduced GiB, the
    shares, the part that took most, the aggregator's runs, and the background estimate."""
    if not spans:
        return {}
    n = len(spans)
    mean = {k: sum(s[k] for s in spans) / n for k in ("busy_s", *(f"{p}_s" for p in PARTS))}
    wall = sum(s["wall_s"] for s in spans) / n
    runs = sum(s["bpf_runs"] for s in spans) / n
    gib = nbytes / 2**30
    out = {
        "sys_cpu_s": mean["busy_s"],
        "sys_cpu_s_per_gib": mean["busy_s"] / gib,
        **{f"{p}_s": mean[f"{p}_s"] for p in PARTS},
        **{
            f"{p}_share": (mean[f"{p}_s"] / mean["busy_s"] if mean["busy_s"] else 0.0)
            for p in PARTS
        },
        "mostly": dominant(mean),
        "span_s": wall,
        "bpf_runs": runs,
        "bpf_ns_per_run": (mean["aggregator_s"] * 1e9 / runs) if runs else None,
        "spans": n,
    }
    if background_per_s is not None:
        out["background_cpu_s"] = background_per_s * wall
    return out


def read_proc_stat() -> dict[str, int]:
    return parse_proc_stat(PROC_STAT.read_text())


class Meter:
    """Rank 0's meter: /proc/stat and the run time of the given BPF programs (fds)."""

    def __init__(self, prog_fds: list[int] | None = None) -> None:
        self.hz = ticks_per_second()
        self.fds = list(prog_fds or [])

    def _bpf(self) -> tuple[int, int]:
        from xdp_agg import bpfsys

        ns = cnt = 0
        for fd in self.fds:
            info = bpfsys.prog_info(fd)
            ns, cnt = ns + info.run_time_ns, cnt + info.run_cnt
        return ns, cnt

    def start(self) -> tuple:
        ns, cnt = self._bpf()  # before /proc/stat: the reads' own CPU stays outside the span
        return (read_proc_stat(), time.monotonic(), ns, cnt)

    def span(self, start: tuple) -> dict:
        """CPU seconds by field, the split, the wall time and the BPF runs since `start`."""
        stat, t = read_proc_stat(), time.monotonic()
        ns, cnt = self._bpf()
        cpu = delta_seconds(start[0], stat, self.hz)
        d = split(cpu, ns - start[2])
        return {**d, "wall_s": t - start[1], "bpf_runs": cnt - start[3], "cpu": cpu}

    def background(self, seconds: float = 1.0) -> float:
        """Busy CPU seconds per second over a quiet `seconds` (nothing of ours running)."""
        s0, t0 = read_proc_stat(), time.monotonic()
        time.sleep(seconds)
        s1, t1 = read_proc_stat(), time.monotonic()
        d = delta_seconds(s0, s1, self.hz)
        return sum(d[f] for f in BUSY) / (t1 - t0)


def aggregator_prog_fds(agg_name: str) -> list[int]:
    """The attached aggregator's programs (each of backend.PROGRAMS pinned), by their pins."""
    from xdp_switch import pins
    from xdp_switch.backend import PROGRAMS

    inst = pins.Instance(agg_name)
    fds = []
    for name in PROGRAMS:
        if inst.prog_path(name).exists():
            fds.append(inst.open_prog(name))
    return fds


class BpfStats:
    """kernel.bpf_stats_enabled = 1 while open, the previous value restored after (root)."""

    def __init__(self, path: Path = BPF_STATS_SYSCTL) -> None:
        self.path = path
        self.before: str | None = None

    def __enter__(self) -> BpfStats:
        try:
            self.before = self.path.read_text().strip()
            self.path.write_text("1\n")
        except OSError:
            self.before = None  # not root, or no such sysctl: the aggregator's share reads 0
        return self

    @property
    def enabled(self) -> bool:
        return self.before is not None

    def __exit__(self, *exc) -> None:
        if self.before is not None:
            self.path.write_text(self.before + "\n")
