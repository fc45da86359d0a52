"""`xdp-agg`: attach the XDP aggregator and manage its jobs, workers and counters.

Exit codes (every command):
  0  success
  1  the operation failed (the message says why and what to do)
  2  usage error (bad option or argument)
  3  environment: not root, no bpffs, bcc or kernel headers missing

Codes 1 and 3 are the exit_code of the XdpAggError the command raised (xdp_switch/errors.py);
2 is click's. This module parses options; what the commands decide lives in aggregator.py
(attach, detach, status, counters), serving.py (job defaults, the control endpoint) and
service.py (the systemd unit and its config).
"""

from __future__ import annotations

import importlib.metadata
import ipaddress
import json
import time
from pathlib import Path

import click

from aggproto import limits, wire
from aggproto.jobs import DEFAULT_CONTROL_PORT, WorkerSpec

from . import aggregator, links, loader, pins, service, serving
from .errors import EXIT_ENV, EXIT_FAILED, EXIT_OK, EXIT_USAGE, XdpAggError

__all__ = ["EXIT_ENV", "EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "main"]


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


def _listen(ctx, param, value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    try:
        if not sep or not 0 < int(port) < 65536:
            raise ValueError
        return host or "0.0.0.0", int(port)
    except ValueError:
        raise click.BadParameter(f"{value!r}: use HOST:PORT, e.g. 0.0.0.0:48800") from None


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
    "3 environment (root, bpffs, bcc, headers).",
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
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def detach(ctx, as_json):
    """Detach our program from every interface it was attached to and remove its pins.

    A program that is no longer ours on an interface is left alone (and reported).
    """
    rep = aggregator.detach(ctx.obj["name"])
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
    default="0.0.0.0",
    callback=_ipv4,
    help="One-arm: group (multicast or subnet broadcast) address of results.",
)
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
    as_json,
):
    """Create job JOB_ID (its slots start cleared).

    \b
    Example:
      sudo xdp-agg job create 0 --workers 4 --elems 256 --slots 0:128 --group 198.18.0.255
      sudo xdp-agg job create 1 --workers 2 --slots 128:64 --port 48865 --udp-checksum
    """
    base, count = _slot_range(slots)
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
                f"published={v['published']} e0={v['result_e0']} head={v['result_head']}"
            )

    _emit(s, as_json, text)


@main.command()
@click.option(
    "--listen",
    default=f"0.0.0.0:{DEFAULT_CONTROL_PORT}",
    show_default=True,
    callback=_listen,
    help="HOST:PORT of the control endpoint (TCP).",
)
@click.option(
    "--group",
    "group_ip",
    default=None,
    callback=_ipv4,
    help="One-arm: where results go (default: the interface's subnet broadcast).",
)
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
@click.pass_context
def serve(ctx, listen, group_ip, barrier_timeout, target, ports, workdir, udp_checksum):
    """Run the control endpoint: rank 0 creates jobs, every worker registers.

    The host library (hostlib.init) talks to this; nobody types worker tables. Jobs get a slot
    range, an aggregator port and a job id, and are deleted when their workers leave. Runs until
    interrupted. With --target bmv2 it also starts simple_switch with the P4 program on --ports
    (p4c and bmv2 must be installed, see p4/README.md) and stops it on exit: the host library
    talks to bmv2 exactly as to the XDP aggregator.

    A job striped over several aggregators needs one control endpoint per aggregator, each in
    front of its own attached program (give each its own --group); the workers list all of them
    (hostlib.init(aggregator=[...]), README "Several aggregators").

    \b
    Examples:
      sudo xdp-agg --netns agg serve --listen 198.18.0.1:48800
      sudo xdp-agg --netns agg serve --target bmv2 --ports p0,p1,p2,p3
    """
    host, port = listen

    def announce(line: str) -> None:
        click.echo(line, err=True)

    if target == "xdp":
        serving.serve_xdp(
            ctx.obj["name"],
            host,
            port,
            group_ip=group_ip,
            barrier_timeout=barrier_timeout,
            udp_checksum=udp_checksum,
            announce=announce,
        )
        return
    if not ports:
        raise click.UsageError("--target bmv2 needs --ports IFACE,IFACE,...")
    serving.serve_bmv2(
        ports.split(","),
        workdir,
        host,
        port,
        netns=ctx.obj["netns"],
        barrier_timeout=barrier_timeout,
        announce=announce,
    )


@main.command("install-service")
@click.argument("name", default="default", callback=_name)
@click.option("--interfaces", default="", help='The sample config\'s INTERFACES, e.g. "eth1".')
@click.option(
    "--listen",
    default=f"0.0.0.0:{DEFAULT_CONTROL_PORT}",
    show_default=True,
    callback=_listen,
    help="The sample config's LISTEN.",
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
        listen=f"{listen[0]}:{listen[1]}",
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
