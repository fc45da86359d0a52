"""End to end: a 4-worker int32 all-reduce through simple_switch, with the host library.

The netns testbed's switch topology (worker i behind the aggregator namespace's p<i>, each on its
own /24) with simple_switch running p4/switchml.p4 on p0..p3 inside the aggregator namespace; the
control endpoint (ControlEndpoint) in front of Bmv2Backend listens in that namespace too. Each
worker process runs hostlib.init(...) / comm.allreduce(...) in its own namespace, exactly as
against the XDP aggregator; the result must be the exact int32 sum (wrapping) on every rank.

The kernel of the aggregator namespace still owns p<i>'s addresses (ARP, the TCP control
connection); an nftables rule there drops the data packets it also sees, so that it does not
answer them with ICMP port unreachable. simple_switch drops plain traffic to unknown MACs here.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from typing import NamedTuple

import numpy as np
import pytest
from harness.p4 import _InNetns, p4_skip_reason

import xdp_agg.targets.bmv2 as bm
from netns_testbed import faults
from xdp_agg.proto import control
from xdp_agg.proto.jobs import Delivery
from xdp_agg.proto.reasons import is_drop

pytestmark = [pytest.mark.root, pytest.mark.netns, pytest.mark.p4]

WORLD = 4
N = 6000  # elements: 94 packets of 64 (24 of 256) per worker, window 16: slots reused, both
# versions

WORKER = r"""
import json, sys
import numpy as np
import hostlib
rank, world, endpoint, n = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
elems = int(sys.argv[5])
x = np.random.default_rng(rank).integers(-2**31, 2**31, size=n, dtype=np.int64).astype(np.int32)
# UDP GSO/GRO off: simple_switch reads frames with libpcap and must see one datagram per frame.
opts = hostlib.HostOptions.from_env(elems=elems, window=16, timeout=60, gso=False, gro=False)
with hostlib.init(rank, world, endpoint, "p4-allreduce", opts) as comm:
    out = comm.allreduce(x)
    stats = comm.stats
print(json.dumps({"rank": rank, "result": out.astype(np.int64).tolist(), "dtype": str(out.dtype),
                  "stats": {k: int(v) for k, v in stats.items()
                            if isinstance(v, (int, np.integer))}}))
"""


def _expected() -> np.ndarray:
    total = np.zeros(N, dtype=np.int64)
    for r in range(WORLD):
        total += (
            np.random.default_rng(r)
            .integers(-(2**31), 2**31, size=N, dtype=np.int64)
            .astype(np.int32)
        )
    return ((total + 2**31) % 2**32 - 2**31).astype(np.int32)


def _drop_data_in_kernel(netns: str) -> None:
    """nftables in the aggregator namespace: the kernel ignores UDP to 0xBEE0..0xBEEF."""
    faults.apply(netns, faults.kernel_ignores_data_script())


def _run_workers(tb, script: str, port: int, log_tail, secret_file, elems: int) -> list[dict]:
    """Run `script` as the 4 workers against the control endpoint on `port` (proving the
    deployment secret in `secret_file`), `elems` elements per packet; each rank's JSON line."""
    env = {**os.environ, control.SECRET_ENV: str(secret_file)}
    procs = [
        tb.popen(
            w,
            [sys.executable, "-c", script, str(w.index), str(WORLD)]
            + [f"{w.agg_ip}:{port}", str(N), str(elems)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in tb.workers
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, f"worker failed:\n{err[-3000:]}\nswitch log:\n{log_tail()}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def _run_and_check_workers(tb, port: int, log_tail, secret_file, elems: int = 64) -> None:
    """Run the 4 int32 workers (WORKER); every rank's sum is exact."""
    results = _run_workers(tb, WORKER, port, log_tail, secret_file, elems)
    want = _expected()
    packets = -(-N // elems)
    for r in results:
        assert r["dtype"] == "int32"
        assert r["stats"]["results"] == packets, r["stats"]  # one result per packet
        np.testing.assert_array_equal(
            np.asarray(r["result"], dtype=np.int64),
            want.astype(np.int64),
            err_msg=f"rank {r['rank']}",
        )


class _Endpoint(NamedTuple):
    switch: bm.SimpleSwitch
    backend: bm.Bmv2Backend
    port: int  # the control endpoint's TCP port
    created: list  # the JobSpecs the endpoint made (it deletes jobs when workers leave)


@contextlib.contextmanager
def _bmv2_endpoint(tb, tmp_path, job_defaults: dict):
    """simple_switch on the aggregator namespace's ports and a control endpoint in front of it
    (listening there, secret in tmp_path/"secret"); yields an _Endpoint."""
    from xdp_agg.ctl.endpoint import stand_up

    agg = tb.aggregator
    _drop_data_in_kernel(agg.netns)
    ports = bm.port_specs(agg.ifnames, netns=agg.netns)
    assert [(p.mac, p.ip) for p in ports] == list(zip(agg.macs, agg.ips))
    # compile, start simple_switch on p0..p3 in the aggregator namespace, set it up
    switch, backend = bm.launch(ports, tmp_path, netns=agg.netns, unknown_unicast="drop")
    server = None
    created: list = []
    create_job = backend.create_job
    backend.create_job = lambda spec: (create_job(spec), created.append(spec))
    try:
        with _InNetns(agg.netns):  # the listening socket lives in the aggregator namespace
            server, _ = stand_up(
                backend,
                "0.0.0.0",
                0,
                {"delivery": Delivery.BROADCAST, "barrier_timeout": 60.0, **job_defaults},
                fill_worker=backend.fill_worker,
                secret=control.create_secret(tmp_path / "secret"),
            )
        server.start()
        yield _Endpoint(switch, backend, server.address[1], created)
    finally:
        if server is not None:
            server.stop()
        switch.stop()


def _assert_clean(counts: dict, loss: float) -> None:
    """Nothing of ours dropped for a reason other than the protocol's own (duplicates); under
    loss, lost contributions or results were really sent again."""
    bad = {k: v for k, v in counts.items() if is_drop(k) or k == "egress_no_worker"}
    assert not any(bad.values()), bad
    if loss:
        assert counts["retx_answered"] + counts["dup_pending"] > 0, counts


@pytest.mark.parametrize(("elems", "loss"), [(64, 0.0), (256, 0.0), (256, 0.05)])
def test_allreduce_int32_through_simple_switch(testbed_factory, tmp_path, elems, loss):
    """64 elements per packet (one pass) and 256 (four passes, recirculated), and 256 under
    5% loss each way between the workers and the switch (retransmissions, answers)."""
    reason = p4_skip_reason()
    if reason:
        pytest.skip(reason)
    tb = testbed_factory(workers=WORLD, topology="switch", loss_up=loss, loss_down=loss)
    with _bmv2_endpoint(tb, tmp_path, {"pool_slots": bm.DEFAULT_POOL_SLOTS}) as ep:
        _run_and_check_workers(tb, ep.port, ep.switch.log_tail, tmp_path / "secret", elems)
        packets = -(-N // elems)
        # Every chunk completed once in the P4 program and went out once per worker.
        assert len(ep.created) == 1
        counts = ep.backend.counters(ep.created[0].job_id)
        assert counts["completed"] == packets
        assert counts["egress_sent"] == WORLD * packets
        assert counts["aggregated"] == (WORLD - 1) * packets
        _assert_clean(counts, loss)


# A rank's int32 and float32 tensors: a fifth of the blocks of `elems` non-zero, drawn per rank
# (most blocks zero on every rank, some on a few). Source text: the workers run it too.
SPARSE_TENSORS = r"""
import numpy as np
def tensors(rank, n, elems):
    rng = np.random.default_rng(1000 + rank)
    keep = np.repeat(rng.random(-(-n // elems)) < 0.2, elems)[:n]
    ints = rng.integers(-(2**31), 2**31, size=n, dtype=np.int64).astype(np.int32) * keep
    floats = (rng.standard_normal(n) * 2.0 ** rng.integers(-8, 8, size=n)).astype(np.float32)
    return ints.astype(np.int32), floats * keep
"""

SPARSE_WORKER = (
    SPARSE_TENSORS
    + r"""
import json, sys
import hostlib
rank, world, endpoint, n = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
elems = int(sys.argv[5])
ints, floats = tensors(rank, n, elems)
opts = hostlib.HostOptions.from_env(elems=elems, window=16, timeout=60, gso=False, gro=False)
with hostlib.init(rank, world, endpoint, "p4-sparse", opts) as comm:
    out_i = comm.allreduce(ints, sparse=True)
    out_f = comm.allreduce(floats, sparse=True)
    stats = comm.stats
print(json.dumps({"rank": rank, "ints": out_i.astype(np.int64).tolist(),
                  "floats": out_f.astype(np.float64).tolist(),
                  "stats": {k: int(v) for k, v in stats.items()
                            if isinstance(v, (int, np.integer))}}))
"""
)


def _sparse_tensors(rank: int, n: int, elems: int) -> tuple[np.ndarray, np.ndarray]:
    """SPARSE_TENSORS' tensors of `rank`, as its worker makes them."""
    ns: dict = {}
    exec(SPARSE_TENSORS, ns)
    return ns["tensors"](rank, n, elems)


@pytest.mark.parametrize(("elems", "loss"), [(64, 0.0), (32, 0.05)])
def test_sparse_allreduce_through_simple_switch(testbed_factory, tmp_path, elems, loss):
    """A sparse job (docs/protocol.md section 8) on bmv2: int32 exact and float32 within the
    block scaling bound, the zero blocks left home (header-only empties: the results grow in
    the switch), and under 5% loss each way at 32 elements."""
    from hostlib import scaling

    reason = p4_skip_reason()
    if reason:
        pytest.skip(reason)
    tb = testbed_factory(workers=WORLD, topology="switch", loss_up=loss, loss_down=loss)
    with _bmv2_endpoint(tb, tmp_path, {"sparse": True}) as ep:
        log, secret = ep.switch.log_tail, tmp_path / "secret"
        results = _run_workers(tb, SPARSE_WORKER, ep.port, log, secret, elems)
        assert [s.sparse for s in ep.created] == [True]
        counts = ep.backend.counters(ep.created[0].job_id)
    tensors = [_sparse_tensors(r, N, elems) for r in range(WORLD)]
    ints = sum(t[0].astype(np.int64) for t in tensors)
    want_i = ((ints + 2**31) % 2**32 - 2**31).astype(np.int64)
    want_f = sum(t[1].astype(np.float64) for t in tensors)
    chunks = [
        scaling.chunk_exponents(np.pad(t[1], (0, -N % elems)).reshape(-1, elems)) for t in tensors
    ]
    exps = np.max(np.stack(chunks).astype(np.int64), axis=0)
    for r in results:
        np.testing.assert_array_equal(r["ints"], want_i, err_msg=f"rank {r['rank']}")
        got = np.asarray(r["floats"])
        bound = np.repeat(scaling.error_bound(exps, WORLD), elems)[:N] + 2.0**-24 * abs(got)
        assert (abs(got - want_f) <= bound).all(), f"rank {r['rank']}"
        assert r["stats"]["sparse_allreduces"] == 2, r["stats"]
        assert r["stats"]["blocks_skipped"] > 0, r["stats"]
    assert counts["completed"] > 0 and counts["egress_sent"] == WORLD * counts["completed"]
    _assert_clean(counts, loss)


def test_xdp_agg_serve_target_bmv2(testbed_factory, tmp_path):
    """`xdp-agg serve --target bmv2`: the same workers, through the CLI's bmv2 control endpoint."""
    reason = p4_skip_reason()
    if reason:
        pytest.skip(reason)
    tb = testbed_factory(workers=WORLD, topology="switch")
    _drop_data_in_kernel(tb.aggregator.netns)
    serve = tb.popen(
        "agg",
        [
            sys.executable,
            "-m",
            "xdp_agg.app.cli",
            "--netns",
            tb.aggregator.netns,
            "serve",
            "--target",
            "bmv2",
            "--ports",
            ",".join(tb.aggregator.ifnames),
            "--listen",
            "0.0.0.0:48800",
            "--workdir",
            str(tmp_path),
            "--secret-file",
            str(tmp_path / "serve.secret"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = serve.stderr.readline()
        assert "listening" in line, line + serve.stderr.read()
        _run_and_check_workers(tb, 48800, lambda: "", tmp_path / "serve.secret")
    finally:
        serve.terminate()
        assert serve.wait(timeout=30) is not None
    # simple_switch was stopped with the control endpoint
    left = subprocess.run(
        ["pgrep", "-f", f"simple_switch.*{tmp_path}"], capture_output=True, text=True
    ).stdout
    assert not left.strip(), f"simple_switch still running: {left}"
