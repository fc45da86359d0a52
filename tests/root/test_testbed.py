"""Tests of netns_testbed: address plan (no root) and real namespaces (root).

The namespace tests build small testbeds (2-3 workers) and check reachability,
UDP delivery, loss/duplication rules, rate shaping, live changes, cleanup on
every exit path and the CLI. The whole file runs in well under a minute.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys

import pytest
import unprivileged
from harness.cli import run_testbed_cli

from netns_testbed import faults, plan, registry, shaping
from netns_testbed.errors import TestbedError
from netns_testbed.fixtures import SKIP_REASON
from netns_testbed.testbed import MAX_MTU, PLAIN_XDP_MAX_MTU, Testbed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGG_PORT = 0xBEE0

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason=SKIP_REASON)


def netns_marks(f):
    """Mark a test as building namespaces (root + netns markers, skip unless root)."""
    return pytest.mark.root(pytest.mark.netns(needs_root(f)))


@pytest.fixture(scope="module", autouse=True)
def _tools():
    """ping is not in the base image; install it once if we may."""
    if os.geteuid() == 0 and shutil.which("ping") is None:
        subprocess.run(["apt-get", "install", "-y", "iputils-ping"], capture_output=True)


# Receiver run inside a namespace: binds, prints "ready", and waits for a line on stdin, which
# collect() writes once the test's senders have exited; only then does it drain the datagrams
# (queued in its socket meanwhile) until `idle` seconds pass without one, and prints them as
# JSON. The idle clock so starts after the sending, however slowly a loaded machine starts the
# sender's Python: a receiver that timed out while the sender was still starting saw nothing.
RECV = r"""
import json, socket, sys
port, idle = int(sys.argv[1]), float(sys.argv[2])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE: no overflow drops
s.bind(("0.0.0.0", port))
print("ready", flush=True)
sys.stdin.readline()  # the senders are done
s.settimeout(idle)
got = []
try:
    while True:
        data, addr = s.recvfrom(65535)
        got.append([addr[0], addr[1], data.decode()])
except socket.timeout:
    pass
print(json.dumps(got), flush=True)
"""

# Sender: argv = dst port count tag [sport]
SEND = r"""
import socket, sys
dst, port, n, tag = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
if len(sys.argv) > 5:
    s.bind(("0.0.0.0", int(sys.argv[5])))
for i in range(n):
    s.sendto(f"{tag}-{i}".encode(), (dst, port))
"""


def start_receiver(tb, host, port, idle=0.5):
    p = tb.popen(
        host,
        [sys.executable, "-c", RECV, str(port), str(idle)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "ready"
    return p


def collect(p):
    """The datagrams the receiver got, told once every send() before this call has returned."""
    out, _ = p.communicate(input="done\n", timeout=30)
    return json.loads(out)


def send(tb, host, dst, port, n=1, tag="x", sport=None):
    argv = [sys.executable, "-c", SEND, dst, str(port), str(n), tag]
    if sport is not None:
        argv.append(str(sport))
    tb.run(host, argv, check=True, timeout=10)


def netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def assert_gone(prefix):
    pat = plan.netns_name_re(prefix)
    assert not [n for n in netns_names() if pat.match(n)]
    assert not os.path.exists(registry.state_path(prefix))


# ---------------------------------------------------------------- no root


def test_plan_one_arm():
    p = plan.make_plan("xt0001", 3, "one-arm")
    assert p.namespaces == ["xt0001sw", "xt0001ag", "xt0001w0", "xt0001w1", "xt0001w2"]
    assert p.aggregator.ifnames == ["eth0"] and p.aggregator.ips == ["198.18.0.1"]
    assert [w.ip for w in p.workers] == ["198.18.0.10", "198.18.0.11", "198.18.0.12"]
    assert {w.agg_ip for w in p.workers} == {"198.18.0.1"}
    assert {w.agg_ifname for w in p.workers} == {"eth0"}
    assert p.group_ip == "198.18.0.255" and p.agg_interfaces == ["eth0"]
    assert p.workers[1].mac == "02:00:c6:12:00:0b"


def test_plan_switch():
    p = plan.make_plan("xt0001", plan.MAX_TESTBED_WORKERS, "switch")
    assert p.switch_netns is None and p.group_ip is None
    assert p.agg_interfaces == [f"p{i}" for i in range(32)]
    w = p.workers[31]
    assert (w.ip, w.agg_ip, w.agg_ifname) == ("198.18.32.2", "198.18.32.1", "p31")
    for v in p.veths:
        assert len(v.if_a) <= 15 and len(v.if_b) <= 15


@pytest.mark.parametrize(
    "kw",
    [
        dict(workers=0),
        dict(workers=33),
        dict(topology="ring"),
        dict(prefix="bad/prefix"),
        dict(rate="1 gbps"),
        dict(loss_up=1.5),
        dict(mtu=10),
        dict(topology="switch", agg_rate="1gbit"),
        dict(topology="switch", dup_down=0.1),
    ],
)
def test_bad_options(kw):
    with pytest.raises(ValueError):
        Testbed(**kw)


def test_mtu_above_the_jumbo_limit_is_refused_with_the_limit():
    """Up to 3506 the testbed's XDP programs are plain ones; above, to 9000, multi-buffer (frags)
    programs (veth refuses a plain one there with ERANGE); more is refused up front."""
    assert (PLAIN_XDP_MAX_MTU, MAX_MTU) == (3506, 9000)
    Testbed(mtu=PLAIN_XDP_MAX_MTU)
    Testbed(mtu=MAX_MTU)
    with pytest.raises(ValueError, match=r"68\.\.9000, got 9001.*multi-buffer"):
        Testbed(mtu=9001)
    r = run_testbed_cli("up", "--mtu", "9001")
    assert r.exit_code == 2 and "9000" in r.output and "Traceback" not in r.output


def test_default_prefix_and_records():
    tb = Testbed(workers=2)
    assert re.fullmatch(r"xt[0-9a-f]{4}", tb.prefix)
    assert tb.netns_of("w1") == tb.workers[1].netns == tb.prefix + "w1"
    assert tb.netns_path("agg") == f"/var/run/netns/{tb.prefix}ag"
    assert tb.host(0) is tb.workers[0] and tb.host("sw") == tb.prefix + "sw"


def test_rates_and_nft_text():
    assert shaping.parse_rate("1gbit") == 10**9
    assert shaping.parse_rate("100mbit") == 10**8
    assert shaping.format_rate(10**10) == "10gbit"
    # burst: >= 1 ms at the rate and >= 16 full frames
    assert shaping.tbf_burst(10**9, 1500) == 125_000
    assert shaping.tbf_burst(10**7, 1500) == 16 * 1514
    text = faults.worker_script("eth0", 0.25, 0.0)
    assert "udp dport 0xbee0-0xbeef numgen random mod 1000000000 < 250000000" in text
    assert 'hook egress device "eth0"' in text and "hook ingress" not in text
    # loss down sits on the bridge port's egress, before any receiver on the worker
    text = faults.switch_script(["w0", "w1"], 0.0, 1.0)
    assert 'chain loss_down_w1 { type filter hook egress device "w1" priority -10;' in text
    assert "udp sport 0xbee0-0xbeef counter drop" in text  # p=1: unconditional
    # what a bridge port receives goes through its ifb's tbf (AF_XDP senders skip their qdisc)
    lines = shaping.ingress_batch(["w0"], 10**8, 1500).splitlines()
    assert lines[0] == "qdisc replace dev w0 handle ffff: ingress"
    assert lines[1].endswith("u32 match u32 0 0 action mirred egress redirect dev ifb-w0")
    assert lines[2].startswith("qdisc replace dev ifb-w0 root tbf rate 100000000bit")


# ------------------------------------------------------------- namespaces


@netns_marks
@pytest.mark.parametrize("topology,workers", [("one-arm", 3), ("switch", 2)])
def test_topology_reachability_udp_and_shaping(testbed_factory, topology, workers):
    tb = testbed_factory(workers=workers, topology=topology, rate="1gbit", mtu=3500)
    assert os.path.exists(registry.state_path(tb.prefix))
    # every worker pings its aggregator address
    for w in tb.workers:
        cp = tb.run(w, ["ping", "-c", "1", "-W", "1", w.agg_ip])
        assert cp.returncode == 0, cp.stdout + cp.stderr
    # addresses and MACs match the records; MTU applied
    for k, ifname in enumerate(tb.agg_interfaces):
        out = tb.run("agg", ["ip", "-o", "addr", "show", "dev", ifname]).stdout
        assert f"{tb.aggregator.ips[k]}/24" in out
        assert tb.aggregator.macs[k] in tb.run("agg", ["ip", "link", "show", ifname]).stdout
    w0 = tb.workers[0]
    link = tb.run(w0, ["ip", "link", "show", "eth0"]).stdout
    assert w0.mac in link and "mtu 3500" in link
    # a UDP datagram from each worker reaches a socket in the aggregator namespace
    rx = start_receiver(tb, "agg", AGG_PORT)
    for w in tb.workers:
        send(tb, w, w.agg_ip, AGG_PORT, tag=w.name)
    got = collect(rx)
    assert sorted((ip, d) for ip, _, d in got) == sorted((w.ip, f"{w.name}-0") for w in tb.workers)
    # GRO on at both ends (XDP_TX frames need it)
    assert "generic-receive-offload: on" in tb.run(w0, ["ethtool", "-k", "eth0"]).stdout
    assert "generic-receive-offload: on" in tb.run("agg", ["ethtool", "-k", w0.agg_ifname]).stdout
    # tbf on both directions of each worker link, aggregator link unshaped (one-arm)
    assert "tbf" in tb.run(w0, ["tc", "qdisc", "show", "dev", "eth0"]).stdout
    peer_host, peer_dev = ("sw", "w0") if topology == "one-arm" else ("agg", "p0")
    assert "rate 1Gbit" in tb.run(peer_host, ["tc", "qdisc", "show", "dev", peer_dev]).stdout
    if topology == "one-arm":
        assert "tbf" not in tb.run("agg", ["tc", "qdisc", "show", "dev", "eth0"]).stdout
    # live rate change
    tb.set_rate("100mbit")
    assert "rate 100Mbit" in tb.run(w0, ["tc", "qdisc", "show", "dev", "eth0"]).stdout
    tb.set_rate(None)
    assert "tbf" not in tb.run(peer_host, ["tc", "qdisc", "show", "dev", peer_dev]).stdout


@netns_marks
def test_group_broadcast_reaches_all_workers(testbed_factory):
    tb = testbed_factory(workers=3)
    rxs = [start_receiver(tb, w, 5555) for w in tb.workers]
    send(tb, "agg", tb.group_ip, 5555, tag="result", sport=AGG_PORT)
    for rx in rxs:
        assert [d for _, _, d in collect(rx)] == ["result-0"]


@netns_marks
@pytest.mark.parametrize("topology", ["one-arm", "switch"])
def test_loss_up_drops_udp_but_not_ping(testbed_factory, topology):
    tb = testbed_factory(workers=2, topology=topology, loss_up=1.0)
    w = tb.workers[1]
    assert tb.run(w, ["ping", "-c", "1", "-W", "1", w.agg_ip]).returncode == 0
    rx_in, rx_out = start_receiver(tb, "agg", AGG_PORT), start_receiver(tb, "agg", 0xBEF0)
    send(tb, w, w.agg_ip, AGG_PORT, n=5)
    send(tb, w, w.agg_ip, 0xBEF0, n=1)  # just outside the aggregation port range
    assert collect(rx_in) == []
    assert len(collect(rx_out)) == 1
    # live change: loss off
    tb.set_loss(0.0, 0.0)
    rx = start_receiver(tb, "agg", AGG_PORT)
    send(tb, w, w.agg_ip, AGG_PORT, n=5)
    assert len(collect(rx)) == 5


@netns_marks
def test_loss_scope_all_drops_traffic_between_workers_too(testbed_factory):
    """loss_scope "all": a frame between two workers meets the sender's loss up and the
    receiver's loss down (as gloo's TCP would); "aggregation" leaves it alone. ARP works."""
    tb = testbed_factory(workers=2, loss_up=1.0, loss_scope="all")
    w0, w1 = tb.workers
    rx = start_receiver(tb, w1, 5555)
    send(tb, w0, w1.ip, 5555, n=3)
    assert collect(rx) == []
    assert tb.run(w0, ["ping", "-c", "1", "-W", "1", w1.ip]).returncode != 0  # IPv4 dropped
    tb.set_loss(0.0, 1.0)  # down only: dropped on the bridge port toward the receiver
    rx = start_receiver(tb, w1, 5555)
    send(tb, w0, w1.ip, 5555, n=3)
    assert collect(rx) == []
    tb2 = testbed_factory(workers=2, loss_up=1.0, loss_down=1.0)  # scope "aggregation"
    a0, a1 = tb2.workers
    rx = start_receiver(tb2, a1, 5555)
    send(tb2, a0, a1.ip, 5555, n=3)
    assert len(collect(rx)) == 3
    with pytest.raises(ValueError, match="loss_scope"):
        Testbed(workers=2, topology="switch", loss_scope="all")


@netns_marks
def test_random_loss_rate(testbed_factory):
    tb = testbed_factory(workers=1, loss_up=0.3)
    w = tb.workers[0]
    rx = start_receiver(tb, "agg", AGG_PORT + 15)
    send(tb, w, w.agg_ip, AGG_PORT + 15, n=2000)
    kept = len(collect(rx))
    assert 1400 - 150 < kept < 1400 + 150  # ~6 sigma around 70 %


@netns_marks
@pytest.mark.parametrize("topology", ["one-arm", "switch"])
def test_reorder_holds_frames_back_and_loses_none(testbed_factory, topology):
    """reorder: a share of the uplink's aggregation frames arrives after later ones, none is
    lost or doubled, each held frame counted; other traffic is never held; 0 ends it."""
    tb = testbed_factory(workers=1, topology=topology, reorder=0.3, reorder_delay=0.2)
    w = tb.workers[0]
    rx = start_receiver(tb, "agg", AGG_PORT + 1, idle=2.0)
    send(tb, w, w.agg_ip, AGG_PORT + 1, n=2000)
    got = [int(d.split("-")[1]) for _, _, d in collect(rx)]
    held = tb.held_frames()
    assert sorted(got) == list(range(2000))
    late = sum(1 for i, seq in enumerate(got) if seq < max(got[: i + 1]))
    assert 0 < late <= held
    assert 600 - 130 < held < 600 + 130  # ~6 sigma around 30 %
    rx = start_receiver(tb, "agg", 5555, idle=2.0)
    send(tb, w, w.agg_ip, 5555, n=200, tag="other")  # not aggregation traffic: never held
    assert [d for _, _, d in collect(rx)] == [f"other-{i}" for i in range(200)]
    assert tb.held_frames() == held
    tb.set_reorder(0.0)
    rx = start_receiver(tb, "agg", AGG_PORT + 1)
    send(tb, w, w.agg_ip, AGG_PORT + 1, n=200)
    assert [d for _, _, d in collect(rx)] == [f"x-{i}" for i in range(200)]
    assert tb.held_frames() == held


@netns_marks
def test_loss_down_drops_from_aggregation_ports(testbed_factory):
    tb = testbed_factory(workers=1, topology="switch", loss_down=1.0)
    w = tb.workers[0]
    rx = start_receiver(tb, w, 5555)
    send(tb, "agg", w.ip, 5555, tag="agg", sport=AGG_PORT + 3)
    send(tb, "agg", w.ip, 5555, tag="other", sport=40000)
    assert [d for _, _, d in collect(rx)] == ["other-0"]


@netns_marks
def test_duplication_both_directions(testbed_factory):
    tb = testbed_factory(workers=1, dup_up=1.0, dup_down=1.0)
    w = tb.workers[0]
    rx = start_receiver(tb, "agg", AGG_PORT)
    send(tb, w, w.agg_ip, AGG_PORT, n=3, tag="up")
    # dup_up=1: exactly one extra copy each (the mark stops copies of copies)
    assert sorted(d for _, _, d in collect(rx)) == sorted(2 * ["up-0", "up-1", "up-2"])
    rx = start_receiver(tb, w, 5555)
    send(tb, "agg", w.ip, 5555, n=2, tag="down", sport=AGG_PORT)
    assert sorted(d for _, _, d in collect(rx)) == sorted(2 * ["down-0", "down-1"])


@netns_marks
def test_down_removes_everything_and_is_idempotent():
    tb = Testbed(workers=2, topology="switch")
    try:
        tb.up()
        proc = tb.popen("w1", ["sleep", "60"])
        assert all(n in netns_names() for n in tb.namespaces)
        tb.down()
        assert proc.poll() is not None  # killed, by PID
        assert_gone(tb.prefix)
        tb.down()  # second call is a no-op
    finally:
        tb.down()


@netns_marks
def test_exception_in_context_manager_cleans_up():
    tb = Testbed(workers=2)
    with pytest.raises(RuntimeError, match="boom"):
        with tb:
            proc = tb.popen("agg", ["sleep", "60"])
            raise RuntimeError("boom")
    assert proc.poll() is not None
    assert_gone(tb.prefix)


@netns_marks
def test_failed_up_rolls_back(monkeypatch):
    def fail(*a, **k):
        raise TestbedError("injected failure")

    monkeypatch.setattr(faults, "apply", fail)
    tb = Testbed(workers=2, loss_up=0.1)
    with pytest.raises(TestbedError, match="injected"):
        tb.up()
    assert_gone(tb.prefix)


@netns_marks
def test_prefix_in_use_is_refused_without_harm(testbed_factory):
    tb = testbed_factory(workers=1)
    with pytest.raises(TestbedError, match="in use"):
        Testbed(workers=1, prefix=tb.prefix).up()
    assert all(n in netns_names() for n in tb.namespaces)
    assert os.path.exists(registry.state_path(tb.prefix))


@netns_marks
@pytest.mark.parametrize("testbed", [{"topology": "switch", "workers": 2}], indirect=True)
def test_testbed_fixture_indirect(testbed):
    assert testbed.agg_interfaces == ["p0", "p1"]
    assert testbed.run("w1", ["ping", "-c", "1", "-W", "1", "198.18.2.1"]).returncode == 0


BUILD_AND_EXIT = r"""
import os, signal, sys
from netns_testbed.testbed import MAX_MTU, Testbed
tb = Testbed(workers=1).up()
print(tb.prefix, flush=True)
if sys.argv[1] == "die":
    os.kill(os.getpid(), signal.SIGKILL)  # no atexit, leaves the testbed behind
"""


@netns_marks
def test_atexit_cleanup_and_down_stale():
    def build(mode):
        cp = subprocess.run(
            [sys.executable, "-c", BUILD_AND_EXIT, mode],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return cp.stdout.strip()

    assert_gone(build("exit"))  # the atexit hook removed it
    prefix = build("die")
    try:
        assert prefix and os.path.exists(registry.state_path(prefix))
        st = [s for s in json.loads(cli("status", "--json").stdout) if s["prefix"] == prefix]
        assert st and st[0]["owner_alive"] is False and st[0]["health"] == "ok"
        cp = cli("down", "--stale")
        assert cp.returncode == 0 and f"removed {prefix}" in cp.stdout
        assert_gone(prefix)
    finally:
        if prefix and registry.load_state(prefix) is not None:
            Testbed.attach(prefix).down()


def cli(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "netns_testbed.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        **kw,
    )


@netns_marks
def test_cli_round_trip():
    prefix = "tc" + secrets.token_hex(2)
    try:
        cp = cli(
            "up",
            "--workers",
            "2",
            "--topology",
            "one-arm",
            "--rate",
            "1gbit",
            "--prefix",
            prefix,
            "--json",
        )
        assert cp.returncode == 0, cp.stderr
        st = json.loads(cp.stdout)
        assert st["prefix"] == prefix and st["status"] == "up"
        assert [w["ip"] for w in st["workers"]] == ["198.18.0.10", "198.18.0.11"]
        # the testbed outlives the CLI process
        cp = cli("status", "--json")
        assert cp.returncode == 0
        mine = [s for s in json.loads(cp.stdout) if s["prefix"] == prefix]
        assert mine and mine[0]["health"] == "ok"
        cp = cli("exec", "--prefix", prefix, "w1", "--", "ping", "-c", "1", "-W", "1", "198.18.0.1")
        assert cp.returncode == 0, cp.stdout + cp.stderr
        assert cli("exec", "--prefix", prefix, "agg", "--", "sh", "-c", "exit 3").returncode == 3
        assert cli("exec", "--prefix", prefix, "w7", "--", "true").returncode == 2
        assert cli("up", "--workers", "0").returncode == 2
        cp = cli("up", "--prefix", prefix)
        assert cp.returncode == 1 and "in use" in cp.stderr
        assert cli("down", "--prefix", prefix).returncode == 0
        assert_gone(prefix)
        cp = cli("down", "--prefix", prefix)
        assert cp.returncode == 1 and "no testbed" in cp.stderr
    finally:
        if registry.load_state(prefix) is not None:
            Testbed.attach(prefix).down()


def test_cli_not_root_message_in_process(monkeypatch):
    """Every command that changes testbeds refuses a non-root caller with the hint to use sudo.

    The effective uid is faked, so this runs without root, from any checkout; the prefix is
    fresh, so a broken check run as root builds or touches nothing of anyone else's."""
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    prefix = "tn" + secrets.token_hex(2)
    try:
        for args in (
            ["up", "--workers", "1"],
            ["down"],
            ["exec", "w0", "--", "true"],
            ["set", "--rate", "1gbit"],
        ):
            r = run_testbed_cli(args[0], "--prefix", prefix, *args[1:])
            assert r.exit_code == 1, (args, r.output)
            assert "not root: run with sudo" in r.stderr, args
    finally:
        monkeypatch.undo()
        if registry.load_state(prefix) is not None:
            Testbed.attach(prefix).down()


@pytest.mark.root
@pytest.mark.as_nobody
def test_cli_not_root_message():
    """The real thing: `netns-testbed up` started by uid 65534 gets the message, not a traceback.

    The child imports from a readable copy (tests/unprivileged.py), so this works wherever the
    checkout is, even in a directory only root can enter."""
    with unprivileged.readable_copy("netns_testbed.cli") as copy:
        cp = unprivileged.run_as_nobody(copy, "netns_testbed.cli", "up")
    assert cp.returncode == 1, cp.stderr
    assert "not root: run with sudo" in cp.stderr
    assert "Traceback" not in cp.stderr


@netns_marks
@pytest.mark.parametrize("topology", ["one-arm", "switch"])
def test_agg_queues_spread_flows_over_the_aggregators_queues(testbed_factory, topology):
    """agg_queues=4: the aggregator's link has 4 receive queues, and flows from 16 source ports
    land on more than one of them (each counted by the XDP program on it)."""
    from netns_testbed import counters, xdp_pass

    tb = testbed_factory(workers=1, topology=topology, agg_queues=4)
    w = tb.workers[0]
    xdp_pass.attach_pass({tb.aggregator.netns: [w.agg_ifname]})
    for sport in range(40000, 40016):
        send(tb, w, w.agg_ip, AGG_PORT, n=4, sport=sport)
    out = tb.run("agg", ["ethtool", "-S", w.agg_ifname], check=True).stdout
    stats = counters.parse_ethtool(out)
    per_queue = [stats.get(f"rx_queue_{q}_xdp_packets", 0) for q in range(4)]
    assert sum(per_queue) >= 64 and sum(n > 0 for n in per_queue) >= 2, per_queue
    assert f"rx_queue_{4}_xdp_packets" not in stats  # exactly 4
    assert tb.state()["agg_queues"] == 4


def test_agg_queues_bounds():
    for bad in (0, 65, "2"):
        with pytest.raises(ValueError, match="agg_queues"):
            Testbed(agg_queues=bad)
