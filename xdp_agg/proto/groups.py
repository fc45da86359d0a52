"""Where a job's results go in the one-arm topology: a multicast group per job.

The aggregator sends each finished sum once, to the job's group address (JobSpec.group_ip and
group_mac). By default the control endpoint gives every job a group of its own, the job id's
address in an administratively scoped block (RFC 2365, 239.0.0.0/8): job 5 with the base
239.18.0.0/24 gets 239.18.0.5. Its workers join it, and a switch with IGMP snooping (and a
querier on the segment) forwards the results only to their ports; a host that is not in the job
receives none of them. The alternative is the subnet broadcast, which every host on the segment
receives.
"""

from __future__ import annotations

import ipaddress

from .limits import MAX_JOBS

DEFAULT_GROUP_BASE = "239.18.0.0/24"  # one address per job id: 239.18.0.0 .. 239.18.0.63
# Groups a bridge or switch always floods to every port, snooping or not (RFC 4541 2.1.2: the
# local network control block); a per-job group there would reach every host.
LINK_LOCAL_BLOCK = ipaddress.IPv4Network("224.0.0.0/24")
MULTICAST = ipaddress.IPv4Network("224.0.0.0/4")


def check_group_base(base: str) -> ipaddress.IPv4Network:
    """The block `base` ("A.B.C.D/P") as a network, or ValueError saying what is wrong: it must
    be multicast, outside 224.0.0.0/24 (always flooded), and hold an address per job id."""
    try:
        net = ipaddress.IPv4Network(base, strict=True)
    except ValueError as e:
        raise ValueError(f"group base {base!r} is not an IPv4 network A.B.C.D/P: {e}") from None
    if not net.subnet_of(MULTICAST):
        raise ValueError(f"group base {base} is not multicast (224.0.0.0/4; use 239.x.y.0/24)")
    if net.overlaps(LINK_LOCAL_BLOCK):
        raise ValueError(
            f"group base {base} overlaps 224.0.0.0/24, which switches flood to every port "
            "whatever their snooping; use an administratively scoped block such as 239.18.0.0/24"
        )
    if net.num_addresses < MAX_JOBS:
        raise ValueError(
            f"group base {base} has {net.num_addresses} addresses, fewer than the {MAX_JOBS} job "
            f"ids: use a /{32 - (MAX_JOBS - 1).bit_length()} or larger"
        )
    return net


def job_group(base: str, job_id: int) -> str:
    """The multicast group of job `job_id` in the block `base`: its address number job_id."""
    net = check_group_base(base)
    if not 0 <= job_id < MAX_JOBS:
        raise ValueError(f"job id {job_id} is not in 0..{MAX_JOBS - 1}")
    return str(net.network_address + job_id)


def group_mac(ip: str) -> str:
    """The Ethernet address of a group: 01:00:5e + the low 23 bits of a multicast address
    (RFC 1112 6.4), ff:ff:ff:ff:ff:ff for anything else (a subnet broadcast address)."""
    addr = ipaddress.IPv4Address(ip)
    if addr.is_multicast:
        o = addr.packed
        return f"01:00:5e:{o[1] & 0x7F:02x}:{o[2]:02x}:{o[3]:02x}"
    return "ff:ff:ff:ff:ff:ff"
