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
  duplication rules of :mod:`netns_testbed.faults` (loss up in each worker's namespace; loss
  down, one-arm, in the bridge's, chain ``loss_down_w<i>``);

The switch topology's loss down is the XDP program on each worker's ``eth0``
(:mod:`netns_testbed.xdp_pass`): its drops are that veth's ``rx_queue_N_xdp_drops``.
:func:`down_loss` reads either for worker i.

and once per machine ``/proc/net/softnet_stat`` (backlog drops, global), plus, when given, the
XDP aggregator's counters by reason (``xdp-agg stats --json``: per job and per worker).

:func:`diff` subtracts two snapshots (bench.loss attributes a difference to causes).
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


def down_loss(delta: dict, layout: Layout, i: int) -> dict[str, int]:
    """What the testbed's downstream loss dropped toward worker ``i`` in a :func:`diff`, shaped
    as an nft rule's counter: ``{"packets", "bytes"}`` in one-arm (the bridge port's chain; a
    packet is an skb there), ``{"packets"}`` in switch (the XDP_DROP verdicts on the worker's
    ``eth0``; there a packet is one frame, one datagram: XDP sees no GSO/GRO)."""
    if layout.topology == "one-arm":
        port_ns, port = layout.down_ports[i]
        c = delta.get("ns", {}).get(port_ns, {}).get("nft", {}).get(faults.down_chain(port), {})
        return {"packets": c.get("packets", 0), "bytes": c.get("bytes", 0)}
    eth = delta.get("ns", {}).get(layout.workers[i], {}).get("ethtool", {}).get("eth0", {})
    return {"packets": sum(v for k, v in eth.items() if _XDP_DROPS.match(k))}


_XDP_DROPS = re.compile(r"^rx_queue_\d+_xdp_drops$")


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


_DROP_KEY = re.compile(r"drop|err|Errors|overlimits|requeues|squeeze", re.IGNORECASE)
_AGG_KEY = re.compile(r"^drop|dup|answered|^dropped$|^duplicates$")


def drop_counters(delta: dict, layout: Layout | None = None) -> dict[str, int]:
    """Every non-zero drop-like counter of a :func:`diff`, flattened to "ns/section/dev/key"
    (qdisc drops and overlimits, link dropped and errors, ethtool drops and errors, UDP errors,
    nft rule counters, softnet drops, the aggregator's non-pass reasons). With ``layout`` of a
    switch testbed, the workers' XDP_DROP verdicts (its downstream loss) are kept."""
    lossy = set(layout.workers) if layout and layout.topology != "one-arm" else set()
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
    return {k: v for k, v in out.items() if not k.endswith("xdp_drops") or k.split("/")[1] in lossy}
