"""Interfaces, through pyroute2: look-ups, XDP attach and detach, and entering a namespace."""

from __future__ import annotations

import ctypes as ct
import errno
import os

from pyroute2 import IPRoute, NetlinkError

from xdp_agg.errors import NeedsRoot, XdpAggError

XDP_FLAGS_UPDATE_IF_NOEXIST = 1 << 0  # refuse to replace a program already attached
XDP_FLAGS_SKB_MODE = 1 << 1  # generic XDP
XDP_FLAGS_DRV_MODE = 1 << 2  # native (driver) XDP
MODE_FLAGS = {"native": XDP_FLAGS_DRV_MODE, "skb": XDP_FLAGS_SKB_MODE}
IFF_MULTICAST = 0x1000  # net/if.h: the link supports multicast
_CLONE_NEWNET = 0x40000000


class LinkError(XdpAggError):
    """An interface operation failed; the message says what to do."""


def enter_netns(name: str) -> None:
    """Move this (single-threaded) process into a named network namespace.

    Unlike `ip netns exec`, this keeps /sys/fs/bpf, where the aggregator's pins live.
    """
    path = name if name.startswith("/") else f"/var/run/netns/{name}"
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise LinkError(f"no network namespace {name!r} (see `ip netns list`)") from None
    libc = ct.CDLL(None, use_errno=True)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            e = ct.get_errno()
            if e == errno.EPERM:
                raise NeedsRoot(f"entering network namespace {name!r}")
            raise LinkError(f"cannot enter namespace {name!r}: {os.strerror(e)}")
    finally:
        os.close(fd)


def in_netns(name: str) -> bool:
    """True when this process is in the named namespace already."""
    path = name if name.startswith("/") else f"/var/run/netns/{name}"
    try:
        return os.stat(path).st_ino == os.stat("/proc/self/ns/net").st_ino
    except FileNotFoundError:
        return False


def _link(ipr: IPRoute, ifname: str):
    idx = ipr.link_lookup(ifname=ifname)
    if not idx:
        raise LinkError(
            f"no interface {ifname!r} here (see `ip link`; use --netns for another namespace)"
        )
    return ipr.get_links(idx[0])[0]


def ifindex(ifname: str) -> int:
    with IPRoute() as ipr:
        return _link(ipr, ifname)["index"]


def xdp_prog_id(ifname: str) -> int:
    """The id of the XDP program attached to an interface, 0 if none."""
    with IPRoute() as ipr:
        xdp = _link(ipr, ifname).get_attr("IFLA_XDP")
    if not xdp:
        return 0
    return xdp.get_attr("IFLA_XDP_PROG_ID") or 0


def addresses(ifname: str) -> dict:
    """MAC and IPv4 addresses of an interface."""
    with IPRoute() as ipr:
        link = _link(ipr, ifname)
        addrs = ipr.get_addr(index=link["index"], family=2)
    ips = [a.get_attr("IFA_ADDRESS") for a in addrs]
    nets = [f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}" for a in addrs]
    return {
        "ifname": ifname,
        "ifindex": link["index"],
        "mac": link.get_attr("IFLA_ADDRESS"),
        "ipv4": ips,
        "ipv4_nets": nets,
        # IFF_MULTICAST: the link can send to and take in multicast groups (a per-job group
        # needs it; without it results go to the subnet broadcast, serving.serve_defaults)
        "multicast": bool(link["flags"] & IFF_MULTICAST),
    }


def attach_xdp(ifname: str, prog_fd: int, mode: str) -> None:
    """Attach an XDP program; refuses to replace one that is already there."""
    flags = XDP_FLAGS_UPDATE_IF_NOEXIST | MODE_FLAGS[mode]
    try:
        with IPRoute() as ipr:
            idx = _link(ipr, ifname)["index"]
            ipr.link(
                "set",
                index=idx,
                xdp={"attrs": [("IFLA_XDP_FD", prog_fd), ("IFLA_XDP_FLAGS", flags)]},
            )
    except NetlinkError as e:  # the kernel's errno is e.code
        if e.code == errno.EPERM:
            raise NeedsRoot(f"attaching XDP to {ifname}") from e
        if e.code == errno.EBUSY:
            raise LinkError(f"another XDP program is already attached to {ifname}") from e
        if e.code == errno.ERANGE:  # veth: "Peer MTU is too large to set XDP"
            raise LinkError(
                f"{ifname} (or its veth peer) has an MTU larger than a page holds, which an XDP "
                "program without multi-buffer support cannot take: attach with --frags, or "
                "lower the MTU to 3506 or less"
            ) from e
        if e.code == errno.EOPNOTSUPP and mode == "native":
            raise LinkError(f"{ifname}'s driver has no native XDP: use --xdp-mode skb") from e
        raise LinkError(f"attaching XDP to {ifname} failed: {e}") from e


def detach_xdp(ifname: str, expected_prog_id: int) -> bool:
    """Remove the XDP program from an interface if it is still ours; False if it is not."""
    cur = xdp_prog_id(ifname)
    if cur == 0 or cur != expected_prog_id:
        return False
    with IPRoute() as ipr:
        idx = _link(ipr, ifname)["index"]
        link = ipr.get_links(idx)[0]
        mode = link.get_attr("IFLA_XDP").get_attr("IFLA_XDP_ATTACHED")
        flags = XDP_FLAGS_SKB_MODE if mode == "xdpgeneric" else XDP_FLAGS_DRV_MODE
        attrs = {"attrs": [("IFLA_XDP_FD", -1), ("IFLA_XDP_FLAGS", flags)]}
        try:
            ipr.link("set", index=idx, xdp=attrs)
        except NetlinkError as e:
            if e.code == errno.EPERM:
                raise NeedsRoot(f"detaching XDP from {ifname}") from e
            raise LinkError(f"detaching XDP from {ifname} failed: {e}") from e
    return True


# linux/neighbour.h NUD_*: entries whose link-layer address can be used
_NUD_VALID = 0x02 | 0x04 | 0x08 | 0x10 | 0x40 | 0x80  # REACHABLE STALE DELAY PROBE NOARP PERMANENT


def neighbour_mac(ip: str, oif: int) -> str | None:
    """The link-layer address the neighbour table holds for `ip` on interface `oif`, or None."""
    with IPRoute() as ipr:
        for n in ipr.get_neighbours(ifindex=oif, dst=ip):
            mac = n.get_attr("NDA_LLADDR")
            if mac and n["state"] & _NUD_VALID:
                return mac
    return None
