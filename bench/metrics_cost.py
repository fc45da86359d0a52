"""`python -m bench.metrics_cost`: what a Prometheus scrape of `xdp-agg serve --metrics` costs.

On a one-arm testbed of two workers, with the XDP aggregator served with --metrics:

1. all-reduce throughput side by side: phases of `--reps` all-reduces of `--mib` MiB int32
   each, without scraping, with a scrape every second (Prometheus's usual pace is 15 s to 1 min),
   and with scrapes back to back (the worst case: the exporter never idle), the modes taking
   turns for `--rounds` rounds; per mode the median all-reduce time over all its phases and
   the Gbit/s that makes (S*8/time, S the tensor's bytes);
2. time per scrape: the wall time of an HTTP GET of /metrics from the aggregator's namespace
   (what Prometheus waits for) and the collector's own reading of the maps and the endpoint
   (xdpagg_scrape_duration_seconds, summed over its sources), median and 99th percentile, over
   the back-to-back phases (one job of two workers), then again with 64 jobs of 4 workers each
   in the aggregator (the most jobs it has), each counter row read per scrape.

Prints one JSON object (docs/operations.md, "Metrics", quotes it). Needs root.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import unwind_on_sigterm
from netns_testbed.testbed import Testbed
from xdp_agg.cluster.cluster import Cluster

METRICS_PORT = 9464
MODES = {"none": None, "every_1s": 1.0, "back_to_back": 0.0}

# a scraper in the aggregator's namespace: GETs until the stop file exists (or `limit` GETs)
SCRAPER = """
import json, os, sys, time, urllib.request
url, interval, stop, limit = sys.argv[1], float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
lat, reads, size = [], [], 0
while not os.path.exists(stop) and len(lat) < limit:
    t0 = time.perf_counter()
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    lat.append(time.perf_counter() - t0)
    size = len(text)
    reads.append(sum(float(x.split()[-1]) for x in text.splitlines()
                     if x.startswith("xdpagg_scrape_duration_seconds{")))
    if interval:
        time.sleep(interval)
print(json.dumps({"latency_s": lat, "read_s": reads, "bytes": size}))
"""

# 63 more jobs of 4 workers (ids 1..63, 16 slots each) straight into the aggregator's maps
MANY_JOBS = """
import sys
from xdp_agg.proto.jobs import JobSpec, WorkerSpec
from xdp_switch.backend import XdpBackend
b = XdpBackend(sys.argv[1])
for j in range(1, 64):
    b.create_job(JobSpec(job_id=j, num_workers=4, elems=256, slot_base=16 * j, slot_count=16,
                         agg_port=0xBEE0 + j % 16))
    for i in range(4):
        b.add_worker(WorkerSpec(j, i, f"198.19.{j}.{i + 1}", 48864, 0xBEE0 + j % 16))
"""


def _quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {
        "n": len(xs),
        "median_ms": 1e3 * statistics.median(xs),
        "p99_ms": 1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))],
    }


def _scraper(tb, url: str, interval: float, stop: Path, limit: int = 10**9):
    argv = [sys.executable, "-c", SCRAPER, url, str(interval), str(stop), str(limit)]
    return tb.popen(tb.aggregator, argv, stdout=subprocess.PIPE, text=True)


def _phase(tb, cl, url: str, mode: str, args, tmp: Path, k: int) -> dict:
    """One phase: `args.reps` all-reduces with the mode's scraping; rank 0's times."""
    stop = tmp / f"stop-{k}"
    scraper = None if MODES[mode] is None else _scraper(tb, url, MODES[mode], stop)
    plan = [{"dtype": "int32", "count": args.mib << 18, "reps": args.reps, "verify": False}]
    try:
        reports = cl.run_workers(plan, job=f"cost-{k}", deadline=600)
    finally:
        stop.touch()
    scraped = json.loads(scraper.communicate(timeout=120)[0]) if scraper else None
    # an all-reduce's time is its slowest rank's
    times = [max(ts) for ts in zip(*(r[0]["times"] for r in reports))]
    return {"mode": mode, "times": times, "scraped": scraped}


def _many_jobs(tb, cl, url: str, tmp: Path, n: int) -> dict:
    r = tb.run(tb.aggregator, [sys.executable, "-c", MANY_JOBS, cl.name], timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"creating 63 jobs failed: {r.stderr}")
    out = _scraper(tb, url, 0.0, tmp / "never", n).communicate(timeout=600)[0]
    return json.loads(out)


def run(args) -> dict:
    """The measurements (module docstring) as one dict."""
    with tempfile.TemporaryDirectory() as tmpdir, Testbed(workers=2) as tb:
        tmp = Path(tmpdir)
        metrics_at = f"{tb.aggregator.ips[0]}:{METRICS_PORT}"
        url = f"http://{metrics_at}/metrics"
        with Cluster(tb, serve_args=("--metrics", metrics_at)) as cl:
            phases = [
                _phase(tb, cl, url, mode, args, tmp, k)
                for k, mode in enumerate(m for _ in range(args.rounds) for m in MODES)
            ]
            many = _many_jobs(tb, cl, url, tmp, args.scrapes)
    nbytes = (args.mib << 18) * 4
    out = {"tensor_mib": args.mib, "reps": args.reps, "rounds": args.rounds, "throughput": {}}
    for mode in MODES:
        times = [t for p in phases if p["mode"] == mode for t in p["times"]]
        med = statistics.median(times)
        out["throughput"][mode] = {"median_s": med, "gbit_s": nbytes * 8 / med / 1e9}
    fast = [p["scraped"] for p in phases if p["mode"] == "back_to_back"]
    slow = [p["scraped"] for p in phases if p["mode"] == "every_1s"]
    out["scrapes_per_phase"] = {
        "back_to_back": [len(s["latency_s"]) for s in fast],
        "every_1s": [len(s["latency_s"]) for s in slow],
    }
    out["scrape_one_job"] = {
        "http": _quantiles([x for s in fast for x in s["latency_s"]]),
        "read": _quantiles([x for s in fast for x in s["read_s"]]),
        "bytes": fast[0]["bytes"],
    }
    out["scrape_64_jobs"] = {
        "http": _quantiles(many["latency_s"]),
        "read": _quantiles(many["read_s"]),
        "bytes": many["bytes"],
    }
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mib", type=int, default=16, help="tensor size, MiB")
    ap.add_argument("--reps", type=int, default=20, help="all-reduces per phase")
    ap.add_argument("--rounds", type=int, default=3, help="phases per mode, taking turns")
    ap.add_argument("--scrapes", type=int, default=200, help="scrapes with 64 jobs")
    print(json.dumps(run(ap.parse_args(argv)), indent=1))


if __name__ == "__main__":
    unwind_on_sigterm()  # a killed run still takes its testbed down
    main()
