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
(bridge port ``w<i>`` in one-arm, the aggregator's ``p<i>`` in switch). In
one-arm what ``w<i>`` receives is shaped as well (an ifb device ``ifb-w<i>``
per port): frames a worker sends through an AF_XDP socket skip its own qdisc
(and its nftables hooks, so loss_up/loss_down/dup_up do not touch them; the
bridge ports' rules, ``faults.port_loss_script`` and dup_down, do).
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

from . import faults, nsexec, registry, shaping, xdp_pass
from . import reorder as reordering
from .build import TestbedBuild
from .errors import NotRootError, TestbedError
from .hosts import AggregatorHost, ObserverHost, WorkerHost
from .plan import MAX_AGG_QUEUES, MAX_MTU, MIN_MTU, PLAIN_XDP_MAX_MTU, make_plan, new_prefix

_KEEP = object()  # "leave this setting as it is"
STATE_VERSION = 1


def require_root() -> None:
    """Raise NotRootError unless running as root."""
    if os.geteuid() != 0:
        raise NotRootError()


class Testbed(TestbedBuild):
    """Workers and an aggregator in network namespaces; see the module docstring.

    Args:
        workers: number of workers, 1..32.
        topology: ``"one-arm"`` or ``"switch"``.
        rate: per-worker-link rate, e.g. ``"1gbit"``; None = unshaped.
        agg_rate: rate of the aggregator's own link (one-arm only; each one's).
        aggregators: number of aggregators, 1..9 (more than 1: one-arm only).
        mtu: MTU of every veth and the bridge, 68..9000; above 3506 (PLAIN_XDP_MAX_MTU, XDP
            without frags) the aggregator needs a multi-buffer program (xdp-agg attach --frags).
        loss_up / loss_down: drop probability in [0, 1] for UDP a worker sends
            to / receives from ports 0xBEE0-0xBEEF (1 = drop all).
        loss_scope: what loss_up / loss_down drop: ``"aggregation"`` (that UDP, the default)
            or ``"all"`` (every IPv4 frame on the worker links, one-arm only: gloo's TCP
            between workers crosses the same loss; :mod:`netns_testbed.faults`).
        dup_up / dup_down: probability in [0, 1] of sending one extra copy of
            such a packet toward the aggregator / the worker (dup_down: one-arm only).
        reorder: probability in [0, 1] that a frame a worker sends (of the traffic loss_scope
            names) is held back ``reorder_delay`` seconds, so that later ones overtake it
            (:mod:`netns_testbed.reorder`; AF_XDP senders are not held).
        prefix: name prefix of namespaces and the state file; default ``xt`` + 4 hex.
        observers: one-arm: hosts in no job on the bridge (``o0``.., 198.18.0.200..), 0..16.
        mcast_snooping: one-arm: the bridge snoops IGMP and runs a querier (default), so a
            multicast group reaches only its members' ports; False: it floods every group.
        agg_queues: receive and transmit queues of every veth into an aggregator, 1..64, as a
            NIC's: the flows toward it are hashed over them (addresses and ports), and each
            queue's XDP runs apart, so that several CPUs aggregate one job at once.
        cleanup_at_exit: tear down at interpreter exit if still up (the CLI
            turns this off to leave the testbed running).
        kernel_forwarding: switch only: the workers reach one another through the aggregator's
            namespace, routed by the kernel (:mod:`netns_testbed.kernel_forward`: a route per
            worker to 198.18.0.0/15, forwarding on the ports ``p<i>``); default off.

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
        agg_queues: int = 1,
        loss_scope: str = "aggregation",
        reorder: float = 0.0,
        reorder_delay: float = reordering.DEFAULT_DELAY,
        kernel_forwarding: bool = False,
    ):
        self.prefix = prefix if prefix is not None else new_prefix()
        self._plan = make_plan(self.prefix, workers, topology, observers, aggregators)
        self.mcast_snooping = bool(mcast_snooping)
        if not isinstance(mtu, int) or not MIN_MTU <= mtu <= MAX_MTU:
            raise ValueError(
                f"mtu must be an integer in {MIN_MTU}..{MAX_MTU}, got {mtu!r} "
                f"(above {PLAIN_XDP_MAX_MTU} the XDP programs on its veths are multi-buffer ones)"
            )
        self.mtu = mtu
        if not isinstance(agg_queues, int) or not 1 <= agg_queues <= MAX_AGG_QUEUES:
            raise ValueError(
                f"agg_queues must be an integer in 1..{MAX_AGG_QUEUES}: {agg_queues!r}"
            )
        self.agg_queues = agg_queues
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
        self.loss_scope = faults.check_scope(loss_scope)
        if loss_scope != "aggregation" and topology != "one-arm":
            raise ValueError("loss_scope 'all' needs the one-arm topology (netns_testbed.faults)")
        self.reorder = faults.check_probability("reorder", reorder)
        self.reorder_delay = reordering.check_delay(reorder_delay)
        self._reorder_pids: list[int] = []  # the delay lines (netns_testbed.reorder), by PID
        self.cleanup_at_exit = cleanup_at_exit
        if kernel_forwarding and topology != "switch":
            raise ValueError(
                "kernel_forwarding needs the switch topology (netns_testbed.kernel_forward)"
            )
        self.kernel_forwarding = bool(kernel_forwarding)

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

    def sniff(self, host, ifname: str | None = None, sent: bool = False) -> "Sniffer":
        """Start counting the result frames and IGMP reports on ``host``'s interface (default
        its ``eth0``; the bridge namespace needs ``ifname``, a port such as ``"w0"``) with a
        raw socket (:mod:`netns_testbed.sniff`); ``stop()`` on the answer returns the counts.
        `sent`: count the results the interface sends (a bridge port's, toward its host), not
        those it receives. Killed by :meth:`down` if still running."""
        ns = self.netns_of(host)
        h = self.host(host)
        ifname = ifname or (h.ifname if not isinstance(h, (str, AggregatorHost)) else None)
        if ifname is None:
            raise ValueError(f"sniff({host!r}) needs ifname= (e.g. 'eth0' or a bridge port)")
        p = self.popen(
            ns,
            [sys.executable, "-m", "netns_testbed.sniff", *(["--sent"] if sent else []), ifname],
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
            self._apply_reorder()
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
        if self._is_up and self.topology != "one-arm":  # loss down: the workers' XDP program
            self._attach_xdp()
        if self._owns_state:
            self._save()

    def set_reorder(self, p: float, delay: float | None = None) -> None:
        """Change the share of held-back frames (and, if given, how long they are held) on a
        live testbed; 0 ends reordering."""
        self.reorder = faults.check_probability("reorder", p)
        if delay is not None:
            self.reorder_delay = reordering.check_delay(delay)
        if self._is_up:  # not up yet: applied by up()
            self._apply_reorder()
        if self._owns_state:
            self._save()

    def _apply_reorder(self) -> None:
        """End the running delay lines, then (reorder > 0) start one per worker and put the
        choice on its uplink; the choice is removed first, so no frame is held with no line."""
        if not (self.reorder > 0 or self._reorder_pids):
            return
        for w in self.workers:
            reordering.install(w.netns, w.ifname, 0.0, self.loss_scope)
        for pid in self._reorder_pids:
            nsexec.kill_pid(pid)
            if pid in self._registry.pids:
                self._registry.pids.remove(pid)
        self._reorder_pids.clear()
        if self.reorder <= 0:
            return
        for w in self.workers:
            argv = reordering.argv(w.ifname, self.reorder_delay)
            p = self.popen(w, argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
            self._reorder_pids.append(p.pid)
            line = p.stderr.readline() if p.stderr else ""
            if "ready" not in line:
                raise TestbedError(f"the delay line in {w.netns} did not start: {line.strip()}")
            reordering.install(w.netns, w.ifname, self.reorder, self.loss_scope)

    def held_frames(self) -> int:
        """Frames held back so far by the reordering, over all workers."""
        return sum(reordering.held_frames(w.netns) for w in self.workers)

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

    def own_mac_only(self, workers: list[int] | None = None) -> None:
        """Make the ``eth0`` of workers `workers` (default: all) receive as a NIC without
        promiscuous mode that joined no multicast group does: frames to its own MAC or to the
        broadcast, nothing else (:func:`netns_testbed.xdp_pass.mac_filter_insns`; its drops are
        the veth's ``rx_queue_N_xdp_drops``). In the switch topology the filter replaces the
        worker's end's own program, so it cannot go with loss down there."""
        if self.topology != "one-arm" and self.loss_down > 0:
            raise ValueError("own_mac_only replaces the switch topology's loss-down program")
        chosen = self.workers if workers is None else [self.workers[i] for i in workers]
        ends: dict[str, list[str]] = {}
        for w in chosen:
            ends.setdefault(w.netns, []).append(w.ifname)
        xdp_pass.attach_mac_filter(ends, frags=self.mtu > PLAIN_XDP_MAX_MTU)

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
            "agg_queues": self.agg_queues,
            "rate": shaping.format_rate(self.rate_bits),
            "agg_rate": shaping.format_rate(self.agg_rate_bits),
            "loss_up": self.loss_up,
            "loss_down": self.loss_down,
            "dup_up": self.dup_up,
            "dup_down": self.dup_down,
            "loss_scope": self.loss_scope,
            "reorder": self.reorder,
            "reorder_delay": self.reorder_delay,
            "reorder_pids": list(self._reorder_pids),
            "kernel_forwarding": self.kernel_forwarding,
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
            loss_scope=st.get("loss_scope", "aggregation"),
            reorder=st.get("reorder", 0.0),
            reorder_delay=st.get("reorder_delay", reordering.DEFAULT_DELAY),
            prefix=prefix,
            cleanup_at_exit=False,
            observers=st.get("n_observers", 0),
            mcast_snooping=st.get("mcast_snooping", False),
            aggregators=st.get("n_aggregators", 1),
            agg_queues=st.get("agg_queues", 1),
            kernel_forwarding=st.get("kernel_forwarding", False),
        )
        tb._registry = registry.CleanupRegistry.from_dict(st.get("registry", {}))
        tb._reorder_pids = list(st.get("reorder_pids", []))
        tb._is_up = st.get("status") == "up"
        tb._owns_state = True
        tb._owner_pid = st.get("owner_pid")
        tb._owner_start = st.get("owner_start")
        tb._created = st.get("created")
        return tb

    def _save(self, status: str | None = None) -> None:
        st = self.state()
        if status:
            st["status"] = status
        registry.save_state(self.prefix, st)


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
