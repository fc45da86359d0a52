"""A real Prometheus scrapes `xdp-agg serve --metrics` in the testbed during all-reduces.

Two workers all-reduce through the XDP aggregator (bench.soak_worker: mixed sizes, every result
checked) until the test is done; serve exports its metrics on the aggregator's address, and
Debian's Prometheus (started here, in the aggregator's namespace, scraping every second, its data
in a temporary directory, ended by its PID) scrapes them with docs/prometheus/alerts.yml loaded.
Worker 0's address sends contributions of the wrong size. Through Prometheus's HTTP API, PromQL
must then give the job's contribution rate (above zero), the bad-size drops of the job and of
worker 0 (as many as the aggregator counted: `xdp-agg stats`), the XDP program's runs (the
kernel's BPF statistics, on for the test), every source of the scrape read
(xdpagg_scrape_success 1 for the data plane, the programs, forwarding and the endpoint), the
ingress program named by its kernel id and tag (xdpagg_program_info, as bpfsys reads them), and
the alert XdpAggDropsRising pending. `promtool check metrics` passes on what serve exposes and
on `xdp-agg stats --prometheus`. The test waits for events (samples present, counts equal), each
wait bounded by a generous number of polls.

Skipped, with the reason, where Debian's prometheus package (prometheus, promtool) is missing.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from harness.workers import finish_soak_workers, start_soak_workers

from bench.cpustat import BpfStats
from xdp_agg.cluster.cluster import Cluster

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
METRICS_PORT = 9464
PROM_PORT = 9090  # in the aggregator's namespace: no other test's Prometheus is there
POLLS = 600  # each wait: at most this many polls, 0.25 s apart (2.5 minutes)
BAD_FRAMES = 50

# a PromQL query through the HTTP API, run in the aggregator's namespace: its JSON answer
QUERY = """
import sys, urllib.parse, urllib.request
url = sys.argv[1] + "/api/v1/query?" + urllib.parse.urlencode({"query": sys.argv[2]})
print(urllib.request.urlopen(url, timeout=10).read().decode())
"""
FETCH = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10)\
.read().decode(), end='')"
# contributions of 128 elements from worker 0's address to the job's port: the job's are 64
BAD_SIZE = """
import socket, sys
import numpy as np
from xdp_agg.proto import wire
src, dst, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
p = wire.build_payloads(job_number=0, size_code=2, tsi=0, slot=0, version=0,
                        values=np.zeros((1, 128), dtype=np.int32))[0].tobytes()
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((src, 0))
for _ in range(n):
    s.sendto(p, (dst, port))
"""


def _tools() -> tuple[str, str]:
    prom, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if prom is None or promtool is None:
        pytest.skip(
            "Debian's prometheus package (prometheus, promtool) is not installed: `make deps` "
            "installs it (apt-get install --no-install-recommends prometheus)"
        )
    return prom, promtool


def _config(tmp_path: Path, target: str) -> Path:
    shutil.copy(ROOT / "docs" / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "rule_files:\n  - alerts.yml\n"
        "scrape_configs:\n  - job_name: xdpagg\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
    )
    return cfg


class Prom:
    """Queries to the Prometheus in the aggregator's namespace."""

    def __init__(self, tb, url: str, log) -> None:
        self.tb, self.url, self.log = tb, url, log  # log: prometheus's stderr, a file

    def query(self, expr: str) -> dict:
        """The API's answer to an instant query (JSON)."""
        r = self.tb.run(
            self.tb.aggregator, [sys.executable, "-c", QUERY, self.url, expr], timeout=60
        )
        assert r.returncode == 0, f"query {expr!r}: {r.stderr}"
        return json.loads(r.stdout)

    def wait(self, expr: str, done) -> dict:
        """The answer to `expr` once done(result list) holds; fails after POLLS polls."""
        for _ in range(POLLS):
            answer = self.query(expr)
            if answer["status"] == "success" and done(answer["data"]["result"]):
                return answer
            time.sleep(0.25)
        raise AssertionError(f"{expr!r} never satisfied the test: last answer {answer}")

    def ready(self, proc) -> None:
        for _ in range(POLLS):
            if proc.poll() is not None:
                self.log.seek(0)
                raise AssertionError(f"prometheus exited: {self.log.read().decode()[-2000:]}")
            r = self.tb.run(
                self.tb.aggregator, [sys.executable, "-c", FETCH, self.url + "/-/ready"]
            )
            if r.returncode == 0:
                return
            time.sleep(0.25)
        raise AssertionError("prometheus never became ready")


def _values(result: list) -> list[float]:
    return [float(s["value"][1]) for s in result]


def test_prometheus_scrapes_serve_during_allreduces(testbed_factory, tmp_path):
    prom_bin, promtool = _tools()
    tb = testbed_factory(workers=2, topology="one-arm")
    agg, w0 = tb.aggregator, tb.workers[0]
    metrics_at = f"{agg.ips[0]}:{METRICS_PORT}"
    stop = tmp_path / "stop"
    with (
        BpfStats() as bpf_stats,
        Cluster(tb, serve_args=("--metrics", metrics_at)) as cl,
        tempfile.TemporaryFile() as prom_log,
    ):
        assert f"Prometheus metrics at http://{metrics_at}/metrics" in cl.serve_line
        prom = tb.popen(
            agg,
            [
                prom_bin,
                f"--config.file={_config(tmp_path, metrics_at)}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address={agg.ips[0]}:{PROM_PORT}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=prom_log,  # a file: its log would fill a pipe nobody reads
            text=True,
        )
        ranks = start_soak_workers(
            tb, cl, world=2, job="scraped", stop=stop, args=("--elems", "64", "--max-bytes",
                                                             str(1 << 20)))  # fmt: skip
        try:
            api = Prom(tb, f"http://{agg.ips[0]}:{PROM_PORT}", prom_log)
            api.ready(prom)
            found = _query_while_running(tb, cl, api, w0, promtool, bpf_stats.enabled)
        finally:
            stop.touch()
            prom.terminate()
            prom.wait(timeout=60)
        reports = finish_soak_workers(ranks, deadline=300)
    for rank, reps in enumerate(reports):
        assert reps[-1].get("done") and reps[-1]["wrong"] == 0, f"rank {rank}: {reps[-1]}"
    print(json.dumps(found, indent=1))  # the PromQL answers, for the record (pytest -s)


def _query_while_running(tb, cl, api: Prom, w0, promtool: str, bpf_stats: bool) -> dict:
    """The PromQL checks, while the workers all-reduce; the answers by query."""
    found = {}
    rate = "sum by (job_id) (rate(xdpagg_contributions_total[5s]))"
    found[rate] = api.wait(rate, lambda res: res and min(_values(res)) > 0)
    job = next(j for j in json.loads(cl.cli("job", "list", "--json").stdout))
    jid = str(job["job_id"])
    assert [s["metric"]["job_id"] for s in found[rate]["data"]["result"]] == [jid]
    r = tb.run(w0, [sys.executable, "-c", BAD_SIZE, w0.ip, job["agg_ip"],
                    str(job["agg_port"]), str(BAD_FRAMES)], timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    counted = _counted_bad_size(cl, jid)
    assert 0 < counted <= BAD_FRAMES  # what the path did not drop of them
    drops = f'xdpagg_drops_total{{job_id="{jid}",reason="drop_bad_size"}}'
    found[drops] = api.wait(drops, lambda res: _values(res) == [counted])
    w0_index = str(next(w["index"] for w in job["workers"] if w["ip"] == w0.ip))
    worker = f'xdpagg_worker_drops_total{{job_id="{jid}",worker="{w0_index}"}}'
    found[worker] = api.wait(worker, lambda res: _values(res) == [counted])
    alert = 'ALERTS{alertname="XdpAggDropsRising"}'
    found[alert] = api.wait(alert, lambda res: [s["metric"]["job_id"] for s in res] == [jid])
    if bpf_stats:  # the kernel counts the program's runs only with the sysctl on
        runs = 'rate(xdpagg_xdp_program_runs_total{program="ingress"}[5s])'
        found[runs] = api.wait(runs, lambda res: res and _values(res)[0] > 0)
    found.update(_sources_and_programs(api))
    # what a scrape cost: our reading of the maps and the endpoint, and the whole scrape as
    # Prometheus timed it (HTTP and parsing too), for the record
    for cost in ("xdpagg_scrape_duration_seconds", "scrape_duration_seconds"):
        found[cost] = api.query(f"max_over_time({cost}[1m])")
    _promtool_checks(tb, cl, promtool)
    return found


def _sources_and_programs(api: Prom) -> dict:
    """Every source of serve's scrape read (scrape_success 1 each), and the ingress program
    named by its id and tag (16 hex digits)."""
    ok = "xdpagg_scrape_success"
    sources = {"data_plane", "programs", "forwarding", "endpoint"}
    got = {
        ok: api.wait(
            ok,
            lambda res: {s["metric"]["source"] for s in res} == sources and min(_values(res)) == 1,
        )
    }
    info = 'xdpagg_program_info{program="ingress"}'
    got[info] = api.wait(
        info,
        lambda res: (
            len(res) == 1
            and int(res[0]["metric"]["id"]) > 0
            and re.fullmatch("[0-9a-f]{16}", res[0]["metric"]["tag"]) is not None
        ),
    )
    return got


def _counted_bad_size(cl, jid: str) -> int:
    """The aggregator's bad-size drops of the job once they stop rising (all frames arrived)."""
    last = -1
    for _ in range(POLLS):
        n = cl.stats()["jobs"][jid]["reasons"]["drop_bad_size"]
        if n == last and n > 0:
            return n
        last = n
        time.sleep(0.25)
    raise AssertionError(f"bad-size drops never settled: {last}")


def _promtool_checks(tb, cl, promtool: str) -> None:
    """promtool check metrics on serve's exposition and on `xdp-agg stats --prometheus`."""
    url = f"http://{tb.aggregator.ips[0]}:{METRICS_PORT}/metrics"
    served = tb.run(tb.aggregator, [sys.executable, "-c", FETCH, url], timeout=60)
    assert served.returncode == 0, served.stderr
    once = cl.cli("stats", "--prometheus").stdout
    assert "xdpagg_xdp_map_memory_bytes" in once and "xdpagg_endpoint" not in once
    assert 'xdpagg_scrape_success{source="programs"} 1.0' in once
    for text in (served.stdout, once):
        assert "xdpagg_contributions_total" in text
        r = subprocess.run(
            [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, r.stdout + r.stderr
