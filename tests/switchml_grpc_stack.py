"""The stack the SwitchML controller API tests run against, without root: a soft aggregator, a
control endpoint (switch topology) and the gRPC API before it on loopback; each rank calls from
its own address (tests/switchml_grpc_client.py's Relay), as p4app's hosts do; and the data
exchange that checks a session's results (every worker's two threads, each sum exact at the
port that sent it).
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from concurrent import futures
from pathlib import Path

import numpy as np
import switchml_grpc_client as client
from harness import p4app_host
from harness.ranks import loopback_prefix

from xdp_agg.ctl.endpoint import stand_up
from xdp_agg.ctl.switchml_grpc import AGG_PORT, SwitchmlApi, SwitchmlSettings, start_server
from xdp_agg.proto.jobs import Delivery
from xdp_agg.targets.soft import SoftAggregator

SWITCH_MAC = "02:5e:00:00:00:01"
K = 64  # elements per packet: p4app's default packet_numel
PER_THREAD = 4  # max_outstanding_packets / threads
THREADS = 2
WORKER_PORT = 4000  # p4app's default backend.dpdk.worker_port


class FakeClock:
    """A clock that stands still until the test moves it (`advance`)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Stack:
    """A soft aggregator, a control endpoint (switch topology) and the gRPC API before it;
    `settings`: SwitchmlSettings' fields beside the barrier timeout; `clock`: the API's clock is
    a FakeClock (self.clock), which only the test moves."""

    def __init__(
        self,
        barrier_timeout: float = 30.0,
        *,
        clock: bool = False,
        table: Path | None = None,
        grace: float = 60.0,
        **settings,
    ) -> None:
        self.prefix = loopback_prefix()
        self.agg_ip = f"{self.prefix}.1"
        self.agg = SoftAggregator(self.agg_ip).start()
        self.table, self.grace = table, grace
        # the workers' subnet may call, as serve allows the subnets of its interfaces
        settings.setdefault("allow", (ipaddress.ip_network(f"{self.prefix}.0/24"),))
        self.settings = SwitchmlSettings(window=64, barrier_timeout=barrier_timeout, **settings)
        self.clock = FakeClock() if clock else time.monotonic
        self._serve()

    def _serve(self) -> None:
        """The control endpoint (with `table`: kept on disk and restored, as serve's) and the API
        before it, started."""
        defaults = {"delivery": Delivery.BROADCAST, "agg_ip": self.agg_ip}
        self.endpoint, self.recovered = stand_up(
            self.agg, self.agg_ip, 0, defaults, secret=None, table=self.table, grace=self.grace
        )
        self.endpoint.start()
        self.api = SwitchmlApi(
            self.endpoint.registry,
            self.settings,
            lambda ip: (self.agg_ip, SWITCH_MAC),
            self.clock,
        )
        self.server = start_server(self.api, "127.0.0.1", 0)
        self.target = f"127.0.0.1:{self.server.port}"

    def restart(self) -> None:
        """`xdp-agg serve` restarted: the API and the endpoint stop (with a table the jobs stay in
        the aggregator) and come back, the endpoint recovering the saved jobs."""
        self.server.stop(None)
        self.endpoint.stop()
        self._serve()

    def worker(self, rank: int) -> tuple[str, str]:
        """Worker `rank`'s (IPv4, MAC)."""
        return f"{self.prefix}.{10 + rank}", f"02:00:00:00:01:{rank:02x}"

    def setup(self, rank: int, world: int, **kw) -> client.Switch:
        """p4app's setup calls of worker `rank`, from its own address."""
        ip, mac = self.worker(rank)
        return client.setup_switch(
            self.target, rank=rank, world=world, mac=mac, ip=ip, packet_numel=K, source=ip, **kw
        )

    def setup_all(self, world: int) -> list[client.Switch]:
        with futures.ThreadPoolExecutor(world) as pool:
            return list(pool.map(lambda r: self.setup(r, world), range(world)))

    def close(self) -> None:
        self.server.stop(None)
        self.endpoint.stop()
        self.agg.stop()

    def host(self, n: int) -> str:
        """The address prefix.n (n 10.. are the workers'; others: strangers on their subnet)."""
        return f"{self.prefix}.{n}"


def wait_for(what, condition, polls: int = 2000) -> None:
    """Until condition() holds, polled every 10 ms, at most `polls` times (a bound on a failure,
    not a timing: the test waits for the event)."""
    for _ in range(polls):
        if condition():
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"never happened: {what}")


def _bound(ip: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((ip, port))
    s.settimeout(10.0)  # bounds a failure only: every datagram expected is counted
    return s


def exchange(stack: Stack, world: int, switch: client.Switch, seed: int) -> None:
    """Every worker's two threads send their first PER_THREAD requests (values of
    client.thread_values) from their own ports; each port must get exactly its thread's
    results, exact."""
    socks = {
        (r, t): _bound(stack.worker(r)[0], WORKER_PORT + t)
        for r in range(world)
        for t in range(THREADS)
    }
    try:
        for (r, t), s in socks.items():
            ip, mac = stack.worker(r)
            values, exponent = client.thread_values(seed, r, t, PER_THREAD, K)
            reqs = client.requests(
                mac=mac,
                ip=ip,
                switch=switch,
                thread=t,
                worker_port=WORKER_PORT,
                per_thread=PER_THREAD,
                values=values,
                exponent=exponent,
            )
            for _, frame in reqs:
                s.sendto(frame[p4app_host.SML_AT :], (switch.ip, AGG_PORT))
        got = {key: [_read(s.recv(65536)) for _ in range(PER_THREAD)] for key, s in socks.items()}
    finally:
        for s in socks.values():
            s.close()
    for (r, t), results in got.items():
        check_thread(results, seed, world, t, what=f"rank {r} thread {t}")


def check_thread(results, seed: int, world: int, t: int, *, what: str) -> None:
    """A thread's results [(pool index, entries, exponent)]: its own slots, each sum exact."""
    want_slots = client.thread_slots(t, PER_THREAD)
    assert sorted(x[0] for x in results) == want_slots, f"{what}: its slots"
    sums, exponent = client.expected(seed, world, t, PER_THREAD, K)
    for slot, values, e in results:
        np.testing.assert_array_equal(values, sums[want_slots.index(slot)], err_msg=what)
        assert e == exponent, what


def _read(payload: bytes) -> tuple[int, np.ndarray, int]:
    """(pool index, entries, exponent) of a result as p4app's receive path reads it."""
    got = p4app_host.read_result(bytes(p4app_host.SML_AT) + payload, K)
    pool_index = int.from_bytes(payload[6:8], "big")
    return pool_index, got.entries, got.exponent
