"""Names and addresses of a testbed, computed before anything is created.

Pure functions only (no root needed), so the address plan can be unit-tested
and so that every namespace and link is known -- and registered for cleanup --
before the first one exists.

Address plan (everything stays inside 198.18.0.0/15, the benchmarking range):

* ``one-arm``: one /24, 198.18.0.0/24. Aggregator ``eth0`` 198.18.0.1, worker
  i ``eth0`` 198.18.0.(10+i); all meet on a bridge ``br0`` in ``<prefix>sw``.
  The subnet broadcast 198.18.0.255 is the ``group_ip`` of results sent to every host
  (``xdp-agg serve --results broadcast``); by default each job gets a multicast group of its
  own, which the bridge (IGMP snooping, with a querier) forwards to its members only.
  Observers (hosts in no job) ``<prefix>o<i>`` ``eth0`` 198.18.0.(200+i), on the same bridge.
  With ``aggregators`` K > 1 (for jobs striped over several aggregators),
  aggregator j is namespace ``<prefix>ag`` (j = 0) or ``<prefix>ag<j>``,
  ``eth0`` 198.18.0.(1+j), bridge port ``ag`` or ``ag<j>``;
  their bridge ports do not flood multicast (``mcast_flood off``), so an
  aggregator's link never carries another aggregator's results.
* ``switch``: one /24 per worker, 198.18.(i+1).0/24. Aggregator ``p<i>``
  198.18.(i+1).1, worker i ``eth0`` 198.18.(i+1).2. No bridge: each worker routes
  198.18.0.0/15 through its port's address, and the aggregator's XDP program (or, before it
  is attached, nothing) forwards between the ports.

MACs are derived from the IP (``02:00`` + the four IP octets) so they are
stable across runs and readable in packet dumps; bridge ports keep
kernel-chosen MACs.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field

from .hosts import AggregatorHost, ObserverHost, WorkerHost

TOPOLOGIES = ("one-arm", "switch")
# The testbed's own bound (namespaces, veths and processes on one machine), below the protocol's
# xdp_agg.proto.limits.MAX_WORKERS (64 per job): a different quantity, so a different name.
MAX_TESTBED_WORKERS = 32
MAX_OBSERVERS = 16  # one-arm: hosts on the bridge that are in no job, 198.18.0.200..215
OBSERVER_IP_BASE = 200
MAX_AGGREGATORS = 9  # one-arm: aggregators at 198.18.0.1..9, workers from 198.18.0.10
MAX_AGG_QUEUES = 64  # receive/transmit queues of an aggregator's veths (a NIC's queues)
PREFIXLEN = 24
ONE_ARM_AGG_IP = "198.18.0.1"
ONE_ARM_GROUP_IP = "198.18.0.255"
# switch topology: each worker's route to the others' subnets, through its port on the box
SWITCH_ROUTE = "198.18.0.0/15"
BRIDGE_NAME = "br0"

# MTU limits of the testbed's links. The veth ends facing the aggregator carry XDP programs (ours
# or the XDP_PASS stub), and veth refuses an XDP program without frags support on a link whose
# frame does not fit one page: 4096 - 256 headroom - 320 skb_shared_info - 14 Ethernet = 3506
# (measured: 3507 fails with ERANGE). Above PLAIN_XDP_MAX_MTU the testbed's XDP_PASS stubs are
# multi-buffer (frags) programs, and the aggregator must be attached with --frags too.
MIN_MTU, PLAIN_XDP_MAX_MTU, MAX_MTU = 68, 3506, 9000
# Interface names must fit IFNAMSIZ-1 = 15 characters; ours are at most 4.
IFNAMSIZ_MAX = 15

_PREFIX_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,11}$")


def new_prefix() -> str:
    """A fresh random prefix, ``xt`` + 4 hex digits, so testbeds don't clash."""
    return "xt" + secrets.token_hex(2)


def validate_prefix(prefix: str) -> str:
    """Return ``prefix`` or raise ValueError saying what a valid one looks like."""
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise ValueError(
            f"invalid prefix {prefix!r}: use 1-12 characters [A-Za-z0-9_-], "
            "starting with a letter (e.g. 'xt1a2b')"
        )
    return prefix


def netns_name_re(prefix: str) -> re.Pattern:
    """Regex matching exactly the namespace names a testbed with ``prefix`` uses."""
    return re.compile(rf"^{re.escape(prefix)}(sw|ag\d*|w\d+|o\d+)$")


def mac_for_ip(ip: str) -> str:
    """Locally administered unicast MAC ``02:00:a:b:c:d`` for IP ``a.b.c.d``."""
    octets = [int(x) for x in ip.split(".")]
    return "02:00:" + ":".join(f"{o:02x}" for o in octets)


@dataclass
class VethSpec:
    """One veth pair: end ``a`` is created in ``ns_a`` with its peer ``b`` in ``ns_b``.

    ``worker`` is the worker index whose link this is, or None for the
    aggregator's own link (one-arm) and an observer's. ``ip``/``mac`` None means "leave unset".
    """

    ns_a: str
    if_a: str
    ns_b: str
    if_b: str
    worker: int | None
    ip_a: str | None = None
    mac_a: str | None = None
    ip_b: str | None = None
    mac_b: str | None = None
    bridge_b: bool = False  # enslave end b to the bridge


@dataclass
class Plan:
    """Everything a testbed will create, by name."""

    prefix: str
    topology: str
    aggregator: AggregatorHost
    workers: list[WorkerHost]
    veths: list[VethSpec]
    switch_netns: str | None = None  # one-arm: namespace holding the bridge
    group_ip: str | None = None
    namespaces: list[str] = field(default_factory=list)
    observers: list[ObserverHost] = field(default_factory=list)  # one-arm only
    aggregators: list[AggregatorHost] = field(default_factory=list)  # [aggregator] unless K > 1

    @property
    def agg_interfaces(self) -> list[str]:
        return list(self.aggregator.ifnames)

    def worker_routes(self) -> list[tuple[str, str, str]]:
        """(namespace, destination, gateway) of the routes the workers get: in the switch
        topology, the other workers' subnets through the worker's own port on the aggregator,
        which forwards between its ports (xdp-agg attach --forwarding); one-arm: none."""
        if self.topology != "switch":
            return []
        return [(w.netns, SWITCH_ROUTE, w.agg_ip) for w in self.workers]


def aggregator_ip(j: int) -> str:
    """One-arm: the address of aggregator j."""
    return f"198.18.0.{1 + j}"


def aggregator_group_base(j: int) -> str:
    """One-arm with several aggregators: the block aggregator j's endpoint takes its jobs'
    multicast groups from (`xdp-agg serve --group-base`): 239.18.j.0/24, so that two
    aggregators' job N never share a group."""
    return f"239.18.{j}.0/24"


def aggregator_netns(prefix: str, j: int) -> str:
    """Namespace of aggregator j: ``<prefix>ag``, then ``<prefix>ag1``, ``<prefix>ag2``..."""
    return f"{prefix}ag" if j == 0 else f"{prefix}ag{j}"


def _worker(index: int, netns: str, ip: str, agg_ip: str, agg_if: str, agg_mac: str):
    """Worker `index` on its eth0 at `ip`, reaching the aggregator at agg_ip on agg_if."""
    return WorkerHost(index, netns, "eth0", ip, mac_for_ip(ip), agg_ip, agg_if, agg_mac, PREFIXLEN)


def _check_sizes(prefix: str, workers: int, topology: str, observers: int, aggregators: int):
    """ValueError for a testbed make_plan cannot lay out."""
    validate_prefix(prefix)
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}: use one of {', '.join(TOPOLOGIES)}")
    if not isinstance(workers, int) or not 1 <= workers <= MAX_TESTBED_WORKERS:
        raise ValueError(f"workers must be an integer in 1..{MAX_TESTBED_WORKERS}, got {workers!r}")
    if not isinstance(observers, int) or not 0 <= observers <= MAX_OBSERVERS:
        raise ValueError(f"observers must be an integer in 0..{MAX_OBSERVERS}, got {observers!r}")
    if observers and topology != "one-arm":
        raise ValueError(
            "observers need the one-arm topology: they share the workers' bridge (in the switch "
            "topology every worker has a link of its own)"
        )
    if (
        not isinstance(aggregators, int)
        or isinstance(aggregators, bool)
        or not 1 <= aggregators <= MAX_AGGREGATORS
    ):
        raise ValueError(
            f"aggregators must be an integer in 1..{MAX_AGGREGATORS}, got {aggregators!r}"
        )
    if aggregators > 1 and topology != "one-arm":
        raise ValueError(
            "several aggregators need the one-arm topology (they share the workers' bridge)"
        )


def _one_arm_plan(prefix, agg_ns, worker_ns, observers, aggregators) -> Plan:
    """Every host on one bridge in <prefix>sw: the aggregator(s), workers, observers."""
    topology, workers = "one-arm", len(worker_ns)
    sw_ns = f"{prefix}sw"
    agg_mac = mac_for_ip(ONE_ARM_AGG_IP)
    agg = AggregatorHost(agg_ns, ["eth0"], [ONE_ARM_AGG_IP], [agg_mac], PREFIXLEN)
    veths = [
        VethSpec(
            agg_ns, "eth0", sw_ns, "ag", None, ip_a=ONE_ARM_AGG_IP, mac_a=agg_mac, bridge_b=True
        )
    ]
    hosts = []
    for i in range(workers):
        ip = f"198.18.0.{10 + i}"
        hosts.append(_worker(i, worker_ns[i], ip, ONE_ARM_AGG_IP, "eth0", agg_mac))
        veths.append(
            VethSpec(
                worker_ns[i],
                "eth0",
                sw_ns,
                f"w{i}",
                i,
                ip_a=ip,
                mac_a=mac_for_ip(ip),
                bridge_b=True,
            )
        )
    watchers = []
    for i in range(observers):
        ip = f"198.18.0.{OBSERVER_IP_BASE + i}"
        watchers.append(ObserverHost(i, f"{prefix}o{i}", "eth0", ip, mac_for_ip(ip), PREFIXLEN))
        veths.append(
            VethSpec(
                f"{prefix}o{i}",
                "eth0",
                sw_ns,
                f"o{i}",
                None,
                ip_a=ip,
                mac_a=mac_for_ip(ip),
                bridge_b=True,
            )
        )
    extra = []
    for j in range(1, aggregators):
        ns, ip = aggregator_netns(prefix, j), aggregator_ip(j)
        extra.append(AggregatorHost(ns, ["eth0"], [ip], [mac_for_ip(ip)], PREFIXLEN, index=j))
        veths.insert(
            j,
            VethSpec(
                ns, "eth0", sw_ns, f"ag{j}", None, ip_a=ip, mac_a=mac_for_ip(ip), bridge_b=True
            ),
        )
    return Plan(
        prefix,
        topology,
        agg,
        hosts,
        veths,
        sw_ns,
        ONE_ARM_GROUP_IP,
        [sw_ns, agg_ns, *(a.netns for a in extra), *worker_ns, *(o.netns for o in watchers)],
        observers=watchers,
        aggregators=[agg, *extra],
    )


def _switch_plan(prefix, agg_ns, worker_ns) -> Plan:
    """A veth per worker into the aggregator's namespace, a /24 each."""
    topology, workers = "switch", len(worker_ns)
    agg = AggregatorHost(agg_ns, [], [], [], PREFIXLEN)
    veths, hosts = [], []
    for i in range(workers):
        agg_ip, ip = f"198.18.{i + 1}.1", f"198.18.{i + 1}.2"
        agg_if = f"p{i}"
        agg.ifnames.append(agg_if)
        agg.ips.append(agg_ip)
        agg.macs.append(mac_for_ip(agg_ip))
        hosts.append(_worker(i, worker_ns[i], ip, agg_ip, agg_if, mac_for_ip(agg_ip)))
        veths.append(
            VethSpec(
                worker_ns[i],
                "eth0",
                agg_ns,
                agg_if,
                i,
                ip_a=ip,
                mac_a=mac_for_ip(ip),
                ip_b=agg_ip,
                mac_b=mac_for_ip(agg_ip),
            )
        )
    return Plan(
        prefix, topology, agg, hosts, veths, None, None, [agg_ns, *worker_ns], aggregators=[agg]
    )


def make_plan(
    prefix: str, workers: int, topology: str, observers: int = 0, aggregators: int = 1
) -> Plan:
    """Compute names/addresses for ``workers`` workers and ``aggregators`` aggregators (more
    than one: one-arm only) in ``topology``, and ``observers`` hosts in no job on the one-arm
    bridge."""
    _check_sizes(prefix, workers, topology, observers, aggregators)
    agg_ns = f"{prefix}ag"
    worker_ns = [f"{prefix}w{i}" for i in range(workers)]
    if topology == "one-arm":
        plan = _one_arm_plan(prefix, agg_ns, worker_ns, observers, aggregators)
    else:
        plan = _switch_plan(prefix, agg_ns, worker_ns)
    for v in plan.veths:
        assert len(v.if_a) <= IFNAMSIZ_MAX and len(v.if_b) <= IFNAMSIZ_MAX
    return plan
