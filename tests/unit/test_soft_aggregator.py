"""SoftAggregator: the reference model behind real UDP sockets, driven with raw datagrams."""

from __future__ import annotations

import socket

import numpy as np
import pytest
from harness.ranks import loopback_prefix

from xdp_agg.proto import wire
from xdp_agg.proto.jobs import JobSpec, WorkerSpec
from xdp_agg.proto.limits import NO_JOB
from xdp_agg.targets.soft import SoftAggregator

pytestmark = pytest.mark.timeout(30)

K = 32


def udp(ip: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((ip, 0))
    s.settimeout(2.0)
    return s


def contribution(values, *, slot=0, version=0, tsi=7, e0=0) -> bytes:
    return wire.Message(
        msg_type=wire.MSG_TYPE_DATA,
        size=wire.size_code_for(K),
        job_number=3,
        tsi=tsi,
        slot=slot,
        version=version,
        e0=e0,
        e1=0,
        values=np.asarray(values, dtype=np.int32),
    ).to_bytes()


def no_datagram(s: socket.socket, wait: float = 0.2) -> bool:
    s.settimeout(wait)
    try:
        s.recv(65536)
        return False
    except socket.timeout:
        return True
    finally:
        s.settimeout(2.0)


@pytest.fixture
def setup():
    """A running aggregator with job 5 (2 workers, slots 10..13) and two worker sockets."""
    prefix = loopback_prefix()
    agg = SoftAggregator(f"{prefix}.1").start()
    port = wire.UDP_PORT + 3
    agg.create_job(
        JobSpec(job_id=5, num_workers=2, elems=K, slot_base=10, slot_count=4, agg_port=port)
    )
    socks = [udp(f"{prefix}.{2 + i}") for i in range(2)]
    for i, s in enumerate(socks):
        ip, p = s.getsockname()
        agg.add_worker(WorkerSpec(job_id=5, index=i, ip=ip, port=p, agg_port=port))
    yield agg, socks, (f"{prefix}.1", port)
    for s in socks:
        s.close()
    agg.stop()


def test_sum_goes_to_every_worker_and_retransmission_to_sender_only(setup):
    agg, (a, b), dest = setup
    x = np.arange(K, dtype=np.int32)
    y = np.full(K, 2**31 - 1, dtype=np.int32)  # the sum wraps modulo 2^32
    a.sendto(contribution(x, slot=11, e0=-3), dest)
    assert no_datagram(a)  # incomplete: nothing comes back
    b.sendto(contribution(y, slot=11, e0=4), dest)
    for s in (a, b):
        data, src = s.recvfrom(65536)
        m = wire.Message.from_bytes(data)
        assert src == dest  # from the job's aggregator port
        assert (m.slot, m.version, m.tsi, m.job_number, m.e0) == (11, 0, 7, 3, 4)
        assert np.array_equal(m.values, (x.astype(np.int64) + y).astype(np.int32))
    a.sendto(contribution(x, slot=11), dest)  # a retransmission: answered to a alone
    assert np.array_equal(wire.Message.from_bytes(a.recv(65536)).values, x + y)
    assert no_datagram(b)
    assert agg.counters(5) == {"aggregated": 1, "completed": 1, "retx_answered": 1}
    wc = agg.worker_counters(5)
    assert wc[0] == {"packets": 2, "contributions": 1, "duplicates": 1, "answered": 1, "dropped": 0}
    assert wc[1]["contributions"] == 1


def test_versions_and_duplicates_follow_the_state_machine(setup):
    agg, (a, b), dest = setup
    ones = np.ones(K, dtype=np.int32)
    a.sendto(contribution(ones, slot=10, version=1), dest)
    a.sendto(contribution(ones, slot=10, version=1), dest)  # duplicate while pending: dropped
    b.sendto(contribution(ones * 5, slot=10, version=1), dest)
    assert wire.Message.from_bytes(a.recv(65536)).values[0] == 6
    assert wire.Message.from_bytes(b.recv(65536)).values[0] == 6
    # next round of the same slot uses the other version and starts a fresh sum
    a.sendto(contribution(ones * 2, slot=10, version=0), dest)
    b.sendto(contribution(ones * 3, slot=10, version=0), dest)
    assert wire.Message.from_bytes(a.recv(65536)).values[0] == 5
    assert agg.counters(5)["dup_pending"] == 1


def test_bad_packets_are_dropped_and_counted(setup):
    agg, (a, b), dest = setup
    a.sendto(contribution(np.ones(K), slot=3), dest)  # outside 10..13
    a.sendto(b"\x13" + bytes(5), dest)  # truncated
    c = udp(f"{dest[0].rsplit('.', 1)[0]}.99")  # not registered
    c.sendto(contribution(np.ones(K), slot=10), dest)
    c.close()
    assert no_datagram(a)
    assert agg.counters(5) == {"drop_slot_range": 1}
    assert agg.worker_counters(5)[0]["dropped"] == 1
    # too short to hold the headers: the model drops it before finding its job
    assert agg.counters(NO_JOB) == {"drop_truncated": 1, "drop_unknown_source": 1}


def test_remove_worker_and_delete_job(setup):
    agg, (a, b), dest = setup
    agg.remove_worker(5, 1)
    b.sendto(contribution(np.ones(K), slot=10), dest)
    assert no_datagram(b)
    assert [w["index"] for w in agg.jobs()[0]["workers"]] == [0]
    agg.delete_job(5)
    assert agg.jobs() == []
    a.sendto(contribution(np.ones(K), slot=10), dest)
    assert no_datagram(a)


def test_contract_errors(setup):
    agg, (a, b), dest = setup
    port = dest[1]
    with pytest.raises(ValueError, match="overlap"):
        agg.create_job(JobSpec(job_id=6, num_workers=1, elems=K, slot_base=12, slot_count=4))
    with pytest.raises(ValueError, match="index"):
        agg.add_worker(WorkerSpec(job_id=5, index=2, ip="127.0.0.9", port=1, agg_port=port))
    with pytest.raises(ValueError, match="does not exist"):
        agg.add_worker(WorkerSpec(job_id=9, index=0, ip="127.0.0.9", port=1, agg_port=port))
    ip = a.getsockname()[0]
    with pytest.raises(ValueError, match="already worker 0"):
        agg.add_worker(WorkerSpec(job_id=5, index=1, ip=ip, port=1, agg_port=port))
    with pytest.raises(ValueError, match="listens on"):
        agg.add_worker(WorkerSpec(job_id=5, index=1, ip="127.0.0.9", port=1))


def test_gso_burst_is_split_into_datagrams(setup):
    """A worker's GSO send arrives as one GRO buffer; every segment is its own contribution."""
    from hostlib.udp_io import DatagramSocket

    agg, (a, b), dest = setup
    ip_a, port_a = a.getsockname()
    a.close()  # rebind worker 0's address with a batching socket
    ds = DatagramSocket((ip_a, port_a))
    rows = np.concatenate(
        [
            np.frombuffer(contribution(np.full(K, s), slot=10 + s, tsi=s), dtype=np.uint8)[None]
            for s in range(4)
        ]
    )
    assert ds.send_rows(rows, dest) == 4
    for s in range(4):
        b.sendto(contribution(np.full(K, 100), slot=10 + s, tsi=s), dest)
    got = sorted(wire.Message.from_bytes(b.recv(65536)).values[0] for _ in range(4))
    assert got == [100, 101, 102, 103]
    assert agg.counters(5)["completed"] == 4
    ds.close()


def test_stop_releases_ports():
    prefix = loopback_prefix()
    spec = JobSpec(job_id=0, num_workers=1, elems=K, slot_base=0, slot_count=1)
    with SoftAggregator(f"{prefix}.1") as agg:
        agg.create_job(spec)
    with SoftAggregator(f"{prefix}.1") as agg:  # the same port binds again
        agg.create_job(spec)
        assert agg.jobs()[0]["job_id"] == 0
