"""A seeded fuzz of the control protocol (the fuzz half; test_control_auth.py tests the limits):
random, oversized, truncated and ill-typed requests to the control endpoint, on connections of their
own, while a job is live. Every request must get an answer that says what is wrong (or, for a line
over the length limit, an answer and a closed connection); the server must keep answering; and once
the fuzzing connections are closed (closing one deletes whatever job it created, as for a crashed
worker) the server's and the backend's state must be what it was before.

The first fuzz proves the deployment secret on every request, so that the fields behind the
credential check are reached; the second fuzzes the credentials themselves (missing, ill-typed,
wrong-secret, stale and replayed proofs; missing, wrong and other jobs' tokens) against the live
job too: none of those requests may succeed (only ping needs no credential), and the state must
stay unchanged after every single one.
"""

from __future__ import annotations

import json
import random
import socket
import time

import pytest
from harness.ranks import soft_cluster

from hostlib.rendezvous import ControlClient
from xdp_agg.ctl.auth import Limits
from xdp_agg.ctl.server import MAX_LINE
from xdp_agg.proto import control

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


def _request(rng: random.Random, secret: bytes | None = None) -> bytes:
    """A random line; with `secret`, a request object proves it (so its fields are read)."""
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
    if secret is not None:
        req["auth"] = control.prove(secret, req)
    text = json.dumps(req, allow_nan=True)
    if kind == 2:  # truncated
        text = text[: rng.randrange(1, len(text))]
    return text.encode() + b"\n"


def _state(cl) -> tuple:
    jobs = sorted(json.dumps(j, sort_keys=True) for j in cl.aggregator.jobs())
    return jobs, sorted(cl.server.registry.jobs)


# the fuzz sends far faster than the rate limit allows: test_control_auth tests that limit
FAST = Limits(rate=1e6, burst=1_000_000)


def test_random_requests_get_errors_and_change_nothing():
    rng = random.Random(1207)
    with soft_cluster(limits=FAST) as cl:
        keeper = ControlClient(cl.server.address, timeout=5, secret=cl.secret)
        keeper.request("create", job="live", world_size=2, elems=64, window=4, worker_port=40000)
        before = _state(cl)
        answers = errors = 0
        for _ in range(8):  # connections, each with a few hundred requests
            with socket.create_connection(cl.server.address, timeout=5) as s:
                f = s.makefile("rb")
                for _ in range(250):
                    s.sendall(_request(rng, cl.secret))
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


def _bad_credentials(
    rng: random.Random, req: dict, secret: bytes, seen: list, tokens: list[tuple[str, str]]
):
    """req with credentials that must not pass: none, ill-typed, a wrong secret's, a stale or a
    replayed proof, a wrong token or another job's."""
    kind = rng.randrange(8)
    if kind == 1:
        req["auth"] = rng.choice(ODD)
    elif kind == 2:  # the right shape, a wrong secret
        req["auth"] = control.prove(b"not-the-deployment-secret", req)
    elif kind == 3:  # the right secret, ten minutes old
        req["auth"] = control.prove(secret, req, now=time.time() - 600)
    elif kind == 4 and seen:  # a proof the server accepted before, replayed
        req["auth"] = rng.choice(seen)
    elif kind == 5:  # a valid proof of another request (a field changed after proving)
        req["auth"] = control.prove(secret, {**req, "rank": 63})
        req["rank"] = 62
    elif kind == 6:
        req["token"] = rng.choice(ODD)
    elif kind == 7:  # another job's token, or a made-up one
        req["token"] = rng.choice([t for job, t in tokens if job != req.get("job")])
    return req


def test_requests_without_valid_credentials_change_nothing():
    rng = random.Random(1208)
    with soft_cluster(limits=FAST) as cl:
        keeper = ControlClient(cl.server.address, timeout=5, secret=cl.secret)
        keeper.request("create", job="live", world_size=2, elems=64, window=4, worker_port=40000)
        keeper.request("create", job="other", world_size=2, elems=64, window=4, worker_port=4001)
        live_token = keeper.tokens["live"]
        # proofs the server has accepted (each once): replaying one must fail
        seen = []
        for _ in range(5):
            req = {"op": "status", "job": "live"}
            req["auth"] = control.prove(cl.secret, req)
            keeper._sock.sendall(json.dumps(req).encode() + b"\n")
            assert json.loads(keeper._rfile.readline())["ok"]
            seen.append(req["auth"])
        tokens = [
            ("other", keeper.tokens["other"]),
            ("live", live_token),
            ("", control.new_token()),
            ("", live_token[:-1] + ("A" if live_token[-1] != "A" else "B")),
            ("", ""),
        ]
        before = _state(cl)
        jobs = ["live", "live", "other", "nope", rng.choice(ODD)]
        refused = 0
        for _ in range(6):
            with socket.create_connection(cl.server.address, timeout=5) as s:
                f = s.makefile("rb")
                for _ in range(200):
                    req = {"op": rng.choice(OPS[:5])}
                    for name in rng.sample(FIELDS, rng.randrange(len(FIELDS))):
                        req[name] = rng.choice(ODD)
                    req["job"] = rng.choice(jobs)
                    # a token is checked once the job exists: waiting for a job that never comes
                    # would only slow the fuzz down (a wait is capped by the barrier timeout)
                    req.pop("wait", None)
                    if req["op"] == "register" and rng.random() < 0.5:  # else often rejected early
                        req.update(rank=rng.randrange(2), port=40000)
                    req = _bad_credentials(rng, req, cl.secret, seen, tokens)
                    s.sendall(json.dumps(req, allow_nan=True).encode() + b"\n")
                    answer = json.loads(f.readline())
                    if req["op"] == "leave" and answer.get("ok"):
                        # leaving a job that does not exist is fine and changes nothing
                        assert req["job"] not in ("live", "other") and answer["deleted"], req
                    else:
                        assert not answer["ok"], (req, answer)
                        assert isinstance(answer["error"], str) and answer["error"]
                        refused += 1
                    assert "token" not in answer
                    assert _state(cl) == before, req
        assert refused > 1000
        # the live job still works for its holder, with the same token
        assert keeper.request("status", job="live")["token"] == live_token
        assert _state(cl) == before
        keeper.close()
