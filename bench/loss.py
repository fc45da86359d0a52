"""Loss attribution for the benchmarks: a testbed's counter difference (netns_testbed.counters:
snapshot, diff) and the workers' engine statistics over the same span, turned into
retransmissions by cause (CAUSES). bench.allreduce is its user; the testbed only counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from netns_testbed.counters import Layout, down_loss, drop_counters
from xdp_agg.proto.reasons import drop_total

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
* ``injected_loss``: dropped by the testbed's loss (nftables rules; XDP drops on the way down in
  the switch topology);
* ``spurious``: nothing was lost, the timer expired before the result came back (also when
  the duplicate's slot was still waiting for another worker's late, not lost, contribution);
* ``unexplained``: retransmissions no counter accounts for (should stay 0).

A datagram lost upstream of the aggregator stalls its slot for every worker, and a lost result
holds back its worker's next packet in that slot, so the others' timers expire too
("collateral" retransmissions, whose own copies did arrive): those are attributed to the cause
of the loss that stalled the slot.
"""


_UP_CHAINS = ("loss_up",)
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
    return sum(drop_total(row) for row in rows)


def _counted(delta: dict, layout: Layout, engine: list[dict], datagram_bytes):
    """What the testbed's counters saw: drops per cause on the way up and on the way down, and
    the duplicates the nftables rules injected."""
    n = len(layout.workers)

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
        down["injected_loss"] += _nft_datagrams(down_loss(delta, layout, i), datagram_bytes)
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
    return up, down, injected_dups


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

    up, down, injected_dups = _counted(delta, layout, engine, datagram_bytes)

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
            # Nothing was lost anywhere, yet the slot of a duplicate's original was still
            # waiting: for another worker's contribution that was late, not lost (a worker
            # descheduled on a machine with more workers than CPUs). The timer expired before
            # the result came back with nothing lost: spurious, by the definition of CAUSES.
            spurious += collateral
            collateral = 0.0
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
        counters=drop_counters(delta, layout),
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
