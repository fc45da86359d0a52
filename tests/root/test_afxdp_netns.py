"""AF_XDP workers through the XDP aggregator in the namespace testbed (the host path without the
kernel's UDP stack).

The same jobs run twice on one one-arm testbed, under loss both ways and duplicated results:
first every rank on the numpy loop over the kernel socket (the reference), then every rank on
the C loop over an AF_XDP socket. Each rank's results must be byte for byte the reference's,
and each must check against the exact sum (xdp_agg.cluster.cluster_worker). The loss sits on the
bridge ports (netns_testbed.faults.port_loss_script) and the duplication on their egress: the
worker's own netdev hooks, where the testbed puts loss_up and loss_down, are skipped by AF_XDP
frames (transmit goes straight to the driver; the redirect comes before the ingress hook).
"""

import pytest
from harness.workers import assert_reports_ok

from netns_testbed import faults, nsexec, shaping
from xdp_agg.cluster.cluster import Cluster

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.slow]

PLAN = [
    {"dtype": "int32", "count": 150_001, "digest": True},
    {"dtype": "float32", "count": 100_000, "seed": 2, "digest": True},
    {"dtype": "float32", "count": 4_097, "seed": 3, "digest": True},
]


def _digests(reports) -> list[list[str]]:
    return [[r["sha256"] for r in reps if "sha256" in r] for reps in reports]


# 16-bit elements (docs/protocol.md 5.6): bfloat16 at its default width, float32 compressed,
# on the companion job, with the main job's int32 all-reduces before, between and after
PLAN_WIRE16 = [
    {"dtype": "int32", "count": 60_001, "seed": 3, "digest": True},
    {"dtype": "bfloat16", "count": 100_003, "seed": 4, "digest": True},
    {"dtype": "int32", "count": 70_001, "seed": 6, "digest": True},
    {"dtype": "float32", "count": 50_000, "seed": 5, "wire_bits": 16, "digest": True},
    {"dtype": "int32", "count": 60_001, "seed": 7, "digest": True},
]
WIRE16_BITS = [32, 16, 32, 16, 32]  # the width each item of PLAN_WIRE16 runs at


@pytest.mark.parametrize("lanes", [1, 3])
def test_afxdp_workers_match_the_numpy_engine_under_loss_and_duplication(
    testbed_factory, monkeypatch, lanes
):
    """With lanes, every lane of a worker has its own AF_XDP socket on the one queue of its veth
    (sharing one UMEM, hostlib/_xsk.c); the reference runs as many numpy lanes over the kernel
    socket, on the same slots."""
    _against_numpy(testbed_factory, monkeypatch, lanes, PLAN, "afxdp")


@pytest.mark.parametrize("lanes, path", [(1, "afxdp"), (2, "auto")])
def test_afxdp_wire16_workers_match_the_numpy_engine_under_loss_and_duplication(
    testbed_factory, monkeypatch, lanes, path
):
    """The same for 16-bit all-reduces between the main job's int32 ones, on an AF_XDP
    communicator: its 16-bit companion job runs over AF_XDP too (its sockets join the main
    job's on the queue: one UMEM, each port in the program's maps, hostlib/_xsk.c), byte for
    byte the numpy loop's, the int32 sums exact and the 16-bit ones within their bound, under
    loss and duplication; with data path "afxdp" and "auto" (which says no reason)."""
    job = f"afxdp-w16-{lanes}"
    got = _against_numpy(testbed_factory, monkeypatch, lanes, PLAN_WIRE16, job, path=path)
    for reps in got:
        assert [r["stats"]["wire_bits"] for r in reps] == WIRE16_BITS
        assert all(r["stats"]["data_path_reason"] == "" for r in reps)
        assert all(r["ok"] for r in reps)  # int32 exact, 16-bit within scaling's bound


AFXDP_PATHS = ("afxdp-copy-drv", "afxdp-copy-skb")


def _against_numpy(testbed_factory, monkeypatch, lanes, plan, job, path="afxdp") -> list:
    """`plan` on a 3-worker one-arm testbed with loss (2% on the bridge ports) and duplicated
    results, first on the numpy loop over the kernel socket, then on the C loop with data path
    `path` ("afxdp" or "auto"): the same digests, every result checked, loss and duplication
    seen, every report's data path one of AFXDP_PATHS; the C loop's reports."""
    monkeypatch.setenv("XDP_AGG_LANES", str(lanes))
    tb = testbed_factory(workers=3, topology="one-arm", dup_down=0.05)
    ports = [f"w{w.index}" for w in tb.workers]
    faults.apply(tb.switch_netns, faults.port_loss_script(ports, 0.02))
    with Cluster(tb) as cl:
        monkeypatch.setenv("XDP_AGG_NATIVE", "0")
        monkeypatch.setenv("XDP_AGG_DATA_PATH", "udp")
        ref = cl.run_workers(plan, job=f"{job}-ref", timeout=60)
        monkeypatch.setenv("XDP_AGG_NATIVE", "1")
        monkeypatch.setenv("XDP_AGG_DATA_PATH", path)
        got = cl.run_workers(plan, job=job, timeout=60)
    assert_reports_ok(ref)
    assert_reports_ok(got)
    assert _digests(got) == _digests(ref) and all(len(d) == len(plan) for d in _digests(ref))
    for reps in got:
        for r in reps:
            # one path for every lane (StripedEngine.data_path: comma-separated if they differ)
            assert r["stats"]["data_path"] in AFXDP_PATHS, r["stats"]["data_path"]
            assert r["stats"]["lanes"] == lanes
    retx = sum(r["stats"]["retransmissions"] for reps in got for r in reps)
    dups = sum(r["stats"]["duplicates"] for reps in got for r in reps)
    assert retx > 0 and dups > 0, "loss and duplication were configured but none showed"
    return got


def _to_aggregator(tb) -> int:
    """Bytes the bridge sent the aggregator (its port "ag"): what reached the aggregator's link
    (the aggregator's own veth counts no frames its XDP program takes)."""
    # /proc/net is the reader's namespace's (nsenter leaves /sys the caller's)
    cp = nsexec.run(tb.switch_netns, ["cat", "/proc/net/dev"])
    assert cp.returncode == 0, cp.stderr
    line = next(x for x in cp.stdout.splitlines() if x.strip().startswith("ag:"))
    return int(line.split(":", 1)[1].split()[8])  # receive: 8 fields, then transmit bytes


def test_neither_path_exceeds_the_link_rate(testbed_factory, monkeypatch):
    """100 Mbit/s per worker link towards the aggregator: what reaches the aggregator stays
    within the two links' rate on the kernel path (shaped at the worker's qdisc and the bridge
    port's ingress) and on AF_XDP (whose frames skip the worker's qdisc: only the bridge port's
    ingress ifb shapes them; without it they reach several times the rate)."""
    rate = 100e6
    tb = testbed_factory(workers=2, topology="one-arm", rate="100mbit")
    # the results' direction unshaped: otherwise the results (as large as the contributions)
    # would clock the senders down to the rate whatever shaped their own direction
    shaping.shape(tb.switch_netns, [f"w{w.index}" for w in tb.workers], None, tb.mtu)
    plan = [{"dtype": "int32", "count": 1_000_000, "reps": 2}]
    burst = shaping.tbf_burst(int(rate), tb.mtu)
    seen = {}
    with Cluster(tb) as cl:
        for path in ("udp", "afxdp"):
            monkeypatch.setenv("XDP_AGG_DATA_PATH", path)
            before = _to_aggregator(tb)
            reports = cl.run_workers(plan, job=f"rate-{path}", timeout=60)
            got = _to_aggregator(tb) - before
            assert_reports_ok(reports)
            assert all(r["stats"]["data_path"].startswith(path) for reps in reports for r in reps)
            # the all-reduces' time (after a barrier each); the bytes also hold the rendezvous
            # and barriers, which only makes the measured rate higher
            seconds = max(sum(r["times"]) for reps in reports for r in reps)
            seen[path] = got * 8 / seconds
            assert got * 8 <= 2 * rate * seconds * 1.05 + 2 * 8 * burst, (path, seen)
    assert min(seen.values()) > 0.3 * 2 * rate, seen  # the links were the bottleneck
