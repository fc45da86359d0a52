"""The control endpoint's authentication and limits, on loopback without root:
the deployment secret (its file, proofs that are missing, wrong, stale or replayed), job tokens
(one job's token cannot touch another job), where `xdp-agg serve` listens by default, and the
bounds (connections in all and per source, the idle cut, the request rate). Every refusal must
be an error answer that changes nothing.
"""

from __future__ import annotations

import json
import os
import queue
import select
import socket
import stat
import time

import numpy as np
import pytest
from harness.cli import xdp_agg_cli
from harness.ranks import in_threads, init, ok, run_ranks, soft_cluster

from hostlib.errors import AuthError, LimitError, RendezvousError
from hostlib.rendezvous import ControlClient
from xdp_agg.app import cli, serving
from xdp_agg.ctl.auth import Limits
from xdp_agg.proto import control

pytestmark = pytest.mark.timeout(60)

JOB = dict(world_size=2, elems=64, window=4, worker_port=40000)


def _state(cl) -> tuple:
    return sorted(json.dumps(j, sort_keys=True) for j in cl.aggregator.jobs()), sorted(
        cl.server.registry.jobs
    )


def _send(cl, req: dict, source: str | None = None) -> dict:
    """One raw request on a connection of its own; the answer."""
    with socket.create_connection(
        cl.server.address, timeout=5, source_address=(source, 0) if source else None
    ) as s:
        s.sendall(json.dumps(req).encode() + b"\n")
        return json.loads(s.makefile("rb").readline())


# --- the deployment secret ---------------------------------------------------------------------
def test_create_needs_a_valid_fresh_unreplayed_proof():
    with soft_cluster() as cl:
        before = _state(cl)
        req = {"op": "create", "job": "a", **JOB}
        cases = {
            "no proof": (req, "needs proof of the deployment secret"),
            "wrong secret": (
                {**req, "auth": control.prove(b"another-secret-entirely", req)},
                "proof of the deployment secret is wrong",
            ),
            "stale": (
                {**req, "auth": control.prove(cl.secret, req, now=time.time() - 3600)},
                "timestamp",
            ),
            "from the future": (
                {**req, "auth": control.prove(cl.secret, req, now=time.time() + 3600)},
                "timestamp",
            ),
            "another request's proof": (
                {**req, "world_size": 3, "auth": control.prove(cl.secret, req)},
                "is wrong",
            ),
            "ill-typed": ({**req, "auth": "yes"}, "'auth' must be"),
        }
        for what, (r, expect) in cases.items():
            answer = _send(cl, r)
            assert not answer["ok"] and answer["kind"] == "auth", (what, answer)
            assert expect in answer["error"], (what, answer)
            assert _state(cl) == before, what
        # a valid proof creates; the same bytes again are a replay, refused
        good = {**req, "auth": control.prove(cl.secret, req)}
        with socket.create_connection(cl.server.address, timeout=5) as s:
            f = s.makefile("rb")
            s.sendall(json.dumps(good).encode() + b"\n")
            first = json.loads(f.readline())
            assert first["ok"] and isinstance(first["token"], str) and len(first["token"]) >= 32
            after = _state(cl)
            s.sendall(json.dumps({**good, "job": "a"}).encode() + b"\n")
            replay = json.loads(f.readline())
            assert not replay["ok"] and "used before" in replay["error"]
            assert _state(cl) == after
        # the client library's errors say which kind of refusal it was
        with pytest.raises(AuthError, match="needs proof"):
            ControlClient(cl.server.address, timeout=5).request("create", job="b", **JOB)
        with pytest.raises(AuthError, match="is wrong"):
            ControlClient(cl.server.address, timeout=5, secret=b"x" * 32).request(
                "create", job="b", **JOB
            )


def test_listing_all_jobs_needs_the_secret_and_status_with_it_gives_the_token():
    with soft_cluster() as cl:
        owner = ControlClient(cl.server.address, timeout=5, secret=cl.secret)
        owner.request("create", job="a", **JOB)
        stranger = ControlClient(cl.server.address, timeout=5)
        with pytest.raises(AuthError, match="status of all jobs needs proof"):
            stranger.request("status")
        with pytest.raises(AuthError, match="without its token"):
            stranger.request("status", job="a", wait=5)  # refused at once, not after a wait
        assert [j["job"]["key"] for j in owner.request("status")["jobs"]] == ["a"]
        other = ControlClient(cl.server.address, timeout=5, secret=cl.secret)
        assert other.request("status", job="a")["token"] == owner.tokens["a"]
        assert "token" not in other.request("diagnose", job="a")
        # with the token alone, status works and does not hand out a token again
        holder = ControlClient(cl.server.address, timeout=5, tokens={"a": owner.tokens["a"]})
        assert "token" not in holder.request("status", job="a")
        for c in (owner, stranger, other, holder):
            c.close()


def test_one_jobs_token_cannot_touch_another_job():
    with soft_cluster() as cl:
        owner = ControlClient(cl.server.address, timeout=5, secret=cl.secret)
        owner.request("create", job="a", **JOB)
        owner.request("create", job="b", **JOB)
        ta, tb = owner.tokens["a"], owner.tokens["b"]
        assert ta != tb
        before = _state(cl)
        # A's token, used for B: every job op is refused and nothing changes
        for op, fields in [
            ("register", {"rank": 0, "port": 40000}),
            ("leave", {"rank": 0}),
            ("status", {}),
            ("diagnose", {}),
        ]:
            answer = _send(cl, {"op": op, "job": "b", "token": ta, **fields}, cl.worker_ip(0))
            assert not answer["ok"] and answer["kind"] == "auth", (op, answer)
            assert "wrong token" in answer["error"]
            answer = _send(cl, {"op": op, "job": "b", **fields}, cl.worker_ip(0))
            assert not answer["ok"] and answer["kind"] == "auth", (op, answer)
            assert _state(cl) == before, op
        # B's own token works
        c = ControlClient(cl.server.address, timeout=5, source_ip=cl.worker_ip(1), tokens={"b": tb})
        assert c.request("status", job="b")["registered"] == []
        assert c.request("diagnose", job="b")["absent"] == [0, 1]
        owner.close()
        c.close()


def test_a_rank_without_the_secret_joins_with_the_token_rank_0_hands_on():
    """rank 0 proves the secret and hands the token on before the barrier (on_token), the way
    hostlib.pt shares it through the store; rank 1 joins with the token alone."""
    with soft_cluster() as cl:
        handed: queue.Queue = queue.Queue()
        results: dict = {}

        def rank(r: int) -> None:
            try:
                kw = dict(job="t", ip=cl.worker_ip(r), elems=64, window=4, rendezvous_timeout=10)
                if r == 0:
                    kw.update(secret_file=cl.secret_file, on_token=handed.put)
                else:
                    kw.update(token=handed.get(timeout=10))
                with init(r, 2, cl.endpoint, **kw) as comm:
                    results[r] = (comm.allreduce(np.full(8, r + 1, np.int32)), comm.token)
            except Exception as e:
                results[r] = e

        assert not in_threads(rank, 2, 30)
        for r in range(2):
            assert not isinstance(results[r], Exception), results[r]
            got, token = results[r]
            assert got.tolist() == [3] * 8
        assert results[0][1] == results[1][1]
        # without the secret and without a token, rank 0 cannot create
        with pytest.raises(AuthError, match="create needs proof"):
            init(0, 1, cl.endpoint, job="u", ip=cl.worker_ip(3), secret_file=None)


def test_workers_read_the_secret_file_from_the_environment(monkeypatch):
    with soft_cluster() as cl:
        monkeypatch.setenv(control.SECRET_ENV, cl.secret_file)
        got = ok(run_ranks(cl, 2, lambda c: c.allreduce(np.ones(4, np.int32)), secret_file=None))
        assert [g.tolist() for g in got] == [[2] * 4] * 2


def test_secret_file_created_0600_and_a_readable_one_refused(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "lab.secret"
    secret = serving.secret_for(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert len(secret) == 2 * control.SECRET_BYTES and serving.secret_for(path) == secret
    monkeypatch.setenv("XDP_AGG_STATE_DIR", str(tmp_path / "state"))
    assert serving.default_secret_path("lab") == tmp_path / "state" / "lab.secret"
    loose = tmp_path / "loose.secret"
    loose.write_text("0123456789abcdef0123456789abcdef\n")
    os.chmod(loose, 0o644)
    with pytest.raises(control.SecretError, match="mode 0644"):
        control.load_secret(loose)
    with pytest.raises(AuthError, match="mode 0644"):
        init(0, 1, "127.0.0.1:1", secret_file=str(loose))
    r = xdp_agg_cli("serve", "--listen", "127.0.0.1:1", "--secret-file", str(loose))
    assert r.exit_code == cli.EXIT_FAILED and "chmod 600" in r.output, r.output
    short = tmp_path / "short.secret"
    short.write_text("abc")
    os.chmod(short, 0o600)
    with pytest.raises(control.SecretError, match="fewer than"):
        control.load_secret(short)
    with pytest.raises(control.SecretError, match="cannot read"):
        control.load_secret(tmp_path / "absent")


# --- where serve listens -----------------------------------------------------------------------
def test_serve_listens_on_the_interface_address_by_default(monkeypatch):
    addrs = {"eth1": ["198.18.7.1"], "p0": ["198.18.8.1"], "p1": ["198.18.9.1"], "bare": []}
    monkeypatch.setattr(serving.links, "addresses", lambda ifname: {"ipv4": addrs[ifname]})
    assert serving.listen_address(["eth1"]) == "198.18.7.1"
    with pytest.raises(serving.XdpAggError, match="several IPv4 addresses"):
        serving.listen_address(["p0", "p1"])
    with pytest.raises(serving.XdpAggError, match="no IPv4 address"):
        serving.listen_address(["bare"])

    seen = {}

    def fake_serve(name, opts, ep, **kw):
        seen.update(host=ep.host, port=ep.port, secret=ep.secret, limits=ep.limits)
        kw["announce"]("control endpoint listening")

    monkeypatch.setattr(serving, "aggregator_interfaces", lambda name: ["eth1"])
    monkeypatch.setattr(serving, "serve_xdp", fake_serve)
    r = xdp_agg_cli("serve", "--insecure-no-auth")
    assert r.exit_code == 0, r.output
    assert (seen["host"], seen["port"], seen["secret"]) == ("198.18.7.1", 48800, None)
    assert "WARNING: --insecure-no-auth" in r.output and "0.0.0.0" not in r.output
    r = xdp_agg_cli("serve", "--listen", "0.0.0.0:48801", "--insecure-no-auth")
    assert r.exit_code == 0 and seen["host"] == "0.0.0.0"
    assert "WARNING: listening on every address" in r.output
    monkeypatch.setattr(serving, "aggregator_interfaces", lambda name: ["p0", "p1"])
    r = xdp_agg_cli("serve", "--insecure-no-auth")
    assert r.exit_code == cli.EXIT_FAILED and "--listen 0.0.0.0:PORT" in r.output


def test_serve_creates_its_secret_in_the_state_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("XDP_AGG_STATE_DIR", str(tmp_path))
    monkeypatch.delenv(control.SECRET_ENV, raising=False)
    seen = {}
    monkeypatch.setattr(
        serving, "serve_xdp", lambda name, opts, ep, **kw: seen.update(secret=ep.secret)
    )
    r = xdp_agg_cli("--name", "lab", "serve", "--listen", "127.0.0.1:1", "--request-rate", "7")
    assert r.exit_code == 0, r.output
    path = tmp_path / "lab.secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert seen["secret"] == control.load_secret(path)


# --- limits ------------------------------------------------------------------------------------
def test_connection_caps_in_all_and_per_source():
    with soft_cluster(limits=Limits(max_connections=3, max_per_source=2)) as cl:
        a = [socket.create_connection(cl.server.address, 5, (cl.worker_ip(0), 0)) for _ in "12"]
        time.sleep(0.2)  # the server has counted them
        third = _send(cl, {"op": "ping"}, cl.worker_ip(0))
        assert not third["ok"] and third["kind"] == "limit" and "per source" in third["error"]
        b = socket.create_connection(cl.server.address, 5, (cl.worker_ip(1), 0))
        time.sleep(0.2)
        fourth = _send(cl, {"op": "ping"}, cl.worker_ip(2))
        assert not fourth["ok"] and fourth["kind"] == "limit" and "its limit" in fourth["error"]
        for s in [*a, b]:
            s.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if _send(cl, {"op": "ping"}, cl.worker_ip(0)).get("ok"):
                break
            time.sleep(0.05)
        else:
            pytest.fail("closed connections were not released")


def test_idle_and_slow_connections_holding_no_job_are_cut_but_job_holders_are_not():
    with soft_cluster(limits=Limits(idle_timeout=0.5)) as cl:
        holder = ControlClient(cl.server.address, timeout=5, secret=cl.secret)
        holder.request("create", job="a", **JOB)
        with socket.create_connection(cl.server.address, timeout=5) as idle:
            t0 = time.monotonic()
            answer = json.loads(idle.makefile("rb").readline())
            assert 0.4 < time.monotonic() - t0 < 3
            assert not answer["ok"] and answer["kind"] == "limit" and "0.5 s" in answer["error"]
            assert idle.recv(1) == b""  # closed
        with socket.create_connection(cl.server.address, timeout=5) as slow:
            t0 = time.monotonic()
            for ch in b'{"op": "ping"':  # a byte every 0.1 s never completes the line
                if select.select([slow], [], [], 0)[0]:
                    break  # the server answered: stop before it sees more
                slow.sendall(bytes([ch]))
                time.sleep(0.1)
            answer = json.loads(slow.makefile("rb").readline())
            assert not answer["ok"] and answer["kind"] == "limit"
            assert time.monotonic() - t0 < 1.5
        time.sleep(1.0)  # twice the idle timeout: the job's holder keeps its connection
        assert holder.request("status", job="a")["state"] == "registering"
        holder.close()


def test_request_rate_per_source_is_answered_with_an_error_and_changes_nothing():
    with soft_cluster(limits=Limits(rate=5, burst=5)) as cl:
        c = ControlClient(cl.server.address, timeout=5, secret=cl.secret)
        c.request("create", job="a", **JOB)
        refused = 0
        for i in range(20):
            try:
                c.request("create", job=f"x{i}", **JOB)
            except LimitError as e:
                assert "requests/s" in str(e)
                refused += 1
            except RendezvousError:
                pass
        assert refused >= 10  # 20 at once, 5 of burst (plus what refills meanwhile)
        assert len(_state(cl)[1]) == 1 + 20 - refused  # the refused ones created nothing
        time.sleep(1.0)  # the bucket refills
        assert c.request("ping")["ok"]
        c.close()


def test_the_trusted_lab_mode_needs_no_credentials():
    with soft_cluster(auth=False) as cl:
        c = ControlClient(cl.server.address, timeout=5)
        assert c.request("create", job="a", **JOB)["job"]["key"] == "a"
        assert c.request("status")["jobs"][0]["job"]["key"] == "a"
        c.close()


def test_token_comparison_refuses_empty_and_ill_typed_tokens():
    t = control.new_token()
    assert control.same_token(t, t) and not control.same_token(t, t + "x")
    assert not control.same_token("", "")  # a job without a token is reachable by proof only
    assert not any(control.same_token(t, v) for v in (None, 5, [t], {"t": t}))
    assert control.new_token() != t and len(t) == 32
