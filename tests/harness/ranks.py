"""Helpers for the host library, soft aggregator and rendezvous tests (loopback only).

Each cluster gets its own 127.A.B.0/24 (random A, B): the aggregator and control endpoint on .1,
rank r on .(2 + r). The aggregator tells workers apart by source address, and distinct subnets
keep concurrent test runs on one machine (and their 0xBEE0.. ports) apart.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import tempfile
import threading
from dataclasses import dataclass

import hostlib
from aggctl.server import RendezvousServer
from aggctl.soft_aggregator import SoftAggregator


def loopback_prefix() -> str:
    """A random '127.A.B' unlikely to be used by anything else on this machine."""
    rnd = random.SystemRandom()
    return f"127.{rnd.randint(16, 250)}.{rnd.randint(1, 250)}"


@dataclass
class Cluster:
    prefix: str
    aggregator: SoftAggregator | None
    server: RendezvousServer
    secret: bytes | None = None  # the deployment secret the server checks (None: no auth)
    secret_file: str | None = None  # where it is (mode 0600), for hostlib.init(secret_file=)

    @property
    def agg_ip(self) -> str:
        return f"{self.prefix}.1"

    @property
    def endpoint(self) -> str:
        host, port = self.server.address
        return f"{host}:{port}"

    def worker_ip(self, rank: int) -> str:
        return f"{self.prefix}.{2 + rank}"


@contextlib.contextmanager
def soft_cluster(
    *,
    backend=None,
    defaults: dict | None = None,
    start_aggregator: bool = True,
    auth: bool = True,
    limits=None,
):
    """A RendezvousServer on prefix.1 in front of a SoftAggregator (or `backend`).

    auth: the server checks a fresh deployment secret, written (0600) to a temporary file that
    run_ranks gives every rank; False: the trusted-lab mode, no credentials. limits: its
    aggctl.auth.Limits."""
    prefix = loopback_prefix()
    agg = None
    if backend is None:
        agg = backend = SoftAggregator(f"{prefix}.1")
        if start_aggregator:
            agg.start()
    d = {"agg_ip": f"{prefix}.1", "barrier_timeout": 20.0, **(defaults or {})}
    with tempfile.TemporaryDirectory(prefix="xdp-agg-secret-") as tmp:
        secret = path = None
        if auth:
            secret = secrets.token_hex(32).encode()
            path = os.path.join(tmp, "secret")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secret)
        server = RendezvousServer(
            backend, f"{prefix}.1", 0, d, secret=secret, limits=limits
        ).start()
        try:
            yield Cluster(prefix, agg, server, secret, path)
        finally:
            server.stop()
            if agg is not None:
                agg.stop()


def run_ranks(cluster: Cluster, n: int, fn, *, job: str = "test", deadline: float = 60.0, **kw):
    """Run fn(comm) on ranks 0..n-1 (threads), each in its own communicator; their results.

    An exception of a rank is returned in its place; a rank still running after `deadline` s
    fails the test (nothing may hang).
    """
    results: list = [None] * n

    def rank_main(r: int) -> None:
        try:
            kw.setdefault("timeout", 10.0)
            with hostlib.init(
                r,
                n,
                cluster.endpoint,
                job=job,
                ip=cluster.worker_ip(r),
                rendezvous_timeout=15.0,
                **{"secret_file": cluster.secret_file, **kw},
            ) as comm:
                results[r] = fn(comm)
        except Exception as e:  # reported to the test
            results[r] = e

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(deadline)
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    assert not stuck, f"ranks {stuck} still running after {deadline} s"
    return results


def ok(results: list) -> list:
    """The results, raising the first rank's exception if any failed."""
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results
