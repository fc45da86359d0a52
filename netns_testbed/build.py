"""Building a testbed: its namespaces, the bridge and the veths, addresses, rates and faults,
the XDP programs the aggregator's frames need (with the switch topology's downstream loss).
Testbed (netns_testbed.testbed) is this and its runtime side (commands in the namespaces, live
changes, state, teardown).
"""

from __future__ import annotations

import os
import time

from pyroute2 import IPRoute
from pyroute2 import netns as pr_netns

from . import faults, kernel_forward, nsexec, registry, shaping, xdp_pass
from .errors import TestbedError
from .plan import BRIDGE_NAME, PLAIN_XDP_MAX_MTU, Plan

# br_netfilter, when loaded (Docker loads it), makes every bridge pass its frames through the
# iptables/ip6tables/arptables hooks, per namespace; a switch does not, and on one worker it cost
# 39% of the send path's kernel time (perf, hostlib's fast path, one-arm). The testbed's bridge
# namespace turns the hooks off; gloo's traffic crosses the same bridge, so both systems gain.
_BRIDGE_NF_SYSCTLS = (
    "bridge-nf-call-iptables",
    "bridge-nf-call-ip6tables",
    "bridge-nf-call-arptables",
)


def _bridge_without_netfilter(netns: str) -> None:
    """Turn br_netfilter's hooks off in the bridge's namespace (nothing to do if not loaded)."""
    for name in _BRIDGE_NF_SYSCTLS:
        nsexec.check(
            netns,
            ["sh", "-c", f"f=/proc/sys/net/bridge/{name}; [ ! -e $f ] || echo 0 > $f"],
            f"turning {name} off",
        )


# The bridge's IGMP querier. Linux's bridge keeps flooding every multicast group to every port
# until a querier has existed for one query response interval ("reports should have arrived by
# now"), and takes that interval as it is when the querier is switched on: so the interval is
# set first, the querier after, and up() returns only once the interval has passed (measured:
# with the querier given at creation, groups were flooded for 10 s, the default interval,
# whatever interval was asked for with it). 0.5 s is long enough: hosts report a membership the
# moment they join (IGMP unsolicited reports) and answer a query within the interval.
QUERY_RESPONSE_CS = 50  # the querier's query response interval, in centiseconds (USER_HZ)


class TestbedBuild:
    """How a Testbed is built (a mixin: Testbed's __init__ makes the plan, the registry and the
    settings it reads)."""

    # the settings it reads (Testbed.__init__ sets them)
    loss_up: float
    loss_down: float
    dup_up: float
    dup_down: float
    loss_scope: str
    kernel_forwarding: bool
    _plan: Plan

    def _wants_nft(self) -> bool:
        return any(x > 0 for x in (self.loss_up, self.loss_down, self.dup_up, self.dup_down))

    def _check_free(self) -> None:
        """Refuse to reuse a prefix that has a state file or existing namespaces."""
        taken = [ns for ns in self.namespaces if os.path.exists(nsexec.netns_path(ns))]
        if taken or registry.load_state(self.prefix) is not None:
            what = f"namespace {taken[0]} exists" if taken else "a state file exists"
            raise TestbedError(
                f"prefix {self.prefix!r} is in use ({what}): choose another "
                f"prefix or run `netns-testbed down --prefix {self.prefix}`"
            )

    def _build(self) -> None:
        self._create_namespaces()
        veth_ends, querier_since = self._build_links()
        self._finish_links(veth_ends, querier_since)

    def _create_namespaces(self) -> None:
        """Every namespace of the plan, registered before it exists, without IPv6."""
        plan, reg = self._plan, self._registry
        for ns in plan.namespaces:
            reg.namespaces.append(ns)
            self._save("building")  # registered before it exists
            pr_netns.create(ns)
        for ns in plan.namespaces:
            if os.path.exists("/proc/sys/net/ipv6"):
                # Before any link exists, so new links inherit "default".
                nsexec.check(
                    ns,
                    [
                        "sysctl",
                        "-q",
                        "-w",
                        "net.ipv6.conf.all.disable_ipv6=1",
                        "net.ipv6.conf.default.disable_ipv6=1",
                    ],
                    "sysctl (disable IPv6)",
                )

    def _build_links(self) -> tuple[dict[str, list[str]], float | None]:
        """The bridge and every veth, addressed and up; the veth ends per namespace, and when the
        bridge's querier was switched on (None without one)."""
        plan, reg = self._plan, self._registry
        iprs: dict[str, IPRoute] = {}

        def ipr(ns: str) -> IPRoute:
            if ns not in iprs:
                iprs[ns] = IPRoute(netns=ns)
            return iprs[ns]

        def index(ns: str, ifname: str) -> int:
            found = ipr(ns).link_lookup(ifname=ifname)
            if not found:
                raise TestbedError(f"interface {ifname} missing in namespace {ns}")
            return found[0]

        veth_ends: dict[str, list[str]] = {ns: [] for ns in plan.namespaces}
        querier_since = None
        try:
            for ns in plan.namespaces:
                ipr(ns).link("set", index=index(ns, "lo"), state="up")
            br = None
            if plan.switch_netns:
                reg.links.append([plan.switch_netns, BRIDGE_NAME])
                self._save("building")
                # STP off and no forward delay: ports forward as soon as they are
                # up. IGMP snooping (or, without it, every group flooded to every port).
                ipr(plan.switch_netns).link(
                    "add",
                    ifname=BRIDGE_NAME,
                    kind="bridge",
                    br_stp_state=0,
                    br_forward_delay=0,
                    br_mcast_snooping=int(self.mcast_snooping),
                    br_mcast_query_response_intvl=QUERY_RESPONSE_CS,
                    mtu=self.mtu,
                )
                br = index(plan.switch_netns, BRIDGE_NAME)
                _bridge_without_netfilter(plan.switch_netns)
                ipr(plan.switch_netns).link("set", index=br, state="up")
                if self.mcast_snooping:
                    # after the response interval is set: see QUERY_RESPONSE_CS
                    ipr(plan.switch_netns).link("set", index=br, kind="bridge", br_mcast_querier=1)
                    querier_since = time.monotonic()
            for v in plan.veths:
                reg.links.append([v.ns_a, v.if_a])
                reg.links.append([v.ns_b, v.if_b])
                self._save("building")
                peer = {"ifname": v.if_b, "net_ns_fd": nsexec.netns_path(v.ns_b), "mtu": self.mtu}
                if v.mac_b:
                    peer["address"] = v.mac_b
                kw = {"ifname": v.if_a, "kind": "veth", "peer": peer, "mtu": self.mtu}
                if self._into_aggregator(v):
                    # both ends: the sending end's transmit queue (its flow hash) is the
                    # receiving end's receive queue on veth
                    for attrs in (kw, peer):
                        attrs["num_tx_queues"] = attrs["num_rx_queues"] = self.agg_queues
                if v.mac_a:
                    kw["address"] = v.mac_a
                ipr(v.ns_a).link("add", **kw)
                veth_ends[v.ns_a].append(v.if_a)
                veth_ends[v.ns_b].append(v.if_b)
                for ns, ifname, ip in ((v.ns_a, v.if_a, v.ip_a), (v.ns_b, v.if_b, v.ip_b)):
                    idx = index(ns, ifname)
                    if ip:
                        ipr(ns).addr(
                            "add", index=idx, address=ip, prefixlen=plan.aggregator.prefixlen
                        )
                    if ns == plan.switch_netns and v.bridge_b:
                        ipr(ns).link("set", index=idx, master=br)
                        if v.worker is None and len(plan.aggregators) > 1:
                            # results are multicast to the workers: keep them off the other
                            # aggregators' links (see the module docstring)
                            nsexec.check(
                                ns,
                                ["bridge", "link", "set", "dev", ifname, "mcast_flood", "off"],
                                "bridge (mcast_flood off on an aggregator port)",
                            )
                    ipr(ns).link("set", index=idx, state="up")
            for ns, dst, gateway in plan.worker_routes():
                ipr(ns).route("add", dst=dst, gateway=gateway)
        finally:
            for r in iprs.values():
                r.close()  # an open netlink socket would keep a namespace alive
        return veth_ends, querier_since

    def _into_aggregator(self, v) -> bool:
        """Whether veth `v` is a link of an aggregator (which agg_queues applies to)."""
        aggs = {a.netns for a in self._plan.aggregators}
        return v.ns_a in aggs or v.ns_b in aggs

    def _finish_links(self, veth_ends: dict[str, list[str]], querier_since: float | None) -> None:
        """GRO, rates and faults, operstate, the XDP_PASS programs the XDP_TX'd frames need, and
        the querier's first response interval."""
        # GRO can only be switched on after link-up.
        for ns, ends in veth_ends.items():
            if ends:
                script = "\n".join(f"ethtool -K {d} gro on" for d in ends)
                nsexec.check(ns, ["sh", "-ec", script], "ethtool (enable GRO)")
        # Switch topology: the workers fill their checksums in, as a NIC does on the wire. A
        # veth with transmit checksum offload hands on a partial checksum, which a frame the
        # aggregator forwards by XDP redirect keeps (no skb, no offload): every forwarded TCP
        # segment would be dropped by its receiver (xdp-tools f0b4ac2
        # xdp-forward/tests/test-xdp-forward.sh lines 74-79 switch it off for the same reason).
        for ns, _, _ in self._plan.worker_routes():
            nsexec.check(ns, ["ethtool", "-K", "eth0", "tx", "off"], "ethtool (checksums)")
        self._apply_rates(with_agg=True, initial=True)
        if self._wants_nft():
            self._apply_faults()
        self._wait_operstate_up(veth_ends)
        self._attach_xdp()
        if self.kernel_forwarding:
            kernel_forward.apply(self._plan)
        if querier_since is not None:
            # the bridge floods groups until its querier is one response interval old
            time.sleep(max(0.0, querier_since + QUERY_RESPONSE_CS / 100 - time.monotonic()))

    def _attach_xdp(self) -> None:
        """The ends facing the aggregator receive its XDP_TX'd / redirected frames: they need
        NAPI, so an XDP program; a worker's end gets the downstream loss program when there is
        loss down in the switch topology (:mod:`netns_testbed.xdp_pass` says why there)."""
        plan = self._plan
        facing: dict[str, list[str]] = {}
        agg_netns = {a.netns for a in plan.aggregators}
        for v in plan.veths:
            if v.ns_a in agg_netns:
                facing.setdefault(v.ns_b, []).append(v.if_b)
            elif v.ns_b in agg_netns:
                facing.setdefault(v.ns_a, []).append(v.if_a)
        lossy = {} if self.topology == "one-arm" else {w.netns for w in self.workers}
        frags = self.mtu > PLAIN_XDP_MAX_MTU
        xdp_pass.attach_pass({ns: e for ns, e in facing.items() if ns not in lossy}, frags)
        xdp_pass.attach_pass(
            {ns: e for ns, e in facing.items() if ns in lossy}, frags, loss_down=self.loss_down
        )

    def _wait_operstate_up(self, veth_ends: dict[str, list[str]], timeout: float = 5.0) -> None:
        """Wait until every veth end reports operstate UP.

        Carrier-on is applied by the kernel's linkwatch worker, which may
        defer it by up to a second (seen here on the first veth of a
        namespace); until then the device's qdisc is noop and drops what is
        sent, so up() must not return before.
        """
        deadline = time.monotonic() + timeout
        pending = {ns: set(ends) for ns, ends in veth_ends.items() if ends}
        while pending:
            for ns in list(pending):
                with IPRoute(netns=ns) as ipr:
                    for link in ipr.get_links():
                        if link.get("IFLA_OPERSTATE") == "UP":
                            pending[ns].discard(link.get("IFLA_IFNAME"))
                if not pending[ns]:
                    del pending[ns]
            if not pending:
                return
            if time.monotonic() > deadline:
                late = ", ".join(f"{ns}:{i}" for ns, ifs in pending.items() for i in sorted(ifs))
                raise TestbedError(f"links not operationally up after {timeout:.0f} s: {late}")
            time.sleep(0.02)

    def _apply_rates(self, with_agg: bool, initial: bool = False) -> None:
        """(Re)install tbf; ``initial`` skips removing limits that were never set."""
        plan = self._plan
        if not (initial and self.rate_bits is None):
            for w in self.workers:
                shaping.shape(w.netns, [w.ifname], self.rate_bits, self.mtu)
            if plan.switch_netns:
                ports = [f"w{w.index}" for w in self.workers]
                shaping.shape(plan.switch_netns, ports, self.rate_bits, self.mtu)
                # and what the ports receive: an AF_XDP sender skips its own qdisc
                shaping.shape_ingress(plan.switch_netns, ports, self.rate_bits, self.mtu)
            else:
                shaping.shape(self.aggregator.netns, self.agg_interfaces, self.rate_bits, self.mtu)
        if plan.switch_netns and with_agg and not (initial and self.agg_rate_bits is None):
            for a in self.aggregators:
                shaping.shape(a.netns, ["eth0"], self.agg_rate_bits, self.mtu)
            ports = ["ag"] + [f"ag{a.index}" for a in self.aggregators[1:]]
            shaping.shape(plan.switch_netns, ports, self.agg_rate_bits, self.mtu)

    def _apply_faults(self) -> None:
        for w in self.workers:
            script = faults.worker_script(w.ifname, self.loss_up, self.dup_up, self.loss_scope)
            faults.apply(w.netns, script)
        if self._plan.switch_netns:
            ports = [f"w{w.index}" for w in self.workers]
            faults.apply(
                self._plan.switch_netns,
                faults.switch_script(ports, self.dup_down, self.loss_down, self.loss_scope),
            )
