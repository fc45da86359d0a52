"""Random loss and duplication of aggregation traffic with nftables.

netem is not built on this kernel, so faults come from nftables rules
(``numgen random``) in ``table netdev netns_testbed``, installed in each
WORKER namespace on its ``eth0`` and thus independent of the aggregator's XDP
program (whose XDP_TX/redirect frames bypass qdiscs and netfilter on the
aggregator side, but not on the receiving worker):

* loss up:   egress hook, UDP to ports 0xBEE0-0xBEEF dropped with probability p.
* loss down: UDP from ports 0xBEE0-0xBEEF dropped with p (unicast and the one-arm group
  broadcast alike) before ANY receiver on the worker sees it: in one-arm on the egress hook of
  the bridge port toward each worker (chain ``loss_down_w<i>`` in ``<prefix>sw``, here); in the
  switch topology, where the aggregator's XDP_TX'd frames skip every hook of its ``p<i>``, in
  the XDP program on the worker's ``eth0`` (:mod:`netns_testbed.xdp_pass`). Not the worker's
  own ingress hook: AF_PACKET sockets (DPDK's net_af_packet) and XDP programs (AF_XDP) see a
  frame before it, so a drop there reached only the kernel's own receivers.
* dup up:    egress hook, ``dup to "eth0"`` sends one extra copy with p.
* loss scope "all" (one-arm only): loss up and down drop every IPv4 frame on those hooks, not
  only aggregation traffic, so that a system beside it (gloo's TCP between workers) crosses
  the same loss: a frame between two workers meets its sender's loss up and its receiver's loss
  down, as a contribution and its result do. ARP stays untouched.
* dup down:  one-arm only: egress hook of the bridge port toward each worker
  (in ``<prefix>sw``), after loss down. In the switch topology the only device before the worker is
  the aggregator's ``p<i>``, whose XDP_TX/redirected frames skip its egress
  hook, and a worker's ingress hook cannot copy a frame into its own receive
  path (nft ``dup`` only transmits; this kernel's tc has no random match,
  skbedit or gact), so the switch topology has no dup down.

Why netdev hooks rather than the inet output/input hooks: a drop in the
output hook makes the sender's ``sendto`` fail with EPERM, i.e. the loss is
visible to the application; a drop in the egress hook is silent, like loss
on a wire. netdev hooks also catch AF_PACKET senders and raw receivers
(except with PACKET_QDISC_BYPASS, and AF_XDP, which skip them).

Granularity: rules act on skbs, so a UDP GSO send (one skb, many datagrams)
or a GRO-merged receive (UDP_GRO sockets) is dropped or copied as a whole.

A mark bit on the original keeps its copy from being duplicated again
(the copy inherits the mark; crossing into another namespace clears it).
"""

from __future__ import annotations

from . import nsexec

AGG_PORT_LO, AGG_PORT_HI = 0xBEE0, 0xBEEF
TABLE = "netns_testbed"
DUP_MARK = 0x40000000
# numgen's modulus is 32-bit; 1e9 gives a resolution of 1e-9 in probability.
_MOD = 1_000_000_000


def check_probability(name: str, p: float) -> float:
    """Return ``p`` as float, or raise ValueError unless 0 <= p <= 1."""
    try:
        p = float(p)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number in [0, 1], got {p!r}") from None
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name} must be in [0, 1] (0 = never, 1 = always), got {p}")
    return p


def _chance(p: float) -> str:
    """nft expression true with probability ``p`` (empty when p >= 1: always)."""
    if p >= 1.0:
        return ""
    return f"numgen random mod {_MOD} < {max(1, round(p * _MOD))} "


def _replace_table(family: str, body: str) -> str:
    # "add; delete; define" in one nft transaction: replaces the table
    # atomically whether or not it existed, and leaves none when body is empty.
    text = f"table {family} {TABLE}\ndelete table {family} {TABLE}\n"
    if body:
        text += f"table {family} {TABLE} {{\n{body}}}\n"
    return text


LOSS_SCOPES = ("aggregation", "all")  # what loss up/down drop (Testbed loss_scope)


def check_scope(scope: str) -> str:
    """``scope`` if it is one of LOSS_SCOPES, else ValueError."""
    if scope not in LOSS_SCOPES:
        raise ValueError(f"loss_scope must be one of {', '.join(LOSS_SCOPES)}, got {scope!r}")
    return scope


def worker_script(ifname: str, loss_up: float, dup_up: float, scope: str = "aggregation") -> str:
    """nft script for a worker namespace (replaces any earlier one)."""
    ports = f"{AGG_PORT_LO:#x}-{AGG_PORT_HI:#x}"
    body = ""
    if loss_up > 0:
        match = "meta protocol ip" if scope == "all" else f"udp dport {ports}"
        body += _loss_chain("loss_up", ifname, match, loss_up)
    if dup_up > 0:  # priority 10: after loss_up, so only survivors are copied
        body += _dup_chain("dup_up", ifname, f"udp dport {ports}", dup_up, priority=10)
    return _replace_table("netdev", body)


def switch_script(
    ports: list[str], dup_down: float, loss_down: float = 0.0, scope: str = "aggregation"
) -> str:
    """nft script for the one-arm bridge namespace: on each worker port's egress, loss down
    (chain ``loss_down_<port>``, priority -10: first) and dup down (``dup_<port>``)."""
    match = f"udp sport {AGG_PORT_LO:#x}-{AGG_PORT_HI:#x}"
    body = ""
    if loss_down > 0:
        lossy = "meta protocol ip" if scope == "all" else match
        body += "".join(
            _loss_chain(down_chain(p), p, lossy, loss_down, priority=-10) for p in ports
        )
    if dup_down > 0:
        body += "".join(_dup_chain(f"dup_{p}", p, match, dup_down) for p in ports)
    return _replace_table("netdev", body)


def down_chain(port: str) -> str:
    """The name of the one-arm loss-down chain on bridge port ``port`` (``w<i>``)."""
    return f"loss_down_{port}"


def _loss_chain(chain: str, dev: str, match: str, p: float, priority: int = 0) -> str:
    return (
        f'  chain {chain} {{ type filter hook egress device "{dev}" priority {priority}; '
        "policy accept;\n"
        f"    {match} {_chance(p)}counter drop\n  }}\n"
    )


def _dup_chain(chain: str, dev: str, match: str, p: float, priority: int = 0) -> str:
    return (
        f'  chain {chain} {{ type filter hook egress device "{dev}" priority {priority}; '
        "policy accept;\n"
        f"    meta mark and {DUP_MARK:#x} == 0 {match} {_chance(p)}"
        f'meta mark set meta mark or {DUP_MARK:#x} counter dup to "{dev}"\n  }}\n'
    )


def apply(netns: str, script: str) -> None:
    """Load ``script`` into ``netns`` with ``nft -f -``."""
    nsexec.check(netns, ["nft", "-f", "-"], "nft (loss/duplication rules)", input=script)


def port_loss_script(ports: list[str], loss: float) -> str:
    """nft script for the one-arm bridge namespace: loss on the named bridge ports, both ways.

    For links whose far end runs an aggregator: its XDP_TX'd frames skip its own egress hook and
    its XDP program sees a frame before its ingress hook, so rules in its own namespace (as
    worker_script puts them) would never touch the aggregation traffic. Here they sit on the
    bridge's end of the link: a frame from the aggregator meets the port's ingress hook, one to
    it the port's egress hook, each dropped with probability ``loss`` when it is UDP from or to
    0xBEE0-0xBEEF (one chance per frame and direction, whichever of its ports matches). Its own
    table (``netns_testbed_ports``), so switch_script's duplication stays as it is.
    """
    ports_range = f"{AGG_PORT_LO:#x}-{AGG_PORT_HI:#x}"
    body = ""
    if loss > 0:
        for p in ports:
            for hook in ("ingress", "egress"):
                body += (
                    f'  chain loss_{hook}_{p} {{ type filter hook {hook} device "{p}" priority 0; '
                    "policy accept;\n"
                    f"    udp dport {ports_range} {_chance(loss)}counter drop\n"
                    f"    udp sport {ports_range} udp dport != {ports_range} "
                    f"{_chance(loss)}counter drop\n  }}\n"
                )
    text = f"table netdev {PORTS_TABLE}\ndelete table netdev {PORTS_TABLE}\n"
    if body:
        text += f"table netdev {PORTS_TABLE} {{\n{body}}}\n"
    return text


PORTS_TABLE = TABLE + "_ports"


def kernel_ignores_data_script() -> str:
    """nft script for a namespace whose aggregation traffic a userspace switch takes (bmv2 reads
    its interfaces with libpcap, beside the kernel): the kernel drops UDP to 0xBEE0-0xBEEF
    instead of answering it with ICMP port unreachable. Not a fault, but the same machinery."""
    return _replace_table(
        "inet",
        "  chain input {\n"
        "    type filter hook input priority 0; policy accept;\n"
        f"    udp dport {AGG_PORT_LO:#x}-{AGG_PORT_HI:#x} drop\n"
        "  }\n",
    )
