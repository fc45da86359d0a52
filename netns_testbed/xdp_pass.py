"""A two-instruction XDP_PASS program for the veth ends that receive XDP_TX'd or redirected frames.

A veth drops frames sent to it by its peer's XDP program unless it runs NAPI, which it does when
it has an XDP program of its own (toggling GRO did not enable it on this kernel). So the testbed
puts this program on exactly the ends that face an aggregator interface, and nowhere else (an
XDP program on a veth costs its peer TSO, which would slow TCP baselines).
"""

from __future__ import annotations

import ctypes as ct
import os
import platform

from pyroute2 import IPRoute

_NR_BPF = {"x86_64": 321, "aarch64": 280}.get(platform.machine(), 321)
_PROG_LOAD, _PROG_TYPE_XDP, _XDP_PASS = 5, 6, 2
_XDP_FLAGS_DRV_MODE = 1 << 2


class _ProgLoad(ct.Structure):
    _fields_ = [
        ("prog_type", ct.c_uint32),
        ("insn_cnt", ct.c_uint32),
        ("insns", ct.c_uint64),
        ("license", ct.c_uint64),
        ("log_level", ct.c_uint32),
        ("log_size", ct.c_uint32),
        ("log_buf", ct.c_uint64),
        ("kern_version", ct.c_uint32),
        ("prog_flags", ct.c_uint32),
        ("prog_name", ct.c_char * 16),
        ("pad", ct.c_uint8 * 64),
    ]


def load_xdp_pass() -> int:
    """Load `r0 = XDP_PASS; exit` and return its fd."""
    insns = (ct.c_uint64 * 2)(0xB7 | (_XDP_PASS << 32), 0x95)  # mov64 r0, 2 ; exit
    lic = ct.create_string_buffer(b"GPL")
    attr = _ProgLoad(_PROG_TYPE_XDP, 2, ct.addressof(insns), ct.addressof(lic))
    attr.prog_name = b"tb_xdp_pass"
    libc = ct.CDLL(None, use_errno=True)
    libc.syscall.restype = ct.c_long
    fd = libc.syscall(_NR_BPF, _PROG_LOAD, ct.byref(attr), ct.sizeof(attr))
    if fd < 0:
        e = ct.get_errno()
        raise OSError(e, f"loading the XDP_PASS program failed: {os.strerror(e)}")
    return fd


def attach_pass(ends: dict[str, list[str]]) -> None:
    """Attach the XDP_PASS program to each named interface, per namespace."""
    if not any(ends.values()):
        return
    fd = load_xdp_pass()
    try:
        for ns, ifnames in ends.items():
            with IPRoute(netns=ns) as ipr:
                for ifname in ifnames:
                    idx = ipr.link_lookup(ifname=ifname)[0]
                    ipr.link("set", index=idx, xdp={"attrs": [("IFLA_XDP_FD", fd), ("IFLA_XDP_FLAGS", _XDP_FLAGS_DRV_MODE)]})
    finally:
        os.close(fd)  # the interfaces hold the program now
