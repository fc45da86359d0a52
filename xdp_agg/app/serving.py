"""What `xdp-agg serve` and `xdp-agg job create` decide beyond their options: the defaults a job
gets from the attached aggregator, and running the control endpoint in front of the XDP
aggregator or of bmv2. cli.py parses options and calls these.

In the one-arm topology a job's results go once to a group address from the interface's own
address and MAC (Delivery.GROUP_TX). How that address is chosen is the *results* setting:

- "multicast" (the default): each job its own multicast group, the job id's address in a block
  (xdp_agg.proto.groups, default 239.18.0.0/24); its workers join it, and a switch with IGMP
  snooping and a querier delivers the results to their ports only;
- "broadcast": the interface's subnet broadcast, which every host on the segment receives;
- "unicast": one copy of each result per worker, to its own MAC and address (Delivery.UNICAST),
  for hosts that join no group (p4app-switchML's; a NIC without promiscuous mode drops what is
  not to its MAC); the n copies cost the aggregator more than one (docs/benchmarks.md);
- or one fixed group address for every job (`--group`).

An interface without the multicast flag cannot carry per-job groups: by default the results
then go to the subnet broadcast, with a warning; asking for "multicast" explicitly is refused.
In the switch topology every result is broadcast through the devmap and addressed per port
(Delivery.BROADCAST), so a job needs no group and the setting does not apply.

The control endpoint checks a deployment secret (xdp_agg.proto.control): `secret_for` loads or
creates it, by default in the state directory (/run/xdp-agg/NAME.secret, mode 0600) so that a
restarted serve keeps it. It listens where `listen_address` says: the address given, else the
one IPv4 address of the aggregator's interfaces; 0.0.0.0 only when asked for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import ipaddress
import logging
import os
from collections.abc import Callable
from pathlib import Path

from xdp_agg.errors import Busy, EnvironmentProblem, NeedsRoot, XdpAggError
from xdp_agg.proto import control, groups
from xdp_agg.proto.jobs import DEFAULT_CONTROL_PORT, Delivery, JobSpec, WorkerSpec
from xdp_switch import backend as xdp_backend
from xdp_switch import links, pins

from . import options

log = logging.getLogger(__name__)


def default_secret_path(name: str) -> Path:
    """Where `xdp-agg --name NAME serve` keeps its deployment secret unless told otherwise."""
    return pins.state_dir() / f"{pins.check_name(name)}.secret"


def secret_for(path: str | Path) -> bytes:
    """The deployment secret in `path`, created (0600) when absent; XdpAggError when the file
    cannot be used (readable by group or others, too short, not ours to read)."""
    try:
        return control.create_secret(path)
    except control.SecretError as e:
        raise XdpAggError(str(e)) from None


def read_secret(path: str | Path) -> bytes:
    """The deployment secret in `path`, which must exist (another endpoint's: never created
    here); XdpAggError when it cannot be used."""
    try:
        return control.load_secret(path)
    except control.SecretError as e:
        raise XdpAggError(str(e)) from None


def listen_address(ifnames: list[str]) -> str:
    """The address the control endpoint listens on by default: the one IPv4 address of the
    aggregator's interfaces. XdpAggError when they have none or several (then --listen must
    choose; never a silent 0.0.0.0)."""
    found = []
    for ifname in ifnames:
        try:
            found += links.addresses(ifname)["ipv4"]
        except XdpAggError:
            continue  # an interface gone since attach: it has no address to offer
    if len(found) == 1:
        return found[0]
    if not found:
        raise XdpAggError(
            f"{', '.join(ifnames)} have no IPv4 address to listen on: give --listen ADDR:PORT "
            "(the address workers reach the aggregator at)"
        )
    raise XdpAggError(
        f"{', '.join(ifnames)} have several IPv4 addresses ({', '.join(found)}): give --listen "
        "ADDR:PORT for one, or --listen 0.0.0.0:PORT to listen on every address"
    )


def aggregator_interfaces(name: str) -> list[str]:
    """The interfaces aggregator `name` is attached to."""
    state, _ = xdp_backend.open_instance(name)
    return [i["ifname"] for i in state.interfaces]


# how one-arm results reach a job's workers: multicast, broadcast or unicast (module docstring)
RESULTS = options.RESULTS
DEFAULT_GROUP_BASE = options.DEFAULT_GROUP_BASE


def group_mac_for(ip: str) -> str:
    """The Ethernet address of an IPv4 group: 01:00:5e + the low 23 bits for a multicast
    address, else broadcast (a subnet broadcast address)."""
    return groups.group_mac(ip)


def _results_mode(first: dict, results: str | None, warn: Callable[[str], None] | None) -> str:
    """The results mode, multicast, broadcast or unicast, for interface `first`
    (links.addresses); `results` None: multicast where the interface supports it, else
    broadcast with a warning."""
    if results not in (None, *RESULTS):
        raise XdpAggError(f"results {results!r}: use one of {', '.join(RESULTS)}")
    if first.get("multicast", True) or results in ("broadcast", "unicast"):
        return results or "multicast"
    if results == "multicast":
        raise XdpAggError(
            f"{first['ifname']} has no multicast flag, so per-job multicast groups cannot reach "
            f"the workers: `ip link set {first['ifname']} multicast on`, or --results broadcast"
        )
    if warn is not None:
        warn(
            f"warning: {first['ifname']} has no multicast flag: results go to the subnet "
            "broadcast, which every host on the segment receives (--results broadcast says so "
            f"without this warning; `ip link set {first['ifname']} multicast on` gives each job "
            "its own group)"
        )
    return "broadcast"


def _subnet_broadcast(first: dict) -> str:
    if not first["ipv4_nets"]:
        raise XdpAggError(
            f"{first['ifname']} has no IPv4 address, so it has no subnet broadcast: "
            f"`ip addr add ADDR/PREFIX dev {first['ifname']}`, or give --group"
        )
    return str(ipaddress.IPv4Interface(first["ipv4_nets"][0]).network.broadcast_address)


def _first_interface(state) -> dict:
    return links.addresses(state.interfaces[0]["ifname"])


def _tree_fields(opts: options.JobOptions) -> dict:
    """JobSpec's parent fields from the options (none without --parent-address; JobOptions.check
    has made sure it is IP:PORT)."""
    if opts.parent is None:
        return {}
    from xdp_agg.ctl.tree import parse_endpoint

    parent_ip, parent_port = parse_endpoint(opts.parent)
    return dict(
        parent_ip=str(ipaddress.IPv4Address(parent_ip)),
        parent_mac=opts.parent_mac,
        parent_port=parent_port,
        parent_slot_base=opts.parent_slot_base,
        uplink_port=opts.uplink_port or opts.agg_port,
        worker_port=opts.worker_port,
        total_workers=opts.total_workers or 0,
    )


def _job_results(topology: str, first: dict, job_id: int, opts, warn) -> tuple[str, Delivery]:
    """(group address, delivery) of job `job_id` when no --group is given: none in the switch
    topology and for unicast; else the job's group in the block or the subnet broadcast."""
    if topology == "switch":
        return "0.0.0.0", xdp_backend.DELIVERY["switch"]
    mode = _results_mode(first, opts.results, warn)
    if mode == "unicast":
        return "0.0.0.0", Delivery.UNICAST
    if mode == "broadcast":
        return _subnet_broadcast(first), Delivery.GROUP_TX
    try:
        return groups.job_group(opts.group_base, job_id), Delivery.GROUP_TX
    except ValueError as e:
        raise XdpAggError(str(e)) from None


def create_job(
    name: str,
    job_id: int,
    opts: options.JobOptions,
    *,
    warn: Callable[[str], None] | None = None,
) -> JobSpec:
    """Create job `job_id` as `opts` says on the attached aggregator `name`, filling what was
    not given from it: results leave from its first interface's address and MAC, to the group
    address (one-arm, when not given: the job's group in the group block, or the subnet
    broadcast, as the results option says: see the module docstring), at that address's MAC
    unless one is given. With a parent address: a rack job of a two-level tree. Returns the spec
    as created."""
    tree = _tree_fields(opts)
    slot_base, slot_count = opts.slots
    group_ip, group_mac = opts.group_ip, opts.group_mac
    backend = xdp_backend.XdpBackend(name)
    first = _first_interface(backend.state)
    delivery = xdp_backend.DELIVERY[backend.state.topology]
    if group_ip is None:
        group_ip, delivery = _job_results(backend.state.topology, first, job_id, opts, warn)
    spec = JobSpec(
        job_id=job_id,
        num_workers=opts.num_workers,
        elems=int(opts.elems),
        slot_base=slot_base,
        slot_count=slot_count,
        agg_port=opts.agg_port,
        agg_ip=opts.agg_ip or (first["ipv4"][0] if first["ipv4"] else "0.0.0.0"),
        agg_mac=first["mac"],
        group_ip=group_ip,
        group_mac=group_mac or group_mac_for(group_ip),
        delivery=delivery,
        udp_checksum=opts.udp_checksum,
        sparse=opts.sparse,
        wire_bits=opts.wire_bits,
        **tree,
    )
    backend.create_job(spec)
    return spec


def serve_defaults(
    name: str, opts: options.ServeOptions, warn: Callable[[str], None] | None = None
) -> dict:
    """What the control endpoint puts into the jobs it creates, from the attached aggregator
    `name` and serve's options (xdp_agg.ctl.server.ServerDefaults' fields). One-arm: --group,
    if given, is every job's group; else --results (module docstring) chooses a group per job
    in --group-base or the subnet broadcast; `warn` gets the warning of a fallback to the
    broadcast."""
    group_ip = opts.group_ip
    state, _ = xdp_backend.open_instance(name)
    d: dict = {
        "pool_slots": state.pool_slots,
        "barrier_timeout": opts.barrier_timeout,
        "udp_checksum": opts.udp_checksum,
        "sparse": opts.sparse,
        "delivery": xdp_backend.DELIVERY[state.topology],
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
    d.update(agg_ip=str(net.ip), agg_mac=first["mac"])
    mode = None if group_ip is not None else _results_mode(first, opts.results, warn)
    if mode == "unicast":
        d["delivery"] = Delivery.UNICAST
        return d
    if mode == "multicast":
        try:
            d["group_base"] = str(groups.check_group_base(opts.group_base))
        except ValueError as e:
            raise XdpAggError(str(e)) from None
        return d
    group_ip = group_ip or str(net.network.broadcast_address)
    d.update(group_ip=group_ip, group_mac=group_mac_for(group_ip))
    return d


def describe_results(defaults: dict) -> str:
    """Where the jobs' results go under `defaults` (serve_defaults' answer), in words."""
    if defaults.get("group_base"):
        return f"results to a multicast group per job in {defaults['group_base']}"
    if defaults.get("group_ip"):
        return f"results of every job to {defaults['group_ip']}"
    if defaults.get("delivery") == Delivery.UNICAST:
        return "results to each worker by unicast"
    return "results per port (switch topology)"


def fill_worker(ws: WorkerSpec, local: tuple[str, int]) -> None:
    """ControlEndpoint hook: in the switch topology, the address the worker reached the control
    endpoint at is our address on its port, the source of the results sent there."""
    ws.extra["agg_ip"] = local[0]


def lock_path(name: str) -> Path:
    """The file `serve` holds an flock on for its whole life (one serve per aggregator)."""
    return pins.state_dir() / f"{name}.lock"


def jobs_path(name: str) -> Path:
    """serve's job table (xdp_agg.ctl.jobtable), rewritten atomically on every change."""
    return pins.state_dir() / f"{name}.jobs"


def hold_serve_lock(name: str) -> int:
    """Take the serve lock of aggregator `name` (an flock, released by the kernel when the
    process ends however it ends, so a crashed serve never blocks the next); returns its fd,
    to keep open. Raises Busy naming the holder when another serve has it."""
    path = lock_path(name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except PermissionError as e:
        raise NeedsRoot(f"locking {path}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            os.close(fd)
            raise XdpAggError(f"locking {path} failed: {e.strerror}") from e
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise Busy(
            f"aggregator {name!r} is already served (xdp-agg serve, pid {holder}, holds {path}): "
            f"one control endpoint per aggregator; stop that one first (`kill {holder}`), or "
            "serve another aggregator (--name)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


@dataclasses.dataclass
class SwitchmlServe:
    """Where and how `serve --switchml-grpc` serves p4app-switchML's controller API."""

    host: str
    port: int
    window: int = 512  # slots of a session's job, from 0
    barrier_timeout: float = 120.0  # longest a Barrier or Broadcast waits
    allow: tuple = ()  # the networks whose hosts may call (--switchml-allow, interface_networks)
    idle_takeover: float = 60.0  # s without traffic before another host's session may replace


def interface_networks(ifnames: list[str]) -> tuple:
    """The IPv4 subnets of interfaces `ifnames` (the default --switchml-allow); XdpAggError
    when they have none."""
    nets = []
    for ifname in ifnames:
        try:
            found = links.addresses(ifname)["ipv4_nets"]
        except XdpAggError:
            continue  # an interface gone since attach: it has no subnet to offer
        for n in found:
            net = ipaddress.IPv4Interface(n).network
            if net not in nets:
                nets.append(net)
    if not nets:
        raise XdpAggError(
            f"--switchml-grpc: {', '.join(ifnames)} have no IPv4 subnet whose hosts could be "
            "allowed to call it: give --switchml-allow CIDR[,CIDR] (the SwitchML hosts' networks)"
        )
    return tuple(nets)


def port_address_of(ifnames: list[str]) -> Callable[[str], tuple[str, str]]:
    """For the SwitchML API: our (IPv4 with its prefix length, MAC) on the interface whose
    subnet holds a worker's address (the switch topology: the port it reaches), or of the one
    interface (one-arm); the API refuses our own, the subnet's broadcast and network addresses
    and loopback ones as a worker's (xdp_agg.ctl.switchml_sessions.check_worker_ip)."""

    def find(ip: str) -> tuple[str, str]:
        found = [links.addresses(i) for i in ifnames]
        for a in found:
            for net in map(ipaddress.IPv4Interface, a["ipv4_nets"]):
                if ipaddress.IPv4Address(ip) in net.network:
                    return str(net), a["mac"]
        if len(found) == 1 and found[0]["ipv4"]:
            # ipv4_nets: the addresses of ipv4, each with its prefix length
            return str(ipaddress.IPv4Interface(found[0]["ipv4_nets"][0])), found[0]["mac"]
        raise ValueError(
            f"no interface of the aggregator ({', '.join(ifnames)}) has a subnet holding the "
            f"worker's address {ip}: give the port it reaches an address in its subnet"
        )

    return find


def bmv2_port_address(backend) -> Callable[[str], tuple[str, str]]:
    """For the SwitchML API on bmv2: our (IPv4, MAC) on the switch port whose subnet holds a
    worker's address (Bmv2Backend.uplink_address, which speaks of a parent)."""

    def find(ip: str) -> tuple[str, str]:
        try:
            return backend.uplink_address(ip)
        except ValueError:
            raise ValueError(
                f"not one port of the switch has a subnet holding the worker's address {ip}: "
                "give the port it is behind an address in its subnet"
            ) from None

    return find


@contextlib.contextmanager
def switchml_serving(sml: SwitchmlServe | None, server, port_address):
    """A context serving the SwitchML API (xdp_agg.ctl.switchml_grpc) before control endpoint
    `server` (nothing without --switchml-grpc), stopped on exit; yields the served API
    (SwitchmlServer, for the metrics) or None. EnvironmentProblem without grpcio, XdpAggError
    when it cannot bind."""
    if sml is None:
        yield None
        return
    try:
        from xdp_agg.ctl import switchml_grpc
    except ImportError as e:
        raise EnvironmentProblem(
            f"--switchml-grpc needs grpcio and protobuf ({e}): pip install 'xdp-agg[switchml]'"
        ) from e
    settings = switchml_grpc.SwitchmlSettings(
        sml.window, sml.barrier_timeout, allow=sml.allow, idle_takeover=sml.idle_takeover
    )
    api = switchml_grpc.SwitchmlApi(server.registry, settings, port_address)
    try:
        served = switchml_grpc.start_server(api, sml.host, sml.port)
    except OSError as e:
        raise XdpAggError(
            f"--switchml-grpc: {e}; stop what listens there (`ss -ltnp`) or choose another port"
        ) from e
    try:
        yield served
    finally:
        served.stop(None)


def metrics_exporting(address: tuple[str, int] | None, sources: dict):
    """xdp_agg.app.metrics.exporting (serve --metrics, the soft endpoint's too): a context yielding
    the metrics' URL, or None when `address` is None; `sources`: xdp_agg.app.metrics.Sources'
    fields. prometheus_client is an optional dependency (the `metrics` extra): imported only
    when asked for."""
    if address is None:
        return contextlib.nullcontext()
    metrics = _metrics_module()
    return metrics.exporting(address, metrics.Sources(**sources))


def _metrics_module():
    """xdp_agg.app.metrics; EnvironmentProblem without prometheus_client (an optional dependency,
    the `metrics` extra, imported only where metrics are asked for)."""
    try:
        from . import metrics
    except ImportError as e:
        raise EnvironmentProblem(
            f"metrics need the Python package prometheus_client ({e}): "
            "pip install 'xdp-agg[metrics]'"
        ) from e
    return metrics


def xdp_exposition(name: str) -> str:
    """The metrics of the attached XDP aggregator `name` (xdp_agg.app.metrics, without a control
    endpoint's), once, in Prometheus's text format: `xdp-agg stats --prometheus`."""
    backend = xdp_backend.XdpBackend(name)
    sources = dict(backend=backend, target="xdp")
    metrics = _metrics_module()
    return metrics.exposition(metrics.Sources(**sources))


def _metrics_note(url: str | None) -> str:
    """The announce line's words for where the metrics are served."""
    return f"; Prometheus metrics at {url}" if url else ""


@dataclasses.dataclass
class Endpoint:
    """Where and how serve's control endpoint listens, resolved from its options."""

    host: str
    port: int
    secret: bytes | None  # None: no authentication
    limits: object  # xdp_agg.ctl.auth.Limits
    parent: object | None  # xdp_agg.ctl.tree.ParentLink: every job a rack of the parent's
    notes: list[str]  # what to tell the operator after the "listening" line
    switchml: SwitchmlServe | None = None  # p4app-switchML's controller API, if asked for


def _stand_up(backend, ep: Endpoint, defaults: dict, **kw):
    """xdp_agg.ctl.endpoint.stand_up on `ep` (its address, secret and limits), with a bind
    failure said as what to do about it."""
    from xdp_agg.ctl.endpoint import stand_up

    try:
        return stand_up(
            backend, ep.host, ep.port, defaults, secret=ep.secret, limits=ep.limits, **kw
        )
    except OSError as e:  # bind: the address is taken or not ours
        raise XdpAggError(
            f"cannot listen on {ep.host}:{ep.port}: {e.strerror or e}; stop what listens there "
            "(`ss -ltnp`) or choose another --listen"
        ) from e


def _run_serving(
    opts: options.ServeOptions,
    ep: Endpoint,
    server,
    sources: dict,
    *,
    port_address: Callable[[str], tuple[str, str]],
    announce: Callable[[str], None],
    what: str,
) -> None:
    """Serve `server` until interrupted, with p4app-switchML's API (--switchml-grpc; a worker
    port's addresses from `port_address`) and the metrics (--metrics, of `sources`) beside it;
    `announce` gets the "listening" line, which names `what` is served in brackets."""
    metrics = (opts.metrics[0] or ep.host, opts.metrics[1]) if opts.metrics else None
    with (
        switchml_serving(ep.switchml, server, port_address) as sml,
        metrics_exporting(metrics, {**sources, "switchml": sml}) as url,
    ):
        announce(
            f"control endpoint listening on {ep.host}:{ep.port} ({what})"
            f"{_metrics_note(url)}; Ctrl-C stops it"
        )
        server.run_until_interrupted()


def serve_xdp(
    name: str,
    opts: options.ServeOptions,
    ep: Endpoint,
    *,
    announce: Callable[[str], None] = print,
    warn: Callable[[str], None] | None = None,
) -> None:
    """Run the control endpoint `ep` in front of the attached XDP aggregator `name` until
    interrupted (Ctrl-C or SIGTERM); `announce` gets one line once it listens, `warn` (default:
    announce) a warning line before it if the results fall back to the broadcast. With
    `ep.parent` every job created here is a rack of the parent's job of the same name; --metrics
    and --switchml-grpc serve Prometheus metrics and p4app-switchML's controller API beside it.

    One per aggregator (hold_serve_lock: Busy otherwise). The job table is saved to
    jobs_path(name) on every change and recovered from it (with the pinned maps) at start, so
    a restart does not end the jobs, which the data plane runs without us; stopping leaves
    them running for the next serve (`detach --force` ends them)."""
    # the configuration first: a refusal of the options is worth more than "already served"
    defaults = serve_defaults(name, opts, warn=warn or announce)
    lock = hold_serve_lock(name)
    try:
        backend = xdp_backend.XdpBackend(name)
        if ep.parent is not None:
            from xdp_agg.ctl.tree import TreeBackend

            backend = TreeBackend(backend, ep.parent)
        server, recovered = _stand_up(
            backend,
            ep,
            defaults,
            fill_worker=fill_worker,
            table=jobs_path(name),
            generation=backend.generation(),
            grace=opts.rejoin_timeout,
        )
        what = f"aggregator {name}, {describe_results(defaults)}" + (
            f"; recovered jobs {', '.join(map(repr, recovered))}" if recovered else ""
        )
        sources = dict(backend=backend, target="xdp", endpoint=server)
        port_address = port_address_of(aggregator_interfaces(name))
        _run_serving(
            opts, ep, server, sources, port_address=port_address, announce=announce, what=what
        )
    finally:
        os.close(lock)


def _launch_bmv2(ifnames: list[str], workdir: str, netns: str | None):
    """Compile the P4 program and start simple_switch on `ifnames`: (switch, Bmv2Backend)."""
    import xdp_agg.targets.bmv2 as bm

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
        return bm.launch(ports, workdir, netns=netns, unknown_unicast="drop")
    except bm.Bmv2Error as e:
        raise XdpAggError(f"starting bmv2 failed: {e}") from e


def serve_bmv2(
    opts: options.ServeOptions,
    ep: Endpoint,
    *,
    netns: str | None = None,
    announce: Callable[[str], None] = print,
) -> None:
    """Compile the P4 program, start simple_switch on --ports (switch port i = the i-th) and run
    the control endpoint `ep` in front of it until interrupted; the switch stops on exit. With
    --sparse the jobs created take sparse all-reduces too where the program runs them (32 and
    64 elements per packet). With `ep.parent` every job created here is a rack of the parent's
    job of the same name, its partial sums sent up from the port whose subnet holds the parent.
    --metrics and --switchml-grpc serve Prometheus metrics and p4app-switchML's controller API
    beside it."""
    ifnames = opts.ports.split(",")
    switch, backend = _launch_bmv2(ifnames, opts.workdir, netns)
    endpoint_backend = backend
    if ep.parent is not None:
        from xdp_agg.ctl.tree import TreeBackend

        endpoint_backend = TreeBackend(backend, ep.parent)
    defaults = {
        "delivery": Delivery.BROADCAST,
        "barrier_timeout": opts.barrier_timeout,
        "sparse": opts.sparse,
    }
    try:
        server, _ = _stand_up(endpoint_backend, ep, defaults, fill_worker=backend.fill_worker)
        rack = f", rack {ep.parent.rank} of {ep.parent.racks}" if ep.parent is not None else ""
        sources = dict(backend=endpoint_backend, target="bmv2", endpoint=server)
        port_address = bmv2_port_address(backend)
        what = f"bmv2 on {','.join(ifnames)}{rack}"
        _run_serving(
            opts, ep, server, sources, port_address=port_address, announce=announce, what=what
        )
    finally:
        switch.stop()


# --- serve: from its options to a running endpoint ----------------------------------------------
def resolve(name: str, opts: options.ServeOptions) -> Endpoint:
    """The endpoint `opts` describe for aggregator `name`: its address (the one IPv4 address
    of the aggregator's interfaces, or of the bmv2 ports, unless --listen says), its secret
    (loaded or created) and its parent link. ValueError for parent options that make no link."""
    host, port = opts.listen or ("", DEFAULT_CONTROL_PORT)
    bmv2 = opts.target == "bmv2"
    ifnames = functools.cache(
        lambda: opts.ports.split(",") if bmv2 else aggregator_interfaces(name)
    )
    if not host:
        host = listen_address(ifnames())
    notes, secret = [], None
    if opts.insecure_no_auth:
        notes.append(
            "WARNING: --insecure-no-auth: anyone who reaches this endpoint can create, join and "
            "end jobs"
        )
    else:
        path = os.path.abspath(opts.secret_file or default_secret_path(name))
        secret = secret_for(path)
        notes.append(f"deployment secret: {path} (workers: {control.SECRET_ENV}=<a copy of it>)")
    if host == "0.0.0.0":
        notes.append("WARNING: listening on every address (0.0.0.0), as --listen asked")
    sml = _switchml_serve(opts, ifnames, notes)
    link = _parent_link(opts, secret)
    return Endpoint(host, port, secret, opts.limits(), link, notes, sml)


def _switchml_serve(opts: options.ServeOptions, ifnames, notes: list[str]):
    """The SwitchML API's serving (None without --switchml-grpc): its callers' networks are
    --switchml-allow, else the subnets of `ifnames()`; another host's session may replace an
    idle one after the job lease (the barrier timeout when leases are off)."""
    if opts.switchml_grpc is None:
        return None
    host, port = opts.switchml_grpc
    allow = opts.switchml_allow or interface_networks(ifnames())
    sml = SwitchmlServe(
        host,
        port,
        opts.switchml_window,
        opts.barrier_timeout,
        allow=allow,
        idle_takeover=opts.job_lease or opts.barrier_timeout,
    )
    notes.append(
        f"SwitchML controller API (gRPC) on {host}:{port} for callers in "
        f"{', '.join(map(str, allow))}, without credentials: a host there can open a session "
        "when none is running (docs/operations.md, trust model)"
    )
    return sml


def _parent_link(opts: options.ServeOptions, secret: bytes | None):
    if opts.parent is None:
        return None
    from xdp_agg.ctl.tree import ParentLink, parse_endpoint

    return ParentLink(
        parse_endpoint(opts.parent),
        opts.rack_rank,
        opts.racks,
        total_workers=opts.tree_workers or 0,
        parent_mac=opts.parent_mac,
        barrier_timeout=opts.barrier_timeout,
        secret=read_secret(opts.parent_secret_file) if opts.parent_secret_file else secret,
    )


def serve(
    name: str,
    opts: options.ServeOptions,
    endpoint: Endpoint,
    *,
    netns: str | None = None,
    announce: Callable[[str], None] = print,
    warn: Callable[[str], None] | None = None,
) -> None:
    """Run the endpoint (resolve's) in front of the target `opts` names until interrupted."""
    if opts.target == "bmv2":
        serve_bmv2(opts, endpoint, netns=netns, announce=announce)
    else:
        serve_xdp(name, opts, endpoint, announce=announce, warn=warn)
