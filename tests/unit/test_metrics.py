"""Prometheus metrics (xdp_agg.app.metrics) on loopback with the soft aggregator, without root.

A job of two ranks all-reduces through a soft aggregator behind its control endpoint; while the
job lives, a scrape must show each worker's contributions (one per packet it sent: the count
is exact), a bad-size packet that worker 0's address sent counted as a drop of the job and of
worker 0, an unregistered sender's packet as a drop of no job, the endpoint's job with its
ranks, and the refusals the test provoked by kind. Served over HTTP (`exporting`), the same;
`promtool check metrics` (Debian's prometheus package, where installed) passes on it. The
Prometheus server scraping `xdp-agg serve --metrics` in the testbed is
tests/root/test_metrics_prometheus.py.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from harness.cli import xdp_agg_cli
from harness.ranks import ok, run_ranks, soft_cluster
from prometheus_client.parser import text_string_to_metric_families

from hostlib.errors import RendezvousError
from hostlib.rendezvous import ControlClient
from xdp_agg.app import metrics
from xdp_agg.errors import XdpAggError
from xdp_agg.proto import limits, wire

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
ELEMS = 64
COUNT = 64 * 40  # 40 packets per rank per all-reduce
ALLREDUCES = 3


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of every sample in an exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(got: dict, metric: str, **labels) -> float:
    key = (metric, tuple(sorted(labels.items())))
    have = sorted(k for k in got if k[0] == metric)
    assert key in got, f"no sample {metric}{labels}; have {have}"
    return got[key]


def _bad_size_payload() -> bytes:
    """A contribution with the size code of 128 elements: the job's is 64's."""
    values = np.zeros((1, 128), dtype=np.int32)
    return bytes(
        wire.build_payloads(job_number=0, size_code=2, tsi=0, slot=0, version=0, values=values)[0]
    )


def _send_from(ip: str, dest: tuple[str, int], payload: bytes) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((ip, 0))
        s.sendto(payload, dest)


def _scrape_during_job(cl, scrape) -> list:
    """Two ranks all-reduce ALLREDUCES times; then, while the job still lives, rank 0 sends
    junk and takes `scrape()`; the ranks leave after. Returns [scrape's answer, None]."""
    gate = threading.Barrier(2, timeout=60)

    def rank(comm):
        for _ in range(ALLREDUCES):
            out = comm.allreduce(np.ones(COUNT, dtype=np.int32))
            assert int(out[0]) == 2
        gate.wait()  # both ranks done: nothing more of theirs is in flight
        got = None
        if comm.rank == 0:
            (job,) = cl.aggregator.jobs()
            dest = (cl.agg_ip, job["agg_port"])
            _send_from(cl.worker_ip(0), dest, _bad_size_payload())  # worker 0: bad size
            _send_from(f"{cl.prefix}.99", dest, _bad_size_payload())  # nobody's: unknown
            got = _counted_then(cl, job["job_id"], scrape)
        gate.wait()
        return got

    return ok(run_ranks(cl, 2, rank, job="metrics", elems=ELEMS))


def _counted_then(cl, job_id: int, scrape):
    """scrape() once the soft aggregator has counted both junk packets (counted events, not a
    sleep: it handles them in its own thread)."""
    for _ in range(10_000):
        c, none = cl.aggregator.counters(job_id), cl.aggregator.counters(limits.NO_JOB)
        if c.get("drop_bad_size") and none.get("drop_unknown_source"):
            return scrape()
        threading.Event().wait(0.01)
    raise AssertionError(f"junk not counted: {c}, {none}")


def _provoke_refusals(cl) -> None:
    """One refusal for a wrong secret (auth), one for a job that does not exist (request), one
    for a request line over the endpoint's limit (limit)."""
    for secret, fields in ((b"x" * 32, {}), (cl.secret, {"job": "nobody"})):
        c = ControlClient(cl.server.address, timeout=5, secret=secret)
        try:
            with pytest.raises(RendezvousError):
                c.request("status", **fields)
        finally:
            c.close()
    with socket.create_connection(cl.server.address, timeout=10) as s:
        s.sendall(b"x" * (cl.server.limits.max_line + 1) + b"\n")
        answer = json.loads(s.makefile("rb").readline())
    assert answer["kind"] == "limit", answer


def test_a_scrape_shows_contributions_drops_ranks_and_refusals():
    with soft_cluster() as cl:
        _provoke_refusals(cl)
        src = metrics.Sources(backend=cl.aggregator, target="soft", endpoint=cl.server)
        text, _ = _scrape_during_job(cl, lambda: metrics.exposition(src))
    got = samples(text)
    (jid,) = {dict(k[1])["job_id"] for k in got if k[0] == "xdpagg_contributions_total"}
    soft = dict(target="soft", job_id=jid)
    for w in ("0", "1"):
        want = ALLREDUCES * COUNT // ELEMS
        assert value(got, "xdpagg_contributions_total", **soft, worker=w) == want
    assert value(got, "xdpagg_drops_total", **soft, reason="drop_bad_size") == 1
    assert value(got, "xdpagg_worker_drops_total", **soft, worker="0") == 1
    assert value(got, "xdpagg_worker_drops_total", **soft, worker="1") == 0
    nobody = dict(target="soft", job_id=metrics.NO_JOB_LABEL, reason="drop_unknown_source")
    assert value(got, "xdpagg_drops_total", **nobody) == 1
    # results: one completed slot per packet of a rank (every contribution of two workers)
    assert value(got, "xdpagg_packets_total", **soft, reason="completed") == want
    assert value(got, "xdpagg_job_packet_payload_bytes", **soft) == 4 * ELEMS
    assert value(got, "xdpagg_job_workers", **soft) == 2
    assert value(got, "xdpagg_endpoint_job_info", job_id=jid, name="metrics") == 1
    assert value(got, "xdpagg_endpoint_registered_ranks", job_id=jid) == 2
    assert value(got, "xdpagg_endpoint_missing_ranks", job_id=jid) == 0
    assert value(got, "xdpagg_endpoint_jobs", state="ready") == 1
    assert value(got, "xdpagg_endpoint_refusals_total", kind="auth") == 1
    assert value(got, "xdpagg_endpoint_refusals_total", kind="request") == 1
    assert value(got, "xdpagg_endpoint_refusals_total", kind="limit") == 1
    assert value(got, "xdpagg_endpoint_refusals_total", kind="internal") == 0
    assert value(got, "xdpagg_endpoint_lease_expiries_total") == 0
    # every name is one metric_names() announces, with its type
    names = metrics.metric_names()
    for fam in text_string_to_metric_families(text):
        stored = fam.name + ("_total" if fam.type == "counter" else "")
        assert names.get(stored) == fam.type, fam.name


def test_series_go_with_their_job_and_other_targets_shapes_are_read():
    with soft_cluster() as cl:
        src = metrics.Sources(backend=cl.aggregator, target="soft", endpoint=cl.server)
        ok(run_ranks(cl, 1, lambda c: c.allreduce(np.ones(ELEMS, dtype=np.int32)), job="gone"))
        got = samples(metrics.exposition(src))
    assert not [k for k in got if k[0] == "xdpagg_contributions_total"]
    assert not [k for k in got if dict(k[1]).get("job_id", "none") != "none"]
    assert value(got, "xdpagg_endpoint_jobs", state="ready") == 0

    class JobsOnly:
        """A target with the Backend contract and none of the counter capabilities."""

        def jobs(self):
            return [{"job_id": 3, "num_workers": 2, "elems": 256, "workers": []}]

    got = samples(metrics.exposition(metrics.Sources(backend=JobsOnly(), target="bmv2")))
    assert value(got, "xdpagg_job_workers", target="bmv2", job_id="3") == 2
    assert not [k for k in got if k[0] in ("xdpagg_packets_total", "xdpagg_drops_total")]

    class Batched(JobsOnly):
        """bmv2's shape: counters per row, and counter_rows for several rows in one call."""

        def __init__(self):
            self.calls = []

        def counters(self, row):
            raise AssertionError("one call for all rows was expected")

        def counter_rows(self, rows):
            self.calls.append(list(rows))
            return {row: {"drop_bad_type": row} for row in rows}

    b = Batched()
    got = samples(metrics.exposition(metrics.Sources(backend=b, target="bmv2")))
    assert b.calls == [[limits.NO_JOB, 3]]
    assert value(got, "xdpagg_drops_total", target="bmv2", job_id="3", reason="drop_bad_type") == 3
    assert value(got, "xdpagg_packets_total", target="bmv2", job_id="3", reason="completed") == 0


class _OneJob:
    """A target with the Backend contract's jobs() and one job, nothing else."""

    def jobs(self):
        return [{"job_id": 3, "num_workers": 2, "elems": 256, "workers": []}]


class _Programs(_OneJob):
    """A ProgramStats target (xdp_agg.ctl.backend) whose kernel statistics are `stats`, or raise."""

    def __init__(self, stats):
        self.stats = stats

    def program_stats(self):
        if isinstance(self.stats, Exception):
            raise self.stats
        return self.stats


def _kernel_stats():
    from xdp_agg.ctl.backend import KernelProgram, KernelStats

    prog = KernelProgram(run_time_ns=2_000_000_000, run_cnt=4, memlock=8192, id=41, tag="ab" * 8)
    return KernelStats(bpf_stats_enabled=True, programs={"ingress": prog}, maps={"slots": 4096})


def test_program_info_and_build_info():
    got = samples(metrics.exposition(metrics.Sources(_Programs(_kernel_stats()), "xdp")))
    assert value(got, "xdpagg_program_info", program="ingress", id="41", tag="ab" * 8) == 1
    assert value(got, "xdpagg_xdp_program_run_seconds_total", program="ingress") == 2.0
    assert value(got, "xdpagg_xdp_map_memory_bytes", map="slots") == 4096
    (build,) = [k for k in got if k[0] == "xdpagg_build_info"]
    assert dict(build[1])["version"] and got[build] == 1
    for source in ("data_plane", "programs"):
        assert value(got, "xdpagg_scrape_success", source=source) == 1
        assert value(got, "xdpagg_scrape_duration_seconds", source=source) >= 0
    # a source the target does not have is not scraped, so it has no success to report
    assert not [k for k in got if dict(k[1]).get("source") in ("endpoint", "switchml")]


def test_a_failing_source_leaves_the_others_in_the_scrape(caplog):
    class Broken:
        """An endpoint whose overview fails."""

        def overview(self):
            raise RuntimeError("overview broke")

    backend = _Programs(OSError(9, "Bad file descriptor"))
    src = metrics.Sources(backend=backend, target="xdp", endpoint=Broken())
    got = samples(metrics.exposition(src))
    assert value(got, "xdpagg_scrape_success", source="data_plane") == 1
    assert value(got, "xdpagg_scrape_success", source="programs") == 0
    assert value(got, "xdpagg_scrape_success", source="endpoint") == 0
    assert value(got, "xdpagg_job_workers", target="xdp", job_id="3") == 2  # still there
    assert not [k for k in got if k[0].startswith(("xdpagg_xdp_", "xdpagg_endpoint_"))]
    assert "reading the programs failed" in caplog.text
    assert "reading the endpoint failed" in caplog.text
    # and the data plane failing leaves the programs
    backend = _Programs(_kernel_stats())
    backend.jobs = lambda: (_ for _ in ()).throw(OSError("map gone"))
    got = samples(metrics.exposition(metrics.Sources(backend=backend, target="xdp")))
    assert value(got, "xdpagg_scrape_success", source="data_plane") == 0
    assert value(got, "xdpagg_program_info", program="ingress", id="41", tag="ab" * 8) == 1


def test_served_over_http_while_the_job_runs_and_promtool_accepts_it(tmp_path):
    with soft_cluster() as cl:
        src = metrics.Sources(backend=cl.aggregator, target="soft", endpoint=cl.server)
        with metrics.exporting((cl.agg_ip, 0), src) as url:
            assert url.startswith(f"http://{cl.agg_ip}:")

            def fetch():
                with urllib.request.urlopen(url, timeout=10) as r:
                    return r.headers["Content-Type"], r.read().decode()

            (ctype, text), _ = _scrape_during_job(cl, fetch)
            port = int(url.rsplit(":", 1)[1].split("/")[0])
            with pytest.raises(XdpAggError, match="cannot serve metrics"):
                with metrics.exporting((cl.agg_ip, port), src):
                    pass
    assert ctype.startswith("text/plain")
    assert value(samples(text), "xdpagg_drops_total", target="soft", job_id="none",
                 reason="drop_unknown_source") == 1  # fmt: skip
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian's prometheus package) is not installed: `make deps`")
    (tmp_path / "metrics.prom").write_text(text)
    r = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_stats_prometheus_prints_once_only():
    r = xdp_agg_cli("stats", "--prometheus", "--json")
    assert r.exit_code == 2 and "--prometheus prints once" in r.output


# --- what the operator is given: alert rules and the dashboard --------------------------------
def _promql_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression uses (words starting with our prefix)."""
    return set(re.findall(r"\b(xdpagg_[a-z_]+)\b", expr))


def test_alert_rules_pass_promtool_and_use_metrics_that_exist():
    path = ROOT / "docs" / "prometheus" / "alerts.yml"
    text = path.read_text()
    # each rule: "- alert: NAME", then its "expr: |" block up to the rule's "for:"
    blocks = text.split("- alert: ")[1:]
    rules = [(b.split()[0], b.split("expr: |", 1)[1].split("for:", 1)[0]) for b in blocks]
    names = set(metrics.metric_names())
    for alert, expr in rules:
        used = _promql_metrics(expr)
        assert used and used <= names, f"{alert}: {used - names}"
    assert {"XdpAggDropsRising", "XdpAggWorkerSilent", "XdpAggEndpointRefusing"} <= {
        a for a, _ in rules
    }
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian's prometheus package) is not installed: `make deps`")
    r = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_dashboard_parses_and_its_queries_use_metrics_that_exist():
    board = json.loads((ROOT / "docs" / "grafana" / "xdp-agg.json").read_text())
    names = set(metrics.metric_names())
    panels = {p["title"]: [t["expr"] for t in p["targets"]] for p in board["panels"]}
    for title, exprs in panels.items():
        used = set().union(*(_promql_metrics(e) for e in exprs))
        assert used and used <= names, f"panel {title!r}: {used - names}"
    wanted = ("Gbit/s", "drops", "retransmissions", "jobs", "ranks")
    for word in wanted:
        assert any(word in t.lower() or word in t for t in panels), f"no panel on {word}"


def test_the_soft_endpoint_serves_metrics_too():
    """`python -m xdp_agg.app.soft_endpoint --metrics`: the soft target's counters and the
    endpoint's."""
    from harness.ranks import loopback_prefix

    ip = f"{loopback_prefix()}.1"
    argv = [sys.executable, "-m", "xdp_agg.app.soft_endpoint", "--soft", ip, "--insecure-no-auth"]
    proc = subprocess.Popen(
        [*argv, "--metrics", f"{ip}:9464"], stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        lines = []
        for line in proc.stderr:  # its log, until it says where the metrics are
            lines.append(line)
            if "Prometheus metrics at" in line:
                break
        url = lines[-1].split("Prometheus metrics at ")[-1].strip() if lines else ""
        assert url == f"http://{ip}:9464/metrics", "".join(lines)
        with urllib.request.urlopen(url, timeout=10) as r:
            got = samples(r.read().decode())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert value(got, "xdpagg_drops_total", target="soft", job_id="none",
                 reason="drop_unknown_source") == 0  # fmt: skip
    assert value(got, "xdpagg_endpoint_jobs", state="ready") == 0


def test_served_and_stopped_whatever_start_http_server_returns(monkeypatch):
    """prometheus_client's start_http_server returns (server, thread) only since 0.20; before,
    None (0.17, which pyproject allows). `exporting` must serve, and free its port on exit,
    with a prometheus_client whose start_http_server has the old shape."""
    import prometheus_client

    def old_shape(port, addr="0.0.0.0", registry=None):  # 0.17-0.19: serves, returns nothing
        return None

    monkeypatch.setattr(prometheus_client, "start_http_server", old_shape)
    monkeypatch.setattr(metrics, "start_http_server", old_shape, raising=False)
    with soft_cluster() as cl:
        src = metrics.Sources(backend=cl.aggregator, target="soft", endpoint=cl.server)
        with metrics.exporting((cl.agg_ip, 0), src) as url:
            with urllib.request.urlopen(url, timeout=10) as r:
                got = samples(r.read().decode())
            port = int(url.rsplit(":", 1)[1].split("/")[0])
        assert value(got, "xdpagg_endpoint_jobs", state="ready") == 0
        with socket.socket() as s:  # nothing listens there any more: the server was shut down
            # (SO_REUSEADDR: the scrape's closed connection may leave the port in TIME_WAIT)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((cl.agg_ip, port))
            s.listen()
