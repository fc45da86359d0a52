"""The rank runner: soft aggregators with their control endpoints on loopback, and ranks as
threads, each with its own communicator, for one aggregator or a job striped over k.

Each cluster gets its own 127.A.B.0/24 (random A, B): the first aggregator and its control
endpoint on .1, aggregator j > 0 on .(200 + j), rank r on .(2 + r). The aggregator tells workers
apart by source address, and distinct subnets keep concurrent test runs on one machine (and
their 0xBEE0.. ports) apart.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import threading
from dataclasses import dataclass, field

import pytest

import hostlib
from xdp_agg.ctl.endpoint import stand_up
from xdp_agg.ctl.server import ControlEndpoint
from xdp_agg.proto import control
from xdp_agg.targets.soft import SoftAggregator


def loopback_prefix() -> str:
    """A random '127.A.B' unlikely to be used by anything else on this machine."""
    rnd = random.SystemRandom()
    return f"127.{rnd.randint(16, 250)}.{rnd.randint(1, 250)}"


@dataclass
class Cluster:
    """k control endpoints (servers[j]), each in front of a soft aggregator (aggs[j]) unless the
    test brought its own backend; one deployment secret for all of them."""

    prefix: str
    servers: list[ControlEndpoint] = field(default_factory=list)
    aggs: list[SoftAggregator | None] = field(default_factory=list)
    secret: bytes | None = None  # the deployment secret the servers check (None: no auth)
    secret_file: str | None = None  # where it is (mode 0600), for HostOptions.secret_file

    @property
    def server(self) -> ControlEndpoint:
        """The first (with one aggregator: the only) control endpoint."""
        return self.servers[0]

    @property
    def aggregator(self) -> SoftAggregator | None:
        """The first soft aggregator (None where the test gave its own backend)."""
        return self.aggs[0]

    @property
    def agg_ip(self) -> str:
        return f"{self.prefix}.1"

    @property
    def endpoints(self) -> list[str]:
        """Every control endpoint as HOST:PORT, in stripe order."""
        return [f"{h}:{p}" for h, p in (s.address for s in self.servers)]

    @property
    def endpoint(self) -> str:
        return self.endpoints[0]

    def worker_ip(self, rank: int) -> str:
        return f"{self.prefix}.{2 + rank}"


@contextlib.contextmanager
def soft_cluster(
    *,
    aggregators: int = 1,
    backend=None,
    backends: list | None = None,
    defaults: dict | None = None,
    start_aggregator: bool = True,
    auth: bool = True,
    limits=None,
):
    """k control endpoints (on prefix.1, prefix.201, ...) in front of SoftAggregators (or the
    given backends: `backend` for one, `backends` with None where a soft aggregator stands).

    auth: the servers check a fresh deployment secret, written (0600) to a temporary file that
    run_ranks gives every rank; False: the trusted-lab mode, no credentials. limits: their
    xdp_agg.ctl.auth.Limits."""
    prefix = loopback_prefix()
    given = backends if backends is not None else [backend] + [None] * (aggregators - 1)
    cluster = Cluster(prefix)
    with tempfile.TemporaryDirectory(prefix="xdp-agg-secret-") as tmp:
        if auth:
            cluster.secret_file = os.path.join(tmp, "secret")
            cluster.secret = control.create_secret(cluster.secret_file)
        try:
            for j, b in enumerate(given):
                ip = f"{prefix}.1" if j == 0 else f"{prefix}.{200 + j}"
                agg = None
                if b is None:
                    agg = b = SoftAggregator(ip)
                    if start_aggregator:
                        agg.start()
                cluster.aggs.append(agg)
                d = {"agg_ip": ip, "barrier_timeout": 20.0, **(defaults or {})}
                server, _ = stand_up(b, ip, 0, d, secret=cluster.secret, limits=limits)
                cluster.servers.append(server.start())
            yield cluster
        finally:
            for server in cluster.servers:
                server.stop()
            for agg in cluster.aggs:
                if agg is not None:
                    agg.stop()


def in_threads(fn, n: int, deadline: float = 60.0) -> list[int]:
    """fn(r) for r in 0..n-1, each in its own thread, all at once; the r still running after
    `deadline` seconds (none, for a test that passes)."""
    threads = [threading.Thread(target=fn, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(deadline)
    return [r for r, t in enumerate(threads) if t.is_alive()]


# what the tests' communicators use unless a test says otherwise: the sizes the tests were
# written for (on loopback elems="auto" would take 2048, the MTU of lo allowing it)
TEST_OPTIONS = {"elems": 256, "window": 64}


def init(rank: int, world: int, control, *, job: str = "default", token=None, on_token=None, **kw):
    """hostlib.init with HostOptions made from `kw` (fields by name, over TEST_OPTIONS and the
    environment's: HostOptions.from_env)."""
    opts = hostlib.HostOptions.from_env(**{**TEST_OPTIONS, **kw})
    return hostlib.init(rank, world, control, job, opts, token=token, on_token=on_token)


def join_rank(cluster: Cluster, rank: int, world: int, *, job: str, **kw):
    """hostlib.init of `rank` at the cluster's first endpoint, from its address, with its secret."""
    args = {"secret_file": cluster.secret_file, "ip": cluster.worker_ip(rank), **kw}
    return init(rank, world, cluster.endpoint, job=job, **args)


def run_ranks(cluster, n, fn, *, job="test", deadline=60.0, control_spec=None, per_rank=None, **kw):
    """Run fn(comm) on ranks 0..n-1 (threads), each in its own communicator joined to every
    aggregator of the cluster; their results.

    control_spec: what hostlib.init gets as `control` (default: the one endpoint, or the
    list of k); per_rank(r): extra options of rank r (a loop, faults). An exception of a
    rank is returned in its place; a rank still running after `deadline` s fails the test
    (nothing may hang).
    """
    results: list = [None] * n
    if control_spec is None:
        control_spec = cluster.endpoint if len(cluster.servers) == 1 else cluster.endpoints
    base = {"timeout": 10.0, "rendezvous_timeout": 20.0, "secret_file": cluster.secret_file}

    def rank_main(r: int) -> None:
        args = {**base, **kw, **(per_rank(r) if per_rank else {})}
        try:
            with init(r, n, control_spec, job=job, ip=cluster.worker_ip(r), **args) as comm:
                results[r] = fn(comm)
        except Exception as e:  # reported to the test
            results[r] = e

    stuck = in_threads(rank_main, n, deadline)
    assert not stuck, f"ranks {stuck} still running after {deadline} s"
    return results


def start_rank(cluster: Cluster, rank: int, world: int, *, job: str, **kw):
    """One rank joining in a thread and leaving at once (a rank that waits at the barrier while
    the test does something else); the started thread and the HostlibErrors it raised."""
    errors: list = []

    def join() -> None:
        try:
            args = {"secret_file": cluster.secret_file, **kw}
            init(rank, world, cluster.endpoint, job=job, ip=cluster.worker_ip(rank), **args).close()
        except hostlib.HostlibError as e:
            errors.append(e)

    t = threading.Thread(target=join, daemon=True)
    t.start()
    return t, errors


def ok(results: list) -> list:
    """The results, raising the first rank's exception if any failed."""
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.fixture
def soft():
    """A soft cluster with one aggregator and auth on, for the length of one test."""
    with soft_cluster() as cluster:
        yield cluster
