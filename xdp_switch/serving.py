"""What `xdp-agg serve` and `xdp-agg job create` decide beyond their options: the defaults a job
gets from the attached aggregator, and running the control endpoint in front of the XDP
aggregator or of bmv2. cli.py parses options and calls these.

In the one-arm topology a job's results go once to a group address (default: the subnet
broadcast of the aggregator's interface) from the interface's own address and MAC
(Delivery.GROUP_TX); in the switch topology every result is broadcast through the devmap and
addressed per port (Delivery.BROADCAST), so a job needs no group.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

from aggproto.jobs import JobSpec, WorkerSpec

from . import aggregator, links
from .errors import EnvironmentProblem, XdpAggError


def group_mac_for(ip: str) -> str:
    """The Ethernet address of an IPv4 group: 01:00:5e + the low 23 bits for a multicast
    address, else broadcast (a subnet broadcast address)."""
    addr = ipaddress.IPv4Address(ip)
    if addr.is_multicast:
        o = addr.packed
        return f"01:00:5e:{o[1] & 0x7F:02x}:{o[2]:02x}:{o[3]:02x}"
    return "ff:ff:ff:ff:ff:ff"


def _first_interface(state) -> dict:
    return links.addresses(state.interfaces[0]["ifname"])


def create_job(
    name: str,
    job_id: int,
    num_workers: int,
    elems: int,
    slot_base: int,
    slot_count: int,
    *,
    agg_port: int,
    group_ip: str = "0.0.0.0",
    group_mac: str | None = None,
    agg_ip: str | None = None,
    udp_checksum: bool = False,
    **tree,
) -> JobSpec:
    """Create a job on the attached aggregator `name`, filling what was not given from it:
    results leave from its first interface's address and MAC, to `group_ip`'s MAC (derived from
    the group address). `tree`: JobSpec's parent fields (a rack job of a two-level tree).
    Returns the spec as created."""
    backend = aggregator.XdpBackend(name)
    first = _first_interface(backend.state)
    spec = JobSpec(
        job_id=job_id,
        num_workers=num_workers,
        elems=elems,
        slot_base=slot_base,
        slot_count=slot_count,
        agg_port=agg_port,
        agg_ip=agg_ip or (first["ipv4"][0] if first["ipv4"] else "0.0.0.0"),
        agg_mac=first["mac"],
        group_ip=group_ip,
        group_mac=group_mac or group_mac_for(group_ip),
        udp_checksum=udp_checksum,
        **tree,
    )
    backend.create_job(spec)
    return spec


def serve_defaults(
    name: str, group_ip: str | None, barrier_timeout: float, udp_checksum: bool = False
) -> dict:
    """What the control endpoint puts into the jobs it creates, from the attached aggregator
    `name` (aggctl.server.ServerDefaults' fields)."""
    state, _ = aggregator.open_instance(name)
    d = {
        "pool_slots": state.pool_slots,
        "barrier_timeout": barrier_timeout,
        "udp_checksum": udp_checksum,
        "delivery": aggregator.DELIVERY[state.topology],
    }
    if state.topology == "switch":
        return d
    first = _first_interface(state)
    if not first["ipv4_nets"]:
        raise XdpAggError(
            f"{first['ifname']} has no IPv4 address, and workers need one to send to: "
            f"`ip addr add ADDR/PREFIX dev {first['ifname']}`"
        )
    net = ipaddress.IPv4Interface(first["ipv4_nets"][0])
    group_ip = group_ip or str(net.network.broadcast_address)
    d.update(
        group_ip=group_ip,
        group_mac=group_mac_for(group_ip),
        agg_ip=str(net.ip),
        agg_mac=first["mac"],
    )
    return d


def fill_worker(ws: WorkerSpec, local: tuple[str, int]) -> None:
    """RendezvousServer hook: in the switch topology, the address the worker reached the control
    endpoint at is our address on its port, the source of the results sent there."""
    ws.extra["agg_ip"] = local[0]


def _server(backend, host: str, port: int, defaults: dict, fill: Callable | None):
    from aggctl.server import RendezvousServer

    try:
        return RendezvousServer(backend, host, port, defaults, fill_worker=fill)
    except OSError as e:  # bind: the address is taken or not ours
        raise XdpAggError(
            f"cannot listen on {host}:{port}: {e.strerror or e}; stop what listens there "
            "(`ss -ltnp`) or choose another --listen"
        ) from e


def serve_xdp(
    name: str,
    host: str,
    port: int,
    *,
    group_ip: str | None = None,
    barrier_timeout: float = 120.0,
    udp_checksum: bool = False,
    announce: Callable[[str], None] = print,
    parent=None,
) -> None:
    """Run the control endpoint in front of the attached XDP aggregator `name` until
    interrupted (Ctrl-C or SIGTERM); `announce` gets one line once it listens. `parent` (a
    tree.ParentLink): every job created here is a rack of the parent's job of the same name."""
    defaults = serve_defaults(name, group_ip, barrier_timeout, udp_checksum)
    backend = aggregator.XdpBackend(name)
    if parent is not None:
        from aggctl.tree import TreeBackend

        backend = TreeBackend(backend, parent)
    server = _server(backend, host, port, defaults, fill_worker)
    announce(f"control endpoint listening on {host}:{port} (aggregator {name}); Ctrl-C stops it")
    server.run_until_interrupted()


def serve_bmv2(
    ifnames: list[str],
    workdir: str,
    host: str,
    port: int,
    *,
    netns: str | None = None,
    barrier_timeout: float = 120.0,
    announce: Callable[[str], None] = print,
) -> None:
    """Compile the P4 program, start simple_switch on `ifnames` (switch port i = the i-th) and
    run the control endpoint in front of it until interrupted; the switch stops on exit."""
    from aggctl import bmv2_backend as bm
    from aggproto.jobs import Delivery

    missing = bm.missing_tools()
    if missing:
        raise EnvironmentProblem(
            f"{', '.join(missing)} not on PATH: install p4c and bmv2 as p4/README.md says"
        )
    try:
        ports = bm.port_specs(ifnames, netns=netns)
    except ValueError as e:  # an interface that is not there
        raise XdpAggError(f"{e} (see `ip link`)") from e
    try:
        switch, backend = bm.launch(ports, workdir, netns=netns, unknown_unicast="drop")
    except bm.Bmv2Error as e:
        raise XdpAggError(f"starting bmv2 failed: {e}") from e
    try:
        server = _server(
            backend,
            host,
            port,
            {"delivery": Delivery.BROADCAST, "barrier_timeout": barrier_timeout},
            backend.fill_worker,
        )
        announce(
            f"control endpoint listening on {host}:{port} (bmv2 on {','.join(ifnames)}); "
            "Ctrl-C stops it"
        )
        server.run_until_interrupted()
    finally:
        switch.stop()
