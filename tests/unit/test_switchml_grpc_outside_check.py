"""An outside check of `xdp-agg serve --switchml-grpc` (four findings, N1-N4), each a test that
failed before its fix: worker addresses that are no host's in one-arm (N1), idle server threads
that restart each other's wait (N2), gRPC's own uncounted refusal past its limit of calls in
flight (N3), and a session recovered after a restart that refused its own hosts' next session
for the rejoin timeout (N4). The stack is tests/switchml_grpc_stack.py's: loopback, no root.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

grpc = pytest.importorskip("grpc")

import switchml_grpc_client as client  # noqa: E402  (needs grpc)
from switchml_grpc_stack import SWITCH_MAC, K, Stack, exchange, wait_for  # noqa: E402

from xdp_agg.ctl import switchml_proto as pb  # noqa: E402
from xdp_agg.ctl.switchml_grpc import IdlePool  # noqa: E402
from xdp_agg.proto.limits import MAX_WORKERS  # noqa: E402

pytestmark = pytest.mark.timeout(120)

CODE = grpc.StatusCode
STRANGER = 66  # prefix.66: a host on the workers' subnet that is not one of theirs


def _udp_session(stack: Stack, source: str, session_id: int, ip: str, *, world: int = 1):
    """Rank 0's UdpSession as p4app's host sends it, from `source`, giving address `ip`."""
    request = client.udp_session_request(
        session_id, rank=0, world=world, mac=stack.worker(0)[1], ip=ip, packet_numel=K
    )
    with client.channel(stack.target, source) as ch:
        return client.call(ch, "Session", "UdpSession")(request, timeout=30)


# --- N1: in one-arm, an address that is no worker's is refused -------------------------------
def test_switchml_n1_one_arm_refuses_broadcast_own_and_loopback_worker_addresses(monkeypatch):
    """serve's one-arm port_address (one interface, 198.18.0.1/24): a worker may not give the
    subnet's broadcast or network address, the aggregator's own address or 127.0.0.1 (none
    reaches a worker's NIC); each refusal is INVALID_ARGUMENT, says what to give, is counted,
    and opens no session. A worker's own address still opens one."""
    from xdp_agg.app import serving
    from xdp_switch import links

    stack = Stack()
    try:
        # the one interface, as a NIC's (the callers stay on loopback: only the addresses
        # they give are the workers' NICs', which the soft aggregator never sends to here)
        arm = {"ipv4_nets": ["198.18.0.1/24"], "ipv4": ["198.18.0.1"], "mac": SWITCH_MAC}
        monkeypatch.setattr(links, "addresses", lambda ifname: arm)
        stack.api.port_address = serving.port_address_of(["arm0"])
        source = stack.worker(0)[0]
        bad = ["198.18.0.255", "198.18.0.0", "198.18.0.1", "127.0.0.1"]
        for n, ip in enumerate(bad):
            with pytest.raises(grpc.RpcError) as err:
                _udp_session(stack, source, 0x5EED + n, ip)
            assert err.value.code() == CODE.INVALID_ARGUMENT, ip
            assert f"ipv4 {ip} is " in err.value.details(), err.value.details()
            assert "give the worker port's own address" in err.value.details()
        assert stack.api.refusals == {"invalid": len(bad)}
        assert stack.agg.jobs() == [] and stack.api.session_key is None
        answer = _udp_session(stack, source, 0x5EEF, "198.18.0.10")  # a worker's: a session
        assert stack.api.session_key == "switchml-0x5eef"
        assert answer.ipv4 == 0xC6120001  # 198.18.0.1, ours, without the prefix length
    finally:
        stack.close()


# --- N2: an idle server thread ends after its own idle time ----------------------------------
class _CountingCondition:
    """The pool's condition, counting the waits begun on it (each a thread's idle wait)."""

    def __init__(self, cond: threading.Condition) -> None:
        self.cond = cond
        self.waits = 0

    def __enter__(self):
        return self.cond.__enter__()

    def __exit__(self, *exc):
        return self.cond.__exit__(*exc)

    def wait(self, timeout=None):
        self.waits += 1
        return self.cond.wait(timeout)

    def wait_for(self, predicate, timeout=None):
        return self.cond.wait_for(predicate, timeout)

    def notify(self, n: int = 1) -> None:
        self.cond.notify(n)

    def notify_all(self) -> None:
        self.cond.notify_all()


def test_switchml_n2_an_idle_thread_ends_after_its_own_idle_time_not_restarted():
    """After a burst, N threads go idle one after the other; each must wait once and end when
    its own idle time is up: N waits in all. Before, each ending thread woke every other idle
    one, which began its whole wait again (N + (N-1) + ... waits, 145 s instead of 10 for a
    burst's threads). The count is of waits, not of time: the stagger only lets the old
    behaviour show."""
    n, idle = 8, 0.5
    pool = IdlePool(n, idle)
    counting = _CountingCondition(pool._cond)
    pool._cond = counting  # type: ignore[assignment]
    gates = [threading.Event() for _ in range(n)]
    for gate in gates:
        pool.submit(gate.wait)
    wait_for("a thread per call", lambda: pool.threads == n)
    for i, gate in enumerate(gates):
        gate.set()
        wait_for(f"thread {i} idle", lambda i=i: counting.waits >= i + 1)
        time.sleep(idle / (3 * n))  # one after the other, all before the first ends
    assert pool.wait_threads(0, timeout=60), pool.threads
    assert counting.waits == n


# --- N3: past the bound of calls, our refusal (counted, with advice), never gRPC's -----------
@contextlib.contextmanager
def _stranger_barriers(**stack_kw):
    """A Stack(**stack_kw) and a stranger's Barriers, each for MAX_WORKERS workers (valid in a
    session of 64): yields (stack, send, call), send(k) starting k calls at once (their futures),
    call() one that waits for its answer. On leaving, every call started is cancelled, nobody
    waits, the admission holds none, and the stack is closed."""
    stack = Stack(**stack_kw)
    started: list = []
    try:
        with client.channel(stack.target, stack.host(STRANGER)) as ch:
            barrier = client.call(ch, "Sync", "Barrier")
            request = pb.BarrierRequest(num_workers=MAX_WORKERS)

            def send(k: int) -> list:
                calls = [barrier.future(request, timeout=60) for _ in range(k)]
                started.extend(calls)
                return calls

            yield stack, send, lambda: barrier(request, timeout=60)
            for f in started:
                f.cancel()
            wait_for("nobody waits", lambda: stack.api.waiting == 0)
        assert stack.server.admission.active == 0
    finally:
        stack.close()


def test_switchml_n3_calls_past_the_bound_get_our_counted_refusal_not_grpcs():
    """8 calls may be in progress; 40 Barriers come at once while every call is held at the
    admission (its lock taken by the test): more are in flight than the server has threads.
    Once let through, 8 wait (valid Barriers of 64 workers, for a session of 64) and each of
    the other 32 is refused by the admission, RESOURCE_EXHAUSTED with what to do, and
    counted. Before, gRPC's own limit (8 + 4) answered the rest itself: "Concurrent RPC limit
    exceeded!", counted nowhere."""
    with _stranger_barriers(calls=8, calls_per_peer=64) as (stack, send, _):
        pool, admission = stack.server.pool, stack.server.admission
        with admission._lock:
            calls = send(40)
            threads = pool.size

            def arrived() -> bool:  # held at the admission, queued, or answered
                queued = len(pool._queue)
                answered = sum(f.done() for f in calls)
                return pool.threads == threads and queued + answered == len(calls) - threads

            wait_for("every call at the server", arrived)
        wait_for("32 answered", lambda: sum(f.done() for f in calls) == 32)
        wait_for("8 waiting", lambda: stack.api.waiting == 8)
        refused = [f for f in calls if f.done()]
        assert {f.code() for f in refused} == {CODE.RESOURCE_EXHAUSTED}
        for f in refused:
            assert "the most it takes" in f.details(), f.details()
        assert stack.api.refusals == {"calls": 32}


def test_switchml_n3_grpcs_own_refusals_past_its_limit_are_counted():
    """The backstop: 8 calls, 4 reserve threads and a queue of 4, so gRPC's own limit is 16
    calls in flight; 30 Barriers come while the admission is held. gRPC refuses 14 itself
    (its own words, "Concurrent RPC limit exceeded!"), and each is counted (grpc_limit); once
    let through, 8 wait and the admission refuses the other 8, and the next call, as calls."""
    with _stranger_barriers(calls=8, calls_per_peer=64, backlog=4) as (stack, send, call):
        pool, admission = stack.server.pool, stack.server.admission
        with admission._lock:
            calls = send(30)
            wait_for("14 refused by gRPC", lambda: sum(f.done() for f in calls) == 14)
            wait_for("12 held, 4 queued", lambda: (pool.threads, pool.backlog) == (12, 4))
        grpcs = [f for f in calls if f.done()]
        assert {f.details() for f in grpcs} == {"Concurrent RPC limit exceeded!"}
        wait_for("22 answered", lambda: sum(f.done() for f in calls) == 22)
        wait_for("8 waiting", lambda: stack.api.waiting == 8)
        with pytest.raises(grpc.RpcError) as err:  # one more: the last one counted then
            call()
        assert "the most it takes" in err.value.details()
        assert stack.api.refusals == {"grpc_limit": 14, "calls": 9}


def test_switchml_n3_grpcs_own_limit_is_past_the_admission_and_its_queue():
    """The defaults docs/protocol.md 7.3 gives: 132 calls, 4 reserve threads, 1024 queued."""
    from xdp_agg.ctl.switchml_grpc import RESERVE, SwitchmlSettings, grpc_limit

    s = SwitchmlSettings()
    assert (s.calls, RESERVE, s.backlog) == (132, 4, 1024)
    assert grpc_limit(s) == 1160 > s.calls + RESERVE


# --- N4: a session recovered after a restart -----------------------------------------------
def test_switchml_n4_a_recovered_session_yields_to_its_hosts_and_says_when_it_clears(tmp_path):
    """serve restarts while a session of two runs (its job kept in the aggregator and
    recovered from the table, held for the rejoin timeout, 60 s). Another host's rank 0 is
    refused, told that the recovered session clears by itself when the rejoin timeout ends,
    when that is, and what to do now; the same hosts' next run replaces it at once and
    aggregates."""
    stack = Stack(table=tmp_path / "jobs.json", grace=60.0)
    try:
        switch = stack.setup_all(2)[0]
        exchange(stack, 2, switch, seed=11)
        old = stack.api.session_key
        stack.restart()
        assert stack.recovered == [old] and stack.api.session_key is None
        with pytest.raises(grpc.RpcError) as err:
            _udp_session(stack, stack.host(STRANGER), 0x5EED, stack.host(STRANGER), world=2)
        why = err.value.details()
        assert err.value.code() == CODE.FAILED_PRECONDITION, why
        assert "recovered" in why and "rejoin timeout" in why, why
        assert "UTC" in why and "frees it by itself" in why, why
        assert "from one of its hosts" in why, why
        assert stack.api.refusals == {"session_busy": 1}
        switches = stack.setup_all(2)  # the same hosts' next run
        assert stack.api.session_key != old
        assert [j["key"] for j in stack.endpoint.registry.snapshot()["jobs"]] == [
            stack.api.session_key
        ]
        assert stack.api.ended == {"replaced": 1}
        exchange(stack, 2, switches[0], seed=12)
    finally:
        stack.close()
