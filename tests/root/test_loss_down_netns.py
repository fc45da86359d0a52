"""The testbed's downstream loss reaches every kind of receiver.

It used to be an nftables drop on the worker's ingress hook: a kernel UDP socket lost what it
dropped, but an AF_PACKET socket (DPDK's net_af_packet, p4app-switchML's client) and an XDP
program (the AF_XDP path) see a frame before that hook, so they lost nothing. Now it sits before
the worker: on the bridge port's egress in one-arm, in the XDP program on the worker's end in
the switch topology (netns_testbed.faults, netns_testbed.xdp_pass). Each test counts: what was
sent, what each receiver got, and what the testbed's counter says it dropped
(netns_testbed.counters.down_loss); they must add up, with some loss and some delivery.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

from netns_testbed import counters, nsexec, xdp_pass
from netns_testbed.counters import Layout
from netns_testbed.faults import AGG_PORT_HI, AGG_PORT_LO
from xdp_agg import bpfsys

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns]

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the helpers
SENT = 400
P_DOWN = 0.3  # P(no drop in 400) and P(all 400 dropped) are both below 1e-60
PORT = 5555


def _frame(sport: int) -> bytes:
    eth = b"\x02" * 6 + b"\x04" * 6 + b"\x08\x00"
    ip = bytes([0x45, 0, 0, 32, 0, 0, 0x40, 0, 64, 17, 0, 0, 198, 18, 1, 1, 198, 18, 1, 2])
    return eth + ip + struct.pack(">HHHH", sport, PORT, 12, 0) + b"abcd"


def test_the_loss_program_drops_only_the_aggregation_ports():
    """The switch topology's XDP program, run on frames (BPF_PROG_TEST_RUN): p=1 drops every
    frame from 0xBEE0-0xBEEF and nothing else; p=0.3 drops some and passes some."""
    if os.geteuid() != 0:
        pytest.skip("needs root (BPF_PROG_LOAD)")
    for p, verdicts in ((1.0, {bpfsys.XDP_DROP}), (P_DOWN, {bpfsys.XDP_DROP, bpfsys.XDP_PASS})):
        fd = bpfsys.prog_load(bpfsys.PROG_TYPE_XDP, xdp_pass.loss_insns(p), "t_xdp_loss")
        try:
            got = [bpfsys.prog_test_run(fd, _frame(AGG_PORT_LO + k % 16))[0] for k in range(SENT)]
            others = [
                bpfsys.prog_test_run(fd, _frame(s))[0]
                for s in (AGG_PORT_LO - 1, AGG_PORT_HI + 1, PORT)
            ]
        finally:
            os.close(fd)
        assert set(got) == verdicts
        assert others == [bpfsys.XDP_PASS] * 3


def _receiver(tb, w) -> subprocess.Popen:
    argv = [sys.executable, os.path.join(HERE, "loss_receivers.py"), "receive", str(PORT)]
    p = tb.popen(w, argv + [w.ifname], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stderr.readline().strip() == "ready"
    return p


@pytest.mark.parametrize("topology", ["one-arm", "switch"])
def test_kernel_and_packet_sockets_lose_what_the_counter_says(testbed_factory, topology):
    """From the aggregator's namespace, SENT datagrams from 0xBEE0 to a worker with loss down:
    the worker's kernel UDP socket and its AF_PACKET socket each get SENT minus what the
    testbed counted as dropped."""
    tb = testbed_factory(workers=1, topology=topology, loss_down=P_DOWN)
    w = tb.workers[0]
    layout = Layout.from_testbed(tb)
    before = counters.snapshot(layout)
    rx = _receiver(tb, w)
    send = [sys.executable, os.path.join(HERE, "loss_receivers.py"), "send"]
    tb.run("agg", send + [f"{w.ip}:{PORT}", str(SENT)], check=True, timeout=60)
    out, err = rx.communicate(timeout=60)
    got = json.loads(out)
    dropped = counters.down_loss(counters.diff(before, counters.snapshot(layout)), layout, 0)
    assert 0 < dropped["packets"] < SENT, dropped
    assert got == {"udp": SENT - dropped["packets"], "packet": SENT - dropped["packets"]}, err


def test_an_afxdp_receiver_loses_what_the_counter_says(testbed_factory):
    """hostlib's AF_XDP path (one-arm: it cannot attach beside the switch topology's program)
    against an echo on the aggregator's address at 0xBEEF: every echo either reached the
    worker's XDP program, which redirected it to the AF_XDP socket, or was counted as dropped;
    the engine recovered the dropped ones with retransmissions and got exact results."""
    tb = testbed_factory(workers=1, topology="one-arm", loss_down=0.2)
    w = tb.workers[0]
    layout = Layout.from_testbed(tb)
    agg = f"{w.agg_ip}:{AGG_PORT_HI}"
    peer = nsexec.popen(
        tb.aggregator.netns,
        [sys.executable, os.path.join(HERE, "afxdp_peer.py"), "--listen", agg],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert peer.stderr.readline().strip() == b"ready"
        before = counters.snapshot(layout)
        argv = [sys.executable, os.path.join(HERE, "afxdp_worker.py"), "--path", "afxdp"]
        argv += ["--local", f"{w.ip}:40000", "--agg", agg, "--count", "50000"]
        cp = tb.run(w, argv, capture_output=True, text=True, timeout=120)
    finally:
        out, _ = peer.communicate(timeout=30)
    assert cp.returncode == 0, cp.stderr
    rep = json.loads(cp.stdout.splitlines()[-1])
    delta = counters.diff(before, counters.snapshot(layout))
    answered = json.loads(out)["answered"]
    dropped = counters.down_loss(delta, layout, 0)["packets"]
    eth0 = delta["ns"][w.netns]["ethtool"]["eth0"]
    redirected = sum(v for k, v in eth0.items() if k.endswith("_xdp_redirect"))
    st = rep["stats"]
    assert rep["data_path"].startswith("afxdp-") and rep["int32_equal"], rep
    assert dropped > 0 and st["retransmissions"] >= dropped, (dropped, st)
    # each echo went one of two ways; the socket took what the program redirected
    assert redirected + dropped == answered, (redirected, dropped, answered)
    assert st["results"] + st["duplicates"] + st["stale"] == redirected, (st, redirected)
