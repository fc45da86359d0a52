"""This host's address and MAC as the aggregator will see them."""

from __future__ import annotations

import socket


def source_ip_towards(host: str, port: int) -> str:
    """The IPv4 source address the kernel picks for packets to (host, port).

    A UDP connect() sends nothing; it only runs the route lookup, whose source address
    getsockname() then tells. That is the address the aggregator sees in our packets.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), port or 9))
        return s.getsockname()[0]


IP_MTU = 14  # <linux/in.h>: a connected socket's path MTU (getsockopt); not in Python's socket


def path_mtu_towards(host: str, port: int) -> int:
    """The MTU of the path to (host, port) as this host knows it: the route's (or the
    interface's) MTU, lowered by what path MTU discovery has learnt, read from a connected UDP
    socket (IP_MTU, ip(7)); connect() sends nothing."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), port or 9))
        return s.getsockopt(socket.IPPROTO_IP, IP_MTU)


def mac_of(ip: str) -> str:
    """MAC of the interface that holds `ip`, or all zeros if none does (e.g. 127.0.0.x).

    Only a switch-mode aggregator needs it (to address results); one-arm mode ignores it.
    """
    try:
        from pyroute2 import (
            IPRoute,  # a project dependency, imported late: rarely needed
        )

        with IPRoute() as ipr:
            for addr in ipr.get_addr(family=socket.AF_INET):
                if addr.get_attr("IFA_ADDRESS") == ip or addr.get_attr("IFA_LOCAL") == ip:
                    link = ipr.get_links(addr["index"])[0]
                    mac = link.get_attr("IFLA_ADDRESS")
                    if mac:
                        return mac
    except Exception:  # no netlink (sandbox), no pyroute2: the MAC is optional
        pass
    return "00:00:00:00:00:00"
