"""What an operator's Prometheus scrapes: the aggregator's counters, its XDP program's run time
and memory, and the control endpoint's jobs, ranks and refusals, as Prometheus metrics.

`xdp-agg serve --metrics HOST:PORT` serves them at http://HOST:PORT/metrics (`exporting`);
`xdp-agg stats --prometheus` prints them once (`exposition`), for node_exporter's textfile
collector. Nothing polls in the background: the collector reads the maps (or asks bmv2, or the
soft aggregator) when Prometheus scrapes, through the same interfaces `xdp-agg stats` and the
endpoint's `status` use (xdp_agg.ctl.backend's capabilities, ControlEndpoint.overview). Each
source (the data plane, the kernel programs, the endpoint, the SwitchML API) is read apart, as
node_exporter's collectors are: one that fails leaves the others' metrics in the scrape, and
xdpagg_scrape_success{source} says which failed. docs/operations.md ("Metrics") lists every
metric, with what a scrape costs.

Labels and their bounds: `target` (xdp, bmv2, soft), `job_id` (the aggregator's job id, 0..63,
or "none" for packets of no job), `worker` (a worker's index in its job, 0..63), `reason` (the
reasons of xdp_agg.proto.reasons), `program`, `id`, `tag` and `map` (the XDP program's), `state` (a
job's state at the endpoint), `kind` (xdp_agg.ctl.server.REFUSAL_KINDS), `source` (SOURCES) and, for
the SwitchML controller API, `reason` (xdp_agg.ctl.switchml_sessions' REFUSALS and ENDINGS). A job's
name is a label of one series only (xdpagg_endpoint_job_info), present while the job lives. The
job label is `job_id`, not `job`: Prometheus gives every scraped series a `job` label of its own
(the scrape job), and a `job` of ours would be renamed `exported_job`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import platform
import socket
import threading
import time
from collections.abc import Callable, Iterator
from socketserver import ThreadingMixIn
from typing import Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import generate_latest, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from xdp_agg.ctl.backend import (
    AllWorkerCounters,
    Backend,
    CounterRows,
    ForwardingStats,
    JobCounters,
    ProgramStats,
    WorkerCounters,
)
from xdp_agg.ctl.server import ControlEndpoint
from xdp_agg.errors import XdpAggError
from xdp_agg.proto import limits
from xdp_agg.proto.reasons import Reason, is_drop

from . import build

log = logging.getLogger(__name__)

PREFIX = "xdpagg_"
NO_JOB_LABEL = "none"  # the job_id label of packets that belong to no job
# What a scrape reads, each apart (the `source` label of xdpagg_scrape_success and _duration)
SOURCES = ("data_plane", "programs", "forwarding", "endpoint", "switchml")
# the forwarding counters that are events of the MAC table, not frames (xdp_switch.forwarding)
MAC_EVENTS = ("learned", "moved", "aged")

# Per-worker counters (xdp_agg.codegen.abi.WORKER_STATS's fields, the soft aggregator's alike):
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

# Per-job gauges of the control endpoint (xdp_agg.ctl.server.JobOverview's fields):
# field -> (metric name, help).
ENDPOINT_JOB_METRICS = {
    "world_size": ("endpoint_world_size", "Ranks the job was created for."),
    "registered": ("endpoint_registered_ranks", "Ranks registered and present."),
    "missing": ("endpoint_missing_ranks", "Ranks not registered yet."),
    "gone": ("endpoint_gone_ranks", "Ranks that left or whose connection closed."),
    # loss recovery as the ranks' pings report it (hostlib, docs/protocol.md 4.4)
    "retransmissions": (
        "endpoint_host_retransmissions",
        "Packets the job's ranks sent again, summed over their last reports.",
    ),
    "early_losses": (
        "endpoint_host_early_losses",
        "Resends of packets that later results showed lost (found early), summed over ranks.",
    ),
    "timeouts": (
        "endpoint_host_timeouts",
        "Packets whose retransmission timer expired, summed over the ranks' last reports.",
    ),
    "spurious": (
        "endpoint_host_spurious",
        "Resends that proved needless (the first copy's result came), summed over ranks.",
    ),
}


class SwitchmlStats(Protocol):
    """What the metrics read of the SwitchML controller API (xdp_agg.ctl.switchml_grpc's
    SwitchmlServer; not imported here: it needs grpc, an optional dependency)."""

    def stats(self) -> dict:
        """Its counters and gauges by the keys of _switchml_families; `ended` and `refusals`
        {reason: count}."""


@dataclasses.dataclass
class Sources:
    """What a scrape reads.

    backend: the aggregator target (xdp_agg.ctl.backend.Backend) the endpoint serves, with the
    capabilities it has (JobCounters, CounterRows, WorkerCounters, AllWorkerCounters,
    ProgramStats); target: its name, the `target` label ("xdp", "bmv2", "soft"); endpoint: the
    control endpoint in front of it, None without one; switchml: the SwitchML controller API
    served beside it (xdp_agg.ctl.switchml_grpc.SwitchmlServer: its stats()), None without
    `serve --switchml-grpc`."""

    backend: Backend
    target: str
    endpoint: ControlEndpoint | None = None
    switchml: SwitchmlStats | None = None


def _counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, labels=labels)


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, labels=labels or [])


class AggregatorCollector(Collector):
    """A prometheus_client collector that reads `sources` at every scrape (module docstring)."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        """Every source's metric families, read now, each source apart: one that raises is
        logged and left out, the others stay; then each source's success and duration, and
        the build."""
        fams = _scrape_families()
        for name, read in self._readers():
            t0 = time.perf_counter()
            try:
                got, ok = read(), 1
            except Exception:  # any failure of a source: the scrape goes on without it
                log.exception("metrics: reading the %s failed", name.replace("_", " "))
                got, ok = [], 0
            fams["duration"].add_metric([name], time.perf_counter() - t0)
            fams["success"].add_metric([name], ok)
            yield from got
        fams["build"].add_metric([build.version() or "unknown", platform.python_version()], 1)
        yield from fams.values()

    def _readers(self) -> list[tuple[str, Callable[[], list[Metric]]]]:
        """(source, its reader) of each source `sources` has (SOURCES)."""
        src = self.sources
        readers = {
            "data_plane": self._data_plane,
            "programs": self._programs if isinstance(src.backend, ProgramStats) else None,
            "forwarding": (self._forwarding if isinstance(src.backend, ForwardingStats) else None),
            "endpoint": self._endpoint if src.endpoint is not None else None,
            "switchml": self._switchml if src.switchml is not None else None,
        }
        return [(name, read) for name, read in readers.items() if read is not None]

    # --- the data plane: per job by reason, per worker ------------------------------------------
    def _data_plane(self) -> list[Metric]:
        src = self.sources
        jobs = src.backend.jobs()
        fams = _job_families()
        rows = [(NO_JOB_LABEL, limits.NO_JOB)] + [(str(j["job_id"]), j["job_id"]) for j in jobs]
        counted = _reason_rows(src.backend, [row for _, row in rows])
        for label, row in rows:
            for reason, n in counted.get(row, {}).items():
                fam = fams["drops"] if is_drop(reason) else fams["verdicts"]
                fam.add_metric([src.target, label, reason], n)
        every = _every_worker_counters(src.backend, [j["job_id"] for j in jobs])
        for j in jobs:
            jid = str(j["job_id"])
            fams["workers"].add_metric([src.target, jid], j["num_workers"])
            fams["payload"].add_metric([src.target, jid], 4 * j["elems"])
            for index, c in every.get(j["job_id"], {}).items():
                for field, value in c.items():
                    if field in WORKER_METRICS:
                        fams[field].add_metric([src.target, jid, str(index)], value)
        return list(fams.values())

    # --- the XDP program ----------------------------------------------------------------------
    def _programs(self) -> list[Metric]:
        st = self.sources.backend.program_stats()  # a ProgramStats: _readers asked
        if st is None:
            return []
        fams = _program_families()
        fams["enabled"].add_metric([], int(st.bpf_stats_enabled))
        for name, p in st.programs.items():
            fams["run"].add_metric([name], p.run_time_ns / 1e9)
            fams["runs"].add_metric([name], p.run_cnt)
            fams["program_memory"].add_metric([name], p.memlock)
            fams["info"].add_metric([name, str(p.id), p.tag], 1)
        for name, nbytes in st.maps.items():
            fams["map_memory"].add_metric([name], nbytes)
        return list(fams.values())

    # --- forwarding in the switch topology -------------------------------------------------------
    def _forwarding(self) -> list[Metric]:
        # a ForwardingStats: _readers asked it of the backend (the XDP target's, not Backend's)
        st = self.sources.backend.forwarding_stats()  # type: ignore[attr-defined]
        if st is None:
            return []
        fams = _forwarding_families()
        for mode in ("routed", "switched", "off"):
            fams["mode"].add_metric([mode], int(st["mode"] == mode))
        for name, n in st["counters"].items():
            if name == "igmp":
                fams["igmp"].add_metric([], n)
                continue
            fam = fams["mac_events"] if name in MAC_EVENTS else fams["frames"]
            fam.add_metric([name], n)
        fams["entries"].add_metric([], st["mac_table"]["entries"])
        fams["size"].add_metric([], st["mac_table"]["size"])
        snoop = st.get("igmp_snooping", {})
        fams["querier"].add_metric([], int(bool(snoop.get("querier"))))
        fams["groups"].add_metric([], len(snoop.get("groups", {})))
        return list(fams.values())

    # --- the control endpoint -------------------------------------------------------------------
    def _endpoint(self) -> list[Metric]:
        ov = self.sources.endpoint.overview()  # not None: _readers asked
        fams = _endpoint_families()
        states = {"registering": 0, "ready": 0, "closing": 0}
        for j in ov.jobs:
            states[j.state] = states.get(j.state, 0) + 1
            jid = str(j.job_id)
            fams["info"].add_metric([jid, j.key], 1)
            for field in ENDPOINT_JOB_METRICS:
                fams[field].add_metric([jid], getattr(j, field))
        for state, n in states.items():
            fams["jobs"].add_metric([state], n)
        for kind, n in ov.refusals.items():
            fams["refusals"].add_metric([kind], n)
        fams["connections"].add_metric([], ov.connections)
        fams["lease_expiries"].add_metric([], ov.lease_expiries)
        return list(fams.values())

    # --- the SwitchML controller API ----------------------------------------------------------
    def _switchml(self) -> list[Metric]:
        st = self.sources.switchml.stats()  # not None: _readers asked
        fams = _switchml_families()
        for key, fam in fams.items():
            if key not in ("ended", "refusals"):
                fam.add_metric([], st[key])
        for key in ("ended", "refusals"):
            for reason, n in st[key].items():
                fams[key].add_metric([reason], n)
        return list(fams.values())


def _switchml_families() -> dict[str, Metric]:
    """The SwitchML controller API's families (xdp_agg.ctl.switchml_grpc), empty."""
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
        "info": _gauge(
            "program_info",
            "An attached XDP program (value 1): its kernel id and tag (bpftool prog show).",
            [*prog, "id", "tag"],
        ),
    }


def _forwarding_families() -> dict[str, CounterMetricFamily | GaugeMetricFamily]:
    """The switch topology's forwarding families, empty."""
    return {
        "mode": _gauge(
            "forwarding_mode", "1 for the mode the switch topology forwards in.", ["mode"]
        ),
        "frames": _counter(
            "forwarding_frames",
            "Frames that are not aggregation traffic, by outcome: routed, switched, flooded, "
            "passed (to the kernel), ttl_expired (passed), own_source, loop, same_port, "
            "bad_source (dropped), pruned (a flooded multicast copy IGMP snooping kept from "
            "a port without members).",
            ["outcome"],
        ),
        "mac_events": _counter(
            "forwarding_mac_events", "MAC table events: learned, moved, aged.", ["event"]
        ),
        "entries": _gauge("forwarding_mac_entries", "MACs the switched mode holds now."),
        "size": _gauge("forwarding_mac_table_size", "MACs the switched mode can hold."),
        "igmp": _counter("forwarding_igmp_snooped", "IGMP messages the switched mode snooped.", []),
        "querier": _gauge(
            "forwarding_igmp_querier", "1 while a querier is present (snooping prunes only then)."
        ),
        "groups": _gauge("forwarding_igmp_groups", "Multicast groups with a member port now."),
    }


def _scrape_families() -> dict[str, Metric]:
    """The scrape's own families, empty: each source's success and duration, the build."""
    source = ["source"]
    return {
        "success": _gauge(
            "scrape_success", "1 when this scrape read the source, 0 when it failed.", source
        ),
        "duration": _gauge(
            "scrape_duration_seconds", "Seconds this scrape took to read the source.", source
        ),
        "build": _gauge(
            "build_info",
            "The xdp-agg serving these metrics (value 1): its version and Python's.",
            ["version", "python"],
        ),
    }


def metric_names() -> dict[str, str]:
    """Every metric this module can expose, as Prometheus stores it (a counter's name with its
    _total), and its type: what a dashboard or an alert rule may refer to."""
    fams = [
        *_job_families().values(),
        *_program_families().values(),
        *_endpoint_families().values(),
        *_switchml_families().values(),
        *_scrape_families().values(),
    ]
    return {f.name + ("_total" if f.type == "counter" else ""): f.type for f in fams}


def _endpoint_families() -> dict[str, Metric]:
    """The control endpoint's families, empty."""
    job = ["job_id"]
    return {
        "jobs": _gauge("endpoint_jobs", "Jobs at the control endpoint, by state.", ["state"]),
        "info": _gauge("endpoint_job_info", "A live job's name (value 1).", [*job, "name"]),
        **{f: _gauge(name, doc, job) for f, (name, doc) in ENDPOINT_JOB_METRICS.items()},
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
    target without the counters. One call for all rows where the target has one (CounterRows,
    bmv2's: one simple_switch_CLI run instead of one per row)."""
    if isinstance(backend, CounterRows):
        got = backend.counter_rows(rows)
    elif isinstance(backend, JobCounters):
        got = {row: backend.counters(row) for row in rows}
    else:
        return {}
    names = [r.name.lower() for r in Reason]
    return {row: {r: int(got[row].get(r, 0)) for r in names} for row in rows}


def _every_worker_counters(backend, job_ids: list[int]) -> dict[int, dict[int, dict]]:
    """{job id: {worker index: counters}}: in one read where the target can (XDP), else job by
    job; {} for a target without per-worker counters."""
    if isinstance(backend, AllWorkerCounters):
        return backend.all_worker_counters()
    if isinstance(backend, WorkerCounters):
        return {j: backend.worker_counters(j) for j in job_ids}
    return {}


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
