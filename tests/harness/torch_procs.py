"""The PyTorch tests' rank processes (tests/torch_worker.py) on loopback or in the testbed,
and the checks of their JSON reports: shared by tests/root/test_torch.py,
tests/root/test_torch_wire16.py, tests/unit/test_lanes.py and tests/unit/test_striping.py."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from xdp_agg.cluster.cluster import Cluster

ROOT = Path(__file__).resolve().parents[2]  # the repository
WORKER = str(ROOT / "tests" / "torch_worker.py")


def rank_env(rank: int, n: int, master: str, port: int, control: str, ifname: str, **extra) -> dict:
    env = dict(
        os.environ,
        RANK=str(rank),
        WORLD_SIZE=str(n),
        MASTER_ADDR=master,
        MASTER_PORT=str(port),
        XDP_AGG_CONTROL=control,
        GLOO_SOCKET_IFNAME=ifname,
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


def collect_reports(procs, deadline: float = 150.0) -> list[dict]:
    """Each rank's last JSON report; fails with every failing rank's stderr."""
    return [reps[-1] for reps in Cluster.collect(list(enumerate(procs)), deadline)]


def check_ddp(reports, n):
    for rep in reports:
        for dtype, d in rep["dtypes"].items():
            for step, (err, bound) in enumerate(zip(d["grad_err"], d["grad_bound"])):
                assert err <= bound, (
                    f"rank {rep['rank']} {dtype} step {step}: gradient error "
                    f"{err:.3g} above the bound {bound:.3g}"
                )
            assert d["param_err"] <= d["param_bound"], f"rank {rep['rank']} {dtype}: {d}"
        assert rep["stats"]["packets_sent"] > 0
    # every rank ends with the same parameters' error (they all hold the same sums)
    assert len({json.dumps(r["dtypes"]["float32"]["param_err"]) for r in reports}) == 1


def check_backend(reports, n):
    for rep in reports:
        assert rep["backend"] in ("xdpagg", "cpu:xdpagg")
        assert not rep["failures"], f"rank {rep['rank']}: {rep['failures']}"
        for dtype in ("float32", "float16", "bfloat16", "int32"):
            for op in ("SUM", "AVG"):
                for mode in ("sync", "async"):
                    assert f"all_reduce {op} {dtype} {mode}" in rep["checks"]
        for name in (
            "broadcast",
            "all_gather",
            "all_gather_into_tensor",
            "reduce_scatter_tensor",
            "all_to_all_single",
            "barrier",
            "DDP through the backend",
            "all_reduce SUM int64 sync route",
            "all_reduce SUM float64 async route",
        ):
            assert rep["checks"].get(name), f"rank {rep['rank']}: {name} not checked"
    assert len({r["job"] for r in reports}) == 1


def check_lost(reports, fallback: bool, timeout: float):
    for rep in reports:
        assert rep["first"] == len(reports)  # before the loss, through the aggregator
        if fallback:
            assert rep["outcome"] == "completed", rep
            assert rep["on_fallback"]
            n = len(reports)
            assert rep["sums"] == [sum(range(n)) + n * i for i in range(3)]
            # the hook's gradients over gloo equal plain DDP-with-gloo's (to rounding)
            assert all(e < 1e-6 for e in rep.get("grad_err", [])), rep
        else:
            assert rep["outcome"] == "error", rep
            assert "XDP_AGG_FALLBACK=gloo" in rep["error"] and "all-reduce" in rep["error"]
            assert not rep["on_fallback"]
        # noticed after the stall timeout, plus the endpoint's diagnosis and the agreement
        assert rep["seconds"] < timeout + 10, rep
        assert rep["broadcast_after"] == 0.0


def in_testbed(test):
    """`test` marked as a test in the netns testbed: root, BPF, namespaces, slow."""
    for mark in (pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.slow):
        test = mark(test)
    return test


@contextlib.contextmanager
def one_arm_cluster(testbed_factory, n: int):
    """(tb, cl): a one-arm testbed of n workers (the fixture testbed_factory's) and the cluster
    on it, xdp-agg attached and serving, for start_testbed."""
    tb = testbed_factory(workers=n, topology="one-arm")
    with Cluster(tb) as cl:
        yield tb, cl


def start_testbed(tb, cl, scenario, *args, stdin=None, **extra):
    port = random.randint(20000, 40000)
    procs = []
    n = len(tb.workers)
    for r, w in enumerate(tb.workers):
        env = rank_env(r, n, tb.workers[0].ip, port, cl.control_address(w), "eth0", **extra)
        env["XDP_AGG_SECRET_FILE"] = cl.secret_file
        procs.append(
            tb.popen(
                w,
                [sys.executable, WORKER, scenario, *args],
                env=env,
                text=True,
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    return procs


def start_loopback(cl, n, scenario, *args, stdin=None, worker=WORKER, **extra):
    """n ranks of `worker` (tests/torch_worker.py) on loopback, joined to the soft cluster `cl`."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [
        subprocess.Popen(
            [sys.executable, worker, scenario, *args],
            text=True,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=rank_env(
                r,
                n,
                "127.0.0.1",
                port,
                cl.endpoint,
                "lo",
                XDP_AGG_IP=cl.worker_ip(r),
                **{"XDP_AGG_SECRET_FILE": cl.secret_file, **extra},
            ),
        )
        for r in range(n)
    ]
