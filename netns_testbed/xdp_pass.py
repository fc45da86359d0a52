"""A two-instruction XDP_PASS program for the veth ends that receive XDP_TX'd or redirected frames.

A veth drops frames sent to it by its peer's XDP program unless it runs NAPI, which it does when
it has an XDP program of its own (toggling GRO did not enable it on this kernel). So the testbed
puts this program on exactly the ends that face an aggregator interface, and nowhere else (an
XDP program on a veth costs its peer TSO, which would slow TCP baselines).
"""

from __future__ import annotations

import os

from pyroute2 import IPRoute

import bpfsys

_XDP_FLAGS_DRV_MODE = 1 << 2


def attach_pass(ends: dict[str, list[str]], frags: bool = False) -> None:
    """Attach the XDP_PASS program to each named interface, per namespace. `frags`: load it as
    a multi-buffer program (BPF_F_XDP_HAS_FRAGS), which veth requires once the link's MTU is
    above what one page holds (the testbed's jumbo MTUs)."""
    if not any(ends.values()):
        return
    flags = bpfsys.BPF_F_XDP_HAS_FRAGS if frags else 0
    fd = bpfsys.prog_load(
        bpfsys.PROG_TYPE_XDP, bpfsys.XDP_PASS_INSNS, "tb_xdp_pass", prog_flags=flags
    )
    try:
        for ns, ifnames in ends.items():
            with IPRoute(netns=ns) as ipr:
                for ifname in ifnames:
                    idx = ipr.link_lookup(ifname=ifname)[0]
                    ipr.link(
                        "set",
                        index=idx,
                        xdp={
                            "attrs": [("IFLA_XDP_FD", fd), ("IFLA_XDP_FLAGS", _XDP_FLAGS_DRV_MODE)]
                        },
                    )
    finally:
        os.close(fd)  # the interfaces hold the program now
