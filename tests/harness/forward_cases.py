"""The forwarding cases of the switch topology (issue 53): the packet-case table's shape
(harness/packet_cases.py: cases of steps, each a frame and the verdict it must get) for frames
that are not aggregation traffic, with a serial reference model (FwdModel) of what bpf/forward.h
does with them. Three runners hold a target to the same table, step by step:
tests/unit/test_l2switch_cases_model.py (the model alone, no root),
tests/root/test_l2switch_xdp_cases.py
(the XDP program through BPF_PROG_TEST_RUN in a switch-topology testbed's aggregator namespace)
and tests/root/test_l2switch_p4_cases.py (bmv2's `l2_forward` table, p4/forwarder.p4).

The layout is the testbed's switch topology: port i (p<i>) is 198.18.(i+1).1/24 with MAC
mac_for_ip of it, and its worker 198.18.(i+1).2 behind it. Switched cases add hosts on one
shared segment (198.19.0.0/24) behind the ports. The P4 twin has a static MAC table (no learning,
no own-source or loop checks, no routing): a case says which targets run it, and why not.
"""

from __future__ import annotations

import enum
import struct
from collections import Counter
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network

from scapy.layers.inet import ICMP, IP, TCP, UDP, IPOption_Router_Alert
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import ARP, Ether
from scapy.utils import checksum

PORTS = 4
BROADCAST = "ff:ff:ff:ff:ff:ff"
ALL_HOSTS_V6 = "33:33:00:00:00:01"  # IPv6 all-nodes multicast
FAR_IP = "198.18.4.99"  # in port 3's subnet, never resolved: no neighbour
FOREVER_S = 3600.0  # a hold or an age no case outlives
IGMP_PROTO = 2
IGMP_QUERY = 0x11
IGMP_V3_REPORT = 0x22
MCAST = IPv4Network("224.0.0.0/4")
MCAST_LOCAL = IPv4Network("224.0.0.0/24")  # never pruned


def port_ip(i: int) -> str:
    """The box's address on port i."""
    return f"198.18.{i + 1}.1"


def worker_ip(i: int) -> str:
    """The testbed's worker behind port i."""
    return f"198.18.{i + 1}.2"


def mac_for_ip(ip: str) -> str:
    """The testbed's MACs (netns_testbed.plan.mac_for_ip)."""
    return "02:00:" + ":".join(f"{int(o):02x}" for o in ip.split("."))


BOX_MACS = [mac_for_ip(port_ip(i)) for i in range(PORTS)]
BOX_IPS = [port_ip(i) for i in range(PORTS)]
NEIGHBOURS = {worker_ip(i): (i, mac_for_ip(worker_ip(i))) for i in range(3)}  # resolved


def host_mac(h: int) -> str:
    """Host h on the shared segment (switched cases)."""
    return f"02:00:c6:13:00:{h:02x}"


def host_ip(h: int) -> str:
    return f"198.19.0.{10 + h}"


class Verdict(enum.Enum):
    FORWARD = "forward"  # out of one other port (switched: unchanged; routed: rewritten)
    FLOOD = "flood"  # out of every other port
    TO_HOST = "to_host"  # to the box's own stack (XDP_PASS; bmv2: the host's port)
    DROP = "drop"


@dataclass
class FwdStep:
    """One frame into port `in_port` and what must become of it."""

    in_port: int
    frame: bytes
    verdict: Verdict
    counter: str  # the forwarding counter (xdp_switch.forwarding.COUNTERS) it moves
    out_port: int | None = None  # FORWARD: where
    what: str = ""


def fwd(in_port: int, frame: bytes, counter: str, out_port: int, what: str) -> FwdStep:
    """A step whose frame leaves by one other port (routed or switched: `counter`)."""
    return FwdStep(in_port, frame, Verdict.FORWARD, counter, out_port, what)


def flood(in_port: int, frame: bytes, what: str) -> FwdStep:
    """A step whose frame is flooded to every other port."""
    return FwdStep(in_port, frame, Verdict.FLOOD, "flooded", None, what)


def to_host(in_port: int, frame: bytes, counter: str, what: str) -> FwdStep:
    """A step whose frame goes to the box's own stack."""
    return FwdStep(in_port, frame, Verdict.TO_HOST, counter, None, what)


def drop(in_port: int, frame: bytes, counter: str, what: str) -> FwdStep:
    """A step whose frame is dropped, counted as `counter`."""
    return FwdStep(in_port, frame, Verdict.DROP, counter, None, what)


@dataclass
class FwdCase:
    name: str
    mode: str  # "routed" or "switched"
    steps: list[FwdStep]
    table: dict[str, int] = field(default_factory=dict)  # switched: MAC -> port, learned before
    hold_s: float = FOREVER_S  # a source on a second port sooner than this: a loop
    age_s: float = FOREVER_S  # a learned MAC not seen for this long is forgotten
    events: dict[str, int] = field(default_factory=dict)  # table counters the case moves
    not_on: dict[str, str] = field(default_factory=dict)  # target -> why it does not run it
    leave_s: float = FOREVER_S  # a membership lapses this long after a leave (0: at once)
    groups: dict[str, list[int]] = field(default_factory=dict)  # IGMP snooping's, after it
    routers: list[int] = field(default_factory=list)  # ports a query came in on, after it


class FwdModel:
    """Serial model of bpf/forward.h for one case (time stands still: hold and age are either
    0, always passed, or FOREVER_S, never)."""

    def __init__(self, case: FwdCase) -> None:
        self.case = case
        self.table = dict(case.table)
        self.events: Counter = Counter()  # learned, moved, aged, igmp
        self.groups: dict[str, set[int]] = {}  # IGMP snooping: group -> member ports
        self.routers: set[int] = set()  # ports a query came in on

    def step(self, in_port: int, frame: bytes) -> tuple[Verdict, str, int | None]:
        """(verdict, counter, out port) of a frame."""
        eth = Ether(frame)
        if eth.src in BOX_MACS or (IP in eth and eth[IP].src in BOX_IPS):
            return Verdict.DROP, "own_source", None
        if self.case.mode == "routed":
            return self._route(in_port, eth)
        return self._switch(in_port, eth)

    def _route(self, in_port: int, eth) -> tuple[Verdict, str, int | None]:
        if eth.dst not in BOX_MACS or (IP not in eth and IPv6 not in eth):
            return Verdict.TO_HOST, "passed", None
        ttl = eth[IP].ttl if IP in eth else eth[IPv6].hlim
        if ttl <= 1:
            return Verdict.TO_HOST, "ttl_expired", None
        dst = eth[IP].dst if IP in eth else None
        hop = NEIGHBOURS.get(dst) if dst else V6_NEIGHBOURS.get(eth[IPv6].dst)
        if hop is None or hop[0] == in_port:
            return Verdict.TO_HOST, "passed", None  # local, unresolved, or back out
        return Verdict.FORWARD, "routed", hop[0]

    def _switch(self, in_port: int, eth) -> tuple[Verdict, str, int | None]:
        if int(eth.src.split(":")[0], 16) & 1:
            return Verdict.DROP, "bad_source", None
        known = self.table.get(eth.src)
        if known is not None and known != in_port and self.case.hold_s > 0:
            return Verdict.DROP, "loop", None
        if known is None or known != in_port:
            self.events["learned" if known is None else "moved"] += 1
        self.table[eth.src] = in_port
        if eth.dst in BOX_MACS or (ARP in eth and eth[ARP].pdst in BOX_IPS):
            return Verdict.TO_HOST, "passed", None
        if int(eth.dst.split(":")[0], 16) & 1:
            self._snoop(in_port, eth)
            return Verdict.FLOOD, "flooded", None
        port = self.table.get(eth.dst)
        if port is not None and self.case.age_s == 0:
            del self.table[eth.dst]
            self.events["aged"] += 1
            port = None
        if port is None:
            return Verdict.FLOOD, "flooded", None
        if port == in_port:
            return Verdict.DROP, "same_port", None
        return Verdict.FORWARD, "switched", port

    def _snoop(self, in_port: int, eth) -> None:
        """bpf/snoop.h's ingress side: queries make router ports, reports members, leaves
        lapse after leave_s (time stands still: 0 lapses at once, else never)."""
        if IP not in eth or eth[IP].proto != IGMP_PROTO or len(bytes(eth[IP].payload)) < 8:
            return
        self.events["igmp"] += 1
        body = bytes(eth[IP].payload)
        kind, group = body[0], str(IPv4Address(body[4:8]))
        if kind == IGMP_QUERY:
            self.routers.add(in_port)
        elif kind in (0x12, 0x16):
            self._join(group, in_port)
        elif kind == 0x17:
            self._leave(group, in_port)
        elif kind == IGMP_V3_REPORT:
            for rtype, g, nsrc in v3_records(body):
                if rtype in (1, 3) and nsrc == 0:
                    self._leave(g, in_port)
                elif rtype != 6:
                    self._join(g, in_port)

    def _join(self, group: str, port: int) -> None:
        if IPv4Address(group) in MCAST and IPv4Address(group) not in MCAST_LOCAL:
            self.groups.setdefault(group, set()).add(port)

    def _leave(self, group: str, port: int) -> None:
        if self.case.leave_s == 0 and port in self.groups.get(group, set()):
            self.groups[group].discard(port)
            if not self.groups[group]:
                del self.groups[group]

    def snooped(self) -> tuple[dict[str, list[int]], list[int]]:
        """(group -> member ports, router ports), as the XDP runner reads them back."""
        return {g: sorted(p) for g, p in sorted(self.groups.items())}, sorted(self.routers)


def check_model(model: FwdModel, step: FwdStep) -> None:
    """The model's verdict must be the step's."""
    got = model.step(step.in_port, step.frame)
    assert got == (step.verdict, step.counter, step.out_port), f"{step.what}: model says {got}"


# --- frames ---------------------------------------------------------------------------------
def udp_like(src_mac, dst_mac, src, dst, ttl=64) -> bytes:
    """A TCP SYN (not ours: no UDP to 0xBEE0)."""
    return bytes(Ether(src=src_mac, dst=dst_mac) / IP(src=src, dst=dst, ttl=ttl) / TCP(dport=22))


def ping(src_mac, dst_mac, src, dst, ttl=64) -> bytes:
    return bytes(Ether(src=src_mac, dst=dst_mac) / IP(src=src, dst=dst, ttl=ttl) / ICMP())


def arp_request(src_mac, src, target) -> bytes:
    return bytes(Ether(src=src_mac, dst=BROADCAST) / ARP(hwsrc=src_mac, psrc=src, pdst=target))


def igmp(src_mac, src, dst, body: bytes) -> bytes:
    """An IGMP message as hosts send it: router alert option, TTL 1, checksum right."""
    body = body[:2] + struct.pack("!H", 0) + body[4:]
    body = body[:2] + struct.pack("!H", checksum(body)) + body[4:]
    ip = IP(src=src, dst=dst, ttl=1, proto=IGMP_PROTO, options=[IPOption_Router_Alert()])
    return bytes(Ether(src=src_mac, dst=group_mac(dst)) / ip / body)


def group_mac(group: str) -> str:
    """The Ethernet address of an IPv4 group (RFC 1112 6.4: its low 23 bits)."""
    b = IPv4Address(group).packed
    return f"01:00:5e:{b[1] & 0x7F:02x}:{b[2]:02x}:{b[3]:02x}"


def igmp_v2(kind: int, group: str) -> bytes:
    """An IGMP v1/v2 message body: query (0x11), report (0x12, 0x16) or leave (0x17)."""
    return struct.pack(
        "!BBH4s", kind, 100 if kind == IGMP_QUERY else 0, 0, IPv4Address(group).packed
    )


def igmp_v3_report(records: list[tuple[int, str, int]], count: int | None = None) -> bytes:
    """An IGMPv3 report (RFC 3376 4.2): records of (type, group, sources); `count` may lie."""
    body = b""
    for rtype, group, nsrc in records:
        body += struct.pack("!BBH4s", rtype, 0, nsrc, IPv4Address(group).packed)
        body += b"".join(IPv4Address(f"198.19.9.{i % 250 + 1}").packed for i in range(nsrc))
    n = len(records) if count is None else count
    return struct.pack("!BBHHH", IGMP_V3_REPORT, 0, 0, 0, n) + body


def v3_records(body: bytes) -> list[tuple[int, str, int]]:
    """The (type, group, sources) of an IGMPv3 report's records, as bpf/snoop.h walks them:
    as many as its count says, while each is whole in the message."""
    out, off = [], 8
    for _ in range(struct.unpack("!H", body[6:8])[0]):
        if off + 8 > len(body):
            break
        rtype, aux, nsrc = struct.unpack("!BBH", body[off : off + 4])
        out.append((rtype, str(IPv4Address(body[off + 4 : off + 8])), nsrc))
        off += 8 + 4 * nsrc + 4 * aux
    return out


def mcast_udp(src_mac, src, group) -> bytes:
    """A UDP datagram to a group (what a multicast application sends)."""
    udp = IP(src=src, dst=group) / UDP(dport=5000) / b"x"
    return bytes(Ether(src=src_mac, dst=group_mac(group)) / udp)


V6_PORT = [f"2001:2:0:{i + 1}::1" for i in range(PORTS)]
V6_WORKER = [f"2001:2:0:{i + 1}::2" for i in range(PORTS)]
V6_NEIGHBOURS = {V6_WORKER[i]: (i, mac_for_ip(worker_ip(i))) for i in range(3)}


def ping6(src_mac, dst_mac, src, dst, hlim=64) -> bytes:
    return bytes(Ether(src=src_mac, dst=dst_mac) / IPv6(src=src, dst=dst, hlim=hlim) / TCP())


W = [mac_for_ip(worker_ip(i)) for i in range(PORTS)]
NOT_P4 = {"bmv2": "bmv2's l2_forward is a static MAC table: no routing, learning or checks"}


def _routed_cases() -> list[FwdCase]:
    w0, w1, w2 = worker_ip(0), worker_ip(1), worker_ip(2)
    return [
        FwdCase(
            "routed_between_subnets",
            "routed",
            [
                fwd(0, udp_like(W[0], BOX_MACS[0], w0, w1), "routed", 1, "TCP"),
                fwd(2, ping(W[2], BOX_MACS[2], w2, w0), "routed", 0, "ping"),
                fwd(1, ping6(W[1], BOX_MACS[1], V6_WORKER[1], V6_WORKER[2]), "routed", 2, "IPv6"),
            ],
            not_on=NOT_P4,
        ),
        FwdCase(
            "routed_what_the_kernel_does",
            "routed",
            [
                to_host(0, arp_request(W[0], w0, port_ip(0)), "passed", "ARP"),
                to_host(
                    0, ping(W[0], BOX_MACS[0], w0, port_ip(1)), "passed", "to the box's own address"
                ),
                to_host(
                    0,
                    ping(W[0], BOX_MACS[0], w0, FAR_IP),
                    "passed",
                    "no neighbour yet: the kernel resolves it",
                ),
                to_host(
                    0,
                    ping(W[0], BOX_MACS[0], w0, w1, ttl=1),
                    "ttl_expired",
                    "TTL 1: the kernel answers time exceeded",
                ),
                to_host(
                    1,
                    ping6(W[1], BOX_MACS[1], V6_WORKER[1], V6_WORKER[0], hlim=1),
                    "ttl_expired",
                    "hop limit 1",
                ),
                to_host(0, ping(W[0], W[1], w0, w1), "passed", "not to the box's MAC"),
            ],
            not_on=NOT_P4,
        ),
        FwdCase(
            "routed_own_source_dropped",
            "routed",
            [
                drop(
                    0,
                    ping(BOX_MACS[1], BOX_MACS[0], w0, w1),
                    "own_source",
                    "a port's MAC as source: looped back",
                ),
                drop(
                    0,
                    ping(W[0], BOX_MACS[0], port_ip(2), w1),
                    "own_source",
                    "a port's address as source",
                ),
            ],
            not_on=NOT_P4,
        ),
    ]


def _switched_cases() -> list[FwdCase]:
    h = [host_mac(i) for i in range(8)]
    hi = [host_ip(i) for i in range(8)]
    learned = {h[0]: 0, h[1]: 1, h[2]: 2}
    return [
        FwdCase(
            "switched_known_unicast_and_flooding",
            "switched",
            [
                fwd(0, ping(h[0], h[1], hi[0], hi[1]), "switched", 1, "known"),
                fwd(2, ping(h[2], h[0], hi[2], hi[0]), "switched", 0, "known"),
                flood(0, ping(h[0], h[5], hi[0], hi[5]), "unknown"),
                flood(1, arp_request(h[1], hi[1], hi[2]), "broadcast ARP"),
                flood(2, ping6(h[2], ALL_HOSTS_V6, "2001:2::12", "ff02::1"), "multicast"),
            ],
            table=learned,
        ),
        FwdCase(
            "switched_to_the_box_itself",
            "switched",
            [
                to_host(0, ping(h[0], BOX_MACS[0], hi[0], port_ip(0)), "passed", "to a port's MAC"),
            ],
            table=learned,
        ),
        FwdCase(
            "switched_learns_and_answers",
            "switched",
            [
                flood(3, arp_request(h[3], hi[3], hi[4]), "who-has"),
                fwd(1, ping(h[4], h[3], hi[4], hi[3]), "switched", 3, "the answer: to the asker"),
                fwd(3, ping(h[3], h[4], hi[3], hi[4]), "switched", 1, "and back"),
                to_host(
                    0,
                    arp_request(W[0], worker_ip(0), port_ip(0)),
                    "passed",
                    "ARP for the box",
                ),
            ],
            events={"learned": 3},
            not_on=NOT_P4,
        ),
        FwdCase(
            "switched_bad_input",
            "switched",
            [
                drop(0, ping(h[1], h[2], hi[1], hi[2]), "loop", "a loop"),
                drop(1, ping(h[0], h[1], hi[0], hi[1]), "same_port", "no hairpin"),
                drop(
                    0,
                    ping("03:00:00:00:00:01", h[1], hi[0], hi[1]),
                    "bad_source",
                    "multicast source",
                ),
                drop(2, ping(BOX_MACS[0], h[1], hi[2], hi[1]), "own_source", "box MAC source"),
                drop(
                    2,
                    ping(h[2], h[1], port_ip(3), hi[1]),
                    "own_source",
                    "box IP source",
                ),
            ],
            table={**learned, h[0]: 1},
            not_on=NOT_P4,
        ),
        FwdCase(
            "switched_moved_host_relearned",
            "switched",
            [
                fwd(3, ping(h[0], h[1], hi[0], hi[1]), "switched", 1, "h0 moved to port 3"),
                fwd(1, ping(h[1], h[0], hi[1], hi[0]), "switched", 3, "to it"),
            ],
            table=learned,
            hold_s=0.0,
            events={"moved": 1},
            not_on=NOT_P4,
        ),
        FwdCase(
            "switched_aged_entry_flooded",
            "switched",
            [
                flood(
                    1,
                    ping(h[1], h[0], hi[1], hi[0]),
                    "h0's entry is older than the age: forgotten, flooded",
                ),
            ],
            table=learned,
            age_s=0.0,
            events={"aged": 1},
            not_on=NOT_P4,
        ),
    ]


def _snooping_cases() -> list[FwdCase]:
    """IGMP snooping's ingress side (bpf/snoop.h): what the tables hold after each case. The
    frames are all flooded; pruning at egress is tested live (tests/root/test_l2switch_netns.py)."""
    h, hi = [host_mac(i) for i in range(4)], [host_ip(i) for i in range(4)]
    g1, g2, g3 = "239.1.2.3", "239.4.5.6", "239.7.8.9"
    many = [(2, f"239.0.0.{i + 1}", 0) for i in range(40)]  # MODE_IS_EXCLUDE {}: joined

    general = flood(0, igmp(h[0], hi[0], "224.0.0.1", igmp_v2(IGMP_QUERY, "0.0.0.0")), "query")
    return [
        FwdCase(
            "switched_igmp_reports_make_members",
            "switched",
            [
                general,
                flood(1, igmp(h[1], hi[1], g1, igmp_v2(0x16, g1)), "v2 report"),
                flood(2, igmp(h[2], hi[2], g1, igmp_v2(0x12, g1)), "v1 report"),
                flood(
                    3,
                    igmp(h[3], hi[3], "224.0.0.22", igmp_v3_report([(4, g2, 0), (2, g3, 2)])),
                    "v3 report: to exclude, is exclude with sources",
                ),
                flood(2, mcast_udp(h[2], hi[2], g1), "data to a group: flooded, pruned at egress"),
                flood(1, igmp(h[1], hi[1], "224.0.0.251", igmp_v2(0x16, "224.0.0.251")), "local"),
            ],
            groups={g1: [1, 2], g2: [3], g3: [3]},
            routers=[0],
            events={"igmp": 5, "learned": 4},
            not_on=NOT_P4,
        ),
        FwdCase(
            "switched_igmp_leaves",
            "switched",
            [
                flood(1, igmp(h[1], hi[1], g1, igmp_v2(0x16, g1)), "v2 report"),
                flood(2, igmp(h[2], hi[2], g1, igmp_v2(0x16, g1)), "another port"),
                flood(1, igmp(h[1], hi[1], "224.0.0.2", igmp_v2(0x17, g1)), "v2 leave"),
                flood(
                    3,
                    igmp(h[3], hi[3], "224.0.0.22", igmp_v3_report([(4, g2, 0), (5, g3, 1)])),
                    "v3: to exclude, allow new sources",
                ),
                flood(
                    3,
                    igmp(h[3], hi[3], "224.0.0.22", igmp_v3_report([(3, g2, 0), (6, g3, 1)])),
                    "v3: to include nothing (a leave), block old sources (no change)",
                ),
            ],
            leave_s=0.0,
            groups={g1: [2], g3: [3]},
            events={"igmp": 5, "learned": 3},
            not_on=NOT_P4,
        ),
        FwdCase(
            "switched_igmp_bad_input",
            "switched",
            [
                flood(
                    1,
                    igmp(h[1], hi[1], "224.0.0.22", igmp_v3_report([(2, g1, 0)], count=60000)),
                    "v3 report whose count runs past the message",
                ),
                flood(
                    2,
                    igmp(h[2], hi[2], "224.0.0.22", igmp_v3_report([(2, g2, 300)])[:60]),
                    "v3 record with more sources than the message holds",
                ),
                flood(
                    3,
                    igmp(h[3], hi[3], "224.0.0.22", igmp_v3_report([(2, "198.19.0.1", 0)])),
                    "a unicast 'group'",
                ),
                flood(
                    3,
                    igmp(h[3], hi[3], "224.0.0.22", igmp_v3_report(many)),
                    "a host in 40 groups answers a query in one report: every record counts",
                ),
                flood(0, igmp(h[0], hi[0], g1, b"\x16\x00"), "truncated: not snooped"),
            ],
            groups={g1: [1], g2: [2], **{g: [3] for _, g, _ in many}},
            events={"igmp": 4, "learned": 4},
            not_on=NOT_P4,
        ),
    ]


CASES = _routed_cases() + _switched_cases() + _snooping_cases()
