"""A seeded fuzz of the control protocol (issue 12, item 2, the fuzz part): random, oversized,
truncated and ill-typed requests to the control endpoint, on connections of their own, while a
job is live. Every request must get an answer that says what is wrong (or, for a line over the
length limit, an answer and a closed connection); the server must keep answering; and once the
fuzzing connections are closed (closing one deletes whatever job it created, as for a crashed
worker) the server's and the backend's state must be what it was before.
"""

from __future__ import annotations

import json
import random
import socket
import time

import pytest
from hostlib_fixtures import soft_cluster

from aggctl.server import MAX_LINE
from hostlib.rendezvous import ControlClient

pytestmark = pytest.mark.timeout(120)

OPS = ["create", "register", "leave", "status", "diagnose", "ping", "nope", "", "CREATE", None, 7]
FIELDS = [
    "job",
    "world_size",
    "elems",
    "window",
    "worker_port",
    "rank",
    "port",
    "ip",
    "mac",
    "timeout",
    "wait",
    "op",
]
ODD = [
    None,
    True,
    -1,
    0,
    1,
    2**31,
    2**64,
    -(2**63),
    1.5,
    float("nan"),
    "",
    "x",
    "0",
    "a" * 300,
    [],
    [1, 2],
    {},
    {"a": 1},
    "198.18.0.1",
    "256.1.1.1",
    "02:00:00:00:00:01",
    "bad-mac",
]


def _request(rng: random.Random) -> bytes:
    kind = rng.randrange(6)
    if kind == 0:  # random bytes, ended like a line
        return (
            bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))).replace(b"\n", b"")
            + b"\n"
        )
    if kind == 1:  # JSON that is not an object
        return json.dumps(rng.choice([[1, 2], "create", 3, None, True])).encode() + b"\n"
    req = {"op": rng.choice(OPS)}
    for f in rng.sample(FIELDS, rng.randrange(len(FIELDS))):
        req[f] = rng.choice(ODD)
    text = json.dumps(req, allow_nan=True)
    if kind == 2:  # truncated
        text = text[: rng.randrange(1, len(text))]
    return text.encode() + b"\n"


def _state(cl) -> tuple:
    jobs = sorted(json.dumps(j, sort_keys=True) for j in cl.aggregator.jobs())
    return jobs, sorted(cl.server._jobs)


def test_random_requests_get_errors_and_change_nothing():
    rng = random.Random(1207)
    with soft_cluster() as cl:
        keeper = ControlClient(cl.server.address, timeout=5)
        keeper.request("create", job="live", world_size=2, elems=64, window=4, worker_port=40000)
        before = _state(cl)
        answers = errors = 0
        for _ in range(8):  # connections, each with a few hundred requests
            with socket.create_connection(cl.server.address, timeout=5) as s:
                f = s.makefile("rb")
                for _ in range(250):
                    s.sendall(_request(rng))
                    line = f.readline()
                    assert line, "the server closed a connection over a request of normal size"
                    answer = json.loads(line)
                    answers += 1
                    if not answer.get("ok"):
                        errors += 1
                        assert isinstance(answer.get("error"), str) and answer["error"]
        # an oversized line: an error answer, then the connection is closed
        with socket.create_connection(cl.server.address, timeout=5) as s:
            s.sendall(b'{"op": "ping", "pad": "' + b"x" * (MAX_LINE + 10) + b'"}\n')
            f = s.makefile("rb")
            answer = json.loads(f.readline())
            assert not answer["ok"] and "long" in answer["error"]
            assert f.readline() == b""
        assert keeper.request("ping")["ok"]  # still serving, and the live job's holder still works
        assert keeper.request("status", job="live")["ok"]
        assert errors > 0.9 * answers  # nearly all of them are refused
        for _ in range(50):  # jobs the fuzz created die with their connections
            if _state(cl) == before:
                break
            time.sleep(0.1)
        assert _state(cl) == before
        keeper.close()
