"""Reordering on a worker's uplink: a random share of its frames held back and sent late.

netem is not built on this kernel, and neither are fq or etf (the qdiscs that delay a frame
until its time stamp): no qdisc here holds a frame for a while. So the testbed builds the delay
line itself, in two pieces, on each worker's ``eth0`` egress:

* **the choice**, in the kernel: a tc classifier (clsact egress, direct action) picks each frame
  of the traffic loss_scope names (UDP to ports 0xBEE0-0xBEEF, or every IPv4 frame) with
  probability ``p`` and redirects it to ``rd0``, one end of a veth pair in the worker's namespace;
  every other frame goes on as before, so the bulk of the traffic never leaves the kernel.
* **the delay**, in a small process per worker (:mod:`netns_testbed.delayline`, started and
  ended by the Testbed like any process it runs): it reads the held frames on ``rd1``, the pair's
  other end, with an AF_PACKET socket, and after ``delay`` sends each on ``eth0`` again with
  PACKET_QDISC_BYPASS, which skips the classifier (so a frame is held at most once), the rate
  limit and the nftables loss hook (so a held frame is never lost as well).

Frames that left later overtake the held one: that is the reordering, as netem's
``delay D reorder`` makes it, though from the other side (netem sends the chosen frames at once
and delays the rest). Two held frames keep their order between them.
UDP GSO batches are one frame here (the socket reads and writes them with a virtio-net header,
and the kernel cuts them on the way out), as for loss. AF_XDP senders skip the egress path, so
their frames are never held.

Counts (:func:`held_frames`): ``rd0``'s transmitted frames are the frames chosen.
"""

from __future__ import annotations

import os
import sys

from pyroute2 import IPRoute

from xdp_agg import bpfsys
from xdp_agg.bpfsys.insn import (
    BPF_ADD,
    BPF_ALU64_IMM,
    BPF_EMIT_CALL,
    BPF_EXIT_INSN,
    BPF_H,
    BPF_JGT,
    BPF_JMP_IMM,
    BPF_JMP_REG,
    BPF_JNE,
    BPF_LDX_MEM,
    BPF_MOV64_IMM,
    BPF_MOV64_REG,
    BPF_W,
    assemble,
)

from .xdp_pass import agg_udp_match, chance_insns

DEFAULT_DELAY = 0.0005  # seconds a held frame waits: a few round trips of the quiet testbed
HOLD, HELD = "rd0", "rd1"  # the veth pair in each worker namespace: chosen frames go to HOLD
PROG_TYPE_SCHED_CLS = 3
TC_ACT_OK = 0
_FUNC_REDIRECT = 23
_CLSACT_EGRESS = 0xFFFFFFF3  # TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_EGRESS)
_SKB_DATA, _SKB_DATA_END = 76, 80  # offsetof(struct __sk_buff, data / data_end)


def check_delay(delay: float) -> float:
    """``delay`` (seconds) as float, or ValueError outside 0 < delay <= 1."""
    try:
        delay = float(delay)
    except (TypeError, ValueError):
        raise ValueError(f"reorder_delay must be seconds, got {delay!r}") from None
    if not 0.0 < delay <= 1.0:
        raise ValueError(f"reorder_delay must be in (0, 1] seconds, got {delay}")
    return delay


def choice_insns(p: float, hold_ifindex: int, scope: str) -> list[int]:
    """A tc classifier (direct action) that redirects each frame of ``scope``'s traffic to
    interface ``hold_ifindex`` with probability ``p`` and lets every other frame pass."""
    r0, r1, r2, r3, r4, r5 = range(6)
    if scope == "all":
        match = [
            BPF_MOV64_REG(r4, r2),
            BPF_ALU64_IMM(BPF_ADD, r4, 14),
            BPF_JMP_REG(BPF_JGT, r4, r3, "pass"),  # no Ethernet header: pass
            BPF_LDX_MEM(BPF_H, r5, r2, 12),
            BPF_JMP_IMM(BPF_JNE, r5, 0x0008, "pass"),  # IPv4, read in network order
        ]
    else:
        match = agg_udp_match(port_offset=36)  # the destination port
    return assemble(
        [
            BPF_LDX_MEM(BPF_W, r2, r1, _SKB_DATA),
            BPF_LDX_MEM(BPF_W, r3, r1, _SKB_DATA_END),
            *match,
            *chance_insns(p),
            BPF_MOV64_IMM(r1, hold_ifindex),
            BPF_MOV64_IMM(r2, 0),
            BPF_EMIT_CALL(_FUNC_REDIRECT),  # r0 = TC_ACT_REDIRECT
            BPF_EXIT_INSN(),
            "pass",
            BPF_MOV64_IMM(r0, TC_ACT_OK),
            BPF_EXIT_INSN(),
        ]
    )


def install(netns: str, dev: str, p: float, scope: str) -> None:
    """Make the hold pair in ``netns`` (if missing) and put the choice on ``dev``'s egress,
    replacing an earlier one; ``p`` 0 removes the choice (the pair stays, unused)."""
    with IPRoute(netns=netns) as ipr:
        if not ipr.link_lookup(ifname=HOLD):
            ipr.link("add", ifname=HOLD, kind="veth", peer=HELD)
        for name in (HOLD, HELD):
            ipr.link("set", index=ipr.link_lookup(ifname=name)[0], state="up")
        index = ipr.link_lookup(ifname=dev)[0]
        try:
            ipr.tc("del", "clsact", index=index)
        except Exception:  # noqa: BLE001 - none there yet
            pass
        if p <= 0:
            return
        ipr.tc("add", "clsact", index=index)
        fd = bpfsys.prog_load(
            PROG_TYPE_SCHED_CLS,
            choice_insns(p, ipr.link_lookup(ifname=HOLD)[0], scope),
            "tb_reorder",
        )
        try:
            ipr.tc(
                "add-filter",
                "bpf",
                index=index,
                handle=":1",
                fd=fd,
                name="tb_reorder",
                parent=_CLSACT_EGRESS,
                classid=1,
                direct_action=True,
            )
        finally:
            os.close(fd)  # the filter holds the program now


def held_frames(netns: str) -> int:
    """Frames chosen for holding on this worker so far (``rd0``'s transmitted frames)."""
    with IPRoute(netns=netns) as ipr:
        found = ipr.link_lookup(ifname=HOLD)
        if not found:
            return 0
        stats = ipr.get_links(found[0])[0].get_attr("IFLA_STATS64")
        return int(stats["tx_packets"]) if stats else 0


def argv(dev: str, delay: float) -> list[str]:
    """The delay line's command line for a worker whose uplink is ``dev``."""
    return [sys.executable, "-m", "netns_testbed.delayline", "--out", dev, "--delay", repr(delay)]
