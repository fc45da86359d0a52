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

from .faults import AGG_PORT_HI, AGG_PORT_LO

_XDP_FLAGS_DRV_MODE = 1 << 2
_FUNC_GET_PRANDOM_U32 = 7
_ETH_IPV4_UDP = 14 + 20 + 8  # the headers the program reads (IPv4 without options)


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> int:
    """One raw eBPF instruction as a 64-bit little-endian integer."""
    return code | (dst << 8) | (src << 12) | ((off & 0xFFFF) << 16) | ((imm & 0xFFFFFFFF) << 32)


def agg_udp_match(port_offset: int) -> list:
    """Instructions that jump to ``pass`` unless the frame (data in r2, data_end in r3) is an
    unfragmented UDP over IPv4 (no options) datagram whose port at ``port_offset`` (34: source,
    36: destination) is one of 0xBEE0-0xBEEF. Uses r4 and r5."""
    ldxh, ldxb = 0x69, 0x71  # BPF_LDX | BPF_MEM | size
    jne, jgt, jlt, jgt_x = 0x55, 0x25, 0xA5, 0x2D  # BPF_JMP | op | K or X
    return [
        insn(0xBF, 4, 2),  # r4 = r2
        insn(0x07, 4, imm=_ETH_IPV4_UDP),  # r4 += 42
        to_pass(jgt_x, 4, 3),  # short frame: pass
        insn(ldxh, 5, 2, 12),
        to_pass(jne, 5, imm=0x0008),  # ethertype 0x0800, read in network order
        insn(ldxb, 5, 2, 14),
        to_pass(jne, 5, imm=0x45),  # IPv4 without options
        insn(ldxb, 5, 2, 23),
        to_pass(jne, 5, imm=17),  # UDP
        insn(ldxh, 5, 2, 20),
        insn(0x57, 5, imm=0xFF3F),  # MF and the fragment offset, in network order
        to_pass(jne, 5, imm=0),  # a fragment: pass
        insn(ldxh, 5, 2, port_offset),
        insn(0xDC, 5, imm=16),  # to host order (BPF_END | BPF_TO_BE, 16 bits)
        to_pass(jlt, 5, imm=AGG_PORT_LO),
        to_pass(jgt, 5, imm=AGG_PORT_HI),
    ]


def loss_insns(p: float) -> list[int]:
    """An XDP program: UDP over IPv4 from ports 0xBEE0-0xBEEF (the aggregator's results, unicast
    or broadcast) dropped with probability ``p`` (bpf_get_prandom_u32 below p * 2**32), every
    other frame passed. ``p`` >= 1 drops every such frame."""
    threshold = min(1 << 32, max(1, round(p * (1 << 32)))) if p > 0 else 0
    ldxw, jge_x = 0x61, 0x3D
    body = [
        insn(ldxw, 2, 1, 0),  # r2 = ctx->data
        insn(ldxw, 3, 1, 4),  # r3 = ctx->data_end
        *agg_udp_match(port_offset=34),  # the UDP source port
        insn(0x85, imm=_FUNC_GET_PRANDOM_U32),  # r0 = a random u32
        insn(0x18, 1, imm=threshold & 0xFFFFFFFF),  # r1 = threshold (64-bit immediate)
        insn(0, imm=threshold >> 32),
        to_pass(jge_x, 0, 1),  # r0 >= threshold: pass
        insn(0xB7, 0, imm=bpfsys.XDP_DROP),
        insn(0x95),
    ]
    return assemble([*body, "pass", *bpfsys.XDP_PASS_INSNS])


def to_pass(code: int, dst: int, src: int = 0, imm: int = 0) -> tuple:
    """A conditional jump to the program's pass exit (:func:`assemble` counts its offset)."""
    return (code, dst, src, "pass", imm)


def mac_filter_insns(mac: str) -> list[int]:
    """An XDP program for a host's end that receives as a NIC without promiscuous mode which
    joined no multicast group does: a frame to ``mac`` or to the broadcast passes, every other
    frame (another host's unicast, any multicast) is dropped. Its drops are the veth's
    ``rx_queue_N_xdp_drops``; a raw socket on the interface sees only what passed."""
    b = bytes.fromhex(mac.replace(":", ""))
    lo, hi = int.from_bytes(b[:4], "little"), int.from_bytes(b[4:], "little")  # as loaded
    ldxw, ldxh = 0x61, 0x69  # BPF_LDX | BPF_MEM | size
    jgt_x, jne32, jeq32 = 0x2D, 0x56, 0x16  # 32-bit compares: the immediates are not extended
    return assemble(
        [
            insn(ldxw, 2, 1, 0),  # r2 = ctx->data
            insn(ldxw, 3, 1, 4),  # r3 = ctx->data_end
            insn(0xBF, 4, 2),  # r4 = r2
            insn(0x07, 4, imm=6),  # r4 += 6: the destination MAC
            (jgt_x, 4, 3, "drop", 0),  # a runt frame: drop
            insn(ldxw, 5, 2, 0),  # w5 = its first four bytes
            insn(ldxh, 6, 2, 4),  # w6 = its last two
            (jne32, 5, 0, "broadcast?", lo),
            (jeq32, 6, 0, "pass", hi),  # our own MAC
            "broadcast?",
            (jne32, 5, 0, "drop", 0xFFFFFFFF),
            (jne32, 6, 0, "drop", 0xFFFF),
            (0x05, 0, 0, "pass", 0),  # ff:ff:ff:ff:ff:ff
            "drop",
            insn(0xB7, 0, imm=bpfsys.XDP_DROP),
            insn(0x95),
            "pass",
            *bpfsys.XDP_PASS_INSNS,
        ]
    )


def assemble(body: list) -> list[int]:
    """Raw instructions from a list of instructions, label names (where the next instruction
    is) and jumps (code, dst, src, label, imm), whose offsets are counted here."""
    labels, at = {}, 0
    for x in body:
        if isinstance(x, str):
            labels[x] = at
        else:
            at += 1
    code: list[int] = []
    for x in body:
        if isinstance(x, str):
            continue
        if isinstance(x, tuple):
            op, dst, src, label, imm = x
            x = insn(op, dst, src, labels[label] - len(code) - 1, imm)
        code.append(x)
    return code


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
