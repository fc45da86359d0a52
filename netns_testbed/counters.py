"""Loss accounting: every place a testbed can drop a datagram, snapshotted and diffed.

A snapshot reads, in each namespace of a testbed (one ``nsenter --net`` shell per namespace, so
that a snapshot of eight workers costs about ten processes):

* ``tc -s -j qdisc``: drops, overlimits and requeues of every root qdisc (tbf on the shaped
  worker links, both directions);
* ``ip -s -j link``: rx/tx dropped and errors of every interface;
* ``ethtool -S`` of every veth: ring drops (``rx_queue_N_drops``), XDP verdict and XDP_TX /
  ndo_xdp_xmit error counters (``rx_queue_N_xdp_*``, ``tx_queue_N_xdp_xmit_errors``), whatever
  the kernel exposes (the keys are kept as they come);
* ``/proc/net/snmp``: UDP InErrors, RcvbufErrors, SndbufErrors, MemErrors of the namespace (read
  by a process inside it: /proc/net follows the reader's network namespace);
* ``nft -j list table netdev netns_testbed``: the packet and byte counters of the loss and
  duplication rules of :mod:`netns_testbed.faults`;

and once per machine ``/proc/net/softnet_stat`` (backlog drops, global), plus, when given, the
XDP aggregator's counters by reason (``xdp-agg stats --json``: per job and per worker).

:func:`diff` subtracts two snapshots; :func:`attribute` turns a difference, with the workers'
engine statistics over the same span, into retransmissions by cause (:data:`CAUSES`).
Everything here is plain data (JSON-able dicts), so snapshots can be taken in one process
(e.g. a benchmark's rank 0) and attributed in another.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import asdict, dataclass, field

from . import faults, nsexec

# One shell per namespace; "@@" lines separate the sections parse_namespace_dump splits on.
# Devices come from netlink (ip -o link), not /sys/class/net, which nsenter leaves at the root
# namespace's view.
_DUMP_SCRIPT = r"""
echo '@@tc'; tc -s -j qdisc show 2>/dev/null || echo '[]'
echo '@@link'; ip -s -j link show 2>/dev/null || echo '[]'
echo '@@snmp'; cat /proc/net/snmp
echo '@@nft'; nft -j list table netdev TABLE 2>/dev/null || echo '{}'
for d in $(ip -o link show type veth | sed -n 's/^[0-9]*: \([^@:]*\).*/\1/p'); do
  echo "@@ethtool $d"; ethtool -S "$d" 2>/dev/null
done
""".replace("TABLE", faults.TABLE)

_SNMP_UDP_KEYS = (
    "InDatagrams",
    "NoPorts",
    "InErrors",
    "OutDatagrams",
    "RcvbufErrors",
    "SndbufErrors",
    "InCsumErrors",
    "MemErrors",
)


# --- parsing (pure: tested with captured samples) ---------------------------------------------
def parse_tc(text: str) -> dict[str, dict]:
    """``tc -s -j qdisc`` -> {dev: {kind, drops, overlimits, requeues, packets, bytes, backlog}}
    for each device's root qdisc (children are counted in their root already)."""
    out = {}
    for q in json.loads(text or "[]"):
        if not q.get("root"):
            continue
        out[q["dev"]] = {
            "kind": q.get("kind", "?"),
            **{
                k: int(q.get(k, 0))
                for k in ("drops", "overlimits", "requeues", "packets", "bytes", "backlog")
            },
        }
    return out


def parse_links(text: str) -> dict[str, dict]:
    """``ip -s -j link`` -> {dev: {rx_packets, rx_dropped, rx_errors, tx_packets, tx_dropped,
    tx_errors}}; interfaces without statistics are left out."""
    out = {}
    for link in json.loads(text or "[]"):
        st = link.get("stats64") or link.get("stats")
        if not st:
            continue
        rx, tx = st.get("rx", {}), st.get("tx", {})
        out[link["ifname"]] = {
            "rx_packets": int(rx.get("packets", 0)),
            "rx_dropped": int(rx.get("dropped", 0)),
            "rx_errors": int(rx.get("errors", 0)),
            "tx_packets": int(tx.get("packets", 0)),
            "tx_dropped": int(tx.get("dropped", 0)),
            "tx_errors": int(tx.get("errors", 0)),
        }
    return out


def parse_ethtool(text: str) -> dict[str, int]:
    """``ethtool -S DEV`` -> {counter: value} (numeric counters only; peer_ifindex dropped)."""
    out = {}
    for line in text.splitlines():
        key, sep, val = line.strip().partition(":")
        val = val.strip()
        if sep and val.lstrip("-").isdigit() and key != "peer_ifindex":
            out[key.strip()] = int(val)
    return out


def parse_snmp(text: str) -> dict[str, int]:
    """``/proc/net/snmp`` -> the Udp counters (:data:`_SNMP_UDP_KEYS` where present)."""
    rows = [line.split() for line in text.splitlines() if line.startswith("Udp:")]
    if len(rows) < 2:
        return {}
    values = dict(zip(rows[0][1:], rows[1][1:]))
    return {k: int(values[k]) for k in _SNMP_UDP_KEYS if k in values}


def parse_nft(text: str) -> dict[str, dict]:
    """``nft -j list table ...`` -> {chain: {packets, bytes, drop: bool}} from each rule's
    counter ("drop" tells loss rules from duplication rules)."""
    out: dict[str, dict] = {}
    try:
        items = json.loads(text or "{}").get("nftables", [])
    except json.JSONDecodeError:
        return out
    for item in items:
        rule = item.get("rule")
        if not rule:
            continue
        exprs = rule.get("expr", [])
        counter = next((e["counter"] for e in exprs if "counter" in e), None)
        if counter is None:
            continue
        c = out.setdefault(rule["chain"], {"packets": 0, "bytes": 0, "drop": False})
        c["packets"] += int(counter.get("packets", 0))
        c["bytes"] += int(counter.get("bytes", 0))
        c["drop"] = c["drop"] or any("drop" in e for e in exprs)
    return out


def parse_softnet(text: str) -> dict[str, int]:
    """``/proc/net/softnet_stat`` (hex, one line per CPU) -> processed, dropped (backlog full)
    and time_squeeze, summed over CPUs."""
    out = {"processed": 0, "dropped": 0, "time_squeeze": 0}
    for line in text.split("\n"):
        f = line.split()
        if len(f) >= 3:
            out["processed"] += int(f[0], 16)
            out["dropped"] += int(f[1], 16)
            out["time_squeeze"] += int(f[2], 16)
    return out


def parse_namespace_dump(text: str) -> dict:
    """The output of the per-namespace script -> {qdisc, link, udp, nft, ethtool}."""
    sections: dict[str, list[str]] = {}
    cur = None
    for line in text.splitlines():
        if line.startswith("@@"):
            cur = line[2:].strip()
            sections[cur] = []
        elif cur is not None:
            sections[cur].append(line)

    def get(k: str) -> str:
        return "\n".join(sections.get(k, []))

    return {
        "qdisc": parse_tc(get("tc")),
        "link": parse_links(get("link")),
        "udp": parse_snmp(get("snmp")),
        "nft": parse_nft(get("nft")),
        "ethtool": {
            k.split(None, 1)[1]: parse_ethtool("\n".join(v))
            for k, v in sections.items()
            if k.startswith("ethtool ")
        },
    }


# --- where each namespace sits --------------------------------------------------------------
@dataclass
class Layout:
    """Which namespace and device is which, for attributing a counter to a link direction.

    ``down_ports[i]``: (namespace, device) whose egress carries results toward worker i (the
    bridge port ``w<i>`` in one-arm, the aggregator's ``p<i>`` in switch). ``agg_port``:
    one-arm only, the bridge port toward the aggregator (``ag``).
    """

    topology: str
    workers: list[str]
    aggregator: str
    agg_ifnames: list[str]
    bridge: str | None = None
    down_ports: list[list[str]] = field(default_factory=list)
    agg_port: list[str] | None = None

    @classmethod
    def from_testbed(cls, tb) -> Layout:
        """The layout of a :class:`netns_testbed.Testbed` (up or described by a state file)."""
        if tb.topology == "one-arm":
            down = [[tb.switch_netns, f"w{w.index}"] for w in tb.workers]
            agg_port = [tb.switch_netns, "ag"]
        else:
            down = [[tb.aggregator.netns, w.agg_ifname] for w in tb.workers]
            agg_port = None
        return cls(
            tb.topology,
            [w.netns for w in tb.workers],
            tb.aggregator.netns,
            list(tb.agg_interfaces),
            tb.switch_netns,
            down,
            agg_port,
        )

    @property
    def namespaces(self) -> list[str]:
        return ([self.bridge] if self.bridge else []) + [self.aggregator] + self.workers

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Layout:
        return cls(**d)


# --- snapshots ------------------------------------------------------------------------------
def snapshot(layout: Layout, aggregator_stats=None, timeout: float = 30.0) -> dict:
    """Read every counter of the testbed now: {"ns": {netns: dump}, "softnet": ...,
    "aggregator": ...}. ``aggregator_stats``: a callable returning ``xdp-agg stats --json``'s
    dict (e.g. ``Cluster.stats``), or None. Namespaces are read in parallel."""
    procs = {
        ns: subprocess.Popen(
            nsexec.nsenter_argv(ns, ["sh", "-c", _DUMP_SCRIPT]),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for ns in layout.namespaces
    }
    snap: dict = {"ns": {}}
    for ns, p in procs.items():
        out, _ = p.communicate(timeout=timeout)
        snap["ns"][ns] = parse_namespace_dump(out)
    with open("/proc/net/softnet_stat") as f:
        snap["softnet"] = parse_softnet(f.read())
    if aggregator_stats is not None:
        snap["aggregator"] = aggregator_stats()
    return snap


def diff(before, after):
    """``after - before`` for every number in two snapshots (nested dicts of the same shape);
    a key absent from ``before`` counts from 0 (a job created in between), non-numbers are kept
    from ``after``."""
    if isinstance(after, dict):
        b = before if isinstance(before, dict) else {}
        return {k: diff(b.get(k), v) for k, v in after.items()}
    if isinstance(after, bool) or not isinstance(after, (int, float)):
        return after
    return after - (
        before if isinstance(before, (int, float)) and not isinstance(before, bool) else 0
    )


def sum_deltas(deltas: list[dict]) -> dict:
    """The sum of several :func:`diff` results of the same testbed (e.g. one per repetition)."""
    out: dict = {}
    for d in deltas:
        out = _add(out, d)
    return out


def _add(a, b):
    if isinstance(b, dict):
        a = a if isinstance(a, dict) else {}
        return {k: _add(a.get(k), b.get(k)) for k in set(a) | set(b)}
    if isinstance(b, bool) or not isinstance(b, (int, float)):
        return b if b is not None else a
    return (a if isinstance(a, (int, float)) and not isinstance(a, bool) else 0) + b


_QUEUE_RE = re.compile(r"^(rx|tx)_queue_\d+_(.*)$")


def ethtool_totals(stats: dict[str, int]) -> dict[str, int]:
    """Per-queue ethtool counters summed over queues: rx_queue_0_drops + rx_queue_1_drops ->
    rx_drops; counters without a queue number are kept as they are."""
    out: dict[str, int] = {}
    for k, v in stats.items():
        m = _QUEUE_RE.match(k)
        key = f"{m.group(1)}_{m.group(2)}" if m else k
        out[key] = out.get(key, 0) + v
    return out


# --- attribution ----------------------------------------------------------------------------
CAUSES = (
    "tbf_qdisc",
    "veth_xdp_ring",
    "socket_rcvbuf",
    "send_refused",
    "aggregator_drop",
    "injected_loss",
    "spurious",
    "unexplained",
)
"""What a retransmission can be attributed to (the keys of :attr:`Attribution.causes`):

* ``tbf_qdisc``: a datagram or result dropped by a tbf qdisc on a worker link;
* ``veth_xdp_ring``: dropped between veth ends: a full ptr_ring (NAPI/XDP receive) or receive
  backlog (netdev_max_backlog: rx_dropped of the receiving end), a failed XDP_TX or
  ndo_xdp_xmit, a device that could not transmit;
* ``socket_rcvbuf``: a result the worker's namespace dropped at UDP receive (InErrors:
  RcvbufErrors, MemErrors, checksum);
* ``send_refused``: sends the kernel refused (engine ``send_errors``, one per refused call),
  other than those a tbf qdisc on the worker's own link dropped;
* ``aggregator_drop``: dropped by the aggregator's program (its ``drop_*`` reasons);
* ``injected_loss``: dropped by the testbed's nftables loss rules;
* ``spurious``: nothing was lost, the timer expired before the result came back;
* ``unexplained``: retransmissions no counter accounts for (should stay 0).

A datagram lost upstream of the aggregator stalls its slot for every worker, and a lost result
holds back its worker's next packet in that slot, so the others' timers expire too
("collateral" retransmissions, whose own copies did arrive): those are attributed to the cause
of the loss that stalled the slot.
"""

_UP_CHAINS, _DOWN_CHAINS = ("loss_up",), ("loss_down",)
_DUP_CHAINS = ("dup_up",)


@dataclass
class Attribution:
    """Retransmissions by cause, and how they were derived.

    ``causes``: cause -> retransmissions (floats rounded to integers; they sum to the
    retransmissions). ``detail``: the identities used (datagrams sent, lost before the
    aggregator, aggregator duplicates, counted drops upstream and downstream by cause,
    collateral, where ``spurious`` came from) and every non-zero drop counter, for a reader who
    wants to check.
    """

    causes: dict[str, int]
    detail: dict

    def to_dict(self) -> dict:
        return {"causes": self.causes, "detail": self.detail}

    def dominant(self) -> str | None:
        """The cause with the most retransmissions (None when there were none)."""
        best = max(self.causes.items(), key=lambda kv: kv[1], default=(None, 0))
        return best[0] if best[1] > 0 else None


def _get(d: dict, *path, default=0):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return default
        d = d[p]
    return d


def _pair_loss(delta: dict, a: list[str], b: list[str]) -> int:
    """Drops on the veth pair a -> b: max of a's tx_dropped and b's rx_dropped. The kernel's
    veth statistics count XDP_TX and ndo_xdp_xmit failures on both ends of a pair (as tx on one
    end and rx on the other), so adding them would count a drop twice."""
    tx = _get(delta, "ns", a[0], "link", a[1], "tx_dropped")
    rx = _get(delta, "ns", b[0], "link", b[1], "rx_dropped")
    return max(tx, rx, 0)


def _nft_datagrams(c: dict, datagram_bytes: int | None) -> float:
    """Datagrams in an nft counter: rules act on skbs (a GSO send or a GRO merge is one), so
    with the datagram size known the bytes say how many datagrams were dropped."""
    if not c:
        return 0.0
    if datagram_bytes and datagram_bytes > 28:
        # an skb of k datagrams holds one IPv4 + UDP header (and at egress an Ethernet header)
        # and k payloads
        skbs = float(c.get("packets", 0))
        return max(skbs, (c.get("bytes", 0) - 28 * skbs) / (datagram_bytes - 28))
    return float(c.get("packets", 0))


def _workers_agg(delta: dict) -> dict[str, int] | None:
    """The aggregator's per-worker counters summed over jobs and workers, or None."""
    agg = delta.get("aggregator")
    if not agg:
        return None
    tot: dict[str, int] = {}
    for job in (agg.get("jobs") or {}).values():
        for w in (job.get("workers") or {}).values():
            for k, v in w.items():
                tot[k] = tot.get(k, 0) + v
    return tot


def _agg_reason(delta: dict, reason: str) -> int:
    jobs = (delta.get("aggregator") or {}).get("jobs") or {}
    return sum((j.get("reasons") or {}).get(reason, 0) for j in jobs.values())


def _agg_drops(delta: dict) -> int:
    agg = delta.get("aggregator") or {}
    rows = [agg.get("unattributed") or {}] + [
        j.get("reasons") or {} for j in (agg.get("jobs") or {}).values()
    ]
    return sum(v for row in rows for k, v in row.items() if k.startswith("drop_"))


def attribute(
    delta: dict, layout: Layout, engine: list[dict], datagram_bytes: int | None = None
) -> Attribution:
    """Attribute the workers' retransmissions over a span to causes (:data:`CAUSES`).

    ``delta``: :func:`diff` of snapshots around the span (with the aggregator's counters for a
    per-worker account; taken while the job exists). ``engine``: each worker's engine statistics
    over the same span (differences of ``comm.stats``: retransmissions, packets_sent,
    send_errors, and ``spurious`` when the engine counts it), ``engine[i]`` being the worker in
    ``layout.workers[i]``. ``datagram_bytes``: the size of
    one contribution on the wire (IP and UDP headers included), to count nft drops of GSO/GRO
    skbs in datagrams; by default from the engine's bytes_sent / packets_sent.

    The account, per span: every datagram a worker sends is either lost before the aggregator
    counts it (L = sent - the aggregator's per-worker packets; spread over the upstream drop
    counters in proportion), dropped by the aggregator, a new contribution, or a duplicate of a
    contribution already counted. So retransmissions = L + aggregator drops + duplicates. A
    duplicate's original arrived: its result was lost on the way down (downstream drop
    counters, a drop before the bridge's flood counting once per worker), or its slot waited
    for another worker's lost datagram or result (collateral, at most n-1 per loss: a worker
    that lost a result also holds back the packet that would reuse its slot), or the timer was
    early (spurious). With the engine's ``spurious`` statistic, that is the spurious
    count and the rest of the duplicates is collateral; without it, collateral takes up to its
    bound and the rest is spurious. Without the aggregator's counters, the duplicates are what
    the counted upstream drops leave.
    """
    n = len(layout.workers)
    R = float(sum(e.get("retransmissions", 0) for e in engine))
    S = float(sum(e.get("packets_sent", 0) for e in engine))
    if datagram_bytes is None and S > 0 and sum(e.get("bytes_sent", 0) for e in engine) > 0:
        # UDP payload per datagram (the engine's bytes_sent), plus the IPv4 and UDP headers
        datagram_bytes = sum(e.get("bytes_sent", 0) for e in engine) / S + 28

    def ns(i: int) -> str:
        return layout.workers[i]

    def nft(i: int, chains) -> float:
        return sum(
            _nft_datagrams(_get(delta, "ns", ns(i), "nft", ch, default={}), datagram_bytes)
            for ch in chains
        )

    up = {c: 0.0 for c in CAUSES}
    down = {c: 0.0 for c in CAUSES}
    for i in range(n):
        w_if = [ns(i), "eth0"]
        port = layout.down_ports[i] if i < len(layout.down_ports) else None
        up["tbf_qdisc"] += _get(delta, "ns", ns(i), "qdisc", "eth0", "drops")
        up["injected_loss"] += nft(i, _UP_CHAINS)
        down["injected_loss"] += nft(i, _DOWN_CHAINS)
        down["socket_rcvbuf"] += _get(delta, "ns", ns(i), "udp", "InErrors")
        if port:
            if layout.topology == "one-arm":  # XDP_TX'd results bypass the aggregator's qdiscs
                down["tbf_qdisc"] += _get(delta, "ns", port[0], "qdisc", port[1], "drops")
            up["veth_xdp_ring"] += _pair_loss(delta, w_if, port)
            down["veth_xdp_ring"] += _pair_loss(delta, port, w_if)
    if layout.agg_port:  # one-arm: the aggregator's own link, both directions
        agg_if = [layout.aggregator, layout.agg_ifnames[0]]
        up["tbf_qdisc"] += _get(
            delta, "ns", layout.agg_port[0], "qdisc", layout.agg_port[1], "drops"
        )
        up["veth_xdp_ring"] += _pair_loss(delta, layout.agg_port, agg_if)
        down["veth_xdp_ring"] += n * _pair_loss(delta, agg_if, layout.agg_port)  # before the flood
    for i, e in enumerate(engine[:n]):
        # A tbf drop at the worker's own egress is returned to the sender (ENOBUFS: a refused
        # send in the engine, SndbufErrors in the namespace): count it once, as tbf's.
        tbf_own = _get(delta, "ns", ns(i), "qdisc", "eth0", "drops")
        up["send_refused"] += max(0.0, e.get("send_errors", 0) - tbf_own)
    injected_dups = sum(nft(i, _DUP_CHAINS) for i in range(n))

    agg_w = _workers_agg(delta)
    agg_drops = _agg_drops(delta)
    detail: dict = {"workers": n, "retransmissions": int(R), "packets_sent": int(S)}
    if agg_w is not None and agg_w.get("packets", 0) > 0:
        lost = max(0.0, S + injected_dups - agg_w["packets"])
        dups = max(0.0, agg_w.get("duplicates", 0) - injected_dups)
        detail.update(lost_before_aggregator=int(lost), aggregator_duplicates=int(dups))
        src = "aggregator"
    else:
        lost = sum(v for c, v in up.items() if c != "aggregator_drop")
        dups = max(0.0, R - lost - agg_drops)
        src = "counters"
    counted_up = sum(up.values())
    # Upstream: the exact loss L, spread over the counters that saw it (they count skbs: a GSO
    # send dropped by tbf or nft is one), or unexplained when none did.
    up_events = {c: 0.0 for c in CAUSES}
    if counted_up > 0:
        for c, v in up.items():
            up_events[c] = lost * v / counted_up
    else:
        up_events["unexplained"] = lost
    up_events["aggregator_drop"] += agg_drops
    n_up = sum(up_events.values())
    # Downstream: each lost result costs its worker one retransmission whose copy arrived.
    counted_down = sum(down.values())
    scale = min(1.0, dups / counted_down) if counted_down else 0.0
    down_events = {c: v * scale for c, v in down.items()}
    rest = max(0.0, dups - sum(down_events.values()))
    spurious_engine = [e["spurious"] for e in engine if "spurious" in e]
    if spurious_engine:
        spurious = min(rest, float(sum(spurious_engine)))
        spurious_from = "engine"
    else:
        spurious = max(0.0, rest - (n - 1) * (n_up + sum(down_events.values())))
        spurious_from = "aggregator duplicates" if src == "aggregator" else "counters"
    collateral = rest - spurious
    causes = {c: up_events[c] + down_events[c] for c in CAUSES}
    n_loss = sum(causes.values())
    if collateral > 0:
        if n_loss > 0:
            for c in CAUSES:
                causes[c] += collateral * (up_events[c] + down_events[c]) / n_loss
        else:
            causes["unexplained"] += collateral
    causes["spurious"] += spurious
    # What the identities do not cover (e.g. duplicates and losses that straddle the span)
    residual = R - sum(causes.values())
    causes["unexplained"] += residual
    detail.update(
        source=src,
        spurious_from=spurious_from,
        collateral=round(collateral),
        upstream_counted={c: v for c, v in up.items() if v},
        downstream_counted={c: v for c, v in down.items() if v},
        aggregator_drops=agg_drops,
        injected_duplicates=injected_dups,
        # how the duplicates met the aggregator: their slot still waiting for another worker's
        # contribution (dropped), or complete (answered with the stored result)
        duplicates_while_pending=_agg_reason(delta, "dup_pending"),
        duplicates_answered=_agg_reason(delta, "retx_answered"),
        counters=drop_counters(delta),
    )
    return Attribution(_round_to_total({c: causes[c] for c in CAUSES}, int(R)), detail)


def _round_to_total(values: dict[str, float], total: int) -> dict[str, int]:
    """Round to integers that still sum to ``total`` (largest remainders first)."""
    floors = {k: int(max(0.0, v)) for k, v in values.items()}
    short = total - sum(floors.values())
    order = sorted(values, key=lambda k: -(max(0.0, values[k]) - floors[k]))
    for k in order[: max(0, short)]:
        floors[k] += 1
    if short < 0:  # negative residuals rounded away: take from "unexplained" first
        floors["unexplained"] += short
    return floors


_DROP_KEY = re.compile(r"drop|err|Errors|overlimits|requeues|squeeze", re.IGNORECASE)
_AGG_KEY = re.compile(r"^drop|dup|answered|^dropped$|^duplicates$")


def drop_counters(delta: dict) -> dict[str, int]:
    """Every non-zero drop-like counter of a :func:`diff`, flattened to "ns/section/dev/key"
    (qdisc drops and overlimits, link dropped and errors, ethtool drops and errors, UDP errors,
    nft rule counters, softnet drops, the aggregator's non-pass reasons)."""
    out: dict[str, int] = {}

    def walk(d, path):
        if isinstance(d, dict):
            for k, v in d.items():
                walk(v, path + [str(k)])
        elif isinstance(d, (int, float)) and not isinstance(d, bool) and d:
            leaf = path[-1]
            if path[0] == "aggregator":
                keep = _AGG_KEY.search(leaf) is not None
            else:
                keep = "nft" in path[2:3] or _DROP_KEY.search(leaf) is not None
            if keep:
                out["/".join(path)] = d

    walk(delta, [])
    # the aggregator's XDP_DROP verdicts include every contribution it consumed: not loss
    return {k: v for k, v in out.items() if not k.endswith("xdp_drops")}
