"""AF_XDP workers through the XDP aggregator in the namespace testbed (issue 20 item 3).

The same jobs run twice on one one-arm testbed, under loss both ways and duplicated results:
first every rank on the numpy loop over the kernel socket (the reference), then every rank on
the C loop over an AF_XDP socket. Each rank's results must be byte for byte the reference's,
and each must check against the exact sum (aggcluster.cluster_worker). The loss sits on the
bridge ports (netns_testbed.faults.port_loss_script) and the duplication on their egress: the
worker's own netdev hooks, where the testbed puts loss_up and loss_down, are skipped by AF_XDP
frames (transmit goes straight to the driver; the redirect comes before the ingress hook).
"""

import pytest
from harness.workers import assert_reports_ok

from aggcluster.cluster import Cluster
from hostlib import afxdp
from netns_testbed import faults

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.slow]

PLAN = [
    {"dtype": "int32", "count": 150_001, "digest": True},
    {"dtype": "float32", "count": 100_000, "seed": 2, "digest": True},
    {"dtype": "float32", "count": 4_097, "seed": 3, "digest": True},
]


def _digests(reports) -> list[list[str]]:
    return [[r["sha256"] for r in reps if "sha256" in r] for reps in reports]


def test_afxdp_workers_match_the_numpy_engine_under_loss_and_duplication(
    testbed_factory, monkeypatch
):
    tb = testbed_factory(workers=3, topology="one-arm", dup_down=0.05)
    ports = [f"w{w.index}" for w in tb.workers]
    faults.apply(tb.switch_netns, faults.port_loss_script(ports, 0.02))
    with Cluster(tb) as cl:
        monkeypatch.setenv("XDP_AGG_NATIVE", "0")
        monkeypatch.setenv(afxdp.ENV, "udp")
        ref = cl.run_workers(PLAN, job="afxdp-ref", timeout=60)
        monkeypatch.setenv("XDP_AGG_NATIVE", "1")
        monkeypatch.setenv(afxdp.ENV, "afxdp")
        got = cl.run_workers(PLAN, job="afxdp", timeout=60)
    assert_reports_ok(ref)
    assert_reports_ok(got)
    assert _digests(got) == _digests(ref) and all(len(d) == len(PLAN) for d in _digests(ref))
    for reps in got:
        for r in reps:
            assert r["stats"]["data_path"].startswith("afxdp-copy-"), r["stats"]
    retx = sum(r["stats"]["retransmissions"] for reps in got for r in reps)
    dups = sum(r["stats"]["duplicates"] for reps in got for r in reps)
    assert retx > 0 and dups > 0, "loss and duplication were configured but none showed"
