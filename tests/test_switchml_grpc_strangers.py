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

from aggctl import switchml_proto as pb  # noqa: E402
from aggproto.limits import MAX_WORKERS  # noqa: E402

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


@pytest.mark.xfail(strict=True, reason="issue 39 F1: any rank-0 UdpSession ends the session")
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


@pytest.mark.xfail(strict=True, reason="issue 39 F2: a foreign Barrier closes one too early")
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


@pytest.mark.xfail(strict=True, reason="issue 39 F3: a foreign Broadcast is the next one's")
@pytest.mark.parametrize("world", [2, 3])
def test_f3_a_strangers_broadcast_never_reaches_the_next_session(stack, world):
    with client.channel(stack.target, stack.host(STRANGER)) as ch:
        request = pb.BroadcastRequest(value=0xBAD, rank=0, num_workers=world, root=0)
        assert client.call(ch, "Sync", "Broadcast")(request, timeout=30).value == 0xBAD
    switches = stack.setup_all(2)
    assert {s.session_id for s in switches} == {switches[0].session_id} != {0xBAD}
    exchange(stack, 2, switches[0], seed=3)


@pytest.mark.xfail(strict=True, reason="issue 39 F4: never-completing Barriers hold the pool")
def test_f4_a_flood_of_barriers_does_not_block_a_session():
    """More never-completing Barriers (num_workers beyond any session) than the server has
    threads, from the stranger: a session of two must still set up."""
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
            for f in flood:
                f.cancel()
        exchange(stack, 2, switches[0], seed=4)
    finally:
        stack.close()


@pytest.mark.xfail(strict=True, reason="issue 39 F5: a half-registered session never expires")
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


@pytest.mark.xfail(strict=True, reason="issue 39 F6: any 64-bit MAC is registered")
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
