"""The Testbed: N workers and one aggregator in network namespaces.

Typical use::

    from netns_testbed import Testbed

    with Testbed(workers=3, topology="switch", rate="1gbit") as tb:
        for w in tb.workers:
            tb.run(w, ["ping", "-c", "1", "-W", "1", w.agg_ip], check=True)
        srv = tb.popen(tb.aggregator, ["python3", "server.py"])  # killed by down()
        ...

Topologies (see :mod:`netns_testbed.plan` for the address plan):

* ``one-arm``: namespace ``<prefix>sw`` holds bridge ``br0``; the aggregator
  (``<prefix>ag``, ``eth0``) and each worker (``<prefix>w<i>``, ``eth0``) hang
  off it by one veth each.
* ``switch``: the aggregator has one veth ``p<i>`` per worker; no bridge.

Every veth end gets GRO on after link-up (the hosts' UDP GRO sockets use it). A
veth only receives XDP_TX'd or redirected frames when its receiving end runs
NAPI, which GRO did not turn on with this kernel: the ends facing an aggregator
interface get a two-instruction XDP_PASS program (:mod:`netns_testbed.xdp_pass`).
IPv6 is disabled in all namespaces so that no address outside 198.18.0.0/15
exists and no router solicitations / MLD reports reach the XDP program.

The one-arm bridge snoops IGMP, with its own querier, as a switch in front of an aggregator
should: a multicast group (a job's results) goes only to the ports whose hosts joined it.
``observers`` adds hosts in no job on the same bridge, to show what a bystander receives.

Rate limits (tbf, see :mod:`netns_testbed.shaping`) apply to both directions
of each worker link: the worker's ``eth0`` egress and the other end's egress
(bridge port ``w<i>`` in one-arm, the aggregator's ``p<i>`` in switch).
``aggregators`` K > 1 (one-arm) adds aggregator namespaces ``<prefix>ag1``..
on the same bridge (:mod:`netns_testbed.plan`), for jobs striped over several
aggregators; their bridge ports get ``mcast_flood off`` so that the results
one aggregator multicasts to the workers do not reach (and load) the others'
links, as IGMP snooping on a real switch would keep them off.

LIMITATION (switch): frames the aggregator sends with XDP_TX or a devmap
redirect on ``p<i>`` bypass the qdisc there, so the aggregator->worker
direction is unshaped for XDP traffic; in one-arm the bridge port shapes
those frames. ``agg_rate`` shapes the aggregator's own link (one-arm only), each
aggregator's when there are several.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from subprocess import CompletedProcess, Popen

from pyroute2 import IPRoute
from pyroute2 import netns as pr_netns

from . import faults, nsexec, registry, shaping, xdp_pass
from .errors import NotRootError, TestbedError
from .hosts import AggregatorHost, ObserverHost, WorkerHost
from .plan import BRIDGE_NAME, make_plan, new_prefix

_KEEP = object()  # "leave this setting as it is"
STATE_VERSION = 1


def require_root() -> None:
    """Raise NotRootError unless running as root."""
    if os.geteuid() != 0:
        raise NotRootError()


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


# MTU limits of the testbed's links. The veth ends facing the aggregator carry XDP programs (ours
# or the XDP_PASS stub), and veth refuses an XDP program without frags support on a link whose
# frame does not fit one page: 4096 - 256 headroom - 320 skb_shared_info - 14 Ethernet = 3506
# (measured: 3507 fails with ERANGE).
MIN_MTU, MAX_MTU = 68, 3506


class Testbed:
    """Workers and an aggregator in network namespaces; see the module docstring.

    Args:
        workers: number of workers, 1..32.
        topology: ``"one-arm"`` or ``"switch"``.
        rate: per-worker-link rate, e.g. ``"1gbit"``; None = unshaped.
        agg_rate: rate of the aggregator's own link (one-arm only; each one's).
        aggregators: number of aggregators, 1..9 (more than 1: one-arm only).
        mtu: MTU of every veth and the bridge, 68..3506 (MAX_MTU: XDP without frags).
        loss_up / loss_down: drop probability in [0, 1] for UDP a worker sends
            to / receives from ports 0xBEE0-0xBEEF (1 = drop all).
        dup_up / dup_down: probability in [0, 1] of sending one extra copy of
            such a packet toward the aggregator / the worker (dup_down: one-arm only).
        prefix: name prefix of namespaces and the state file; default ``xt`` + 4 hex.
        observers: one-arm: hosts in no job on the bridge (``o0``.., 198.18.0.200..), 0..16.
        mcast_snooping: one-arm: the bridge snoops IGMP and runs a querier (default), so a
            multicast group reaches only its members' ports; False: it floods every group.
        cleanup_at_exit: tear down at interpreter exit if still up (the CLI
            turns this off to leave the testbed running).

    Attributes after construction (valid before ``up()`` too): ``prefix``,
    ``topology``, ``aggregator`` (:class:`AggregatorHost`), ``workers`` (list
    of :class:`WorkerHost`), ``group_ip``, ``agg_interfaces``,
    ``switch_netns`` and ``namespaces``.
    """

    __test__ = False  # keep pytest from trying to collect this class

    def __init__(
        self,
        workers: int = 2,
        topology: str = "one-arm",
        rate=None,
        agg_rate=None,
        mtu: int = 1500,
        loss_up: float = 0.0,
        loss_down: float = 0.0,
        dup_up: float = 0.0,
        dup_down: float = 0.0,
        prefix: str | None = None,
        cleanup_at_exit: bool = True,
        observers: int = 0,
        mcast_snooping: bool = True,
        aggregators: int = 1,
    ):
        self.prefix = prefix if prefix is not None else new_prefix()
        self._plan = make_plan(self.prefix, workers, topology, observers, aggregators)
        self.mcast_snooping = bool(mcast_snooping)
        if not isinstance(mtu, int) or not MIN_MTU <= mtu <= MAX_MTU:
            raise ValueError(
                f"mtu must be an integer in {MIN_MTU}..{MAX_MTU}, got {mtu!r}: "
                "the testbed attaches "
                f"XDP programs to its veths, and XDP without multi-buffer (frags) support, which "
                f"bcc cannot ask for, fits a frame in one page: at most MTU {MAX_MTU} on veth"
            )
        self.mtu = mtu
        self.topology = topology
        self.rate_bits = shaping.parse_rate(rate)
        self.agg_rate_bits = shaping.parse_rate(agg_rate)
        if self.agg_rate_bits is not None and topology != "one-arm":
            raise ValueError(
                "agg_rate applies to the one-arm topology only; "
                "in the switch topology use rate (every link is a worker link)"
            )
        self.loss_up = faults.check_probability("loss_up", loss_up)
        self.loss_down = faults.check_probability("loss_down", loss_down)
        self.dup_up = faults.check_probability("dup_up", dup_up)
        self.dup_down = faults.check_probability("dup_down", dup_down)
        if self.dup_down > 0 and topology != "one-arm":
            raise ValueError("dup_down needs the one-arm topology (see netns_testbed.faults)")
        self.cleanup_at_exit = cleanup_at_exit

        self.aggregator: AggregatorHost = self._plan.aggregator
        self.aggregators: list[AggregatorHost] = self._plan.aggregators  # [aggregator] unless K > 1
        self.workers: list[WorkerHost] = self._plan.workers
        self.observers: list[ObserverHost] = self._plan.observers
        self.group_ip: str | None = self._plan.group_ip
        self.switch_netns: str | None = self._plan.switch_netns

        self._registry = registry.CleanupRegistry()
        self._procs: list[Popen] = []
        self._is_up = False
        self._owns_state = False
        self._owner_pid = os.getpid()
        self._owner_start = None
        self._created = None

    # ------------------------------------------------------------------ info
    @property
    def agg_interfaces(self) -> list[str]:
        """Aggregator interfaces to attach XDP to: ["eth0"] or ["p0", ..]."""
        return list(self.aggregator.ifnames)

    @property
    def namespaces(self) -> list[str]:
        """All namespace names of this testbed (bridge, aggregator, workers)."""
        return list(self._plan.namespaces)

    @property
    def is_up(self) -> bool:
        return self._is_up

    def __repr__(self) -> str:
        return (
            f"Testbed(prefix={self.prefix!r}, topology={self.topology!r}, "
            f"workers={len(self.workers)}, up={self._is_up})"
        )

    def host(self, host) -> AggregatorHost | WorkerHost | ObserverHost | str:
        """Resolve a host: a host record, worker index, ``"agg"`` (``"agg<j>"``: aggregator j
        of several), ``"w<i>"``, ``"o<i>"`` (an observer), ``"sw"`` (one-arm bridge) or one of
        our namespace names.

        Returns the host record, or the namespace name for the bridge namespace.
        """
        if isinstance(host, (AggregatorHost, WorkerHost, ObserverHost)):
            return host
        if isinstance(host, int) and not isinstance(host, bool):
            if 0 <= host < len(self.workers):
                return self.workers[host]
            raise ValueError(
                f"no worker {host}: this testbed has workers 0..{len(self.workers) - 1}"
            )
        if isinstance(host, str):
            if host in ("agg", "aggregator", "ag", self.aggregator.netns):
                return self.aggregator
            for a in self.aggregators:
                if host in (a.name, a.netns, f"ag{a.index}"):
                    return a
            if host in ("sw", "switch", "bridge") or (
                self.switch_netns and host == self.switch_netns
            ):
                if self.switch_netns is None:
                    raise ValueError("the switch topology has no bridge namespace")
                return self.switch_netns
            for w in (*self.workers, *self.observers):
                if host in (w.name, w.netns):
                    return w
        raise ValueError(
            f"unknown host {host!r}: use 'agg', 'w0'..'w{len(self.workers) - 1}'"
            + (", 'sw'" if self.switch_netns else "")
            + " or a host record"
        )

    def netns_of(self, host) -> str:
        """Namespace name of ``host`` (anything :meth:`host` accepts)."""
        h = self.host(host)
        return h if isinstance(h, str) else h.netns

    def netns_path(self, host) -> str:
        """``/var/run/netns/<name>`` of ``host``, for code that calls setns itself."""
        return nsexec.netns_path(self.netns_of(host))

    # ------------------------------------------------------------- commands
    def run(self, host, argv, **kw) -> CompletedProcess:
        """Run ``argv`` in ``host``'s namespace (nsenter, environment inherited
        or ``env=``); output captured as text unless stdout/stderr are given.
        Other keywords go to subprocess.run (``check``, ``timeout``, ``input``...)."""
        return nsexec.run(self.netns_of(host), argv, **kw)

    def popen(self, host, argv, **kw) -> Popen:
        """Start ``argv`` in ``host``'s namespace; keywords go to subprocess.Popen.

        The process runs in its own session and is killed (its process group,
        SIGTERM then SIGKILL) by :meth:`down` if still alive.
        """
        p = nsexec.popen(self.netns_of(host), argv, **kw)
        self._procs.append(p)
        self._registry.pids.append(p.pid)
        if self._owns_state:
            self._save()
        return p

    def sniff(self, host, ifname: str | None = None) -> "Sniffer":
        """Start counting the result frames and IGMP reports on ``host``'s interface (default
        its ``eth0``; the bridge namespace needs ``ifname``, a port such as ``"w0"``) with a
        raw socket (:mod:`netns_testbed.sniff`); ``stop()`` on the answer returns the counts.
        Killed by :meth:`down` if still running."""
        ns = self.netns_of(host)
        h = self.host(host)
        ifname = ifname or (h.ifname if not isinstance(h, (str, AggregatorHost)) else None)
        if ifname is None:
            raise ValueError(f"sniff({host!r}) needs ifname= (e.g. 'eth0' or a bridge port)")
        p = self.popen(
            ns,
            [sys.executable, "-m", "netns_testbed.sniff", ifname],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = p.stderr.readline()
        if "ready" not in line:
            p.kill()
            raise TestbedError(f"sniff on {ns}:{ifname} did not start: {line}{p.stderr.read()}")
        return Sniffer(p, f"{ns}:{ifname}")

    # ------------------------------------------------------------ lifecycle
    def up(self) -> Testbed:
        """Create everything; on failure remove what was made and re-raise."""
        if self._is_up:
            return self
        require_root()
        nsexec.require_tools("nsenter", "ethtool", "tc", "sysctl")
        if self._wants_nft():
            nsexec.require_tools("nft")
        self._check_free()
        self._owner_pid = os.getpid()
        self._owner_start = registry.process_start_time(self._owner_pid)
        self._created = time.time()
        self._owns_state = True
        if self.cleanup_at_exit:
            registry.register_live(self)
        try:
            self._save("building")
            self._build()
        except BaseException:
            try:
                self.down()
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
            raise
        self._is_up = True
        self._save("up")
        return self

    def down(self) -> None:
        """Kill processes started with popen, remove every namespace/link and the
        state file. Safe to call more than once and after a failed ``up()``."""
        errors: list[str] = []
        try:
            nsexec.terminate(self._procs)
            self._procs.clear()
            self._registry.kill_recorded_pids()
            errors = self._registry.teardown()
        finally:
            self._is_up = False
            registry.unregister_live(self)
        if self._owns_state:
            if errors:
                self._save("broken")
            else:
                registry.remove_state(self.prefix)
                self._owns_state = False
        if errors:
            raise TestbedError("teardown incomplete: " + "; ".join(errors))

    def __enter__(self) -> Testbed:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # --------------------------------------------------------- live changes
    def set_loss(
        self,
        p_up: float,
        p_down: float,
        *,
        dup_up: float | None = None,
        dup_down: float | None = None,
    ) -> None:
        """Change loss (and optionally duplication) probabilities on a live testbed."""
        p_up = faults.check_probability("loss_up", p_up)
        p_down = faults.check_probability("loss_down", p_down)
        d_up = self.dup_up if dup_up is None else faults.check_probability("dup_up", dup_up)
        d_down = (
            self.dup_down if dup_down is None else faults.check_probability("dup_down", dup_down)
        )
        if d_down > 0 and self.topology != "one-arm":
            raise ValueError("dup_down needs the one-arm topology (see netns_testbed.faults)")
        need = self._wants_nft() or any(x > 0 for x in (p_up, p_down, d_up, d_down))
        self.loss_up, self.loss_down, self.dup_up, self.dup_down = p_up, p_down, d_up, d_down
        if need and self._is_up:  # not up yet: applied by up()
            nsexec.require_tools("nft")
            self._apply_faults()
        if self._owns_state:
            self._save()

    def set_rate(self, rate, agg_rate=_KEEP) -> None:
        """Change the per-worker-link rate (None removes it) and, if given,
        the aggregator link's rate (one-arm) on a live testbed."""
        self.rate_bits = shaping.parse_rate(rate)
        if agg_rate is not _KEEP:
            bits = shaping.parse_rate(agg_rate)
            if bits is not None and self.topology != "one-arm":
                raise ValueError("agg_rate applies to the one-arm topology only")
            self.agg_rate_bits = bits
        if self._is_up:  # not up yet: applied by up()
            self._apply_rates(with_agg=agg_rate is not _KEEP)
            self._save()

    # ---------------------------------------------------------------- state
    def state(self) -> dict:
        """JSON-able description: parameters, hosts, addresses and what to clean up."""
        return {
            "version": STATE_VERSION,
            "prefix": self.prefix,
            "topology": self.topology,
            "n_workers": len(self.workers),
            "n_observers": len(self.observers),
            "mcast_snooping": self.mcast_snooping,
            "n_aggregators": len(self.aggregators),
            "mtu": self.mtu,
            "rate": shaping.format_rate(self.rate_bits),
            "agg_rate": shaping.format_rate(self.agg_rate_bits),
            "loss_up": self.loss_up,
            "loss_down": self.loss_down,
            "dup_up": self.dup_up,
            "dup_down": self.dup_down,
            "status": "up" if self._is_up else "down",
            "owner_pid": self._owner_pid,
            "owner_start": self._owner_start,
            "cleanup_at_exit": self.cleanup_at_exit,
            "created": self._created,
            "group_ip": self.group_ip,
            "agg_interfaces": self.agg_interfaces,
            "switch_netns": self.switch_netns,
            "namespaces": self.namespaces,
            "aggregator": self.aggregator.to_dict(),
            "aggregators": [a.to_dict() for a in self.aggregators],
            "workers": [w.to_dict() for w in self.workers],
            "observers": [o.to_dict() for o in self.observers],
            "registry": self._registry.to_dict(),
        }

    @classmethod
    def attach(cls, prefix: str) -> Testbed:
        """A handle on a testbed recorded in the state directory (e.g. built by the
        CLI or another process): run commands in it, change it, or ``down()`` it.
        Its processes started by other processes are not killed by ``down()``
        unless they were started through ``popen`` (their PIDs are recorded)."""
        st = registry.load_state(prefix)
        if st is None:
            raise TestbedError(
                f"no testbed with prefix {prefix!r} in {registry.STATE_DIR} "
                "(see `netns-testbed status`)"
            )
        tb = cls(
            workers=st["n_workers"],
            topology=st["topology"],
            rate=st.get("rate"),
            agg_rate=st.get("agg_rate"),
            mtu=st["mtu"],
            loss_up=st.get("loss_up", 0.0),
            loss_down=st.get("loss_down", 0.0),
            dup_up=st.get("dup_up", 0.0),
            dup_down=st.get("dup_down", 0.0),
            prefix=prefix,
            cleanup_at_exit=False,
            observers=st.get("n_observers", 0),
            mcast_snooping=st.get("mcast_snooping", False),
            aggregators=st.get("n_aggregators", 1),
        )
        tb._registry = registry.CleanupRegistry.from_dict(st.get("registry", {}))
        tb._is_up = st.get("status") == "up"
        tb._owns_state = True
        tb._owner_pid = st.get("owner_pid")
        tb._owner_start = st.get("owner_start")
        tb._created = st.get("created")
        return tb

    # ------------------------------------------------------------ internals
    def _wants_nft(self) -> bool:
        return any(x > 0 for x in (self.loss_up, self.loss_down, self.dup_up, self.dup_down))

    def _save(self, status: str | None = None) -> None:
        st = self.state()
        if status:
            st["status"] = status
        registry.save_state(self.prefix, st)

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
        finally:
            for r in iprs.values():
                r.close()  # an open netlink socket would keep a namespace alive
        return veth_ends, querier_since

    def _finish_links(self, veth_ends: dict[str, list[str]], querier_since: float | None) -> None:
        """GRO, rates and faults, operstate, the XDP_PASS programs the XDP_TX'd frames need, and
        the querier's first response interval."""
        plan = self._plan
        # GRO can only be switched on after link-up.
        for ns, ends in veth_ends.items():
            if ends:
                script = "\n".join(f"ethtool -K {d} gro on" for d in ends)
                nsexec.check(ns, ["sh", "-ec", script], "ethtool (enable GRO)")
        self._apply_rates(with_agg=True, initial=True)
        if self._wants_nft():
            self._apply_faults()
        self._wait_operstate_up(veth_ends)
        # The ends facing the aggregator receive its XDP_TX'd / redirected frames: they need NAPI.
        facing: dict[str, list[str]] = {}
        agg_netns = {a.netns for a in plan.aggregators}
        for v in plan.veths:
            if v.ns_a in agg_netns:
                facing.setdefault(v.ns_b, []).append(v.if_b)
            elif v.ns_b in agg_netns:
                facing.setdefault(v.ns_a, []).append(v.if_a)
        xdp_pass.attach_pass(facing)
        if querier_since is not None:
            # the bridge floods groups until its querier is one response interval old
            time.sleep(max(0.0, querier_since + QUERY_RESPONSE_CS / 100 - time.monotonic()))

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
                shaping.shape(
                    plan.switch_netns,
                    [f"w{w.index}" for w in self.workers],
                    self.rate_bits,
                    self.mtu,
                )
            else:
                shaping.shape(self.aggregator.netns, self.agg_interfaces, self.rate_bits, self.mtu)
        if plan.switch_netns and with_agg and not (initial and self.agg_rate_bits is None):
            for a in self.aggregators:
                shaping.shape(a.netns, ["eth0"], self.agg_rate_bits, self.mtu)
            ports = ["ag"] + [f"ag{a.index}" for a in self.aggregators[1:]]
            shaping.shape(plan.switch_netns, ports, self.agg_rate_bits, self.mtu)

    def _apply_faults(self) -> None:
        for w in self.workers:
            faults.apply(
                w.netns, faults.worker_script(w.ifname, self.loss_up, self.loss_down, self.dup_up)
            )
        if self._plan.switch_netns:
            faults.apply(
                self._plan.switch_netns,
                faults.switch_script([f"w{w.index}" for w in self.workers], self.dup_down),
            )


class Sniffer:
    """A running :mod:`netns_testbed.sniff` (from :meth:`Testbed.sniff`)."""

    def __init__(self, proc: Popen, where: str) -> None:
        self.proc = proc
        self.where = where

    def stop(self, timeout: float = 10.0) -> dict:
        """Stop counting; the counts (see :mod:`netns_testbed.sniff`)."""
        out, err = self.proc.communicate(input="", timeout=timeout)
        if self.proc.returncode != 0 or not out.strip():
            raise TestbedError(f"sniff on {self.where} failed ({self.proc.returncode}): {err}")
        return json.loads(out)
