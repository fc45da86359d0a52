"""`xdp-agg`: attach the XDP aggregator and manage its jobs, workers and counters.

Exit codes (every command):
  0  success
  1  the operation failed (the message says why and what to do)
  2  usage error (bad option or argument)
  3  environment: not root, no bpffs, bcc or kernel headers missing
  4  busy: another `xdp-agg serve` already serves this aggregator name

Codes 1, 3 and 4 are the exit_code of the XdpAggError the command raised (xdp_switch/errors.py);
2 is click's. This module parses options; what the commands decide lives in aggregator.py
(attach, detach, status, counters), serving.py (job defaults, the control endpoint) and
service.py (the systemd unit and its config).
"""

from __future__ import annotations

import importlib.metadata
import ipaddress
import json
import os
import time
from pathlib import Path

import click

from aggctl import auth
from aggproto import control, groups, limits, wire
from aggproto.jobs import DEFAULT_CONTROL_PORT, WorkerSpec

from . import aggregator, links, loader, pins, service, serving
from .errors import EXIT_BUSY, EXIT_ENV, EXIT_FAILED, EXIT_OK, EXIT_USAGE, XdpAggError

__all__ = ["EXIT_BUSY", "EXIT_ENV", "EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "main"]


class _Cli(click.Group):
    """The top-level group: an XdpAggError anywhere below becomes its message on stderr and its
    exit code (1 or 3). Anything else is a bug and keeps its traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except XdpAggError as e:
            click.echo(f"xdp-agg: {e}", err=True)
            ctx.exit(e.exit_code)


def _emit(obj, as_json: bool, text) -> None:
    if as_json:
        click.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))
    else:
        text(obj)


def _name(ctx, param, value: str) -> str:
    try:
        return pins.check_name(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _ipv4(ctx, param, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return str(ipaddress.IPv4Address(value))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an IPv4 address") from None


def _group_base(ctx, param, value: str) -> str:
    try:
        return str(groups.check_group_base(value))
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _results_options(f):
    """--results and --group-base, shared by `serve` and `job create` (one vocabulary)."""
    f = click.option(
        "--group-base",
        default=serving.DEFAULT_GROUP_BASE,
        show_default=True,
        callback=_group_base,
        help="One-arm, --results multicast: job N's group is this block's address number N.",
    )(f)
    return click.option(
        "--results",
        type=click.Choice(serving.RESULTS),
        default=None,
        help="One-arm: where results go when --group is not given. multicast (the default): "
        "a group per job, joined by its workers (a switch needs IGMP snooping and a querier to "
        "keep it from other hosts); broadcast: the subnet broadcast, to every host on the "
        "segment. Without the interface's multicast flag the default falls back to broadcast "
        "with a warning.",
    )(f)


def _check_group_choice(group_ip, results) -> None:
    if group_ip is not None and results is not None:
        raise click.UsageError("give either --group (one address for every job) or --results")


def _listen(ctx, param, value: str | None) -> tuple[str, int] | None:
    """HOST:PORT -> (host, port); an empty HOST (":PORT") means the default address."""
    if value is None:
        return None
    host, sep, port = value.rpartition(":")
    try:
        if not sep or not 0 < int(port) < 65536:
            raise ValueError
        return host, int(port)
    except ValueError:
        raise click.BadParameter(f"{value!r}: use HOST:PORT, e.g. 198.18.0.1:48800") from None


def _version() -> str:
    """The installed distribution's version (pyproject.toml); a bare checkout has none."""
    try:
        return importlib.metadata.version("xdp-agg")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed: pip install .)"


@click.group(
    cls=_Cli,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Exit codes: 0 ok, 1 operation failed, 2 usage error, "
    "3 environment (root, bpffs, bcc, headers), 4 busy (another serve of this name).",
)
@click.version_option(_version(), prog_name="xdp-agg")
@click.option(
    "--name",
    default="default",
    show_default=True,
    callback=_name,
    help="Aggregator instance (pins under /sys/fs/bpf/xdp-agg/NAME).",
)
@click.option(
    "--netns", default=None, help="Run in this network namespace (kept: /sys/fs/bpf stays visible)."
)
@click.pass_context
def main(ctx, name, netns):
    """In-network gradient aggregation (SwitchML protocol) in XDP.

    \b
    Examples:
      sudo xdp-agg attach eth0                      # the one-arm topology on eth0
      sudo xdp-agg attach p0 p1 p2 p3               # the switch topology over four ports
      sudo xdp-agg job create 0 --workers 4 --elems 256 --slots 0:128 --group 198.18.0.255
      sudo xdp-agg worker add 0 0 198.18.0.10
      sudo xdp-agg stats --watch
      sudo xdp-agg detach
      sudo xdp-agg install-service --interfaces eth1   # as a systemd service

    Shell completion (bash): eval "$(_XDP_AGG_COMPLETE=bash_source xdp-agg)"
    """
    ctx.ensure_object(dict)
    ctx.obj["name"] = name
    ctx.obj["netns"] = netns
    if netns:
        links.enter_netns(netns)


@main.command()
@click.argument("ifaces", nargs=-1, required=True)
@click.option(
    "--topology",
    type=click.Choice(pins.TOPOLOGIES),
    default=None,
    help="one-arm: results to a group address on the one interface; switch: one port per "
    "worker. Default: one-arm for one interface, switch for several.",
)
@click.option(
    "--xdp-mode",
    type=click.Choice(pins.XDP_MODES),
    default="native",
    show_default=True,
    help="native: XDP in the driver; skb: generic XDP (any interface, slower).",
)
@click.option(
    "--pool-slots",
    type=click.IntRange(1, wire.MAX_SLOTS),
    default=limits.DEFAULT_POOL_SLOTS,
    show_default=True,
    help="Aggregation slots shared by all jobs.",
)
@click.option(
    "--variant",
    type=click.Choice(list(loader.VARIANTS)),
    default="percpu",
    show_default=True,
    help="percpu: per-CPU partial sums (the design); "
    "spinlock: one locked sum per slot (the baseline).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_context
def attach(ctx, ifaces, topology, xdp_mode, pool_slots, variant, as_json):
    """Compile, load and attach the aggregator to IFACES; it stays after this command exits.

    \b
    Examples:
      sudo xdp-agg attach eth0
      sudo xdp-agg --netns agg attach p0 p1 --xdp-mode skb
      sudo xdp-agg --name lab attach eth1 --pool-slots 4096 --json
    """
    state = aggregator.attach(
        list(ifaces),
        name=ctx.obj["name"],
        topology=topology,
        xdp_mode=xdp_mode,
        pool_slots=pool_slots,
        netns=ctx.obj["netns"],
        variant=variant,
    )
    _emit(
        state.to_dict(),
        as_json,
        lambda s: click.echo(
            f"attached {s['name']} ({s['topology']}, {s['xdp_mode']} XDP) to "
            f"{', '.join(i['ifname'] for i in s['interfaces'])}; "
            f"program id {s['prog_id']}, {s['pool_slots']} slots"
        ),
    )


@main.command()
@click.option(
    "--force",
    is_flag=True,
    help="Detach even while jobs are live: their workers' all-reduces then fail with an error "
    "saying the aggregator's state is gone.",
)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def detach(ctx, force, as_json):
    """Detach our program from every interface it was attached to and remove its pins.

    A program that is no longer ours on an interface is left alone (and reported). With live
    jobs it refuses (exit 1) and lists them, unless --force.

    \b
    Examples:
      sudo xdp-agg detach
      sudo xdp-agg --name lab detach --force --json
    """
    rep = aggregator.detach(ctx.obj["name"], force=force)
    _emit(
        rep,
        as_json,
        lambda r: click.echo(
            f"detached {r['name']} from {', '.join(r['detached']) or 'nothing'}"
            + (
                f"; left alone (not ours any more): {', '.join(r['left_alone'])}"
                if r["left_alone"]
                else ""
            )
        ),
    )


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def status(ctx, as_json):
    """Program, interfaces and jobs of the aggregator."""
    st = aggregator.status(ctx.obj["name"])

    def text(s):
        click.echo(
            f"{s['name']}: {s['topology']} topology, {s['xdp_mode']} XDP, "
            f"program id {s['prog_id']}, {s['pool_slots']} slots"
        )
        for i in s["interfaces"]:
            on = "attached" if i["attached"] else f"NOT attached (program {i['current_prog_id']})"
            click.echo(f"  {i['ifname']} (ifindex {i['ifindex']}): {on}")
        for j in s["jobs"]:
            last = j["slot_base"] + j["slot_count"] - 1
            click.echo(
                f"  job {j['job_id']}: {len(j['workers'])}/{j['num_workers']} workers, "
                f"{j['elems']} elems/packet, slots {j['slot_base']}..{last}, {j['delivery']}"
            )
            if j.get("parent"):
                click.echo("    " + _parent_line(j["parent"]))

    _emit(st, as_json, text)


def _print_stats(s) -> None:
    nz = {k: v for k, v in s["unattributed"].items() if v}
    click.echo("no job: " + (", ".join(f"{k}={v}" for k, v in nz.items()) or "-"))
    for j, js in s["jobs"].items():
        click.echo(
            f"job {j}: " + (", ".join(f"{k}={v}" for k, v in js["reasons"].items() if v) or "-")
        )
        for w, c in js["workers"].items():
            click.echo(f"  worker {w}: " + ", ".join(f"{k}={v}" for k, v in c.items()))
        if js.get("parent"):
            click.echo("  " + _parent_line(js["parent"]))


def _parent_line(p: dict) -> str:
    """One line for a tree job's parent link and its counters."""
    c = ", ".join(f"{k}={v}" for k, v in p["counters"].items())
    return f"parent {p['address']} (uplink port {p['uplink_port']}): {c}"


@main.command()
@click.option("--watch", is_flag=True, help="Refresh every --interval seconds until interrupted.")
@click.option("--interval", type=float, default=1.0, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def stats(ctx, watch, interval, as_json):
    """Packet counters by reason: without a job, per job, and per worker.

    \b
    Examples:
      sudo xdp-agg stats --json
      sudo xdp-agg stats --watch --interval 2     # Ctrl-C ends it
    """
    try:
        while True:
            s = aggregator.stats(ctx.obj["name"])
            if watch and not as_json:
                click.clear()
                click.echo(time.strftime("%H:%M:%S"))
            _emit(s, as_json, _print_stats)
            if not watch:
                return
            time.sleep(interval)
    except KeyboardInterrupt:  # how --watch ends
        if not watch:
            raise


@main.group()
def job():
    """Create, delete and list jobs."""


def _slot_range(text: str) -> tuple[int, int]:
    try:
        base, _, count = text.partition(":")
        return int(base), int(count)
    except ValueError:
        raise click.BadParameter("use BASE:COUNT, e.g. 0:128") from None


@job.command("create")
@click.argument("job_id", type=click.IntRange(0, limits.MAX_JOBS - 1))
@click.option("--workers", "num_workers", type=click.IntRange(1, limits.MAX_WORKERS), required=True)
@click.option(
    "--elems",
    type=click.Choice([str(n) for n in wire.SIZE_CODE_ELEMS.values()]),
    default="256",
    show_default=True,
)
@click.option(
    "--slots", "slots", default="0:128", show_default=True, help="BASE:COUNT of the pool."
)
@click.option(
    "--port",
    "agg_port",
    type=click.IntRange(wire.UDP_PORT, wire.UDP_PORT + 15),
    default=wire.UDP_PORT,
    show_default=True,
)
@click.option(
    "--group",
    "group_ip",
    default=None,
    callback=_ipv4,
    help="One-arm: group (multicast or subnet broadcast) address of results "
    "(default: as --results says).",
)
@_results_options
@click.option(
    "--group-mac",
    default=None,
    help="Default: derived from --group (multicast) or ff:ff:ff:ff:ff:ff.",
)
@click.option(
    "--agg-ip",
    default=None,
    callback=_ipv4,
    help="Source address of results (default: the interface's first address).",
)
@click.option(
    "--udp-checksum",
    is_flag=True,
    help="Verify each contribution's UDP checksum (0 = none sent) and drop wrong ones; "
    "costs a pass over the payload per packet (README: UDP checksums).",
)
@click.option(
    "--parent",
    default=None,
    help="Two levels: IP:PORT of the parent aggregator's job; completed slots go there as "
    "this aggregator's contribution.",
)
@click.option("--parent-mac", default=None, help="With --parent: MAC of the parent (next hop).")
@click.option(
    "--parent-slots",
    "parent_slot_base",
    type=click.IntRange(0, (1 << 14) - 1),
    default=None,
    help="With --parent: the parent job's first slot (ours BASE maps to it).",
)
@click.option(
    "--uplink-port",
    type=click.IntRange(wire.UDP_PORT, wire.UDP_PORT + 15),
    default=None,
    help="With --parent: our port toward the parent (the parent job's worker port; "
    "default: --port).",
)
@click.option(
    "--worker-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="With --parent: our workers' UDP port, where the parent's results go down.",
)
@click.option(
    "--total-workers",
    type=click.IntRange(1, 64 * 64),
    default=None,
    help="With --parent: workers under the root (the hosts' float scaling).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the job as created, as JSON.")
@click.pass_context
def job_create(
    ctx,
    job_id,
    num_workers,
    elems,
    slots,
    agg_port,
    group_ip,
    group_mac,
    agg_ip,
    udp_checksum,
    results,
    group_base,
    parent,
    parent_mac,
    parent_slot_base,
    uplink_port,
    worker_port,
    total_workers,
    as_json,
):
    """Create job JOB_ID (its slots start cleared).

    \b
    Example:
      sudo xdp-agg job create 0 --workers 4 --elems 256 --slots 0:128   # group 239.18.0.0
      sudo xdp-agg job create 0 --workers 4 --elems 256 --slots 0:128 --group 198.18.0.255
      sudo xdp-agg job create 1 --workers 2 --slots 128:64 --port 48865 --udp-checksum
      sudo xdp-agg --name rack0 job create 0 --workers 3 --slots 0:64 --group 198.18.0.255 \
          --parent 198.18.0.1:48864 --parent-mac 02:00:c6:12:00:01 --parent-slots 0 \
          --worker-port 40000 --total-workers 6
    """
    _check_group_choice(group_ip, results)
    base, count = _slot_range(slots)
    tree = {}
    if parent is not None:
        from aggctl.tree import parse_endpoint

        if parent_mac is None or parent_slot_base is None or worker_port is None:
            raise click.UsageError("--parent needs --parent-mac, --parent-slots and --worker-port")
        try:
            pip, pport = parse_endpoint(parent)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--parent") from None
        tree = dict(
            parent_ip=_ipv4(None, None, pip),
            parent_mac=parent_mac,
            parent_port=pport,
            parent_slot_base=parent_slot_base,
            uplink_port=uplink_port or agg_port,
            worker_port=worker_port,
            total_workers=total_workers or 0,
        )
    spec = serving.create_job(
        ctx.obj["name"],
        job_id,
        num_workers,
        int(elems),
        base,
        count,
        agg_port=agg_port,
        group_ip=group_ip,
        group_mac=group_mac,
        agg_ip=agg_ip,
        udp_checksum=udp_checksum,
        results=results,
        group_base=group_base,
        warn=lambda line: click.echo(line, err=True),
        **tree,
    )
    _emit(
        spec.to_dict(),
        as_json,
        lambda _: click.echo(
            f"job {job_id} created: {num_workers} workers, {elems} elems/packet, "
            f"slots {base}..{base + count - 1}"
        ),
    )


@job.command("delete")
@click.argument("job_id", type=click.IntRange(0, limits.MAX_JOBS - 1))
@click.pass_context
def job_delete(ctx, job_id):
    """Delete a job and its workers."""
    aggregator.XdpBackend(ctx.obj["name"]).delete_job(job_id)
    click.echo(f"job {job_id} deleted")


@job.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def job_list(ctx, as_json):
    """The configured jobs and their workers."""
    jobs = aggregator.XdpBackend(ctx.obj["name"]).jobs()
    _emit(
        jobs, as_json, lambda js: [click.echo(json.dumps(j)) for j in js] or click.echo("no jobs")
    )


@main.group()
def worker():
    """Register and remove workers of a job."""


@worker.command("add")
@click.argument("job_id", type=click.IntRange(0, limits.MAX_JOBS - 1))
@click.argument("index", type=click.IntRange(0, limits.MAX_WORKERS - 1))
@click.argument("ip", callback=_ipv4)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=wire.UDP_PORT,
    show_default=True,
    help="The worker's UDP port.",
)
@click.option(
    "--agg-port",
    type=click.IntRange(wire.UDP_PORT, wire.UDP_PORT + 15),
    default=wire.UDP_PORT,
    show_default=True,
)
@click.option("--mac", default="00:00:00:00:00:00", help="Switch topology: the worker's MAC.")
@click.pass_context
def worker_add(ctx, job_id, index, ip, port, agg_port, mac):
    """Register worker INDEX of JOB_ID, sending from IP.

    \b
    Example:
      sudo xdp-agg worker add 0 1 198.18.0.11 --mac 02:00:00:00:00:0b
    """
    aggregator.XdpBackend(ctx.obj["name"]).add_worker(
        WorkerSpec(job_id, index, ip, port, agg_port, mac)
    )
    click.echo(f"worker {index} of job {job_id}: {ip}")


@worker.command("remove")
@click.argument("job_id", type=click.IntRange(0, limits.MAX_JOBS - 1))
@click.argument("index", type=click.IntRange(0, limits.MAX_WORKERS - 1))
@click.pass_context
def worker_remove(ctx, job_id, index):
    """Unregister worker INDEX of JOB_ID."""
    aggregator.XdpBackend(ctx.obj["name"]).remove_worker(job_id, index)
    click.echo(f"worker {index} of job {job_id} removed")


@main.command()
@click.argument("slot", type=click.IntRange(0, wire.MAX_SLOTS - 1))
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def slots(ctx, slot, as_json):
    """One slot's state (both versions), for debugging."""
    s = aggregator.slot_state(slot, ctx.obj["name"])

    def text(s):
        click.echo(f"slot {s['slot']} (job {s['job']})")
        for v in s["versions"]:
            click.echo(
                f"  v{v['version']}: seen={v['seen']} arrivals={v['arrivals']} added={v['added']} "
                f"published={v['published']} up={v['up']} e0={v['result_e0']} "
                f"head={v['result_head']}"
            )

    _emit(s, as_json, text)


@main.command()
@click.option(
    "--listen",
    default=None,
    callback=_listen,
    help=f"HOST:PORT of the control endpoint (TCP). Default: the one IPv4 address of the "
    f"aggregator's interfaces (of --ports for bmv2), port {DEFAULT_CONTROL_PORT}; 0.0.0.0 "
    "(every address) only when given.",
)
@click.option(
    "--group",
    "group_ip",
    default=None,
    callback=_ipv4,
    help="One-arm: one address every job's results go to (default: as --results says).",
)
@_results_options
@click.option(
    "--barrier-timeout",
    type=float,
    default=120.0,
    show_default=True,
    help="Longest a worker waits for the others to register.",
)
@click.option(
    "--target",
    type=click.Choice(["xdp", "bmv2"]),
    default="xdp",
    show_default=True,
    help="xdp: the attached aggregator (--name); bmv2: the P4 program in simple_switch on --ports.",
)
@click.option(
    "--ports", default=None, help="bmv2: comma-separated interfaces, switch port i = the i-th."
)
@click.option(
    "--workdir",
    default="/tmp/xdp-agg-bmv2",
    show_default=True,
    help="bmv2: where the compiled program goes.",
)
@click.option(
    "--udp-checksum",
    is_flag=True,
    help="xdp: every job created verifies its contributions' UDP checksums.",
)
@click.option(
    "--secret-file",
    type=click.Path(dir_okay=False),
    envvar=control.SECRET_ENV,
    default=None,
    help=f"The deployment secret workers must prove (created with mode 0600 when absent; "
    f"refused if group or others may read it). Default: ${control.SECRET_ENV}, else "
    "STATE_DIR/NAME.secret (/run/xdp-agg/NAME.secret).",
)
@click.option(
    "--insecure-no-auth",
    is_flag=True,
    help="Accept every request without credentials: anyone who reaches the endpoint can create, "
    "join and end jobs. Only for a trusted lab.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(1, 100_000),
    default=auth.Limits.max_connections,
    show_default=True,
    help="Open control connections in all.",
)
@click.option(
    "--max-per-source",
    type=click.IntRange(1, 100_000),
    default=auth.Limits.max_per_source,
    show_default=True,
    help="Open control connections from one address.",
)
@click.option(
    "--idle-timeout",
    type=click.FloatRange(0.1, 86_400),
    default=auth.Limits.idle_timeout,
    show_default=True,
    help="Seconds a connection that holds no job may take to send a request before it is cut.",
)
@click.option(
    "--job-lease",
    type=click.FloatRange(0, 86_400),
    default=auth.Limits.job_lease,
    show_default=True,
    help="Seconds a job lives while none of its members sends a request (hostlib pings every "
    "10 s) and the aggregator counts no traffic of it; then it is deleted, freeing its slots "
    "and port (a crashed run's stuck ranks). 0: never.",
)
@click.option(
    "--request-rate",
    type=click.FloatRange(0.1, 1e6),
    default=auth.Limits.rate,
    show_default=True,
    help="Requests per second per source address (bursts up to three times that).",
)
@click.option(
    "--rejoin-timeout",
    type=click.FloatRange(0.1),
    default=60.0,
    show_default=True,
    help="xdp: after a restart, how long a recovered job's ranks have to reconnect before "
    "they count as gone (which frees the job).",
)
@click.option(
    "--parent",
    default=None,
    help="Two levels: HOST:PORT of the parent's control endpoint; every job created here is a "
    "rack of the parent's job of the same name (README: Two-level trees).",
)
@click.option(
    "--rack-rank",
    type=click.IntRange(0, limits.MAX_WORKERS - 1),
    default=None,
    help="With --parent: this rack's rank in the parent's jobs.",
)
@click.option(
    "--racks",
    type=click.IntRange(1, limits.MAX_WORKERS),
    default=None,
    help="With --parent: racks under the parent (its jobs' world size).",
)
@click.option(
    "--tree-workers",
    type=click.IntRange(1, 64 * 64),
    default=None,
    help="With --parent: workers under the root, for float scaling "
    "(default: racks x this job's workers).",
)
@click.option(
    "--parent-mac",
    default=None,
    help="With --parent: the next hop toward the parent (default: the parent's own MAC).",
)
@click.option(
    "--parent-secret-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="With --parent: the parent endpoint's deployment secret (default: this endpoint's).",
)
@click.pass_context
def serve(
    ctx,
    listen,
    group_ip,
    results,
    group_base,
    barrier_timeout,
    target,
    ports,
    workdir,
    udp_checksum,
    secret_file,
    insecure_no_auth,
    max_connections,
    max_per_source,
    idle_timeout,
    job_lease,
    request_rate,
    rejoin_timeout,
    parent,
    rack_rank,
    racks,
    tree_workers,
    parent_mac,
    parent_secret_file,
):
    """Run the control endpoint: rank 0 creates jobs, every worker registers.

    The host library (hostlib.init) talks to this; nobody types worker tables. Jobs get a slot
    range, an aggregator port and a job id, and are deleted when their workers leave. Runs until
    interrupted. With --target bmv2 it also starts simple_switch with the P4 program on --ports
    (p4c and bmv2 must be installed, see p4/README.md) and stops it on exit: the host library
    talks to bmv2 exactly as to the XDP aggregator.

    With --target xdp, one serve per aggregator name (a second exits 4: the lock
    /run/xdp-agg/NAME.lock). The job table is saved in /run/xdp-agg/NAME.jobs on every change;
    stopping serve leaves the jobs running in the data plane, and a restarted serve recovers
    them from that file and the pinned maps (their workers reconnect by themselves).

    \b
    Workers prove the deployment secret to create a job (hostlib.init reads the file named
    by $XDP_AGG_SECRET_FILE), and each job's token or the secret to touch it; give workers a
    copy of the secret file (mode 0600). README "Trust model" says what this protects.

    A job striped over several aggregators needs one control endpoint per aggregator, each in
    front of its own attached program (give each its own --group-base, so that their jobs'
    groups differ); the workers list all of them (hostlib.init(aggregator=[...]), README
    "Several aggregators").

    \b
    Examples:
      sudo xdp-agg --netns agg serve                      # on the interface's address
      sudo xdp-agg --netns agg serve --listen 198.18.0.1:48800
      sudo xdp-agg --netns agg serve --listen 198.18.0.1:48800 --results broadcast
      sudo xdp-agg serve --secret-file /etc/xdp-agg/lab.secret
      sudo xdp-agg --netns agg serve --target bmv2 --ports p0,p1,p2,p3 --listen 0.0.0.0:48800
      sudo xdp-agg --name rack0 serve --parent 198.18.0.1:48800 --rack-rank 0 --racks 2
    """
    _check_group_choice(group_ip, results)
    name = ctx.obj["name"]
    if target == "bmv2" and not ports:
        raise click.UsageError("--target bmv2 needs --ports IFACE,IFACE,...")
    host, port = listen or ("", DEFAULT_CONTROL_PORT)
    if not host:
        ifnames = ports.split(",") if target == "bmv2" else serving.aggregator_interfaces(name)
        host = serving.listen_address(ifnames)
    limits = auth.Limits(
        max_connections=max_connections,
        max_per_source=max_per_source,
        idle_timeout=idle_timeout,
        job_lease=job_lease,
        rate=request_rate,
        burst=max(1, int(3 * request_rate)),
    )
    secret = None
    notes = []
    if insecure_no_auth:
        notes.append(
            "WARNING: --insecure-no-auth: anyone who reaches this endpoint can create, join and "
            "end jobs"
        )
    else:
        path = os.path.abspath(secret_file or serving.default_secret_path(name))
        secret = serving.secret_for(path)
        notes.append(f"deployment secret: {path} (workers: {control.SECRET_ENV}=<a copy of it>)")
    if host == "0.0.0.0":
        notes.append("WARNING: listening on every address (0.0.0.0), as --listen asked")
    link = None
    if parent is not None:
        if target != "xdp" or rack_rank is None or racks is None:
            raise click.UsageError("--parent needs --target xdp, --rack-rank and --racks")
        try:
            from aggctl.tree import ParentLink, parse_endpoint

            link = ParentLink(
                parse_endpoint(parent),
                rack_rank,
                racks,
                total_workers=tree_workers or 0,
                parent_mac=parent_mac,
                barrier_timeout=barrier_timeout,
                secret=serving.read_secret(parent_secret_file) if parent_secret_file else secret,
            )
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--parent/--rack-rank/--racks") from None

    def announce(line: str) -> None:
        click.echo(line, err=True)  # the first line says "listening" (launchers wait for it)
        for note in notes:
            click.echo(note, err=True)

    if target == "xdp":
        serving.serve_xdp(
            name,
            host,
            port,
            group_ip=group_ip,
            barrier_timeout=barrier_timeout,
            udp_checksum=udp_checksum,
            results=results,
            group_base=group_base,
            secret=secret,
            limits=limits,
            rejoin_timeout=rejoin_timeout,
            announce=announce,
            warn=lambda line: click.echo(line, err=True),
            parent=link,
        )
        return
    serving.serve_bmv2(
        ports.split(","),
        workdir,
        host,
        port,
        netns=ctx.obj["netns"],
        barrier_timeout=barrier_timeout,
        secret=secret,
        limits=limits,
        announce=announce,
    )


@main.command("install-service")
@click.argument("name", default="default", callback=_name)
@click.option("--interfaces", default="", help='The sample config\'s INTERFACES, e.g. "eth1".')
@click.option(
    "--listen",
    default=None,
    callback=_listen,
    help="The sample config's LISTEN (default: empty, serve's default address).",
)
@click.option(
    "--root",
    type=click.Path(file_okay=False),
    default="/",
    show_default=True,
    help="Install under this directory instead of / (for packaging and tests).",
)
@click.option(
    "--exec",
    "exe",
    default=None,
    help="How the unit runs xdp-agg (default: the xdp-agg script of this installation).",
)
@click.option("--force", is_flag=True, help="Overwrite an existing config with the sample.")
@click.option("--json", "as_json", is_flag=True)
def install_service(name, interfaces, listen, root, exe, force, as_json):
    """Write the systemd unit xdp-agg@.service and a sample /etc/xdp-agg/NAME.conf.

    The unit attaches aggregator NAME to the config's interfaces and runs the control endpoint;
    stopping it detaches; it restarts on failure. Edit the config, then enable the unit (this
    prints the commands).

    \b
    Examples:
      sudo xdp-agg install-service --interfaces eth1
      sudo xdp-agg install-service lab --interfaces "p0 p1 p2 p3" --listen 198.18.0.1:48800
      xdp-agg install-service --root /tmp/pkgroot --json
    """
    rep = service.install_files(
        Path(root),
        name,
        interfaces.split(),
        exe=exe,
        listen=f"{listen[0]}:{listen[1]}" if listen else "",
        force=force,
    )

    def text(r):
        for path in r["written"]:
            click.echo(f"wrote {path}")
        for path in r["kept"]:
            click.echo(f"kept {path} (--force replaces it with the sample)")
        click.echo(
            "next:\n"
            f"  edit {r['config']} (INTERFACES, LISTEN, ...)\n"
            "  sudo systemctl daemon-reload\n"
            f"  sudo systemctl enable --now {r['instance']}\n"
            f"  sudo xdp-agg --name {r['name']} status          # is it attached?\n"
            f"  journalctl -u {r['instance']}               # what it said"
        )

    _emit(rep, as_json, text)


@main.command("service-start")
@click.argument("name", callback=_name)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Default: /etc/xdp-agg/NAME.conf.",
)
@click.pass_context
def service_start(ctx, name, config_file):
    """What the unit xdp-agg@NAME runs: attach as NAME.conf says, then serve until SIGTERM.

    An aggregator NAME left attached by an earlier run is detached first (the service owns the
    name). Messages go to stderr, which systemd puts in the journal.

    \b
    Example:
      sudo xdp-agg service-start lab --config /etc/xdp-agg/lab.conf
    """
    cfg = service.read_config(name, Path(config_file) if config_file else None)
    # SERVE_OPTIONS are parsed before anything is attached: a usage error there exits 2 with
    # nothing to undo
    ctx.obj["name"], ctx.obj["netns"] = name, cfg.netns
    sub = serve.make_context("serve", cfg.serve_args(), parent=ctx)
    if cfg.netns:
        links.enter_netns(cfg.netns)

    def say(line: str) -> None:
        click.echo(f"xdp-agg@{name}: {line}", err=True)

    if service.clear_leftover(name):
        say("detached what an earlier run left attached")
    state = aggregator.attach(
        cfg.interfaces,
        name=name,
        topology=cfg.topology,
        xdp_mode=cfg.xdp_mode,
        pool_slots=cfg.pool_slots,
        netns=cfg.netns,
        variant=cfg.variant,
    )
    say(
        f"attached to {', '.join(cfg.interfaces)} ({state.topology}, {state.xdp_mode} XDP, "
        f"{state.pool_slots} slots)"
    )
    with sub:
        serve.invoke(sub)


@main.command("service-stop")
@click.argument("name", callback=_name)
@click.option("--json", "as_json", is_flag=True)
def service_stop(name, as_json):
    """What the unit runs when it stops: detach aggregator NAME if it is attached.

    Nothing attached is not an error (the unit runs this after a failed start too).

    \b
    Example:
      sudo xdp-agg service-stop lab
    """
    rep = service.stop(name) or {"name": name, "detached": [], "left_alone": []}
    _emit(
        rep,
        as_json,
        lambda r: click.echo(
            f"xdp-agg@{name}: detached from {', '.join(r['detached']) or 'nothing'}", err=True
        ),
    )


@main.command()
@click.option(
    "--workers",
    type=click.IntRange(1, limits.MAX_WORKERS),
    default=4,
    show_default=True,
    help="Workers per job in the stream.",
)
@click.option(
    "--rounds",
    type=click.IntRange(1, 10_000),
    default=20,
    show_default=True,
    help="Rounds over 64 slots per repetition.",
)
@click.option("--repeats", type=click.IntRange(1, 100), default=5, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def bench(workers, rounds, repeats, as_json):
    """Micro-benchmark of the XDP program (BPF_PROG_TEST_RUN, one core).

    Prints ns per packet and aggregated elements per second per core for 64, 256 and 768
    elements per packet, for both variants (per-CPU partial sums, and the spin-lock baseline),
    beside a program that only parses and drops (the floor), all in one run. Needs root;
    attaches nothing.
    """
    from . import microbench

    def progress(k, i, n):
        if not as_json:
            click.echo(f"  {k} elems/packet: pass {i}/{n}", err=True)

    res = microbench.run(workers=workers, rounds=rounds, repeats=repeats, progress=progress)
    _emit([r.to_dict() for r in res], as_json, lambda _: click.echo(microbench.table(res)))


if __name__ == "__main__":
    main()
