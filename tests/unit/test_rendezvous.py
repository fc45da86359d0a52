"""The control endpoint: allocation, the register barrier, teardown, status and errors."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from harness.ranks import soft_cluster

from hostlib.errors import RendezvousError
from hostlib.rendezvous import ControlClient, parse_endpoint
from xdp_agg.ctl.registry import _first_fit
from xdp_agg.ctl.server import ControlEndpoint
from xdp_agg.proto import control, wire

pytestmark = pytest.mark.timeout(60)


def client(cluster, rank: int | None = None) -> ControlClient:
    src = cluster.worker_ip(rank) if rank is not None else None
    return ControlClient(cluster.server.address, timeout=5, source_ip=src, secret=cluster.secret)


def create(c: ControlClient, job="j", world_size=2, window=4, elems=64, worker_port=40000):
    return c.request(
        "create",
        job=job,
        world_size=world_size,
        elems=elems,
        window=window,
        worker_port=worker_port,
    )["job"]


def register_all(cluster, job: str, n: int, port=40000, timeout=5.0):
    """Register ranks 0..n-1 concurrently (their own connections); (clients, answers)."""
    clients = [client(cluster, r) for r in range(n)]
    answers: list = [None] * n

    def reg(r):
        try:
            answers[r] = clients[r].request(
                "register", job=job, rank=r, port=port, timeout=timeout, reply_timeout=timeout + 5
            )
        except RendezvousError as e:
            answers[r] = e

    threads = [threading.Thread(target=reg, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return clients, answers


def test_create_allocates_ids_slots_and_ports(soft):
    cl = soft
    c = client(cl)
    a = create(c, "a", window=4)
    b = create(c, "b", window=8)
    assert (a["job_id"], a["slot_base"], a["slot_count"], a["agg_port"]) == (0, 0, 4, 0xBEE0)
    assert (b["job_id"], b["slot_base"], b["slot_count"], b["agg_port"]) == (1, 4, 8, 0xBEE1)
    assert a["send_to"] == [cl.agg_ip, 0xBEE0] and a["group"] is None
    assert a["worker_port"] == 40000 and a["key"] == "a" and a["window"] == 4
    assert [j["job_id"] for j in cl.aggregator.jobs()] == [0, 1]
    with pytest.raises(RendezvousError, match="'a' already exists"):
        create(c, "a")
    c.close()  # the creator's connection was the only holder: both jobs go
    deadline = time.monotonic() + 5
    while cl.aggregator.jobs() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cl.aggregator.jobs() == []
    c2 = client(cl)
    again = create(c2, "a", window=2)  # id, port and slots are free again
    assert (again["job_id"], again["slot_base"], again["agg_port"]) == (0, 0, 0xBEE0)
    c2.close()


def test_first_fit():
    assert _first_fit([], 4, 16) == 0
    assert _first_fit([(0, 4), (8, 12)], 4, 16) == 4
    assert _first_fit([(0, 4), (6, 12)], 4, 16) == 12
    assert _first_fit([(0, 4), (6, 14)], 4, 16) is None


def test_pool_and_port_exhaustion_are_explained():
    with soft_cluster(defaults={"pool_slots": 8}) as cl:
        c = client(cl)
        create(c, "a", window=6)
        with pytest.raises(RendezvousError, match="no 4 contiguous free slots"):
            create(c, "b", window=4)
        with pytest.raises(RendezvousError, match=r"window.*not in 1\.\.8"):
            create(c, "b", window=9)
        create(c, "b", window=2)
        c.close()
    with soft_cluster() as cl:
        c = client(cl)
        for i in range(16):
            create(c, f"j{i}", window=1)
        with pytest.raises(RendezvousError, match="all 16 aggregator ports"):
            create(c, "j16", window=1)
        c.close()


def test_register_barrier_answers_everyone_with_the_job(soft):
    cl = soft
    c0 = client(cl, 0)
    create(c0, "j", world_size=3)
    clients, answers = register_all(cl, "j", 3)
    for r, ans in enumerate(answers):
        assert not isinstance(ans, Exception), ans
        job = ans["job"]
        assert job["world_size"] == 3 and job["send_to"] == [cl.agg_ip, 0xBEE0]
        assert job["workers"] == [
            {"rank": i, "ip": cl.worker_ip(i), "port": 40000} for i in range(3)
        ]
    workers = cl.aggregator.jobs()[0]["workers"]
    assert [(w["index"], w["ip"], w["agg_port"]) for w in workers] == [
        (i, cl.worker_ip(i), 0xBEE0) for i in range(3)
    ]
    st = c0.request("status", job="j")
    assert st["state"] == "ready" and st["registered"] == [0, 1, 2] and st["missing"] == []
    # every rank leaves: the job is deleted
    for r, c in enumerate(clients):
        assert c.request("leave", job="j", rank=r)["deleted"] is False  # c0 holds it
    assert c0.request("status", job="j")["left"] == [0, 1, 2]
    c0.close()
    deadline = time.monotonic() + 5
    while cl.aggregator.jobs() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cl.aggregator.jobs() == []
    for c in clients:
        c.close()


def test_barrier_deadline_names_the_missing_ranks(soft):
    cl = soft
    c0 = client(cl, 0)
    create(c0, "j", world_size=4)
    t0 = time.monotonic()
    clients, answers = register_all(cl, "j", 2, timeout=0.5)  # ranks 2 and 3 never come
    assert time.monotonic() - t0 < 5
    for ans in answers:
        assert isinstance(ans, RendezvousError)
        assert "barrier timeout" in str(ans) and "rank(s) 2, 3 of 4" in str(ans)
    for c in clients + [c0]:
        c.close()


def test_register_errors(soft):
    cl = soft
    c = client(cl, 0)
    with pytest.raises(RendezvousError, match="no job 'nope'.*rank 0 creates it"):
        c.request("register", job="nope", rank=0, port=1)
    create(c, "j", world_size=2)
    with pytest.raises(RendezvousError, match="rank 2 is out of range"):
        c.request("register", job="j", rank=2, port=1)
    with pytest.raises(RendezvousError, match="'port' must be an integer"):
        c.request("register", job="j", rank=0, port="x")
    with pytest.raises(RendezvousError, match="not an IPv4"):
        c.request("register", job="j", rank=0, port=1, ip="nowhere")
    # a rank registered twice: the second is refused while the first waits at the barrier
    first = client(cl, 0)
    t = threading.Thread(
        target=lambda: _swallow(first.request, "register", job="j", rank=0, port=1, timeout=2)
    )
    t.start()
    time.sleep(0.3)
    with pytest.raises(RendezvousError, match="rank 0 of job 'j' is already registered"):
        c.request("register", job="j", rank=0, port=1)
    t.join(10)
    first.close()
    c.close()


def _swallow(fn, *a, **kw):
    try:
        fn(*a, **kw)
    except RendezvousError:
        pass


def test_a_rank_lost_during_the_barrier_fails_it_at_once(soft):
    cl = soft
    c0 = client(cl, 0)
    create(c0, "j", world_size=3)
    c1 = client(cl, 1)
    answer = []
    t = threading.Thread(
        target=lambda: _record(
            answer, c1.request, "register", job="j", rank=1, port=40000, timeout=20
        )
    )
    t.start()
    c2 = client(cl, 2)
    # rank 2 registers on a connection that closes while rank 1 waits: a raw socket, so
    # that it can go away without waiting for its own (never coming) answer
    raw = socket.create_connection(cl.server.address, timeout=5)
    req = {"op": "register", "job": "j", "rank": 2, "port": 40000, "timeout": 20}
    raw.sendall(json.dumps({**req, "token": c0.tokens["j"]}).encode() + b"\n")
    time.sleep(0.3)
    t0 = time.monotonic()
    raw.close()
    t.join(10)
    assert time.monotonic() - t0 < 5
    assert answer and "rank(s) 2 of job 'j' left or lost their connection" in str(answer[0])
    for c in (c0, c1, c2):
        c.close()


def test_status_waits_for_the_job_to_be_created(soft):
    cl = soft
    waiter = client(cl, 1)
    got = {}
    t = threading.Thread(target=lambda: got.update(waiter.request("status", job="late", wait=5.0)))
    t.start()
    time.sleep(0.3)
    assert not got
    c0 = client(cl, 0)
    create(c0, "late", worker_port=40123)
    t.join(10)
    assert got["job"]["worker_port"] == 40123 and got["state"] == "registering"
    assert got["missing"] == [0, 1]
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match="no job 'other' after waiting 0.3 s"):
        waiter.request("status", job="other", wait=0.3)
    assert time.monotonic() - t0 < 3
    assert [j["job"]["key"] for j in waiter.request("status")["jobs"]] == ["late"]
    waiter.close()
    c0.close()


def test_diagnose_reports_counters_and_lagging_ranks():
    import numpy as np

    with soft_cluster() as cl:
        c0 = client(cl, 0)
        create(c0, "j", world_size=2, elems=32)
        clients, answers = register_all(cl, "j", 2)
        job = answers[0]["job"]
        # rank 0 contributes to two slots, rank 1 to none
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((cl.worker_ip(0), 40000))
            for slot in (0, 1):
                msg = wire.Message(
                    msg_type=1,
                    size=0,
                    job_number=0,
                    tsi=slot,
                    slot=slot,
                    version=0,
                    e0=0,
                    e1=0,
                    values=np.zeros(32, np.int32),
                )
                s.sendto(msg.to_bytes(), tuple(job["send_to"]))
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                d = c0.request("diagnose", job="j")
                if d["counters"]["0"]["contributions"] == 2:
                    break
                time.sleep(0.02)
        assert d["counters"]["0"]["contributions"] == 2
        assert d["lagging"] == {"1": 0} and d["most_contributions"] == 2
        assert d["reasons"] == {"aggregated": 2} and d["absent"] == []
        clients[1].close()  # rank 1's connection drops: it is gone
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not d["left"]:
            d = c0.request("diagnose", job="j")
            time.sleep(0.02)
        assert d["left"] == [1] and d["absent"] == [1] and d["state"] == "closing"
        with pytest.raises(RendezvousError, match="shutting down"):
            client(cl, 1).request("register", job="j", rank=1, port=40000)
        c0.close()
        clients[0].close()


def test_bad_requests_get_explanations():
    def proven(req: dict) -> bytes:  # a create that proves the secret, so its fields are read
        return json.dumps({**req, "auth": control.prove(cl.secret, req)}).encode() + b"\n"

    with soft_cluster() as cl:
        with socket.create_connection(cl.server.address, timeout=5) as s:
            f = s.makefile("rwb")
            for line, expect in [
                (b"not json\n", "not JSON"),
                (b"[1, 2]\n", "JSON object"),
                (b'{"op": "fly"}\n', "unknown op 'fly'"),
                (b'{"op": "create", "job": ""}\n', "needs proof of the deployment secret"),
                (proven({"op": "create", "job": ""}), "non-empty job name"),
                (
                    proven(
                        {
                            "op": "create",
                            "job": "x",
                            "world_size": 2,
                            "elems": 100,
                            "window": 1,
                            "worker_port": 5,
                        }
                    ),
                    "not a wire size",
                ),
                (b'{"op": "ping"}\n', None),
            ]:
                f.write(line)
                f.flush()
                ans = json.loads(f.readline())
                if expect is None:
                    assert ans == {
                        "ok": True,
                        "version": 1,
                        "elems": sorted(wire.SIZE_CODE_ELEMS.values()),
                    }
                else:
                    assert ans["ok"] is False and expect in ans["error"], ans


def test_fill_worker_hook_and_refusal_by_backend():
    seen = []

    def fill(ws, local):
        seen.append((ws.index, ws.ip, local[0]))
        ws.extra["ifindex"] = 7

    with soft_cluster() as cl:
        cl.server.registry.fill_worker = fill
        c = client(cl, 0)
        create(c, "j", world_size=1)
        ans = c.request("register", job="j", rank=0, port=40000, mac="02:00:00:00:00:01")
        assert ans["job"]["workers"][0]["ip"] == cl.worker_ip(0)
        assert seen == [(0, cl.worker_ip(0), cl.agg_ip)]
        w = cl.aggregator.jobs()[0]["workers"][0]
        assert w["extra"] == {"ifindex": 7} and w["mac"] == "02:00:00:00:00:01"
        # another job gets another aggregator port, so the same worker address may join it
        create(c, "k", world_size=1)
        ans = c.request("register", job="k", rank=0, port=40000)
        assert ans["job"]["agg_port"] == 0xBEE1
        c.close()


def test_group_delivery_fixes_the_worker_port():
    with soft_cluster(defaults={"group_ip": "10.0.0.255"}) as cl:
        c = client(cl, 0)
        job = create(c, "j", world_size=1, worker_port=40001)
        assert job["group"] == ["10.0.0.255", 40001]
        with pytest.raises(RendezvousError, match="differs from the job's worker port 40001"):
            c.request("register", job="j", rank=0, port=40002)
        c.close()


def test_stop_wakes_a_blocked_barrier(soft):
    cl = soft
    c = client(cl, 0)
    create(c, "j", world_size=2)
    errors = []
    t = threading.Thread(
        target=lambda: _record(errors, c.request, "register", job="j", rank=0, port=1, timeout=30)
    )
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    cl.server.stop()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - t0 < 5
    assert errors and ("shutting down" in str(errors[0]) or "closed" in str(errors[0]))
    assert cl.aggregator.jobs() == []


def _record(errors, fn, *a, **kw):
    try:
        fn(*a, **kw)
    except RendezvousError as e:
        errors.append(e)


def test_parse_endpoint():
    assert parse_endpoint("10.0.0.1:7000") == ("10.0.0.1", 7000)
    assert parse_endpoint("host") == ("host", 48800)
    with pytest.raises(ValueError):
        parse_endpoint("host:port")


def test_unreachable_endpoint_is_explained():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(RendezvousError, match="cannot reach the control endpoint"):
        ControlClient(("127.0.0.1", port), timeout=2)


def test_server_defaults_validation():
    with pytest.raises(ValueError, match="unknown server defaults"):
        ControlEndpoint(object(), "127.0.0.1", 0, {"bogus": 1}, secret=None)
    with pytest.raises(ValueError, match="pool_slots"):
        ControlEndpoint(object(), "127.0.0.1", 0, {"pool_slots": 0}, secret=None)


def test_wire16_create_takes_the_element_width_into_the_job(soft):
    """create's wire_bits: 16 makes a 16-bit job (JobSpec.wire_bits, in the description and at
    the aggregator), absent 32; any other width is refused, naming the field."""
    c = client(soft)
    try:
        desc = c.request(
            "create", job="w16", world_size=2, elems=64, window=4, worker_port=40000, wire_bits=16
        )["job"]
        assert desc["wire_bits"] == 16
        assert soft.aggs[0]._specs[desc["job_id"]].wire_bits == 16
        assert create(c, job="w32")["wire_bits"] == 32
        for bad in (8, 24, "16", True):
            with pytest.raises(RendezvousError, match="'wire_bits'.*is not an element width"):
                c.request(
                    "create",
                    job="x",
                    world_size=2,
                    elems=64,
                    window=4,
                    worker_port=4,
                    wire_bits=bad,
                )
    finally:
        c.close()
