"""What a stranger on the SwitchML hosts' subnet can do to `serve --switchml-grpc` (issue 39's
findings F1-F6), each with p4app-switchML's own call shapes (tests/switchml_grpc_client.py):
the requests its DpdkBackend::SetupSwitch builds, one connection per caller, each caller on its
own address (the workers on theirs, the stranger on prefix.66, all on loopback, no root).
"""

from __future__ import annotations

from concurrent import futures

import pytest

grpc = pytest.importorskip("grpc")

import switchml_grpc_client as client  # noqa: E402  (needs grpc)
from switchml_grpc_stack import K, Stack, exchange, wait_for  # noqa: E402

from xdp_agg.ctl import switchml_proto as pb  # noqa: E402
from xdp_agg.proto.limits import MAX_WORKERS  # noqa: E402

pytestmark = pytest.mark.timeout(120)

STRANGER = 66  # the stranger's address: prefix.66, on the workers' subnet
STRANGER_MAC = "02:00:00:00:09:66"
CODE = grpc.StatusCode


@pytest.fixture
def stack():
    s = Stack()
    yield s
    s.close()


def _udp_session(stack: Stack, source: str, session_id: int, *, rank=0, world=2, mac=STRANGER_MAC):
    """One UdpSession as p4app's host sends it, from `source`, registering that address."""
    request = client.udp_session_request(
        session_id, rank=rank, world=world, mac=mac, ip=source, packet_numel=K
    )
    with client.channel(stack.target, source) as ch:
        return client.call(ch, "Session", "UdpSession")(request, timeout=30)


def _session_keys(stack: Stack) -> list[str]:
    return [j["key"] for j in stack.endpoint.registry.snapshot()["jobs"]]


def test_f1_a_strangers_rank0_udp_session_does_not_end_the_running_session(stack):
    switch = stack.setup_all(2)[0]
    key = stack.api.session_key
    with pytest.raises(grpc.RpcError) as err:
        _udp_session(stack, stack.host(STRANGER), 0x5EED)
    assert err.value.code() == CODE.FAILED_PRECONDITION
    assert _session_keys(stack) == [key]
    exchange(stack, 2, switch, seed=1)  # the session still aggregates


def _stranger_barrier(stack: Stack, world: int):
    """A Barrier of `world` from the stranger's address; its error, or None when it passed."""
    with client.channel(stack.target, stack.host(STRANGER)) as ch:
        try:
            client.call(ch, "Sync", "Barrier")(pb.BarrierRequest(num_workers=world), timeout=30)
        except grpc.RpcError as e:
            return e
    return None


@pytest.mark.parametrize("world", [1, 2])
def test_f2_a_strangers_barrier_during_setup_does_not_fail_the_session(stack, world):
    """Rank 0 has opened the session (its UdpSession) when the stranger's Barrier comes; rank 1
    starts after it: the session must complete and aggregate."""
    with futures.ThreadPoolExecutor(2) as pool:
        rank0 = pool.submit(stack.setup, 0, 2)
        wait_for("rank 0 registered", lambda: stack.api.events["ranks_registered"] == 1)
        stranger = _stranger_barrier(stack, world)
        rank1 = pool.submit(stack.setup, 1, 2)
        switches = [rank0.result(), rank1.result()]
    assert switches[0].session_id == switches[1].session_id
    exchange(stack, 2, switches[0], seed=2)
    if world == 1:  # no session of one worker has a rank that has not registered
        assert stranger.code() == CODE.FAILED_PRECONDITION, stranger
    else:  # counted in the session's first barrier, which every rank passes anyway
        assert stranger is None


@pytest.mark.parametrize("world", [2, 3])
def test_f3_a_strangers_broadcast_never_reaches_the_next_session(stack, world):
    with client.channel(stack.target, stack.host(STRANGER)) as ch:
        request = pb.BroadcastRequest(value=0xBAD, rank=0, num_workers=world, root=0)
        assert client.call(ch, "Sync", "Broadcast")(request, timeout=30).value == 0xBAD
    switches = stack.setup_all(2)
    assert {s.session_id for s in switches} == {switches[0].session_id} != {0xBAD}
    exchange(stack, 2, switches[0], seed=3)


def test_f4_a_flood_of_barriers_does_not_block_a_session():
    """More never-completing Barriers (num_workers beyond any session) than the server has
    threads, from the stranger: a session of two must still set up; each Barrier is refused at
    once (no session has 1000 workers, or its address has its calls in progress)."""
    stack = Stack(barrier_timeout=3.0)
    try:
        with client.channel(stack.target, stack.host(STRANGER)) as ch:
            barrier = client.call(ch, "Sync", "Barrier")
            flood = [
                barrier.future(pb.BarrierRequest(num_workers=1000), timeout=30)
                for _ in range(2 * MAX_WORKERS + 8)
            ]
            with futures.ThreadPoolExecutor(2) as pool:
                setups = [pool.submit(stack.setup, r, 2, timeout=10) for r in range(2)]
                switches = [f.result() for f in setups]
            refused = {f.code() for f in flood}  # each ends; none waits for a thread
        exchange(stack, 2, switches[0], seed=4)
        assert refused <= {CODE.INVALID_ARGUMENT, CODE.RESOURCE_EXHAUSTED}, refused
    finally:
        stack.close()


def test_f5_a_rank0_udp_session_without_barrier_expires_and_frees_the_port():
    stack = Stack(barrier_timeout=0.5)
    try:
        _udp_session(stack, stack.host(STRANGER), 0x5EED)
        assert len(stack.agg.jobs()) == 1
        wait_for("the half-registered session's job ended", lambda: stack.agg.jobs() == [])
        stack.api.settings.barrier_timeout = 30.0
        switches = stack.setup_all(2)  # port 0xBEE0 and the slots are free again
        exchange(stack, 2, switches[0], seed=5)
    finally:
        stack.close()


@pytest.mark.parametrize(
    "mac",
    [2**64 - 1, 2**48, 0x01005E000001, 0xFFFFFFFFFFFF, 0],
    ids=["2^64-1", "2^48", "multicast", "broadcast", "zero"],
)
def test_f6_a_mac_that_is_no_hosts_is_refused(stack, mac):
    with pytest.raises(grpc.RpcError) as err:
        _udp_session(stack, stack.worker(0)[0], 0x5EED, world=1, mac=mac)
    assert err.value.code() == CODE.INVALID_ARGUMENT
    assert "MAC" in err.value.details()
    assert stack.agg.jobs() == []


# --- F1: who may replace a session, who may call at all --------------------------------------
def test_f1_another_hosts_session_replaces_a_running_one_only_once_it_is_idle():
    """A stranger's rank 0 is refused while the session has traffic; once the aggregator has
    counted none of it for idle_takeover (60 s by the fake clock), it may take over."""
    stack = Stack(clock=True, idle_takeover=60.0)
    try:
        switch = stack.setup_all(2)[0]
        exchange(stack, 2, switch, seed=6)
        stack.api.sweep()  # notes the traffic, now
        stack.clock.advance(59)
        with pytest.raises(grpc.RpcError) as err:
            _udp_session(stack, stack.host(STRANGER), 0x5EED)
        assert err.value.code() == CODE.FAILED_PRECONDITION
        assert "no traffic for 60 s" in err.value.details()
        stack.clock.advance(2)
        _udp_session(stack, stack.host(STRANGER), 0x5EED)
        assert stack.api.session_key == "switchml-0x5eed"
        assert stack.api.ended == {"idle": 1}
        assert stack.api.refusals == {"session_busy": 1}
    finally:
        stack.close()


def test_callers_outside_the_allowed_networks_are_refused_every_call(stack):
    """127.0.0.1 is outside the Stack's --switchml-allow (the workers' /24)."""
    requests = {
        ("Session", "UdpSession"): client.udp_session_request(
            1, rank=0, world=1, mac=STRANGER_MAC, ip=stack.worker(0)[0], packet_numel=K
        ),
        ("Session", "RdmaSession"): pb.RdmaSessionRequest(rank=0),
        ("Sync", "Barrier"): pb.BarrierRequest(num_workers=2),
        ("Sync", "Broadcast"): pb.BroadcastRequest(value=1, rank=0, num_workers=2, root=0),
    }
    with client.channel(stack.target) as ch:  # no relay: from 127.0.0.1
        for (service, method), request in requests.items():
            with pytest.raises(grpc.RpcError) as err:
                client.call(ch, service, method)(request, timeout=30)
            assert err.value.code() == CODE.PERMISSION_DENIED, method
            assert "127.0.0.1 may not call this controller" in err.value.details()
    assert stack.api.refusals == {"not_allowed": 4}
    assert stack.agg.jobs() == [] and stack.api.open_broadcasts == 0


# --- F3: Broadcast values kept, bounded, expired -----------------------------------------------
def _root_broadcast(stack: Stack, source: str, value: int, world: int = 2) -> int:
    with client.channel(stack.target, source) as ch:
        request = pb.BroadcastRequest(value=value, rank=0, num_workers=world, root=0)
        return client.call(ch, "Sync", "Broadcast")(request, timeout=30).value


def test_f3_open_broadcasts_are_one_per_host_bounded_and_expire():
    stack = Stack(clock=True, open_broadcasts=3)
    try:
        for value in range(10):  # one host's: the newest replaces the one before
            assert _root_broadcast(stack, stack.host(STRANGER), value) == value
        assert stack.api.open_broadcasts == 1
        _root_broadcast(stack, stack.host(70), 70)
        _root_broadcast(stack, stack.host(71), 71)
        with pytest.raises(grpc.RpcError) as err:
            _root_broadcast(stack, stack.host(72), 72)
        assert err.value.code() == CODE.RESOURCE_EXHAUSTED
        assert "3 Broadcast values of other hosts wait" in err.value.details()
        stack.clock.advance(29)  # the barrier timeout is 30 s
        stack.api.sweep()
        assert stack.api.open_broadcasts == 3
        stack.clock.advance(2)
        stack.api.sweep()
        assert stack.api.open_broadcasts == 0
        assert stack.api.events["broadcasts_expired"] == 3
        assert stack.api.refusals == {"broadcasts": 1}
        switches = stack.setup_all(2)  # none of them reached this session
        assert len({s.session_id for s in switches}) == 1
        exchange(stack, 2, switches[0], seed=7)
    finally:
        stack.close()


# --- F4: calls in progress bounded per address and in all; threads return ----------------------
def _barriers(ch, n: int, world: int = MAX_WORKERS) -> list:
    """n Barriers of `world` on one connection, in flight together (futures)."""
    barrier = client.call(ch, "Sync", "Barrier")
    return [barrier.future(pb.BarrierRequest(num_workers=world), timeout=60) for _ in range(n)]


def _refused(calls: list) -> list[grpc.StatusCode]:
    """The codes of the calls that ended (refused); those still waiting are left."""
    return [f.code() for f in calls if f.done()]


def test_f4_waiting_barriers_are_bounded_per_address_and_in_all_and_their_threads_return():
    """Barriers of 64 workers that no session will fill (valid ones: each waits for a session
    of 64): 3 may wait per address and 8 calls may be in progress in all; the rest are refused
    at once. A session of two sets up beside them, and once they are cancelled every thread of
    the server ends."""
    stack = Stack(calls=8, calls_per_peer=3, thread_idle=0.05)
    try:
        with (
            client.channel(stack.target, stack.host(STRANGER)) as a,
            client.channel(stack.target, stack.host(67)) as b,
            client.channel(stack.target, stack.host(68)) as c,
        ):
            flood = _barriers(a, 5) + _barriers(b, 5)
            wait_for("6 waiting, 4 refused", lambda: len(_refused(flood)) == 4)
            wait_for("6 waiting", lambda: stack.api.waiting == 6)
            assert _refused(flood) == [CODE.RESOURCE_EXHAUSTED] * 4
            switches = stack.setup_all(2)  # 2 more calls at most: within the 8
            exchange(stack, 2, switches[0], seed=8)
            more = _barriers(c, 3)  # 6 + 3 > 8: one of them is refused
            wait_for("1 of 3 refused", lambda: len(_refused(more)) == 1)
            assert stack.api.refusals == {"peer_calls": 4, "calls": 1}
            assert "the most it takes" in next(f for f in more if f.done()).details()
            for f in flood + more:
                f.cancel()
            wait_for("nobody waits", lambda: stack.api.waiting == 0)
        assert stack.server.pool.wait_threads(0, timeout=30), stack.server.pool.threads
        assert stack.server.admission.active == 0
    finally:
        stack.close()


# --- F5: a half-registered session expires with the barrier timeout ----------------------------
def test_f5_a_stalled_setup_expires_after_the_barrier_timeout_but_not_while_a_rank_waits():
    stack = Stack(clock=True)  # barrier timeout 30 s, by the fake clock
    try:
        _udp_session(stack, stack.worker(0)[0], 0x5EED)
        stack.clock.advance(29)
        stack.api.sweep()
        assert stack.api.session_key == "switchml-0x5eed"
        stack.clock.advance(2)
        stack.api.sweep()
        assert stack.api.session_key is None and stack.agg.jobs() == []
        assert stack.api.ended == {"expired": 1}
        # rank 0 of the next waits in its first barrier: no expiry while it does
        ip = stack.worker(0)[0]
        request = client.udp_session_request(
            0x5EEE, rank=0, world=2, mac=stack.worker(0)[1], ip=ip, packet_numel=K
        )
        with client.channel(stack.target, ip) as ch:
            client.call(ch, "Session", "UdpSession")(request, timeout=30)
            (waiting,) = _barriers(ch, 1, world=2)
            wait_for("rank 0 waits", lambda: stack.api.waiting == 1)
            stack.clock.advance(31)
            stack.api.sweep()
            assert stack.api.session_key == "switchml-0x5eee"
            waiting.cancel()
            wait_for("rank 0 gone", lambda: stack.api.waiting == 0)
        stack.api.sweep()
        assert stack.api.session_key is None and stack.agg.jobs() == []
        assert stack.api.ended == {"expired": 2}
    finally:
        stack.close()


# --- the metrics ------------------------------------------------------------------------------
def test_the_sessions_and_refusals_are_in_the_metrics(stack):
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from xdp_agg.app import metrics

    stack.setup_all(2)
    stack.setup_all(2)  # replaces the first
    with pytest.raises(grpc.RpcError):
        _udp_session(stack, stack.host(STRANGER), 0x5EED)  # session_busy
    with pytest.raises(grpc.RpcError):
        _udp_session(stack, stack.host(STRANGER), 0x5EED, mac=2**64 - 1)  # invalid
    src = metrics.Sources(
        backend=stack.agg, target="soft", endpoint=stack.endpoint, switchml=stack.server
    )
    got = {
        (s.name, tuple(s.labels.values())): s.value
        for fam in text_string_to_metric_families(metrics.exposition(src))
        for s in fam.samples
    }
    assert got[("xdpagg_switchml_sessions_opened_total", ())] == 2
    assert got[("xdpagg_switchml_sessions_complete_total", ())] == 2
    assert got[("xdpagg_switchml_sessions_ended_total", ("replaced",))] == 1
    assert got[("xdpagg_switchml_sessions_ended_total", ("expired",))] == 0
    assert got[("xdpagg_switchml_refusals_total", ("session_busy",))] == 1
    assert got[("xdpagg_switchml_refusals_total", ("invalid",))] == 1
    assert got[("xdpagg_switchml_refusals_total", ("not_allowed",))] == 0
    assert got[("xdpagg_switchml_broadcasts_expired_total", ())] == 0
    assert got[("xdpagg_switchml_threads", ())] >= 1
    names = {name for name, _ in got}
    assert {n for n in metrics.metric_names() if "switchml" in n} <= names


def test_a_callers_address_and_connection_from_grpcs_peer_string():
    import ipaddress

    from xdp_agg.ctl.switchml_grpc import allowed, caller_of

    c = caller_of("ipv4:198.18.0.2:40112")
    assert (c.host, c.conn) == ("198.18.0.2", "198.18.0.2:40112")
    c = caller_of("ipv6:%5B::1%5D:40112")  # grpc 1.85's form
    assert (c.host, c.conn) == ("::1", "[::1]:40112")
    assert caller_of("ipv6:[::ffff:198.18.0.2]:7").host == "198.18.0.2"
    with pytest.raises(ValueError):
        caller_of("unix:/run/x.sock")
    nets = (ipaddress.ip_network("198.18.0.0/24"), ipaddress.ip_network("fd00::/64"))
    assert allowed("198.18.0.9", nets) and allowed("fd00::5", nets)
    assert not allowed("198.18.1.9", nets) and not allowed("::1", nets)
