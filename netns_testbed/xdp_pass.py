"""The XDP programs on the veth ends that receive XDP_TX'd or redirected frames.

A veth drops frames sent to it by its peer's XDP program unless it runs NAPI, which it does when
it has an XDP program of its own (toggling GRO did not enable it on this kernel). So the testbed
puts a program on exactly the ends that face an aggregator interface, and nowhere else (an XDP
program on a veth costs its peer TSO, which would slow TCP baselines): a two-instruction
XDP_PASS, or, on a worker's end when the testbed has downstream loss, the loss program below.
A test may also give a host's end the MAC filter below (:meth:`Testbed.own_mac_only`), which
receives as a NIC without promiscuous mode does.

Why downstream loss lives here in the switch topology: the aggregator's XDP_TX'd and redirected
results skip every hook of its own interface (qdisc, nftables egress), and on the worker's end
the first thing that sees a frame is this XDP program, before AF_PACKET's taps (DPDK's
net_af_packet, tcpdump) and before the nftables ingress hook. A drop here therefore reaches
every kind of receiver: the kernel's UDP socket, an AF_PACKET socket and (in principle) AF_XDP,
which cannot attach beside it (hostlib/_xsk.c refuses an interface with a program, so AF_XDP
workers run one-arm, where the loss sits on the bridge port: :mod:`netns_testbed.faults`).
The veth counts the program's XDP_DROP verdicts (``ethtool -S``: ``rx_queue_N_xdp_drops``);
nothing else on that end drops, so :mod:`netns_testbed.counters` reads them as the injected
loss.
"""

from __future__ import annotations

import os

from pyroute2 import IPRoute

from xdp_agg import bpfsys
from xdp_agg.bpfsys.insn import (
    BPF_ADD,
    BPF_ALU64_IMM,
    BPF_AND,
    BPF_B,
    BPF_EMIT_CALL,
    BPF_ENDIAN,
    BPF_EXIT_INSN,
    BPF_H,
    BPF_JEQ,
    BPF_JGE,
    BPF_JGT,
    BPF_JLT,
    BPF_JMP32_IMM,
    BPF_JMP_A,
    BPF_JMP_IMM,
    BPF_JMP_REG,
    BPF_JNE,
    BPF_LD_IMM64,
    BPF_LDX_MEM,
    BPF_MOV64_IMM,
    BPF_MOV64_REG,
    BPF_TO_BE,
    BPF_W,
    assemble,
)

from .faults import AGG_PORT_HI, AGG_PORT_LO

_XDP_FLAGS_DRV_MODE = 1 << 2
_FUNC_GET_PRANDOM_U32 = 7
_ETH_IPV4_UDP = 14 + 20 + 8  # the headers the program reads (IPv4 without options)


def agg_udp_match(port_offset: int) -> list:
    """Instructions that jump to label ``pass`` unless the frame (data in r2, data_end in r3) is
    an unfragmented UDP over IPv4 (no options) datagram whose port at ``port_offset`` (34: source,
    36: destination) is one of 0xBEE0-0xBEEF. Uses r4 and r5."""
    r2, r3, r4, r5 = range(2, 6)
    return [
        BPF_MOV64_REG(r4, r2),
        BPF_ALU64_IMM(BPF_ADD, r4, _ETH_IPV4_UDP),  # r4 += 42
        BPF_JMP_REG(BPF_JGT, r4, r3, "pass"),  # short frame: pass
        BPF_LDX_MEM(BPF_H, r5, r2, 12),
        BPF_JMP_IMM(BPF_JNE, r5, 0x0008, "pass"),  # ethertype 0x0800, read in network order
        BPF_LDX_MEM(BPF_B, r5, r2, 14),
        BPF_JMP_IMM(BPF_JNE, r5, 0x45, "pass"),  # IPv4 without options
        BPF_LDX_MEM(BPF_B, r5, r2, 23),
        BPF_JMP_IMM(BPF_JNE, r5, 17, "pass"),  # UDP
        BPF_LDX_MEM(BPF_H, r5, r2, 20),
        BPF_ALU64_IMM(BPF_AND, r5, 0xFF3F),  # MF and the fragment offset, in network order
        BPF_JMP_IMM(BPF_JNE, r5, 0, "pass"),  # a fragment: pass
        BPF_LDX_MEM(BPF_H, r5, r2, port_offset),
        BPF_ENDIAN(BPF_TO_BE, r5, 16),  # to host order
        BPF_JMP_IMM(BPF_JLT, r5, AGG_PORT_LO, "pass"),
        BPF_JMP_IMM(BPF_JGT, r5, AGG_PORT_HI, "pass"),
    ]


def chance_insns(p: float) -> list:
    """Instructions that jump to label ``pass`` unless bpf_get_prandom_u32 falls below
    p * 2**32 (``p`` >= 1: never). Uses r0 and r1."""
    threshold = min(1 << 32, max(1, round(p * (1 << 32)))) if p > 0 else 0
    r0, r1 = 0, 1
    return [
        BPF_EMIT_CALL(_FUNC_GET_PRANDOM_U32),  # r0 = a random u32
        BPF_LD_IMM64(r1, threshold),
        BPF_JMP_REG(BPF_JGE, r0, r1, "pass"),  # r0 >= threshold: pass
    ]


def loss_insns(p: float) -> list[int]:
    """An XDP program: UDP over IPv4 from ports 0xBEE0-0xBEEF (the aggregator's results, unicast
    or broadcast) dropped with probability ``p``, every other frame passed. ``p`` >= 1 drops
    every such frame."""
    r0, r1, r2, r3 = range(4)
    return assemble(
        [
            BPF_LDX_MEM(BPF_W, r2, r1, 0),  # r2 = ctx->data
            BPF_LDX_MEM(BPF_W, r3, r1, 4),  # r3 = ctx->data_end
            *agg_udp_match(port_offset=34),  # the UDP source port
            *chance_insns(p),
            BPF_MOV64_IMM(r0, bpfsys.XDP_DROP),
            BPF_EXIT_INSN(),
            "pass",
            *bpfsys.XDP_PASS_INSNS,
        ]
    )


def mac_filter_insns(mac: str) -> list[int]:
    """An XDP program for a host's end that receives as a NIC without promiscuous mode which
    joined no multicast group does: a frame to ``mac`` or to the broadcast passes, every other
    frame (another host's unicast, any multicast) is dropped. Its drops are the veth's
    ``rx_queue_N_xdp_drops``; a raw socket on the interface sees only what passed."""
    b = bytes.fromhex(mac.replace(":", ""))
    lo, hi = int.from_bytes(b[:4], "little"), int.from_bytes(b[4:], "little")  # as loaded
    r0, r1, r2, r3, r4, r5, r6 = range(7)
    # 32-bit compares (BPF_JMP32): the immediates are not sign-extended
    return assemble(
        [
            BPF_LDX_MEM(BPF_W, r2, r1, 0),  # r2 = ctx->data
            BPF_LDX_MEM(BPF_W, r3, r1, 4),  # r3 = ctx->data_end
            BPF_MOV64_REG(r4, r2),
            BPF_ALU64_IMM(BPF_ADD, r4, 6),  # r4 += 6: the destination MAC
            BPF_JMP_REG(BPF_JGT, r4, r3, "drop"),  # a runt frame: drop
            BPF_LDX_MEM(BPF_W, r5, r2, 0),  # w5 = its first four bytes
            BPF_LDX_MEM(BPF_H, r6, r2, 4),  # w6 = its last two
            BPF_JMP32_IMM(BPF_JNE, r5, lo, "broadcast?"),
            BPF_JMP32_IMM(BPF_JEQ, r6, hi, "pass"),  # our own MAC
            "broadcast?",
            BPF_JMP32_IMM(BPF_JNE, r5, 0xFFFFFFFF, "drop"),
            BPF_JMP32_IMM(BPF_JNE, r6, 0xFFFF, "drop"),
            BPF_JMP_A("pass"),  # ff:ff:ff:ff:ff:ff
            "drop",
            BPF_MOV64_IMM(r0, bpfsys.XDP_DROP),
            BPF_EXIT_INSN(),
            "pass",
            *bpfsys.XDP_PASS_INSNS,
        ]
    )


def attach_mac_filter(ends: dict[str, list[str]], frags: bool = False) -> None:
    """Attach :func:`mac_filter_insns` to each named interface, per namespace, each with its
    own MAC, replacing whatever program is there."""
    flags = bpfsys.BPF_F_XDP_HAS_FRAGS if frags else 0
    for ns, ifnames in ends.items():
        with IPRoute(netns=ns) as ipr:
            for ifname in ifnames:
                link = ipr.get_links(ifname=ifname)[0]
                insns = mac_filter_insns(link.get_attr("IFLA_ADDRESS"))
                fd = bpfsys.prog_load(
                    bpfsys.PROG_TYPE_XDP, insns, "tb_mac_filter", prog_flags=flags
                )
                try:
                    _set_xdp(ipr, link["index"], fd)
                finally:
                    os.close(fd)  # the interface holds the program now


def _set_xdp(ipr: IPRoute, index: int, fd: int) -> None:
    """Attach XDP program `fd` to interface `index` in native (driver) mode."""
    ipr.link(
        "set",
        index=index,
        xdp={"attrs": [("IFLA_XDP_FD", fd), ("IFLA_XDP_FLAGS", _XDP_FLAGS_DRV_MODE)]},
    )


def attach_pass(ends: dict[str, list[str]], frags: bool = False, loss_down: float = 0.0) -> None:
    """Attach the XDP_PASS program to each named interface, per namespace, or with ``loss_down``
    > 0 the loss program (:func:`loss_insns`), replacing whatever program is there. `frags`:
    load it as a multi-buffer program (BPF_F_XDP_HAS_FRAGS), which veth requires once the
    link's MTU is above what one page holds (the testbed's jumbo MTUs)."""
    if not any(ends.values()):
        return
    flags = bpfsys.BPF_F_XDP_HAS_FRAGS if frags else 0
    if loss_down > 0:
        fd = bpfsys.prog_load(
            bpfsys.PROG_TYPE_XDP, loss_insns(loss_down), "tb_xdp_loss", prog_flags=flags
        )
    else:
        fd = bpfsys.prog_load(
            bpfsys.PROG_TYPE_XDP, bpfsys.XDP_PASS_INSNS, "tb_xdp_pass", prog_flags=flags
        )
    try:
        for ns, ifnames in ends.items():
            with IPRoute(netns=ns) as ipr:
                for ifname in ifnames:
                    _set_xdp(ipr, ipr.link_lookup(ifname=ifname)[0], fd)
    finally:
        os.close(fd)  # the interfaces hold the program now
