"""The AF_XDP data path's addresses (the socket is hostlib/_xsk.c).

With data_path "afxdp" or "auto" the C loop sends and receives its job's packets through an
AF_XDP socket on the interface towards the aggregator instead of the kernel's UDP socket: the
frames it builds carry the bytes the kernel would put there (Ethernet to the next hop's MAC,
IPv4 with DF, the socket's TTL and TOS, UDP from the data socket's port; the UDP checksum is 0,
"none", where the kernel leaves veth a partial one and a NIC fills it in), and a small XDP
program on that interface redirects the results (UDP to the data port) to the socket and passes
everything else. The data socket stays open: it keeps the port, takes the results that arrive on
another receive queue, and is the whole path when AF_XDP cannot run. With lanes, each lane has
its own AF_XDP socket on the same queue, and so has each lane of a 16-bit companion job
(hostlib.communicator): every AF_XDP socket of the process on the queue shares one UMEM and one
program, which redirects by destination port (hostlib/_xsk.c).

    "udp"    the kernel socket (the default; HostOptions.data_path)
    "auto"   AF_XDP where it can run, else the kernel socket, with the reason in comm.stats
    "afxdp"  AF_XDP or an error saying why not

spec() finds what the socket needs, or says why there is nothing to find (the loopback, an
aggregator on this host, no neighbour entry); the C side says why a socket could not be made
(no privilege, no AF_XDP, the interface has another XDP program).
"""

from __future__ import annotations

import ipaddress
import socket
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyroute2 import IPRoute

DATA_PATHS = ("udp", "auto", "afxdp")  # HostOptions.data_path

# neighbour states with a usable link-layer address (include/uapi/linux/neighbour.h)
_NUD_VALID = 0x02 | 0x04 | 0x08 | 0x10 | 0x40 | 0x80  # REACHABLE STALE DELAY PROBE NOARP PERM
_RTN_UNICAST = 1
_ARPHRD_ETHER = 1


def spec(
    sock: socket.socket,
    data_address: tuple[str, int],
    lane: int = 0,
    lanes: int = 1,
    zerocopy: bool = True,
    mode: str = "",
) -> dict[str, object] | str:
    """The xsk argument of _fastpath.Engine for the data socket `sock` (of lane `lane` of
    `lanes`: its port is the lanes' first port + lane) sending to the aggregator's
    `data_address`: the fields of the C side's XskConfig by name (hostlib/_xsk.h), or a str:
    why AF_XDP has nothing to run on here."""
    agg_ip = data_address[0]
    if ipaddress.ip_address(agg_ip).is_loopback:
        return "the aggregator is on the loopback"
    try:
        from pyroute2 import IPRoute  # a project dependency, imported late: rarely needed
    except ImportError:
        return "pyroute2 is not installed"
    with IPRoute() as ipr:
        route = ipr.route("get", dst=agg_ip)[0]
        if route["type"] != _RTN_UNICAST:
            return f"the aggregator {agg_ip} is not reached through an interface (local route)"
        oif = route.get_attr("RTA_OIF")
        link = ipr.get_links(oif)[0]
        ifname = link.get_attr("IFLA_IFNAME")
        if link["ifi_type"] != _ARPHRD_ETHER:
            return f"{ifname} is not an Ethernet interface"
        nexthop = route.get_attr("RTA_GATEWAY") or agg_ip
        dst_mac = _neighbour(ipr, oif, nexthop)
        if dst_mac is None:
            return f"no neighbour entry for {nexthop} on {ifname}"
        src_mac = link.get_attr("IFLA_ADDRESS")
        src_ip, src_port = sock.getsockname()
        if src_ip == "0.0.0.0":
            src_ip = route.get_attr("RTA_PREFSRC")
    ttl = sock.getsockopt(socket.IPPROTO_IP, socket.IP_TTL)
    tos = sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS)
    return {
        "ifindex": oif,
        "queue": 0,
        "src_mac": _mac(src_mac),
        "dst_mac": _mac(dst_mac),
        "src_ip": src_ip,
        "src_port": src_port,
        "ttl": ttl,
        "tos": tos,
        "zerocopy": zerocopy,
        "mode": mode,
        "lane": lane,
        "lanes": lanes,
    }


def _mac(text: str) -> bytes:
    return bytes(int(b, 16) for b in text.split(":"))


def _neighbour(ipr: IPRoute, oif: int, ip: str, wait: float = 1.0) -> str | None:
    """The link-layer address of `ip` on interface `oif`; when the table has none, one empty
    datagram to its discard port makes the kernel resolve it (for up to `wait` s)."""
    deadline = time.monotonic() + wait
    probed = False
    while True:
        for n in ipr.get_neighbours(ifindex=oif, dst=ip):
            mac = n.get_attr("NDA_LLADDR")
            if mac and n["state"] & _NUD_VALID:
                return mac
        if time.monotonic() > deadline:
            return None
        if not probed:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:
                    s.sendto(b"", (ip, 9))
                except OSError:
                    return None
            probed = True
        time.sleep(0.02)
