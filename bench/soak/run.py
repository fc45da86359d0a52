"""The soak's run: the testbed, the aggregator and its control endpoint (xdp_agg.cluster.Cluster),
one bench.soak_worker per worker namespace, a sample every interval until the workers are done, and
what is left after the workers and after the teardown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from hostlib.options import env_var

from .probes import count_namespaces, count_pins, progress_line, sample
from .verdicts import Thresholds

DEFAULT_REPORT = Path(__file__).resolve().parent.parent / "results" / "soak"


@dataclass(frozen=True)
class SoakOptions:
    """What a soak runs (the options of `python -m bench.soak`, which says what each means)."""

    minutes: float = 30.0
    report: Path = DEFAULT_REPORT
    interval: float = 30.0
    warmup_min: float | None = None
    loss: float = 0.01
    jobs: int = 2
    workers: int = 4
    max_mib: int = 32
    elems: int = 256
    window: int = 128
    mtu: int = 1500
    rss_growth_mib: int = Thresholds.rss_growth_mib
    data_path: str = "mixed"
    allreduce_timeout: float = 60.0
    drain_s: float = 300.0


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


def _config(opts, jobs: list[str], name: str, prefix: str, warmup: float) -> dict:
    """The soak's configuration, as the report gives it."""
    return {
        "minutes": opts.minutes,
        "interval_s": opts.interval,
        "warmup_s": warmup,
        "jobs": jobs,
        "workers_per_job": opts.workers,
        "loss_up": opts.loss,
        "loss_down": opts.loss,
        "loss_on": "bridge ports" if _uses_afxdp(opts) else "worker eth0",
        "data_paths": {j: job_data_path(opts, i) for i, j in enumerate(jobs)},
        "elems": opts.elems,
        "window": opts.window,
        "mtu": opts.mtu,
        "max_bytes": opts.max_mib << 20,
        "aggregator": name,
        "testbed_prefix": prefix,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": os.uname().nodename,
        "kernel": os.uname().release,
        "cpus": os.cpu_count(),
        "load_before": [round(x, 2) for x in os.getloadavg()],
    }


def job_data_path(opts, j: int) -> str:
    """The data path job number `j` asks for (see the module docstring)."""
    if opts.data_path == "mixed":
        return "afxdp" if j % 2 == 0 else "udp"
    return opts.data_path


def _uses_afxdp(opts) -> bool:
    """Whether any job runs on AF_XDP ("mixed" puts job 0 there; --jobs is at least 1)."""
    return opts.data_path != "udp"


def _start_ranks(cl, tb, opts, jobs: list[str], stop_at: float, ranks: list) -> None:
    """One bench.soak_worker per worker namespace, opts.workers per job, each appended to `ranks`
    as it starts (so that a failure part way still stops the ones started)."""
    for j, job in enumerate(jobs):
        for r in range(opts.workers):
            w = tb.workers[j * opts.workers + r]
            cmd = [
                sys.executable,
                "-m",
                "bench.soak_worker",
                "--rank",
                str(r),
                "--world",
                str(opts.workers),
                "--control",
                cl.control_address(w),
                "--job",
                job,
                "--seed",
                str(j + 1),
                "--stop-at",
                repr(stop_at),
                "--max-bytes",
                str(opts.max_mib << 20),
                "--elems",
                str(opts.elems),
                "--window",
                str(opts.window),
                "--timeout",
                str(opts.allreduce_timeout),
            ]
            err = tempfile.TemporaryFile()
            env = cl.worker_env()
            env[env_var("data_path")] = job_data_path(opts, j)
            if env[env_var("data_path")] == "afxdp":
                env["XDP_AGG_NATIVE"] = "1"  # AF_XDP is the C loop's
            p = tb.popen(w, cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
            ranks.append(Rank(job, r, p, err))


def _watch(cl, tb, ranks, server_pid, pin_dir, opts, log, result, t_start, stop_at) -> None:
    """Sample every interval until the workers are done (or one failed, or overran)."""
    last = {"t": 0.0, "bytes": 0, "packets": 0, "retx": 0}
    next_sample = t_start
    while True:
        now = time.time()
        alive = [rk for rk in ranks if rk.proc.poll() is None]
        if now >= next_sample or not alive:
            s = sample(cl, tb, ranks, server_pid, pin_dir, now - t_start, last)
            result["samples"].append(s)
            log(progress_line(s, opts.minutes))
            next_sample += opts.interval
        if not alive:
            break
        failed = [rk for rk in ranks if rk.proc.poll() not in (None, 0)]
        if failed:
            log(f"soak: {failed[0].key} exited {failed[0].proc.returncode}; stopping")
            break
        if now > stop_at + opts.drain_s:
            log(f"soak: workers still running {opts.drain_s:g} s after the end; stopping")
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


def run(opts, log) -> dict:
    """The soak; returns everything the report needs (raises on set-up failure)."""
    from netns_testbed import faults, nsexec
    from netns_testbed.testbed import Testbed
    from xdp_agg.app.options import AttachOptions
    from xdp_agg.cluster.cluster import Cluster
    from xdp_switch import pins

    duration = opts.minutes * 60.0
    warmup = opts.warmup_min * 60.0 if opts.warmup_min is not None else min(300.0, duration / 4)
    jobs = [f"soak-{chr(ord('a') + j)}" for j in range(opts.jobs)]
    name = f"soak{uuid.uuid4().hex[:6]}"
    on_ports = _uses_afxdp(opts)  # AF_XDP frames skip the worker's own nftables hooks
    tb = Testbed(
        workers=opts.jobs * opts.workers,
        topology="one-arm",
        mtu=opts.mtu,
        loss_up=0.0 if on_ports else opts.loss,
        loss_down=0.0 if on_ports else opts.loss,
    )
    pin_dir = pins.pin_root() / name
    state_file = pins.state_dir() / f"{name}.json"
    result: dict = {"config": _config(opts, jobs, name, tb.prefix, warmup), "samples": []}
    ranks: list[Rank] = []
    pids: list[int] = []
    attach = AttachOptions(pool_slots=max(1024, opts.jobs * opts.window))
    with tb, Cluster(tb, name=name, attach=attach) as cl:
        server_pid = cl._server.pid
        pids.append(server_pid)
        if on_ports:
            ports = [f"w{w.index}" for w in tb.workers]
            faults.apply(tb.switch_netns, faults.port_loss_script(ports, opts.loss))
        t_start = result["t_start"] = time.time()
        stop_at = t_start + duration
        try:
            _start_ranks(cl, tb, opts, jobs, stop_at, ranks)
            pids += [rk.proc.pid for rk in ranks]
            log(
                f"soak: {len(jobs)} jobs x {opts.workers} workers, loss {opts.loss:.1%} both "
                f"ways, {opts.minutes:g} min, aggregator {name}, testbed {tb.prefix}"
            )
            _watch(cl, tb, ranks, server_pid, pin_dir, opts, log, result, t_start, stop_at)
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
