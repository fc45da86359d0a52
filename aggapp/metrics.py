"""What an operator's Prometheus scrapes: the aggregator's counters, its XDP program's run time
and memory, and the control endpoint's jobs, ranks and refusals, as Prometheus metrics.

`xdp-agg serve --metrics HOST:PORT` serves them at http://HOST:PORT/metrics (`exporting`);
`xdp-agg stats --prometheus` prints them once (`exposition`), for node_exporter's textfile
collector. Nothing polls in the background: the collector reads the maps (or asks bmv2, or the
soft aggregator) when Prometheus scrapes, through the same interfaces `xdp-agg stats` and the
endpoint's `status` use (aggctl.backend's capabilities, XdpBackend.program_stats,
ControlEndpoint.overview). docs/operations.md ("Metrics") lists every metric, with what a
scrape costs.

Labels and their bounds: `target` (xdp, bmv2, soft), `job_id` (the aggregator's job id, 0..63,
or "none" for packets of no job), `worker` (a worker's index in its job, 0..63), `reason` (the
reasons of aggproto.reasons), `program` and `map` (the XDP program's), `state` (a job's state
at the endpoint), `kind` (aggctl.server.REFUSAL_KINDS) and, for the SwitchML controller API,
`reason` (aggctl.switchml_sessions' REFUSALS and ENDINGS). A job's name is a label of one
series only (xdpagg_endpoint_job_info), present while the job lives. The job label is `job_id`,
not `job`: Prometheus gives every scraped series a `job` label of its own (the scrape job), and
a `job` of ours would be renamed `exported_job`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Iterator
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import generate_latest, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from aggctl.backend import JobCounters, WorkerCounters
from aggproto import limits
from aggproto.reasons import Reason
from xdp_switch.errors import XdpAggError

log = logging.getLogger(__name__)

PREFIX = "xdpagg_"
NO_JOB_LABEL = "none"  # the job_id label of packets that belong to no job
DROP_PREFIX = "drop_"  # reasons that drop a packet as bad (aggproto.reasons): xdpagg_drops_total

# Per-worker counters (aggcodegen.abi.WORKER_STATS's fields, the soft aggregator's alike):
# field -> (metric name, help).
WORKER_METRICS = {
    "packets": ("worker_packets", "Packets of ours from the worker (every verdict)."),
    "contributions": ("contributions", "New contributions of the worker, added to a slot."),
    "duplicates": (
        "duplicates",
        "Retransmissions and duplicates from the worker (its slot already had its value).",
    ),
    "answered": (
        "retransmissions_answered",
        "Retransmissions of the worker answered with the stored result of a completed slot.",
    ),
    "dropped": ("worker_drops", "Packets of the worker dropped as malformed (any drop reason)."),
}


@dataclasses.dataclass
class Sources:
    """What a scrape reads.

    backend: the aggregator target (aggctl.backend.Backend), with the capabilities it has
    (JobCounters, WorkerCounters); target: its name, the `target` label ("xdp", "bmv2", "soft");
    xdp: an XDP target's XdpBackend (the program's statistics, program_stats, and every job's
    per-worker counters in one read, all_worker_counters), None for the others; endpoint: the
    control endpoint in front of it (aggctl.server.ControlEndpoint), None without one; switchml:
    the SwitchML controller API served beside it (aggctl.switchml_grpc.SwitchmlServer), None
    without `serve --switchml-grpc`."""

    backend: object
    target: str
    xdp: object | None = None
    endpoint: object | None = None
    switchml: object | None = None


def _counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, labels=labels)


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, labels=labels or [])


class AggregatorCollector(Collector):
    """A prometheus_client collector that reads `sources` at every scrape (module docstring)."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        """Every metric family, read now; then how long reading them took."""
        t0 = time.perf_counter()
        families = [*self._data_plane(), *self._programs(), *self._endpoint(), *self._switchml()]
        took = _scrape_family()
        took.add_metric([], time.perf_counter() - t0)
        yield from families
        yield took

    # --- the data plane: per job by reason, per worker ------------------------------------------
    def _data_plane(self) -> list[Metric]:
        src = self.sources
        jobs = src.backend.jobs()
        fams = _job_families()
        rows = [(NO_JOB_LABEL, limits.NO_JOB)] + [(str(j["job_id"]), j["job_id"]) for j in jobs]
        counted = _reason_rows(src.backend, [row for _, row in rows])
        for label, row in rows:
            for reason, n in counted.get(row, {}).items():
                fam = fams["drops"] if reason.startswith(DROP_PREFIX) else fams["verdicts"]
                fam.add_metric([src.target, label, reason], n)
        # per-worker counters: of every job in one read where the target can (XDP)
        every = src.xdp.all_worker_counters() if src.xdp is not None else None
        for j in jobs:
            jid = str(j["job_id"])
            fams["workers"].add_metric([src.target, jid], j["num_workers"])
            fams["payload"].add_metric([src.target, jid], 4 * j["elems"])
            if every is not None:
                per_worker = every.get(j["job_id"], {})
            else:
                per_worker = _worker_counters(src.backend, j["job_id"])
            for index, c in per_worker.items():
                for field, value in c.items():
                    if field in WORKER_METRICS:
                        fams[field].add_metric([src.target, jid, str(index)], value)
        return list(fams.values())

    # --- the XDP program ----------------------------------------------------------------------
    def _programs(self) -> list[Metric]:
        if self.sources.xdp is None:
            return []
        st = self.sources.xdp.program_stats()
        fams = _program_families()
        fams["enabled"].add_metric([], int(st["bpf_stats_enabled"]))
        for name, p in st["programs"].items():
            fams["run"].add_metric([name], p["run_time_ns"] / 1e9)
            fams["runs"].add_metric([name], p["run_cnt"])
            fams["program_memory"].add_metric([name], p["memlock"])
        for name, nbytes in st["maps"].items():
            fams["map_memory"].add_metric([name], nbytes)
        return list(fams.values())

    # --- the control endpoint -------------------------------------------------------------------
    def _endpoint(self) -> list[Metric]:
        if self.sources.endpoint is None:
            return []
        ov = self.sources.endpoint.overview()
        fams = _endpoint_families()
        states = {"registering": 0, "ready": 0, "closing": 0}
        for j in ov["jobs"]:
            states[j["state"]] = states.get(j["state"], 0) + 1
            jid = str(j["job_id"])
            fams["info"].add_metric([jid, j["key"]], 1)
            for key in ("world_size", "registered", "missing", "gone"):
                fams[key].add_metric([jid], j[key])
        for state, n in states.items():
            fams["jobs"].add_metric([state], n)
        for kind, n in ov["refusals"].items():
            fams["refusals"].add_metric([kind], n)
        fams["connections"].add_metric([], ov["connections"])
        fams["lease_expiries"].add_metric([], ov["lease_expiries"])
        return list(fams.values())

    # --- the SwitchML controller API ----------------------------------------------------------
    def _switchml(self) -> list[Metric]:
        if self.sources.switchml is None:
            return []
        st = self.sources.switchml.stats()
        fams = _switchml_families()
        for key, fam in fams.items():
            if key not in ("ended", "refusals"):
                fam.add_metric([], st[key])
        for key in ("ended", "refusals"):
            for reason, n in st[key].items():
                fams[key].add_metric([reason], n)
        return list(fams.values())


def _switchml_families() -> dict[str, Metric]:
    """The SwitchML controller API's families (aggctl.switchml_grpc), empty."""
    why = ["reason"]
    return {
        "opened": _counter("switchml_sessions_opened", "SwitchML sessions opened.", []),
        "complete": _counter(
            "switchml_sessions_complete",
            "SwitchML sessions set up: every rank registered and passed the last barrier.",
            [],
        ),
        "ended": _counter(
            "switchml_sessions_ended",
            "SwitchML sessions ended, by reason: replaced (by its hosts' next), idle (by another "
            "host's after no traffic), failed (setup), expired (setup not done in time).",
            why,
        ),
        "refusals": _counter(
            "switchml_refusals", "Calls of the SwitchML controller API refused, by reason.", why
        ),
        "broadcasts_expired": _counter(
            "switchml_broadcasts_expired",
            "Root Broadcast values that no session took within the barrier timeout.",
            [],
        ),
        "open_broadcasts": _gauge(
            "switchml_open_broadcasts", "Root Broadcast values waiting for their session."
        ),
        "waiting": _gauge("switchml_waiting_calls", "Barrier and Broadcast calls waiting now."),
        "calls": _gauge("switchml_calls", "Calls of the SwitchML controller API in progress."),
        "threads": _gauge(
            "switchml_threads", "Threads of the SwitchML controller API's server (one per call)."
        ),
    }


def _job_families() -> dict[str, Metric]:
    """The data plane's families, empty."""
    job = ["target", "job_id"]
    fams = {  # keyed apart from WORKER_METRICS' fields, which join them below
        "verdicts": _counter(
            "packets",
            "Packets the aggregator handled, by job and verdict reason (the drop_ reasons are "
            "in xdpagg_drops_total); reason completed: results.",
            [*job, "reason"],
        ),
        "drops": _counter("drops", "Packets dropped as bad, by job and reason.", [*job, "reason"]),
        "workers": _gauge("job_workers", "The job's workers (its world size).", job),
        "payload": _gauge(
            "job_packet_payload_bytes",
            "Bytes of values in one packet of the job (elements x 4): contributions times this "
            "are the bytes aggregated.",
            job,
        ),
    }
    for field, (name, doc) in WORKER_METRICS.items():
        fams[field] = _counter(name, doc, [*job, "worker"])
    return fams


def _program_families() -> dict[str, Metric]:
    """The XDP program's families, empty."""
    prog = ["program"]
    return {
        "enabled": _gauge(
            "bpf_stats_enabled",
            "1 while the kernel counts BPF programs' run time and runs (sysctl "
            "kernel.bpf_stats_enabled); the run metrics stand still otherwise.",
        ),
        "run": _counter("xdp_program_run_seconds", "Time the XDP program ran (kernel).", prog),
        "runs": _counter("xdp_program_runs", "Times the XDP program ran (kernel).", prog),
        "program_memory": _gauge("xdp_program_memory_bytes", "Kernel memory of the program.", prog),
        "map_memory": _gauge(
            "xdp_map_memory_bytes", "Kernel memory of the program's map.", ["map"]
        ),
    }


def _scrape_family() -> Metric:
    return _gauge(
        "scrape_duration_seconds",
        "Seconds this scrape took to read the aggregator and the endpoint.",
    )


def metric_names() -> dict[str, str]:
    """Every metric this module can expose, as Prometheus stores it (a counter's name with its
    _total), and its type: what a dashboard or an alert rule may refer to."""
    fams = [
        *_job_families().values(),
        *_program_families().values(),
        *_endpoint_families().values(),
        *_switchml_families().values(),
        _scrape_family(),
    ]
    return {f.name + ("_total" if f.type == "counter" else ""): f.type for f in fams}


def _endpoint_families() -> dict[str, Metric]:
    """The control endpoint's families, empty."""
    job = ["job_id"]
    return {
        "jobs": _gauge("endpoint_jobs", "Jobs at the control endpoint, by state.", ["state"]),
        "info": _gauge("endpoint_job_info", "A live job's name (value 1).", [*job, "name"]),
        "world_size": _gauge("endpoint_world_size", "Ranks the job was created for.", job),
        "registered": _gauge("endpoint_registered_ranks", "Ranks registered and present.", job),
        "missing": _gauge("endpoint_missing_ranks", "Ranks not registered yet.", job),
        "gone": _gauge("endpoint_gone_ranks", "Ranks that left or whose connection closed.", job),
        "refusals": _counter(
            "endpoint_refusals", "Requests and connections refused, by kind.", ["kind"]
        ),
        "connections": _gauge("endpoint_connections", "Open control connections."),
        "lease_expiries": _counter(
            "endpoint_lease_expiries", "Jobs deleted because their lease lapsed.", []
        ),
    }


def _reason_rows(backend, rows: list[int]) -> dict[int, dict[str, int]]:
    """{row: {reason: packets}} for the rows (job ids, limits.NO_JOB), every reason present (0
    where the target counted none: the soft aggregator lists only the reasons it saw); {} for a
    target without the counters. One call for all rows where the target has one (bmv2's
    counter_rows: one simple_switch_CLI run instead of one per row)."""
    if not isinstance(backend, JobCounters):
        return {}
    batch = getattr(backend, "counter_rows", None)
    got = batch(rows) if batch is not None else {row: backend.counters(row) for row in rows}
    names = [r.name.lower() for r in Reason]
    return {row: {r: int(got[row].get(r, 0)) for r in names} for row in rows}


def _worker_counters(backend, job_id: int) -> dict[int, dict]:
    if not isinstance(backend, WorkerCounters):
        return {}
    return backend.worker_counters(job_id)


def registry(sources: Sources) -> CollectorRegistry:
    """A registry holding only our collector (no process or platform metrics of the client:
    node_exporter has the machine's)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(AggregatorCollector(sources))
    return reg


def exposition(sources: Sources) -> str:
    """The metrics of `sources` once, in Prometheus's text format."""
    return generate_latest(registry(sources)).decode()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # no line per scrape on stderr
        pass


def _http_server(host: str, port: int, reg: CollectorRegistry) -> WSGIServer:
    """A threading WSGI server of the metrics of `reg` bound to host:port, not yet serving.

    Ours, not prometheus_client's start_http_server: that one returns (server, thread) only
    since 0.20 and None before (0.17, which pyproject allows), so a serve could neither stop it
    nor learn its port; make_wsgi_app, which it wraps, is the same in every version."""
    try:
        six = ipaddress.ip_address(host).version == 6
    except ValueError:  # a host name: IPv4, as start_http_server binds one by default
        six = False

    class Server(ThreadingMixIn, WSGIServer):
        address_family = socket.AF_INET6 if six else socket.AF_INET
        daemon_threads = True  # a scrape in progress does not hold the exit

    return make_server(host, port, make_wsgi_app(reg), Server, handler_class=_QuietHandler)


@contextlib.contextmanager
def exporting(address: tuple[str, int] | None, sources: Sources) -> Iterator[str | None]:
    """Serve the metrics of `sources` at http://HOST:PORT/metrics (any path answers) while in
    the block; yields the URL (None and nothing served when `address` is None). XdpAggError
    when the address cannot be bound."""
    if address is None:
        yield None
        return
    host, port = address
    try:
        httpd = _http_server(host, port, registry(sources))
    except OSError as e:
        raise XdpAggError(
            f"cannot serve metrics on {host}:{port}: {e.strerror or e}; stop what listens there "
            "(`ss -ltnp`) or choose another --metrics"
        ) from e
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{httpd.server_port}/metrics"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
