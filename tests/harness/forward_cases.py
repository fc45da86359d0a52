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
from collections import Counter
from dataclasses import dataclass, field

from scapy.layers.inet import ICMP, IP, TCP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import ARP, Ether

PORTS = 4
BROADCAST = "ff:ff:ff:ff:ff:ff"
ALL_HOSTS_V6 = "33:33:00:00:00:01"  # IPv6 all-nodes multicast
FAR_IP = "198.18.4.99"  # in port 3's subnet, never resolved: no neighbour
FOREVER_S = 3600.0  # a hold or an age no case outlives


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


class FwdModel:
    """Serial model of bpf/forward.h for one case (time stands still: hold and age are either
    0, always passed, or FOREVER_S, never)."""

    def __init__(self, case: FwdCase) -> None:
        self.case = case
        self.table = dict(case.table)
        self.events: Counter = Counter()  # learned, moved, aged

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


V6_PORT = [f"2001:2:0:{i + 1}::1" for i in range(PORTS)]
V6_WORKER = [f"2001:2:0:{i + 1}::2" for i in range(PORTS)]
V6_NEIGHBOURS = {V6_WORKER[i]: (i, mac_for_ip(worker_ip(i))) for i in range(3)}


def ping6(src_mac, dst_mac, src, dst, hlim=64) -> bytes:
    return bytes(Ether(src=src_mac, dst=dst_mac) / IPv6(src=src, dst=dst, hlim=hlim) / TCP())


W = [mac_for_ip(worker_ip(i)) for i in range(PORTS)]
NOT_P4 = {"bmv2": "bmv2's l2_forward is a static MAC table: no routing, learning or checks"}


def _routed_cases() -> list[FwdCase]:
    w0, w1, w2 = worker_ip(0), worker_ip(1), worker_ip(2)
    s = FwdStep
    return [
        FwdCase(
            "routed_between_subnets",
            "routed",
            [
                s(0, udp_like(W[0], BOX_MACS[0], w0, w1), Verdict.FORWARD, "routed", 1, "TCP"),
                s(2, ping(W[2], BOX_MACS[2], w2, w0), Verdict.FORWARD, "routed", 0, "ping"),
                s(
                    1,
                    ping6(W[1], BOX_MACS[1], V6_WORKER[1], V6_WORKER[2]),
                    Verdict.FORWARD,
                    "routed",
                    2,
                    "IPv6",
                ),
            ],
            not_on=NOT_P4,
        ),
        FwdCase(
            "routed_what_the_kernel_does",
            "routed",
            [
                s(0, arp_request(W[0], w0, port_ip(0)), Verdict.TO_HOST, "passed", None, "ARP"),
                s(
                    0,
                    ping(W[0], BOX_MACS[0], w0, port_ip(1)),
                    Verdict.TO_HOST,
                    "passed",
                    None,
                    "to the box's own address",
                ),
                s(
                    0,
                    ping(W[0], BOX_MACS[0], w0, FAR_IP),
                    Verdict.TO_HOST,
                    "passed",
                    None,
                    "no neighbour yet: the kernel resolves it",
                ),
                s(
                    0,
                    ping(W[0], BOX_MACS[0], w0, w1, ttl=1),
                    Verdict.TO_HOST,
                    "ttl_expired",
                    None,
                    "TTL 1: the kernel answers time exceeded",
                ),
                s(
                    1,
                    ping6(W[1], BOX_MACS[1], V6_WORKER[1], V6_WORKER[0], hlim=1),
                    Verdict.TO_HOST,
                    "ttl_expired",
                    None,
                    "hop limit 1",
                ),
                s(
                    0,
                    ping(W[0], W[1], w0, w1),
                    Verdict.TO_HOST,
                    "passed",
                    None,
                    "not to the box's MAC",
                ),
            ],
            not_on=NOT_P4,
        ),
        FwdCase(
            "routed_own_source_dropped",
            "routed",
            [
                s(
                    0,
                    ping(BOX_MACS[1], BOX_MACS[0], w0, w1),
                    Verdict.DROP,
                    "own_source",
                    None,
                    "a port's MAC as source: looped back",
                ),
                s(
                    0,
                    ping(W[0], BOX_MACS[0], port_ip(2), w1),
                    Verdict.DROP,
                    "own_source",
                    None,
                    "a port's address as source",
                ),
            ],
            not_on=NOT_P4,
        ),
    ]


def _switched_cases() -> list[FwdCase]:
    s = FwdStep
    h = [host_mac(i) for i in range(8)]
    hi = [host_ip(i) for i in range(8)]
    learned = {h[0]: 0, h[1]: 1, h[2]: 2}
    return [
        FwdCase(
            "switched_known_unicast_and_flooding",
            "switched",
            [
                s(0, ping(h[0], h[1], hi[0], hi[1]), Verdict.FORWARD, "switched", 1, "known"),
                s(2, ping(h[2], h[0], hi[2], hi[0]), Verdict.FORWARD, "switched", 0, "known"),
                s(0, ping(h[0], h[5], hi[0], hi[5]), Verdict.FLOOD, "flooded", None, "unknown"),
                s(
                    1,
                    arp_request(h[1], hi[1], hi[2]),
                    Verdict.FLOOD,
                    "flooded",
                    None,
                    "broadcast ARP",
                ),
                s(
                    2,
                    ping6(h[2], ALL_HOSTS_V6, "2001:2::12", "ff02::1"),
                    Verdict.FLOOD,
                    "flooded",
                    None,
                    "multicast",
                ),
            ],
            table=learned,
        ),
        FwdCase(
            "switched_to_the_box_itself",
            "switched",
            [
                s(
                    0,
                    ping(h[0], BOX_MACS[0], hi[0], port_ip(0)),
                    Verdict.TO_HOST,
                    "passed",
                    None,
                    "to a port's MAC",
                ),
            ],
            table=learned,
        ),
        FwdCase(
            "switched_learns_and_answers",
            "switched",
            [
                s(3, arp_request(h[3], hi[3], hi[4]), Verdict.FLOOD, "flooded", None, "who-has"),
                s(
                    1,
                    ping(h[4], h[3], hi[4], hi[3]),
                    Verdict.FORWARD,
                    "switched",
                    3,
                    "the answer goes where the question came from",
                ),
                s(3, ping(h[3], h[4], hi[3], hi[4]), Verdict.FORWARD, "switched", 1, "and back"),
                s(
                    0,
                    arp_request(W[0], worker_ip(0), port_ip(0)),
                    Verdict.TO_HOST,
                    "passed",
                    None,
                    "ARP for the box's address",
                ),
            ],
            events={"learned": 3},
            not_on=NOT_P4,
        ),
        FwdCase(
            "switched_bad_input",
            "switched",
            [
                s(
                    0,
                    ping(h[1], h[2], hi[1], hi[2]),
                    Verdict.DROP,
                    "loop",
                    None,
                    "a source learned on another port just now: looped through two ports",
                ),
                s(
                    1,
                    ping(h[0], h[1], hi[0], hi[1]),
                    Verdict.DROP,
                    "same_port",
                    None,
                    "destination behind the port it came in on: no hairpin",
                ),
                s(
                    0,
                    ping("03:00:00:00:00:01", h[1], hi[0], hi[1]),
                    Verdict.DROP,
                    "bad_source",
                    None,
                    "multicast source MAC",
                ),
                s(
                    2,
                    ping(BOX_MACS[0], h[1], hi[2], hi[1]),
                    Verdict.DROP,
                    "own_source",
                    None,
                    "the box's MAC as source",
                ),
                s(
                    2,
                    ping(h[2], h[1], port_ip(3), hi[1]),
                    Verdict.DROP,
                    "own_source",
                    None,
                    "the box's address as source",
                ),
            ],
            table={**learned, h[0]: 1},
            not_on=NOT_P4,
        ),
        FwdCase(
            "switched_moved_host_relearned",
            "switched",
            [
                s(
                    3,
                    ping(h[0], h[1], hi[0], hi[1]),
                    Verdict.FORWARD,
                    "switched",
                    1,
                    "h0 now behind port 3, after the hold",
                ),
                s(1, ping(h[1], h[0], hi[1], hi[0]), Verdict.FORWARD, "switched", 3, "to it"),
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
                s(
                    1,
                    ping(h[1], h[0], hi[1], hi[0]),
                    Verdict.FLOOD,
                    "flooded",
                    None,
                    "h0's entry is older than the age: forgotten, flooded",
                ),
            ],
            table=learned,
            age_s=0.0,
            events={"aged": 1},
            not_on=NOT_P4,
        ),
    ]


CASES = _routed_cases() + _switched_cases()
