"""p4app-switchML's controller API (xdp_agg.ctl.switchml_grpc) in front of a soft aggregator, no
root: p4app's call sequence replayed (tests/switchml_grpc_client.py) for 1, 2 and 4 workers, each
from its own address (tests/switchml_grpc_stack.py), then each worker's two threads send requests
built as p4app's BuildPacket builds them from their own source ports; every result exact and at
the port that sent its request. Sessions replacing each other, a worker that never calls
UdpSession, the port taken, RdmaSession refused, and the .proto file read by protoc into the
descriptor xdp_agg.ctl.switchml_proto builds. What strangers can do:
test_switchml_grpc_strangers.py.
"""

from __future__ import annotations

from concurrent import futures

import pytest

grpc = pytest.importorskip("grpc")

import switchml_grpc_client as client  # noqa: E402  (needs grpc)
import switchml_grpc_stack as stack_mod  # noqa: E402
from switchml_grpc_stack import PER_THREAD, SWITCH_MAC, THREADS, K, Stack  # noqa: E402

from xdp_agg.ctl import switchml_proto as pb  # noqa: E402
from xdp_agg.ctl.fields import RequestError  # noqa: E402
from xdp_agg.ctl.registry import SESSION, Holder  # noqa: E402
from xdp_agg.ctl.switchml_grpc import AGG_PORT, start_server  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def stack():
    s = Stack()
    yield s
    s.close()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_replay_p4app_setup_then_two_threads_per_worker(stack, world):
    switches = stack.setup_all(world)
    assert len({s.session_id for s in switches}) == 1
    assert {(s.mac, s.ip) for s in switches} == {(SWITCH_MAC, stack.agg_ip)}
    (job,) = stack.agg.jobs()
    assert (job["agg_port"], job["slot_base"], job["elems"]) == (AGG_PORT, 0, K)
    assert sorted((w["index"], w["ip"]) for w in job["workers"]) == [
        (r, stack.worker(r)[0]) for r in range(world)
    ]
    stack_mod.exchange(stack, world, switches[0], seed=world)
    assert stack.agg.counters(job["job_id"])["completed"] == THREADS * PER_THREAD
    assert stack.api.events == {
        "sessions_opened": 1,
        "ranks_registered": world,
        "sessions_complete": 1,
    }


def test_a_second_session_replaces_the_first(stack):
    first = stack.setup_all(2)[0]
    second = stack.setup_all(2)[0]
    assert second.session_id != first.session_id
    (job,) = stack.agg.jobs()  # the first session's job is gone
    assert [j["key"] for j in stack.endpoint.registry.snapshot()["jobs"]] == [stack.api.session_key]
    assert stack.api.session_key == f"switchml-{second.session_id:#x}"
    stack_mod.exchange(stack, 2, second, seed=7)
    assert stack.api.ended == {"replaced": 1}  # rank 0 called from a host of the first
    assert stack.api.events["sessions_opened"] == 2


def test_no_lease_ends_a_session_job(stack):
    from xdp_agg.ctl.lease import JobLease

    stack.setup_all(2)
    # a job of the JSON protocol beside it, whose ranks went quiet
    reg = stack.endpoint.registry
    reg.open_job(Holder.connection(7), "plain", 2, 32, 8, 5000, leased=True)
    reg.jobs["plain"].complete = True
    lease = JobLease(stack.endpoint.registry, seconds=1e-9)
    lease.sweep()
    assert lease.sweep() == ["plain"]
    assert [j["key"] for j in stack.endpoint.registry.snapshot()["jobs"]] == [stack.api.session_key]


def test_a_worker_that_never_calls_udp_session_times_the_barrier_out():
    stack = Stack(barrier_timeout=0.5)
    try:
        with pytest.raises(grpc.RpcError) as err:
            stack.setup(0, 2)  # rank 1 never comes
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "rank(s) [1] have not called UdpSession" in err.value.details()
        assert "its job is ended" in err.value.details()
        assert stack.agg.jobs() == [] and stack.endpoint.registry.snapshot()["jobs"] == []
        assert stack.api.events["barrier_timeouts"] == 1
        assert stack.api.events["sessions_ended"] == 1
    finally:
        stack.close()


def _rank1_refused(stack: Stack, rank1, code: grpc.StatusCode, why: str) -> None:
    """Rank 0's p4app setup beside `rank1` (a function) in a thread: rank 1 is refused with
    `code`, saying `why`; rank 0 waits in vain for rank 1's UdpSession, and no job is left."""
    with futures.ThreadPoolExecutor(1) as pool:
        other = pool.submit(rank1)
        with pytest.raises(grpc.RpcError) as err0:
            stack.setup(0, 2)
        with pytest.raises(grpc.RpcError) as err1:
            other.result()
    assert err1.value.code() == code
    assert why in err1.value.details()
    assert err0.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "rank(s) [1] have not called UdpSession, its job is ended" in err0.value.details()
    assert stack.agg.jobs() == []


def test_a_rank_past_the_first_barrier_without_udp_session_is_refused_at_its_second():
    """Rank 1 calls Broadcast, Barrier, Barrier and no UdpSession: its second Barrier is refused
    at once; rank 0 waits in the last barrier until the timeout (5 s), which ends the job. (A
    stranger can make the same calls: they must not end a session, so they fail only the
    caller.)"""
    stack = Stack(barrier_timeout=5.0)
    try:

        def rank1_without_session():
            with client.channel(stack.target, stack.worker(1)[0]) as ch:
                client.call(ch, "Sync", "Broadcast")(
                    pb.BroadcastRequest(value=0, rank=1, num_workers=2, root=0), timeout=30
                )
                barrier = client.call(ch, "Sync", "Barrier")
                barrier(pb.BarrierRequest(num_workers=2), timeout=30)
                barrier(pb.BarrierRequest(num_workers=2), timeout=30)

        _rank1_refused(
            stack,
            rank1_without_session,
            grpc.StatusCode.FAILED_PRECONDITION,
            "first barrier and has not called UdpSession",
        )
        assert stack.api.ended == {"failed": 1}
    finally:
        stack.close()


def test_refused_when_the_aggregator_port_is_taken(stack):
    stack.endpoint.registry.open_job(SESSION, "other", 2, 32, 8, 5000, port=AGG_PORT, base=100)
    with pytest.raises(grpc.RpcError) as err:
        stack.setup(0, 1)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "aggregator port 0xbee0 is used by a live job" in err.value.details()
    assert [j["key"] for j in stack.endpoint.registry.snapshot()["jobs"]] == ["other"]


def test_registry_refuses_slots_in_use_naming_each_range_once(stack):
    """F7: the refusal listed each used range twice (the registry's job and the backend's)."""
    stack.endpoint.registry.open_job(SESSION, "a", 2, 32, 8, 5000, port=AGG_PORT + 1, base=0)
    with pytest.raises(RequestError, match=r"slots 4..11 are not free") as err:
        stack.endpoint.registry.open_job(SESSION, "b", 2, 32, 8, 5000, port=AGG_PORT + 2, base=4)
    assert "(used: [(0, 8)])" in str(err.value)


def test_who_holds_a_job_is_a_holder_of_its_kind(stack):
    """A session's job and a recovered rank are held by holders of their own kind: no
    connection, whatever its number, lets go of them (they were ints that could collide)."""
    reg = stack.endpoint.registry
    reg.open_job(SESSION, "s", 2, 32, 8, 5000, port=AGG_PORT + 1, base=0)
    reg.open_job(Holder.recovered(1), "r", 2, 32, 8, 5000, leased=True)
    for conn in (-1_000_000, -2, -1, 0, 1, 2):  # the old session and recovered-rank numbers
        assert not reg.holds_job(conn)
        reg.connection_closed(conn)
    assert sorted(j["key"] for j in reg.snapshot()["jobs"]) == ["r", "s"]
    assert reg.jobs["s"].holders == {SESSION}
    assert len({Holder.connection(1), Holder.recovered(1), SESSION}) == 3


def test_rdma_session_is_unimplemented(stack):
    with client.channel(stack.target, stack.worker(0)[0]) as ch:
        with pytest.raises(grpc.RpcError) as err:
            client.call(ch, "Session", "RdmaSession")(pb.RdmaSessionRequest(rank=0), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "RdmaSession is not supported" in err.value.details()


def test_a_port_in_use_is_refused_clearly(stack):
    host, port = stack.target.rsplit(":", 1)
    with pytest.raises(OSError, match="cannot listen on"):
        start_server(stack.api, host, int(port))


def test_the_proto_file_is_the_descriptor_built_in_code(tmp_path):
    protoc = pytest.importorskip("grpc_tools.protoc")
    from pathlib import Path

    from google.protobuf import descriptor_pb2

    import xdp_agg.ctl

    src = Path(xdp_agg.ctl.__file__).parent
    out = tmp_path / "switchml.pb"
    assert protoc.main(["protoc", f"-I{src}", f"--descriptor_set_out={out}", "switchml.proto"]) == 0
    (fd,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    ours = pb.file_descriptor()
    fd.ClearField("source_code_info")
    ours.ClearField("source_code_info")
    assert fd == ours


def test_the_serve_option_takes_an_address_and_defaults_the_port():
    import click

    from xdp_agg.app.options import switchml_address

    assert switchml_address(None, None, "198.18.0.1") == ("198.18.0.1", 50099)
    assert switchml_address(None, None, "198.18.0.1:7000") == ("198.18.0.1", 7000)
    assert switchml_address(None, None, None) is None
    for bad in (":50099", "198.18.0.1:0", "agg:50099", ""):
        with pytest.raises(click.BadParameter, match="ADDRESS"):
            switchml_address(None, None, bad)


def test_a_failed_run_leaves_no_broadcast_for_the_next():
    """Rank 0 broadcasts a session id, rank 1 never comes: the barrier times out; the next
    run's rank 1 must get the next run's id, not the failed run's."""
    stack = Stack(barrier_timeout=0.5)
    try:
        with pytest.raises(grpc.RpcError):
            stack.setup(0, 2)
        stack.api.settings.barrier_timeout = 30.0
        switches = stack.setup_all(2)
        assert switches[0].session_id == switches[1].session_id
        assert stack.api.events["sessions_complete"] == 1
    finally:
        stack.close()


def test_a_rank_with_another_packet_size_is_refused():
    """Rank 1 asks for 256-element packets in a 64-element session: refused; rank 0's last
    barrier then times out (5 s: the first barrier, which both pass, must not) and ends the
    job."""
    stack = Stack(barrier_timeout=5.0)
    try:
        _other_size_refused(stack)
    finally:
        stack.close()


def _other_size_refused(stack: Stack) -> None:
    def rank1_other_size():
        ip, mac = stack.worker(1)
        return client.setup_switch(
            stack.target, rank=1, world=2, mac=mac, ip=ip, packet_numel=256, timeout=30, source=ip
        )

    _rank1_refused(
        stack, rank1_other_size, grpc.StatusCode.INVALID_ARGUMENT, "packet_size 3, but session"
    )


def test_bmv2_answers_the_port_a_worker_is_behind_or_says_why_not():
    from xdp_agg.app.serving import bmv2_port_address

    class Ports:  # Bmv2Backend.uplink_address's contract
        def uplink_address(self, ip):
            if ip.startswith("198.18.1."):
                return "198.18.1.1", "02:00:00:00:01:01"
            raise ValueError("the parent ... (Bmv2Backend.set_parent_port)")

    find = bmv2_port_address(Ports())
    assert find("198.18.1.2") == ("198.18.1.1", "02:00:00:00:01:01")
    with pytest.raises(ValueError, match="worker's address 198.18.9.2") as err:
        find("198.18.9.2")
    assert "parent" not in str(err.value)
