"""Jumbo frames end to end (fewer packets per byte): a testbed at MTU 9000, where only an XDP
multi-buffer (frags) program attaches, and all-reduces of 2048 int32 per packet through it.

- a plain XDP program is refused on a veth whose peer has MTU 9000, with a message naming
  --frags; `xdp-agg attach --frags` attaches (../shared/design/platform.md measured both); an
  aggregator attached without it refuses a jumbo job, and so does one in the switch topology
  (its devmap broadcast did not carry multi-buffer results);
- hostlib's elems="auto" picks 2048 from the path MTU, and int32 and float32 all-reduces come
  back exact (floats within hostlib.scaling's bound) under 1% loss in both directions, through
  the C loop and the numpy reference loop.
"""

import sys

import pytest
from harness.workers import assert_reports_ok

from xdp_agg.app.options import AttachOptions
from xdp_agg.cluster.cluster import Cluster

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.slow]

MTU = 9000


def test_plain_program_refused_frags_attaches(testbed_factory):
    tb = testbed_factory(workers=1, topology="one-arm", mtu=MTU)
    agg = tb.aggregator
    cli = [sys.executable, "-m", "xdp_agg.app.cli", "--name", "jumbo"]
    r = tb.run(agg, [*cli, "attach", *agg.ifnames], timeout=120)
    assert r.returncode != 0 and "--frags" in r.stderr, r.stderr
    r = tb.run(agg, [*cli, "attach", "--frags", *agg.ifnames], timeout=120)
    assert r.returncode == 0, r.stderr
    r = tb.run(agg, [*cli, "detach"], timeout=60)
    assert r.returncode == 0, r.stderr


def _jumbo_job_refused(tb, name: str, attach: list[str], workers: int, why: str) -> None:
    """Attach aggregator `name` with `attach` options: a job of 2048 elements per packet is
    refused with a message containing `why`, one of 768 is created."""
    agg = tb.aggregator
    cli = [sys.executable, "-m", "xdp_agg.app.cli", "--name", name]
    r = tb.run(agg, [*cli, "attach", *attach, *agg.ifnames], timeout=120)
    assert r.returncode == 0, r.stderr
    try:
        job = [*cli, "job", "create", "0", "--workers", str(workers), "--slots", "0:8"]
        r = tb.run(agg, [*job, "--elems", "2048"], timeout=60)
        assert r.returncode != 0 and why in r.stderr, r.stderr
        r = tb.run(agg, [*job, "--elems", "768"], timeout=60)
        assert r.returncode == 0, r.stderr
    finally:
        tb.run(agg, [*cli, "detach", "--force"], timeout=60)


def test_plain_aggregator_refuses_a_jumbo_job(testbed_factory):
    """A job of 2048 elements per packet on an aggregator without --frags would have every
    packet truncated to its first buffer: refused, naming --frags."""
    tb = testbed_factory(workers=1, topology="one-arm")
    _jumbo_job_refused(tb, "plain", [], 1, "--frags")


def test_switch_topology_refuses_a_jumbo_job(testbed_factory):
    """Results of the switch topology leave through a devmap broadcast, which did not carry
    multi-buffer frames here: a jumbo job there is refused, naming the one-arm topology."""
    tb = testbed_factory(workers=2, topology="switch", mtu=MTU)
    _jumbo_job_refused(tb, "jswitch", ["--frags"], 2, "one-arm")


@pytest.mark.parametrize("native", ["1", "0"], ids=["c-loop", "numpy-loop"])
def test_allreduce_2048_per_packet_under_loss(testbed_factory, monkeypatch, native):
    monkeypatch.setenv("XDP_AGG_NATIVE", native)
    tb = testbed_factory(workers=3, topology="one-arm", mtu=MTU, loss_up=0.01, loss_down=0.01)
    plan = [{"dtype": "int32", "count": 300_001}, {"dtype": "float32", "count": 100_000, "seed": 2}]
    with Cluster(tb, attach=AttachOptions(frags=True)) as cl:
        reports = cl.run_workers(plan, job=f"jumbo-{native}", elems="auto", timeout=60)
    assert_reports_ok(reports)
    items = [r for reps in reports for r in reps if "stats" in r]
    assert {r["elems"] for r in items} == {2048}
    assert {r["native"] for r in items} == {native == "1"}
    assert sum(r["stats"]["retransmissions"] for r in items) > 0, "loss made no retransmission"
