"""Options as data: what `xdp-agg attach`, `xdp-agg serve` and `xdp-agg job create` are told, as
dataclasses that the library takes (xdp_switch.backend.attach, xdp_agg.app.serving.serve,
xdp_agg.app.serving.create_job), each field carrying its command-line option (AttachOptions,
the XDP target's, below this layer: its options are ATTACH_FLAGS). `click_options(ServeOptions)`
turns the fields into click options and hands the command one ServeOptions; a script or a test
builds the same object directly.

The callbacks here check one option's value each (an address, HOST:PORT, a group block);
`check()` on the dataclass checks the options together (what needs what, what excludes what)
and raises ValueError with the message the CLI prints as a usage error.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
from dataclasses import dataclass, field

import click

from xdp_agg.ctl import auth
from xdp_agg.proto import control, groups, limits, wire
from xdp_agg.proto.jobs import DEFAULT_CONTROL_PORT
from xdp_switch import attach_options, forwarding, loader, slot_cpus

DEFAULT_GROUP_BASE = groups.DEFAULT_GROUP_BASE
RESULTS = ("multicast", "broadcast", "unicast")
MAX_TREE_TOTAL = 64 * 64  # workers under a root: 64 racks of 64


# --- one option's value ------------------------------------------------------------------------
def ipv4(ctx, param, value: str | None) -> str | None:
    """click callback: an IPv4 address, normalised (None stays None)."""
    if value is None:
        return None
    try:
        return str(ipaddress.IPv4Address(value))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an IPv4 address") from None


def group_base(ctx, param, value: str) -> str:
    """click callback: a block of multicast groups, one address per job id."""
    try:
        return str(groups.check_group_base(value))
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def listen(ctx, param, value: str | None) -> tuple[str, int] | None:
    """click callback: HOST:PORT -> (host, port); an empty HOST (":PORT") means the default
    address."""
    if value is None:
        return None
    host, sep, port = value.rpartition(":")
    try:
        if not sep or not 0 < int(port) < 65536:
            raise ValueError
        return host, int(port)
    except ValueError:
        raise click.BadParameter(f"{value!r}: use HOST:PORT, e.g. 198.18.0.1:48800") from None


SWITCHML_GRPC_PORT = 50099  # p4app-switchML's controller port (xdp_agg.ctl.switchml_grpc)


def switchml_address(ctx, param, value: str | None) -> tuple[str, int] | None:
    """click callback: HOST[:PORT] of the SwitchML gRPC API -> (host, port); the port defaults
    to p4app-switchML's 50099. A host is required: the API binds only where it is told."""
    if value is None:
        return None
    host, sep, port = value.rpartition(":") if value.count(":") == 1 else ("", "", "")
    host, port = (host, port) if sep else (value, str(SWITCHML_GRPC_PORT))
    try:
        if not host or not 0 < int(port) < 65536:
            raise ValueError
        ipaddress.ip_address(host.strip("[]"))
        return host, int(port)
    except ValueError:
        raise click.BadParameter(
            f"{value!r}: use ADDRESS[:PORT], e.g. 198.18.0.1:{SWITCHML_GRPC_PORT} (an address "
            "of this host: the API has no credentials)"
        ) from None


def network_list(ctx, param, value: str | None) -> tuple | None:
    """click callback: CIDR[,CIDR] -> a tuple of ipaddress networks (host bits ignored); None
    when not given."""
    if value is None:
        return None
    try:
        return tuple(ipaddress.ip_network(v.strip(), strict=False) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(
            f"{value!r}: use CIDR[,CIDR], e.g. 198.18.0.0/24 or 198.18.0.0/24,10.1.2.0/24"
        ) from None


def slot_range(ctx, param, text: str) -> tuple[int, int]:
    """click callback: BASE:COUNT -> (base, count)."""
    try:
        base, _, count = text.partition(":")
        return int(base), int(count)
    except ValueError:
        raise click.BadParameter("use BASE:COUNT, e.g. 0:128") from None


# --- fields that are options ---------------------------------------------------------------------
def opt(*decls: str, default=None, **click_kw):
    """A dataclass field with `default`, whose command-line option is click.option(*decls,
    default=default, **click_kw)."""
    return field(default=default, metadata={"click": (decls, {"default": default, **click_kw})})


def count(decl: str, lo: int, hi: int, default: int, help: str):
    """An integer field, lo..hi, with `default` (shown in --help)."""
    return opt(decl, default=default, type=click.IntRange(lo, hi), show_default=True, help=help)


def optional_count(decl: str, lo: int, hi: int, help: str):
    """An integer field, lo..hi, None when its option is not given."""
    return opt(decl, type=click.IntRange(lo, hi), help=help)


def real(decl: str, lo: float, hi: float | None, default: float, help: str):
    """A float field, lo..hi (None: no upper bound), with `default` (shown in --help)."""
    return opt(decl, default=default, type=click.FloatRange(lo, hi), show_default=True, help=help)


def as_int(_ctx, _param, value):
    """A click callback: the choice's string as the int it names."""
    return int(value)


def flag(decl: str, help: str):
    """A boolean field, False unless its flag is given."""
    return opt(decl, default=False, is_flag=True, help=help)


def _group_base_field():
    return opt(
        "--group-base",
        default=DEFAULT_GROUP_BASE,
        show_default=True,
        callback=group_base,
        help="One-arm, --results multicast: job N's group is this block's address number N.",
    )


def _sparse_field(which: str, targets: str = "xdp"):
    """--sparse, of `serve` (which: "every job created", on both targets) and `job create`
    ("the job", of the attached XDP aggregator)."""
    bmv2 = ", bmv2 32 and 64" if "bmv2" in targets else ""
    return flag(
        "--sparse",
        f"{targets}: {which} takes sparse all-reduces too, where the zero blocks stay home "
        f"(docs/protocol.md section 8; xdp up to 768 elements per packet{bmv2}).",
    )


def _results_field():
    return opt(
        "--results",
        type=click.Choice(RESULTS),
        help="One-arm: where results go when --group is not given. multicast (the default): "
        "a group per job, joined by its workers (a switch needs IGMP snooping and a querier to "
        "keep it from other hosts); broadcast: the subnet broadcast, to every host on the "
        "segment; unicast: one copy per worker, to its own MAC and address (hosts that join no "
        "group, as p4app-switchML's). Without the interface's multicast flag the default falls "
        "back to broadcast with a warning.",
    )


def _tree_workers_field(help: str):
    """--tree-workers of a rack (serve and job create): all workers under the root aggregator,
    by which the hosts scale floats; `help` says what the command does with it."""
    return optional_count("--tree-workers", 1, MAX_TREE_TOTAL, help)


def _parent_mac_field(help: str):
    """--parent-mac of a rack (serve and job create): the next hop toward the parent."""
    return opt("--parent-mac", help=help)


def _check_group_choice(group_ip, results) -> None:
    if group_ip is not None and results is not None:
        raise ValueError("give either --group (one address for every job) or --results")


def _click_spec(cls, fl: dataclasses.Field):
    """(decls, click kwargs) of field `fl` of `cls`: its own metadata, or the table of a class
    defined below this layer (AttachOptions: ATTACH_FLAGS); None for a field that is no
    option."""
    return fl.metadata.get("click") or _FLAGS_OF.get(cls, {}).get(fl.name)


def click_options(cls, param: str = "opts"):
    """A click decorator: one option per field of dataclass `cls` (in field order; a field
    without one keeps its default), passed to the command as one `cls` instance named `param`,
    checked (cls.check, and for a class that checks itself, its construction) before the
    command runs: a ValueError there is a usage error (exit 2)."""
    fields = [fl for fl in dataclasses.fields(cls) if _click_spec(cls, fl) is not None]

    def decorate(f):
        @functools.wraps(f)
        def command(*args, **kw):
            try:
                values = cls(**{fl.name: kw.pop(fl.name) for fl in fields})
                values.check()
            except ValueError as e:
                raise click.UsageError(str(e)) from None
            return f(*args, **{param: values}, **kw)

        for fl in reversed(fields):
            decls, click_kw = _click_spec(cls, fl)
            command = click.option(*decls, fl.name, **click_kw)(command)
        return command

    return decorate


# --- attach --------------------------------------------------------------------------------------
# AttachOptions is the XDP target's (xdp_switch.attach_options), which the pinned state records
# and a layer below this one cannot know click: its fields' options are this table, in field
# order (cflags, for tests only, has none).
AttachOptions = attach_options.AttachOptions


def cpu_list(ctx, param, value: str | None) -> list[int] | None:
    """click callback: a CPU list as 0-3,6 (None stays None)."""
    if value is None:
        return None
    try:
        return slot_cpus.parse_cpus(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _flag(*decls: str, **click_kw) -> tuple[tuple[str, ...], dict]:
    return decls, click_kw


_DEFAULTS = AttachOptions()
ATTACH_FLAGS = {
    "topology": _flag(
        "--topology",
        type=click.Choice(attach_options.TOPOLOGIES),
        default=None,
        help="one-arm: results to a group address on the one interface; switch: one port per "
        "worker. Default: one-arm for one interface, switch for several.",
    ),
    "xdp_mode": _flag(
        "--xdp-mode",
        type=click.Choice(attach_options.XDP_MODES),
        default=_DEFAULTS.xdp_mode,
        show_default=True,
        help="native: XDP in the driver; skb: generic XDP (any interface, slower).",
    ),
    "pool_slots": _flag(
        "--pool-slots",
        type=click.IntRange(1, wire.MAX_SLOTS),
        default=_DEFAULTS.pool_slots,
        show_default=True,
        help="Aggregation slots shared by all jobs.",
    ),
    "variant": _flag(
        "--variant",
        type=click.Choice(list(loader.VARIANTS)),
        default=_DEFAULTS.variant,
        show_default=True,
        help="percpu: per-CPU partial sums (the design); "
        "spinlock: one locked sum per slot (the baseline).",
    ),
    "frags": _flag(
        "--frags",
        is_flag=True,
        help="Load as an XDP multi-buffer program: frames larger than a page (jobs of 1024 and "
        "2048 elements per packet; a veth whose peer's MTU is above about 3500 needs it).",
    ),
    "slot_cpus": _flag(
        "--slot-cpus",
        type=click.Choice(list(loader.SLOT_CPUS)),
        default=_DEFAULTS.slot_cpus,
        show_default=True,
        help="rss: each packet is aggregated on the CPU the NIC's receive hash chose, a slot's "
        "partial sums on several CPUs merged when it completes; cpumap: each slot's packets are "
        "redirected to the one CPU that owns it (a cpumap) and aggregated there (native XDP "
        "only).",
    ),
    "cpus": _flag(
        "--cpus",
        callback=cpu_list,
        default=None,
        help="With --slot-cpus cpumap: the CPUs that aggregate, as 0-3,6 (default: every CPU "
        "this command may run on); a job's slots are cut into one contiguous range per CPU.",
    ),
    "forwarding": _flag(
        "--forwarding",
        type=click.Choice(forwarding.MODES),
        default=None,
        help="The switch topology's ordinary traffic between its ports: routed (a FIB lookup "
        "and a redirect; the kernel's forwarding for the rest, its sysctls set on the ports "
        "until detach), switched (a learned MAC table, flooding) or off (to the kernel). "
        "Default: routed when every port has a subnet of its own, else switched; off one-arm.",
    ),
}
_FLAGS_OF: dict[type, dict[str, tuple[tuple[str, ...], dict]]] = {AttachOptions: ATTACH_FLAGS}


def attach_args(opts: AttachOptions) -> list[str]:
    """The `xdp-agg attach` options that give `opts` (defaults left out; not cflags)."""
    args: list[str] = []
    for name, value in opts.to_dict().items():
        if name not in ATTACH_FLAGS or value == getattr(_DEFAULTS, name):
            continue
        flag = ATTACH_FLAGS[name][0][0]
        if isinstance(value, bool):
            args.append(flag)
        elif isinstance(value, list):
            args += [flag, ",".join(map(str, value))]
        else:
            args += [flag, str(value)]
    return args


# --- serve ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServeOptions:
    """What `xdp-agg serve` is told (every field is one of its options)."""

    # before `listen`, whose callback it uses: a field of that name hides it from the fields below
    metrics: tuple[str, int] | None = opt(
        "--metrics",
        callback=listen,
        help="HOST:PORT to serve Prometheus metrics at (http://HOST:PORT/metrics: counters per "
        "job and worker, the XDP program's run time, the endpoint's jobs and refusals; "
        "docs/operations.md); :PORT: on the control endpoint's address. Needs prometheus_client "
        "(the `metrics` extra). Default: none.",
    )
    listen: tuple[str, int] | None = opt(
        "--listen",
        callback=listen,
        help=f"HOST:PORT of the control endpoint (TCP). Default: the one IPv4 address of the "
        f"aggregator's interfaces (of --ports for bmv2), port {DEFAULT_CONTROL_PORT}; 0.0.0.0 "
        "(every address) only when given.",
    )
    group_ip: str | None = opt(
        "--group",
        callback=ipv4,
        help="One-arm: one address every job's results go to (default: as --results says).",
    )
    results: str | None = _results_field()
    group_base: str = _group_base_field()
    barrier_timeout: float = opt(
        "--barrier-timeout",
        default=120.0,
        type=float,
        show_default=True,
        help="Longest a worker waits for the others to register.",
    )
    target: str = opt(
        "--target",
        default="xdp",
        type=click.Choice(["xdp", "bmv2"]),
        show_default=True,
        help="xdp: the attached aggregator (--name); bmv2: the P4 program in simple_switch on "
        "--ports.",
    )
    ports: str | None = opt(
        "--ports", help="bmv2: comma-separated interfaces, switch port i = the i-th."
    )
    workdir: str = opt(
        "--workdir",
        default="/tmp/xdp-agg-bmv2",
        show_default=True,
        help="bmv2: where the compiled program goes.",
    )
    udp_checksum: bool = flag(
        "--udp-checksum", "xdp: every job created verifies its contributions' UDP checksums."
    )
    sparse: bool = _sparse_field("every job created", "xdp, bmv2")
    secret_file: str | None = opt(
        "--secret-file",
        type=click.Path(dir_okay=False),
        envvar=control.SECRET_ENV,
        help=f"The deployment secret workers must prove (created with mode 0600 when absent; "
        f"refused if group or others may read it). Default: ${control.SECRET_ENV}, else "
        "STATE_DIR/NAME.secret (/run/xdp-agg/NAME.secret).",
    )
    insecure_no_auth: bool = flag(
        "--insecure-no-auth",
        "Accept every request without credentials: anyone who reaches the endpoint can create, "
        "join and end jobs. Only for a trusted lab.",
    )
    max_connections: int = count(
        "--max-connections",
        1,
        100_000,
        auth.Limits.max_connections,
        "Open control connections in all.",
    )
    max_per_source: int = count(
        "--max-per-source",
        1,
        100_000,
        auth.Limits.max_per_source,
        "Open control connections from one address.",
    )
    idle_timeout: float = real(
        "--idle-timeout",
        0.1,
        86_400,
        auth.Limits.idle_timeout,
        "Seconds a connection that holds no job may take to send a request before it is cut.",
    )
    job_lease: float = real(
        "--job-lease",
        0,
        86_400,
        auth.Limits.job_lease,
        "Seconds a job lives while none of its members sends a request (hostlib pings every "
        "10 s) and the aggregator counts no traffic of it; then it is deleted, freeing its slots "
        "and port (a crashed run's stuck ranks). 0: never.",
    )
    request_rate: float = real(
        "--request-rate",
        0.1,
        1e6,
        auth.Limits.rate,
        "Requests per second per source address (bursts up to three times that).",
    )
    rejoin_timeout: float = real(
        "--rejoin-timeout",
        0.1,
        None,
        60.0,
        "xdp: after a restart, how long a recovered job's ranks have to reconnect before "
        "they count as gone (which frees the job).",
    )
    parent: str | None = opt(
        "--parent-endpoint",
        help="Two levels: HOST:PORT of the parent's control endpoint; every job created here is "
        "a rack of the parent's job of the same name (docs/striping-and-trees.md).",
    )
    rack_rank: int | None = optional_count(
        "--rack-rank",
        0,
        limits.MAX_WORKERS - 1,
        "With --parent-endpoint: this rack's rank in the parent's jobs.",
    )
    racks: int | None = optional_count(
        "--racks",
        1,
        limits.MAX_WORKERS,
        "With --parent-endpoint: racks under the parent (its jobs' world size).",
    )
    tree_workers: int | None = _tree_workers_field(
        "With --parent-endpoint: workers under the root, for float scaling (default: racks x "
        "this job's workers)."
    )
    parent_mac: str | None = _parent_mac_field(
        "With --parent-endpoint: the next hop toward the parent (default: the parent's own MAC)."
    )
    parent_secret_file: str | None = opt(
        "--parent-secret-file",
        type=click.Path(dir_okay=False),
        help="With --parent-endpoint: the parent endpoint's deployment secret (default: this "
        "endpoint's).",
    )

    switchml_grpc: tuple[str, int] | None = opt(
        "--switchml-grpc",
        callback=switchml_address,
        help="Also serve p4app-switchML's controller API (gRPC: Session.UdpSession, Sync.Barrier, "
        f"Sync.Broadcast) on ADDRESS[:PORT] (port {SWITCHML_GRPC_PORT} unless given), so that "
        "SwitchML's own hosts join jobs unchanged. Off unless given; it has no credentials "
        "(docs/operations.md, trust model).",
    )
    switchml_window: int = count(
        "--switchml-window",
        1,
        limits.DEFAULT_POOL_SLOTS,
        512,
        "With --switchml-grpc: slots of a SwitchML session's job, from 0 (p4app's hosts use "
        "up to 2 x max_outstanding_packets, 2 x 256 by default).",
    )
    switchml_allow: tuple | None = opt(
        "--switchml-allow",
        callback=network_list,
        metavar="CIDR[,CIDR]",
        help="With --switchml-grpc: the networks whose hosts may call it; a call from any other "
        "address is refused (PERMISSION_DENIED). Default: the IPv4 subnets of the aggregator's "
        "interfaces (bmv2: of --ports), where p4app's hosts are.",
    )

    def check(self) -> None:
        """ValueError when the options do not go together."""
        _check_group_choice(self.group_ip, self.results)
        if self.target == "bmv2" and not self.ports:
            raise ValueError("--target bmv2 needs --ports IFACE,IFACE,...")
        if self.parent is not None and (self.rack_rank is None or self.racks is None):
            raise ValueError("--parent-endpoint needs --rack-rank and --racks")
        if self.switchml_allow is not None and self.switchml_grpc is None:
            raise ValueError("--switchml-allow needs --switchml-grpc")

    def limits(self) -> auth.Limits:
        """The endpoint's bounds these options give."""
        return auth.Limits(
            max_connections=self.max_connections,
            max_per_source=self.max_per_source,
            idle_timeout=self.idle_timeout,
            job_lease=self.job_lease,
            rate=self.request_rate,
            burst=max(1, int(3 * self.request_rate)),
        )


# --- job create ----------------------------------------------------------------------------------
AGG_PORTS = click.IntRange(wire.UDP_PORT, wire.UDP_PORT + 15)


@dataclass(frozen=True)
class JobOptions:
    """What `xdp-agg job create` is told besides the job id (every field is one of its
    options)."""

    num_workers: int = opt(
        "--workers",
        type=click.IntRange(1, limits.MAX_WORKERS),
        required=True,
        help="Workers in the job (its world size).",
    )
    elems: str = opt(
        "--elems",
        default="256",
        type=click.Choice([str(n) for n in wire.SIZE_CODE_ELEMS.values()]),
        show_default=True,
        help="Elements per packet (512 and 768 need a larger MTU; 1024 and 2048 MTU 4200 and "
        "9000, and an aggregator attached with --frags).",
    )
    slots: tuple[int, int] = opt(
        "--slots",
        default="0:128",
        callback=slot_range,
        show_default=True,
        help="BASE:COUNT of the pool.",
    )
    agg_port: int = opt(
        "--agg-port",
        default=wire.UDP_PORT,
        type=AGG_PORTS,
        show_default=True,
        help="The aggregator port the job's workers send to (one per live job).",
    )
    group_ip: str | None = opt(
        "--group",
        callback=ipv4,
        help="One-arm: group (multicast or subnet broadcast) address of results "
        "(default: as --results says).",
    )
    results: str | None = _results_field()
    group_base: str = _group_base_field()
    group_mac: str | None = opt(
        "--group-mac", help="Default: derived from --group (multicast) or ff:ff:ff:ff:ff:ff."
    )
    agg_ip: str | None = opt(
        "--agg-ip",
        callback=ipv4,
        help="Source address of results (default: the interface's first address).",
    )
    udp_checksum: bool = flag(
        "--udp-checksum",
        "Verify each contribution's UDP checksum (0 = none sent) and drop wrong ones; "
        "costs a pass over the payload per packet (docs/design.md: UDP checksums).",
    )
    sparse: bool = _sparse_field("the job")
    wire_bits: int = opt(
        "--wire-bits",
        default=32,
        type=click.Choice(["32", "16"]),
        callback=as_int,
        show_default=True,
        help="Element width: 32, one int32 per payload word (p4app-switchML's); 16, two "
        "block-scaled 16-bit elements per word, twice the elements per packet "
        "(docs/protocol.md section 5.6). Packets of the other width are dropped.",
    )
    parent: str | None = opt(
        "--parent-address",
        help="Two levels: IP:PORT of the parent aggregator's job (its data plane); completed "
        "slots go there as this aggregator's contribution.",
    )
    parent_mac: str | None = _parent_mac_field(
        "With --parent-address: MAC of the parent (next hop)."
    )
    parent_slot_base: int | None = optional_count(
        "--parent-slots",
        0,
        (1 << 14) - 1,
        "With --parent-address: the parent job's first slot (ours BASE maps to it).",
    )
    uplink_port: int | None = opt(
        "--uplink-port",
        type=AGG_PORTS,
        help="With --parent-address: our port toward the parent (the parent job's worker port; "
        "default: --agg-port).",
    )
    worker_port: int | None = optional_count(
        "--worker-port",
        1,
        65535,
        "With --parent-address: our workers' UDP port, where the parent's results go down.",
    )
    total_workers: int | None = _tree_workers_field(
        "With --parent-address: workers under the root (the hosts' float scaling)."
    )

    def check(self) -> None:
        """ValueError when the options do not go together."""
        _check_group_choice(self.group_ip, self.results)
        if self.parent is not None and None in (
            self.parent_mac,
            self.parent_slot_base,
            self.worker_port,
        ):
            raise ValueError(
                "--parent-address needs --parent-mac, --parent-slots and --worker-port"
            )
        if self.parent is not None:
            from xdp_agg.ctl.tree import parse_endpoint

            ip, _ = parse_endpoint(self.parent)  # ValueError: not IP:PORT
            ipaddress.IPv4Address(ip)


# --- bench ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchOptions:
    """The options of `xdp-agg bench` (the XDP program's micro-benchmark)."""

    workers: int = count("--workers", 1, limits.MAX_WORKERS, 4, "Workers per job in the stream.")
    rounds: int = count("--rounds", 1, 10_000, 20, "Rounds over 64 slots per repetition.")
    repeats: int = count(
        "--repeats", 1, 100, 5, "Repetitions per case (the table gives the median)."
    )
    slot_cpus: bool = flag(
        "--slot-cpus",
        "Instead: on two CPUs at once, every slot's packets spread over both (rss on veth: the "
        "completing CPU merges the other's partial) against each slot on the CPU that owns it "
        "(--slot-cpus cpumap, its steering program included), at 256 and 768 elements.",
    )

    cpus: str | None = opt(
        "--cpus",
        help="Instead: the program on each of these numbers of CPUs at once (as 1,2,4,8) over "
        "one job's slots, a slot's flows hashed as most NICs do (sdfn: spread over the CPUs) "
        "and on the UDP ports alone (fn: a lane per CPU); aggregate packets and elements per "
        "second and the scaling against one CPU, at 256 and 768 elements.",
    )

    def cpu_counts(self) -> list[int]:
        """--cpus as numbers (ValueError for a bad list)."""
        try:
            counts = [int(part) for part in (self.cpus or "").split(",")]
        except ValueError:
            counts = []
        if not counts or min(counts) < 1 or max(counts) > 8192:
            raise ValueError(f"--cpus takes numbers of CPUs as 1,2,4,8, not {self.cpus!r}")
        return counts

    def check(self) -> None:
        """ValueError for a bad --cpus, or --cpus with --slot-cpus."""
        if self.cpus is not None:
            self.cpu_counts()
            if self.slot_cpus:
                raise ValueError("--cpus and --slot-cpus are two benchmarks: choose one")
