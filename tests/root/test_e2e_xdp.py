"""End to end: hostlib worker processes all-reduce through the XDP aggregator in namespaces.

Every worker checks its own result against the exact sum of all ranks' inputs (int32 bit-exact,
floats within hostlib.scaling's bound: |r - s| <= n/(2f) + 2^-24 |r| per element, f the chunk's
scale factor). Loss comes from the testbed's nftables rules, in both directions.
"""

import subprocess
import sys

import pytest
from harness import junk
from harness.workers import MIXED_PLAN, ODD, assert_reports_ok

from xdp_agg.cluster.cluster import Cluster

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.slow]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_allreduce_one_arm(testbed_factory, n):
    tb = testbed_factory(workers=n, topology="one-arm")
    plan = [
        *MIXED_PLAN,
        {"check": "counters"},
    ]
    with Cluster(tb) as cl:
        reports = cl.run_workers(plan, job=f"one-arm-{n}")
    assert_reports_ok(reports)
    for rank, reps in enumerate(reports):
        c = next(r for r in reps if r.get("check") == "counters")
        agg, me = c["aggregator"], c["worker"]
        # Every packet's first arrival is one contribution, and each packet got one result.
        assert agg["contributions"] == me["results"], f"rank {rank}: {agg} vs {me}"
        if me["retransmissions"] == 0:
            assert agg["packets"] == me["packets_sent"]
        assert agg["dropped"] == 0


def test_allreduce_switch(testbed_factory):
    tb = testbed_factory(workers=4, topology="switch")
    plan = [
        {"dtype": "int32", "count": ODD},
        {"dtype": "float32", "count": 100_000},
        {"check": "counters"},
    ]
    with Cluster(tb) as cl:
        reports = cl.run_workers(plan, job="switch")
        st = cl.stats()
    assert_reports_ok(reports)
    assert st["unattributed"]["drop_unknown_source"] == 0


def test_wire16_allreduce_one_arm(testbed_factory):
    """16-bit elements through the XDP aggregator (AGG_JOB_WIRE16): float16 and bfloat16 at
    their default width, float32 with wire_bits=16, each within the 16-bit bound, on the
    companion job "<job>~w16" the first of them joins; a 32-bit float32 all-reduce of the
    same job after them; the aggregator's counters of both jobs match the workers'."""
    pytest.importorskip("ml_dtypes")
    tb = testbed_factory(workers=4, topology="one-arm")
    plan = [
        {"dtype": "float16", "count": ODD, "seed": 5},
        {"dtype": "bfloat16", "count": 100_000, "seed": 6},
        {"dtype": "float32", "count": 100_000, "seed": 7, "wire_bits": 16},
        {"dtype": "float32", "count": 100_000, "seed": 7},
        {"check": "counters"},
    ]
    with Cluster(tb) as cl:
        reports = cl.run_workers(plan, job="wire16")
    assert_reports_ok(reports)
    for rank, reps in enumerate(reports):
        widths = [r["stats"]["wire_bits"] for r in reps if "stats" in r]
        assert widths == [16, 16, 16, 32], widths
        c = next(r for r in reps if r.get("check") == "counters")
        agg, me = c["aggregator"], c["worker"]
        assert agg["contributions"] == me["results"], f"rank {rank}: {agg} vs {me}"
        assert agg["dropped"] == 0


@pytest.mark.parametrize("loss", [0.01, 0.05])
def test_loss_in_both_directions(testbed_factory, loss):
    tb = testbed_factory(workers=4, topology="one-arm", loss_up=loss, loss_down=loss)
    plan = [{"dtype": "int32", "count": 100_000}, {"dtype": "float32", "count": 50_000, "seed": 2}]
    with Cluster(tb) as cl:
        reports = cl.run_workers(plan, job=f"loss-{loss}", timeout=60)
    assert_reports_ok(reports)
    retx = sum(r["stats"]["retransmissions"] for reps in reports for r in reps if "stats" in r)
    assert retx > 0, "loss was configured but nothing was retransmitted"


@pytest.mark.parametrize("loss", [0.0, 0.01])
def test_early_loss_exact_under_reordering(testbed_factory, loss):
    """A share of every worker's contributions held back 0.5 ms, the testbed's default (later
    ones overtake them), with and without loss: every result exact (a late copy of a resent
    packet never counts in the next round of its slot: docs/protocol.md 3.3); a resend that
    reordering made needless is counted as spurious, not hidden."""
    tb = testbed_factory(workers=3, topology="one-arm", loss_up=loss, loss_down=loss, reorder=0.05)
    plan = [
        {"dtype": "int32", "count": 3_000_000},
        {"dtype": "float32", "count": 1_000_000, "seed": 3},
    ]
    with Cluster(tb) as cl:
        reports = cl.run_workers(plan, job=f"reorder-{loss}", timeout=60)
    assert_reports_ok(reports)
    assert tb.held_frames() > 0
    stats = [r["stats"] for reps in reports for r in reps if "stats" in r]
    assert all(s["spurious"] <= s["retransmissions"] for s in stats), stats


def test_two_jobs_at_once_stay_isolated(testbed_factory):
    tb = testbed_factory(workers=4, topology="one-arm")
    with Cluster(tb) as cl:
        a = cl.start_workers(
            [{"dtype": "int32", "count": 300_000, "seed": 11}], hosts=[0, 1], job="job-a"
        )
        b = cl.start_workers(
            [{"dtype": "int32", "count": 300_000, "seed": 12}], hosts=[2, 3], job="job-b"
        )
        ra, rb = cl.collect(a), cl.collect(b)
    assert_reports_ok(ra)
    assert_reports_ok(rb)


# An unregistered host floods the aggregator with well-formed contributions for the job's slots.
INTRUDER = r"""
import socket, sys, time
import numpy as np
from xdp_agg.proto import wire
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
vals = np.full((1, 256), 12345)
sent, end = 0, time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    for slot in range(64):
        pkt = wire.build_payloads(job_number=0, size_code=3, tsi=0, slot=slot, version=sent % 2,
                                  values=vals)
        s.sendto(pkt.tobytes(), (sys.argv[1], wire.UDP_PORT))
        sent += 1
print(sent)
"""


def test_unregistered_host_changes_nothing(testbed_factory):
    tb = testbed_factory(workers=3, topology="one-arm")
    intruder = tb.workers[2]
    with Cluster(tb) as cl:
        procs = cl.start_workers(
            [{"dtype": "int32", "count": 400_000}], hosts=[0, 1], job="guarded"
        )
        spam = tb.popen(
            intruder,
            [sys.executable, "-c", INTRUDER, intruder.agg_ip, "2"],
            stdout=subprocess.PIPE,
            text=True,
        )
        reports = cl.collect(procs)
        sent = int(spam.communicate(timeout=30)[0])
        st = cl.stats()
    assert_reports_ok(reports)
    assert sent > 0
    assert st["unattributed"]["drop_unknown_source"] >= sent * 0.9  # minus what the veth dropped


def test_lying_lengths_from_a_registered_worker_change_no_sum(testbed_factory, tmp_path):
    """Frames from worker 0's address with lying IPv4/UDP lengths (tests/harness/junk.py: a full
    payload of every size code, for every third slot, both versions and every fifth aggregator
    port), sent in a loop during live all-reduces: the results stay exact, and the aggregator drops
    them as that worker's (counted). Before the aggregator checked lengths, such frames were summed
    into live slots."""
    tb = testbed_factory(workers=3, topology="one-arm")
    w0, agg = tb.workers[0], tb.aggregator
    plan = [{"dtype": "int32", "count": 300_000, "seed": s} for s in range(6)]
    plan += [{"dtype": "float32", "count": 100_000, "seed": 9}, {"check": "counters"}]
    with Cluster(tb) as cl:
        frames = tmp_path / "lies.hex"
        junk.write_frames(frames, junk.lying_frames(w0.ip, w0.mac, agg.ips[0], agg.macs[0]))
        liar = tb.popen(
            w0,
            [sys.executable, "-c", junk.SENDER, str(frames), "loop"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert int(liar.stdout.readline()) > 0  # frames built: it is sending from now on
        try:
            reports = cl.run_workers(plan, job="lied-to", timeout=60)
        finally:
            liar.kill()
            liar.wait(timeout=10)
    assert_reports_ok(reports)
    c = next(r for r in reports[0] if r.get("check") == "counters")
    assert c["aggregator"]["dropped"] > 0, "no lying frame reached the aggregator"
    assert c["aggregator"]["contributions"] == c["worker"]["results"]


def test_no_aggregator_gives_a_clear_error(testbed_factory):
    """Workers whose aggregator never answers fail with a message, not a hang."""
    tb = testbed_factory(workers=2, topology="one-arm")
    with Cluster(tb) as cl:
        cl.detach()  # the control endpoint stays; the data path is gone
        procs = cl.start_workers([{"dtype": "int32", "count": 10_000}], job="orphan", timeout=3)
        with pytest.raises(Exception) as ei:
            cl.collect(procs, deadline=60)
    msg = str(ei.value)
    assert "rank 0 exited" in msg
    assert "AllreduceTimeout" in msg or "timed out" in msg or "no answer" in msg


def test_sparse_allreduces_through_xdp(testbed_factory):
    """`xdp-agg serve --sparse`: the job is sparse, and "auto" runs sparse all-reduces of
    tensors whose blocks are mostly zero (the same blocks on every rank, or drawn per rank),
    int32 exact and floats within the bound, with the zero blocks left home; forced dense
    and forced sparse all-reduces of the same job agree with them."""
    tb = testbed_factory(workers=4, topology="one-arm")
    base = {"count": 200_000, "density": 0.1}
    plan = [
        {**base, "dtype": "int32", "same": True},
        {**base, "dtype": "int32", "seed": 3},
        {**base, "dtype": "float32", "seed": 4},
        {**base, "dtype": "int32", "seed": 5, "sparse": False},
        {**base, "dtype": "float32", "seed": 6, "density": 1.0, "sparse": True},
        {"check": "counters"},
    ]
    with Cluster(tb, serve_args=("--sparse",)) as cl:
        reports = cl.run_workers(plan, job="sparse")
    assert_reports_ok(reports)
    for reps in reports:
        runs = [r["stats"]["sparse_allreduces"] for r in reps if "stats" in r]
        assert runs == [1, 1, 1, 0, 1], runs
        skipped = [r["stats"]["blocks_skipped"] for r in reps if "stats" in r]
        assert all(s > 0 for s in skipped[:3]) and skipped[3:] == [0, 0], skipped
        c = next(r for r in reps if r.get("check") == "counters")
        assert c["aggregator"]["dropped"] == 0, c
