"""Forwarding through the XDP aggregator in the switch topology (issue 53), live, as root, in
a testbed of network namespaces: ARP, ping, TCP and IPv6 between workers through the box,
routed (the testbed's layout: a subnet per port) and switched (the workers given addresses on
one shared subnet); TTL 1 answered by the kernel; detach writes the kernel's sysctls back.
Only 198.18.0.0/15 and its IPv6 twin for benchmarking, 2001:2::/48 (RFC 5180), are used.
Every assertion counts events (replies, bytes, counters), none times anything.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

pytestmark = [pytest.mark.root, pytest.mark.bpf]

TCP_BYTES = 1 << 20
SERVER = (
    "import socket,sys\n"
    "s=socket.socket(socket.AF_INET6 if ':' in sys.argv[1] else socket.AF_INET)\n"
    "s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
    "s.bind((sys.argv[1],5001)); s.listen(1); print('ready',flush=True)\n"
    "c,_=s.accept(); n=0\n"
    "while True:\n"
    "    b=c.recv(65536)\n"
    "    if not b: break\n"
    "    n+=len(b)\n"
    "print(n,flush=True)\n"
)
CLIENT = (
    "import socket,sys\n"
    "fam=socket.AF_INET6 if ':' in sys.argv[1] else socket.AF_INET\n"
    "c=socket.create_connection((sys.argv[1],5001),timeout=20)\n"
    "c.sendall(bytes(int(sys.argv[2]))); c.close()\n"
)


def _agg(tb, name, *args):
    r = tb.run(
        tb.aggregator,
        [sys.executable, "-m", "xdp_agg.app.cli", "--name", name, *args],
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def _sysctls(tb, ifnames):
    script = " ".join(
        f"/proc/sys/net/ipv4/conf/{i}/forwarding /proc/sys/net/ipv6/conf/{i}/forwarding"
        for i in ifnames
    )
    return tb.run(tb.aggregator, ["sh", "-c", f"cat {script}"]).stdout.split()


def _tcp(tb, src, dst, addr):
    """Send TCP_BYTES from worker src to worker dst at addr; the bytes dst received."""
    server = tb.popen(dst, [sys.executable, "-c", SERVER, addr], stdout=-1, stderr=-1, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        r = tb.run(src, [sys.executable, "-c", CLIENT, addr, str(TCP_BYTES)], timeout=60)
        assert r.returncode == 0, r.stderr
        return int(server.stdout.readline())
    finally:
        server.kill()
        server.wait()


def _ping(tb, src, addr, *extra):
    return tb.run(src, ["ping", "-c", "3", "-i", "0.2", "-W", "2", *extra, addr], timeout=30)


def _add_ipv6(tb):
    """2001:2:0:<i+1>::1/64 on port p<i>, ::2 on worker i, a route to 2001:2::/48 by the port
    (the testbed leaves IPv6 off: on for these links alone)."""
    for i, w in enumerate(tb.workers):
        net = f"2001:2:0:{i + 1}::"
        tb.run(tb.aggregator, ["sysctl", "-qw", f"net.ipv6.conf.p{i}.disable_ipv6=0"])
        tb.run(w, ["sysctl", "-qw", "net.ipv6.conf.eth0.disable_ipv6=0"])
        tb.run(tb.aggregator, ["ip", "addr", "add", f"{net}1/64", "dev", f"p{i}", "nodad"])
        tb.run(w, ["ip", "addr", "add", f"{net}2/64", "dev", "eth0", "nodad"])
        tb.run(w, ["ip", "-6", "route", "add", "2001:2::/48", "via", f"{net}1"])


def test_l2switch_routed_ping_tcp_ipv6_ttl_and_detach_restores(testbed_factory):
    tb = testbed_factory(workers=3, topology="switch")
    name = f"l2sw{os.getpid()}"
    ports = ["p0", "p1", "p2"]
    before = _sysctls(tb, ports)
    _add_ipv6(tb)
    st = json.loads(_agg(tb, name, "attach", *ports, "--json"))
    try:
        assert st["options"]["forwarding"] == "routed"
        assert set(_sysctls(tb, ports)) == {"1"}
        w0, w1, w2 = tb.workers
        for w in (w1, w2):
            assert _ping(tb, w0, w.ip).returncode == 0  # ARP to the box, then routed
        assert _ping(tb, w0, "2001:2:0:2::2").returncode == 0
        assert _tcp(tb, w0, w1, w1.ip) == TCP_BYTES
        assert _tcp(tb, w2, w0, "2001:2:0:1::2") == TCP_BYTES
        ttl1 = _ping(tb, w0, w1.ip, "-t", "1")
        assert "Time to live exceeded" in ttl1.stdout
        fwd = json.loads(_agg(tb, name, "status", "--json"))["forwarding"]
        assert fwd["mode"] == "routed"
        c = fwd["counters"]
        assert c["routed"] > 0 and c["ttl_expired"] >= 3 and c["passed"] > 0
        assert c["own_source"] == c["loop"] == 0
        text = _agg(tb, name, "status")
        assert "forwarding routed" in text
        prom = _agg(tb, name, "stats", "--prometheus")
        assert 'xdpagg_forwarding_mode{mode="routed"} 1.0' in prom
        series = 'xdpagg_forwarding_frames_total{outcome="routed"} '
        line = next(x for x in prom.splitlines() if x.startswith(series))
        assert float(line[len(series) :]) >= c["routed"]  # counters only grow
        assert 'xdpagg_scrape_success{source="forwarding"} 1.0' in prom
    finally:
        _agg(tb, name, "detach", "--force")
    assert _sysctls(tb, ports) == before


def test_l2switch_switched_arp_ping_tcp_learns_and_floods(testbed_factory):
    tb = testbed_factory(workers=3, topology="switch")
    name = f"l2sw{os.getpid()}s"
    ports = ["p0", "p1", "p2"]
    before = _sysctls(tb, ports)
    shared = [f"198.19.0.{10 + i}" for i in range(3)]  # one segment across the three ports
    for w, ip in zip(tb.workers, shared):
        tb.run(w, ["ip", "addr", "add", f"{ip}/24", "dev", "eth0"])
    st = json.loads(_agg(tb, name, "attach", *ports, "--forwarding", "switched", "--json"))
    try:
        assert st["options"]["forwarding"] == "switched"
        assert _sysctls(tb, ports) == before  # switched: the kernel's settings untouched
        w0, w1, w2 = tb.workers
        assert _ping(tb, w0, shared[1]).returncode == 0
        assert _ping(tb, w2, shared[0]).returncode == 0
        assert _tcp(tb, w1, w2, shared[2]) == TCP_BYTES
        fwd = json.loads(_agg(tb, name, "status", "--json"))["forwarding"]
        c = fwd["counters"]
        assert fwd["mode"] == "switched"
        assert c["flooded"] >= 2  # the ARP requests, at least
        assert c["switched"] > 0 and c["learned"] >= 3
        assert 3 <= fwd["mac_table"]["entries"] <= fwd["mac_table"]["size"]
    finally:
        _agg(tb, name, "detach", "--force")


@pytest.mark.parametrize("mode", ["routed", "switched"])
def test_l2switch_allreduce_exact_beside_forwarded_traffic(testbed_factory, mode):
    """The aggregation path is unchanged while the box forwards other traffic: an int32 (exact)
    and a float32 all-reduce of 3 workers, each worker's counters the aggregator's, with a TCP
    stream and pings between two workers through the same ports alongside."""
    from harness.workers import ODD, assert_reports_ok

    from xdp_agg.cluster.cluster import Cluster
    from xdp_switch.attach_options import AttachOptions

    tb = testbed_factory(workers=3, topology="switch")
    shared = [f"198.19.0.{10 + i}" for i in range(3)]
    for w, ip in zip(tb.workers, shared):
        tb.run(w, ["ip", "addr", "add", f"{ip}/24", "dev", "eth0"])
    dst = tb.workers[2].ip if mode == "routed" else shared[2]
    plan = [
        {"dtype": "int32", "count": ODD},
        {"dtype": "float32", "count": 100_000},
        {"check": "counters"},
    ]
    with Cluster(tb, attach=AttachOptions(forwarding=mode)) as cl:
        pings = tb.popen(0, ["ping", "-c", "50", "-i", "0.05", dst], stdout=-1, text=True)
        workers = cl.start_workers(plan, job=f"fwd-{mode}")
        assert _tcp(tb, 1, 2, dst) == TCP_BYTES
        reports = cl.collect(workers, 600.0)
        out, _ = pings.communicate(timeout=60)
        fwd = json.loads(cl.cli("status", "--json").stdout)["forwarding"]
        st = cl.stats()
    assert_reports_ok(reports)
    assert " 0% packet loss" in out
    assert fwd["mode"] == mode and fwd["counters"][mode] > 0
    assert st["unattributed"]["drop_unknown_source"] == 0


GROUP, UNJOINED = "239.1.2.3", "239.9.9.9"
BATCH = 20  # datagrams per batch
RECEIVER = (  # a member of GROUP: counts each batch's datagrams until "end"
    "import json,socket,struct,sys\n"
    "from collections import Counter\n"
    "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
    "s.bind(('',5000))\n"
    "s.setsockopt(socket.IPPROTO_IP,socket.IP_ADD_MEMBERSHIP,"
    "socket.inet_aton(sys.argv[1])+socket.inet_aton(sys.argv[2]))\n"
    "print('ready',flush=True); n=Counter()\n"
    "while (b:=s.recv(64))!=b'end': n[b.decode()]+=1\n"
    "print(json.dumps(n),flush=True)\n"
)
SNIFFER = (  # no member: counts the group datagrams that reach its link, until a unicast "end"
    "import json,socket,sys\n"
    "from collections import Counter\n"
    "s=socket.socket(socket.AF_PACKET,socket.SOCK_RAW,socket.htons(3)); s.bind(('eth0',0))\n"
    "print('ready',flush=True); n=Counter()\n"
    "while True:\n"
    "    f,a=s.recvfrom(2048)\n"
    "    if a[2]==4 or f[12:14]!=b'\\x08\\x00' or f[23]!=17: continue\n"
    "    tag=f[14+(f[14]&15)*4+8:].decode(errors='replace')\n"
    "    if tag=='end': break\n"
    "    if f[30]>=224: n[socket.inet_ntoa(f[30:34])+' '+tag]+=1\n"
    "print(json.dumps(n),flush=True)\n"
)
GROUP_SENDER = (  # argv: source address, then (destination, tag, count) triples
    "import socket,sys\n"
    "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
    "s.setsockopt(socket.IPPROTO_IP,socket.IP_MULTICAST_IF,socket.inet_aton(sys.argv[1]))\n"
    "a=sys.argv[2:]\n"
    "for dst,tag,k in zip(a[::3],a[1::3],a[2::3]):\n"
    "    port=5000 if int(dst.split('.')[0])>=224 else 5999\n"
    "    for _ in range(int(k)): s.sendto(tag.encode(),(dst,port))\n"
)


def _snooping(tb, name, until, what):
    """The status's igmp_snooping once until(it) holds (asked at most 100 times)."""
    for _ in range(100):
        snoop = json.loads(_agg(tb, name, "status", "--json"))["forwarding"]["igmp_snooping"]
        if until(snoop):
            return snoop
        time.sleep(0.1)
    raise AssertionError(f"{what}: never seen; last {snoop}")


def test_l2switch_switched_igmp_snooping_prunes_groups(testbed_factory, tmp_path):
    """IGMP snooping as the Linux bridge does it (bpf/snoop.h): without a querier a joined group
    is flooded; once a query came in (that port a router port), the group goes to its member
    and not to a port without members, while a group nobody joined is still flooded. Counted at
    a member (its socket) and at a non-member's link (every frame that reaches it)."""
    from harness import junk
    from harness.forward_cases import IGMP_QUERY, igmp, igmp_v2

    tb = testbed_factory(workers=3, topology="switch")
    name = f"l2sw{os.getpid()}m"
    shared = [f"198.19.0.{10 + i}" for i in range(3)]
    for w, ip in zip(tb.workers, shared):
        tb.run(w, ["ip", "addr", "add", f"{ip}/24", "dev", "eth0"])
    _agg(tb, name, "attach", "p0", "p1", "p2", "--forwarding", "switched")
    procs = []
    try:
        ifindex = {
            json.loads(tb.run(tb.aggregator, ["ip", "-j", "link", "show", p]).stdout)[0][
                "ifindex"
            ]: p
            for p in ("p0", "p1", "p2")
        }
        member = tb.popen(
            1, [sys.executable, "-c", RECEIVER, GROUP, shared[1]], stdout=-1, text=True
        )
        sniffer = tb.popen(2, [sys.executable, "-c", SNIFFER], stdout=-1, text=True)
        procs = [member, sniffer]
        assert member.stdout.readline().strip() == "ready"
        assert sniffer.stdout.readline().strip() == "ready"
        snoop = _snooping(tb, name, lambda s: GROUP in s["groups"], "the member's report")
        assert [ifindex[i] for i in snoop["groups"][GROUP]] == ["p1"]
        assert not snoop["querier"]

        send = [sys.executable, "-c", GROUP_SENDER, shared[0]]
        assert tb.run(0, [*send, GROUP, "flooded", str(BATCH)]).returncode == 0
        mac0 = tb.run(0, ["cat", "/sys/class/net/eth0/address"]).stdout.strip()
        query = igmp(mac0, shared[0], "224.0.0.1", igmp_v2(IGMP_QUERY, "0.0.0.0"))
        junk.write_frames(tmp_path / "query", [query])
        sent = tb.run(0, [sys.executable, "-c", junk.SENDER, str(tmp_path / "query")])
        assert sent.stdout.split() == ["1", "1"], sent.stderr
        snoop = _snooping(tb, name, lambda s: s["querier"], "the query")
        assert [ifindex[i] for i in snoop["router_ports"]] == ["p0"]
        pruned = json.loads(_agg(tb, name, "status", "--json"))["forwarding"]["counters"]["pruned"]
        batches = [GROUP, "pruned", BATCH, UNJOINED, "unjoined", BATCH, GROUP, "end", 1]
        assert tb.run(0, [*send, *batches, shared[2], "end", 1]).returncode == 0
        got_member = json.loads(member.communicate(timeout=30)[0])
        got_other = json.loads(sniffer.communicate(timeout=30)[0])
        fwd = json.loads(_agg(tb, name, "status", "--json"))["forwarding"]
    finally:
        for p in procs:
            p.kill()
            p.wait()
        _agg(tb, name, "detach", "--force")
    assert got_member == {"flooded": BATCH, "pruned": BATCH}
    assert got_other == {f"{GROUP} flooded": BATCH, f"{UNJOINED} unjoined": BATCH}
    assert fwd["counters"]["pruned"] - pruned >= BATCH  # the group's, at p2
    assert fwd["counters"]["igmp"] >= 2  # the report and the query, at least
