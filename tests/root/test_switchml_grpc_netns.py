"""p4app-switchML hosts join through `xdp-agg serve --switchml-grpc` with nothing made by hand:
the XDP aggregator attached in the switch or one-arm topology of the testbed, each worker
namespace runs p4app's setup calls (tests/switchml_grpc_worker.py), then two threads per worker
send frames built as p4app's BuildPacket builds them, each from its own UDP port, to the switch
MAC and address the controller answered. Every result exact, each at the port that sent its request;
the egress program (switch) or the copy program (one-arm, unicast delivery) addressed one copy
per worker and thread.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("grpc")

import switchml_grpc_client as client  # noqa: E402

from xdp_agg.cluster.cluster import Cluster  # noqa: E402

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.timeout(300)]

GRPC_PORT = 50099
THREADS, PER_THREAD, K = 2, 4, 64
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the helpers


def _run_workers(tb, world: int, seed: int) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [
        tb.popen(
            w,
            [
                sys.executable,
                os.path.join(TESTS, "switchml_grpc_worker.py"),
                f"{w.agg_ip}:{GRPC_PORT}",
                str(w.index),
                str(world),
                w.ip,
                w.mac,
                "eth0",
                str(THREADS),
                str(PER_THREAD),
                str(K),
                str(seed),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for w in tb.workers
    ]
    out = []
    for w, p in zip(tb.workers, procs):
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, f"worker {w.index}: {stderr}"
        out.append(json.loads(stdout))
    return out


@pytest.mark.parametrize(
    "world, topology", [(2, "switch"), (4, "switch"), (3, "one-arm")], ids=lambda x: str(x)
)
def test_p4app_hosts_join_through_grpc_and_get_each_result_at_its_port(
    testbed_factory, world, topology
):
    """One-arm: each worker's interface takes only frames to its own MAC or the broadcast, as
    the NIC of p4app's DPDK host (promiscuous mode off, no group joined) does; the session's
    unicast delivery gets every result to it on the first try (the worker never retransmits)."""
    tb = testbed_factory(workers=world, topology=topology)
    if topology == "one-arm":
        tb.own_mac_only()
    serve = ("--switchml-grpc", f"0.0.0.0:{GRPC_PORT}", "--barrier-timeout", "60")
    with Cluster(tb, serve_args=serve) as cl:
        runs = _run_workers(tb, world, seed=world)
        assert len({r["switch"][0] for r in runs}) == 1  # one session
        for w, r in zip(tb.workers, runs):
            # the switch address answered: ours on the port this worker reaches
            assert r["switch"][1:] == [w.agg_mac, w.agg_ip]
            for t in range(THREADS):
                got = r["results"][str(t)]
                slots = client.thread_slots(t, PER_THREAD)
                assert sorted(g[0] for g in got) == slots, f"worker {w.index} thread {t}"
                sums, exponent = client.expected(world, world, t, PER_THREAD, K)
                for slot, values, e in got:
                    np.testing.assert_array_equal(values, sums[slots.index(slot)])
                    assert e == exponent
        stats = json.loads(cl.cli("stats", "--json").stdout)
        (job,) = stats["jobs"].values()
        assert job["reasons"]["completed"] == THREADS * PER_THREAD
        assert job["reasons"]["egress_sent"] == THREADS * PER_THREAD * world
