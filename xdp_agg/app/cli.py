"""`xdp-agg`: attach the XDP aggregator and manage its jobs, workers and counters.

Exit codes (every command):
  0  success
  1  the operation failed (the message says why and what to do)
  2  usage error (bad option or argument)
  3  environment: not root, no bpffs, the BPF objects missing
  4  busy: another `xdp-agg serve` already serves this aggregator name

Codes 1, 3 and 4 are the exit_code of the XdpAggError the command raised (xdp_agg/errors.py);
2 is click's. This module parses options; what the commands decide lives in
xdp_switch/backend.py (attach, detach, status, counters), serving.py (job defaults, the
control endpoint) and service.py (the systemd unit and its config).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import click

from xdp_agg.errors import EXIT_BUSY, EXIT_ENV, EXIT_FAILED, EXIT_OK, EXIT_USAGE, XdpAggError
from xdp_agg.proto import limits, wire
from xdp_agg.proto.jobs import WorkerSpec
from xdp_switch import backend as xdp_backend
from xdp_switch import links, pins
from xdp_switch import slot_cpus as cpu_table

from . import options, service, serving

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


def _json_option(what: str = "the result"):
    """--json, the same on every command: machine-readable output instead of text."""
    return click.option("--json", "as_json", is_flag=True, help=f"Print {what} as JSON.")


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


def _version() -> str:
    """The installed distribution's version (pyproject.toml); a bare checkout has none."""
    from . import build  # importlib.metadata: only --version needs it

    return build.version() or "unknown (not installed: pip install .)"


def _print_version(ctx: click.Context, param, value: bool) -> None:
    """--version, as click.version_option prints it, the version looked up only when asked."""
    if value and not ctx.resilient_parsing:
        click.echo(f"xdp-agg, version {_version()}")
        ctx.exit()


@click.group(
    cls=_Cli,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Exit codes: 0 ok, 1 operation failed, 2 usage error, "
    "3 environment (root, bpffs, BPF objects), 4 busy (another serve of this name).",
)
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the version and exit.",
)
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
      sudo xdp-agg service-install --interfaces eth1   # as a systemd service

    Shell completion (bash): eval "$(_XDP_AGG_COMPLETE=bash_source xdp-agg)"
    """
    ctx.ensure_object(dict)
    ctx.obj["name"] = name
    ctx.obj["netns"] = netns
    if netns:
        links.enter_netns(netns)


@main.command()
@click.argument("ifaces", nargs=-1, required=True)
@options.click_options(options.AttachOptions)
@_json_option()
@click.pass_context
def attach(ctx, ifaces, opts: options.AttachOptions, as_json):
    """Load the aggregator (built with the project) and attach it to IFACES; it stays after
    this command exits.
    Also reports what each interface's receive hash (RSS) for UDP/IPv4 is set to, and what to
    change so that every packet of a slot reaches one CPU (docs/operations.md).

    \b
    Examples:
      sudo xdp-agg attach eth0
      sudo xdp-agg --netns agg attach p0 p1 --xdp-mode skb
      sudo xdp-agg --name lab attach eth1 --pool-slots 4096 --json
      sudo xdp-agg attach eth0 --frags       # MTU 9000: 2048 int32 per packet
      sudo xdp-agg attach veth0 --slot-cpus cpumap --cpus 0-1
    """
    state = xdp_backend.attach(list(ifaces), opts, name=ctx.obj["name"], netns=ctx.obj["netns"])
    out = {**state.to_dict(), "rss": [cpu_table.rss_report(i) for i in ifaces]}
    _emit(out, as_json, _say_attached)


def _attached_as(o: dict) -> str:
    """The options of a state (status's "options", every AttachOptions field) in words."""
    cpus = f" on CPUs {','.join(map(str, o['cpus']))}" if o.get("cpus") else ""
    words = [f"variant {o['variant']}", f"slot CPUs {o['slot_cpus']}{cpus}"]
    words += ["frags"] if o["frags"] else []
    return ", ".join(words)


def _say_attached(s: dict) -> None:
    cpus = f", slots on CPUs {s['options']['cpus']}" if s["options"].get("cpus") else ""
    click.echo(
        f"attached {s['name']} ({s['topology']}, {s['xdp_mode']} XDP, slot CPUs "
        f"{s['options']['slot_cpus']}{cpus}) to {', '.join(i['ifname'] for i in s['interfaces'])}"
        f"; program id {s['prog_id']}, {s['pool_slots']} slots"
    )
    for r in s["rss"]:
        click.echo(f"  RSS: {r['advice']}")


@main.command()
@click.option(
    "--force",
    is_flag=True,
    help="Detach even while jobs are live: their workers' all-reduces then fail with an error "
    "saying the aggregator's state is gone.",
)
@_json_option()
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
    rep = xdp_backend.detach(ctx.obj["name"], force=force)
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
@_json_option()
@click.pass_context
def status(ctx, as_json):
    """Program, interfaces and jobs of the aggregator.

    \b
    Examples:
      sudo xdp-agg status
      sudo xdp-agg --name lab status --json
    """
    st = xdp_backend.status(ctx.obj["name"])

    def text(s):
        click.echo(
            f"{s['name']}: {s['topology']} topology, {s['xdp_mode']} XDP, "
            f"program id {s['prog_id']}, {s['pool_slots']} slots"
        )
        click.echo(f"  attached with {_attached_as(s['options'])}")
        if s.get("forwarding", {}).get("mode", "off") != "off":
            click.echo("  " + _forwarding_line(s["forwarding"]))
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


def _forwarding_line(f: dict) -> str:
    """One line for the switch topology's forwarding: its mode and non-zero counters."""
    c = ", ".join(f"{k}={v}" for k, v in f["counters"].items() if v) or "nothing yet"
    table = f["mac_table"]
    macs = f", {table['entries']}/{table['size']} MACs learned" if f["mode"] == "switched" else ""
    snoop = f.get("igmp_snooping", {})
    if f["mode"] == "switched" and snoop:
        querier = "querier present" if snoop["querier"] else "no querier: multicast flooded"
        macs += f", IGMP snooping: {len(snoop['groups'])} groups, {querier}"
    return f"forwarding {f['mode']}: {c}{macs}"


def _parent_line(p: dict) -> str:
    """One line for a tree job's parent link and its counters."""
    c = ", ".join(f"{k}={v}" for k, v in p["counters"].items())
    return f"parent {p['address']} (uplink port {p['uplink_port']}): {c}"


@main.command()
@click.option("--watch", is_flag=True, help="Refresh every --interval seconds until interrupted.")
@click.option(
    "--interval",
    type=click.FloatRange(0.01),
    default=1.0,
    show_default=True,
    help="With --watch: seconds between refreshes.",
)
@click.option(
    "--prometheus",
    is_flag=True,
    help="Print the metrics `serve --metrics` serves, once, in Prometheus's text format (for "
    "node_exporter's textfile collector); without the control endpoint's.",
)
@_json_option()
@click.pass_context
def stats(ctx, watch, interval, prometheus, as_json):
    """Packet counters by reason: without a job, per job, and per worker.

    \b
    Examples:
      sudo xdp-agg stats --json
      sudo xdp-agg stats --watch --interval 2     # Ctrl-C ends it
      sudo xdp-agg stats --prometheus      # once (node_exporter's textfile collector)
    """
    if prometheus:
        if watch or as_json:
            raise click.UsageError("--prometheus prints once in its own format: no --watch, --json")
        click.echo(serving.xdp_exposition(ctx.obj["name"]), nl=False)
        return
    try:
        while True:
            s = xdp_backend.stats(ctx.obj["name"])
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


@job.command("create")
@click.argument("job_id", type=click.IntRange(0, limits.MAX_JOBS - 1))
@options.click_options(options.JobOptions)
@_json_option("the job as created")
@click.pass_context
def job_create(ctx, job_id, opts: options.JobOptions, as_json):
    """Create job JOB_ID (its slots start cleared).

    \b
    Examples:
      sudo xdp-agg job create 0 --workers 4 --elems 256 --slots 0:128   # group 239.18.0.0
      sudo xdp-agg job create 0 --workers 4 --elems 256 --slots 0:128 --group 198.18.0.255
      sudo xdp-agg job create 1 --workers 2 --slots 128:64 --agg-port 48865 --udp-checksum
      sudo xdp-agg --name rack0 job create 0 --workers 3 --slots 0:64 --group 198.18.0.255 \\
          --parent-address 198.18.0.1:48864 --parent-mac 02:00:c6:12:00:01 --parent-slots 0 \\
          --worker-port 40000 --tree-workers 6
    """
    spec = serving.create_job(
        ctx.obj["name"], job_id, opts, warn=lambda line: click.echo(line, err=True)
    )
    base, count = opts.slots
    _emit(
        spec.to_dict(),
        as_json,
        lambda _: click.echo(
            f"job {job_id} created: {opts.num_workers} workers, {opts.elems} elems/packet, "
            f"slots {base}..{base + count - 1}"
        ),
    )


@job.command("delete")
@click.argument("job_id", type=click.IntRange(0, limits.MAX_JOBS - 1))
@_json_option()
@click.pass_context
def job_delete(ctx, job_id, as_json):
    """Delete a job and its workers.

    \b
    Example:
      sudo xdp-agg job delete 0
    """
    xdp_backend.XdpBackend(ctx.obj["name"]).delete_job(job_id)
    _emit(
        {"job_id": job_id, "deleted": True}, as_json, lambda _: click.echo(f"job {job_id} deleted")
    )


@job.command("list")
@_json_option()
@click.pass_context
def job_list(ctx, as_json):
    """The configured jobs and their workers.

    \b
    Example:
      sudo xdp-agg job list --json
    """
    jobs = xdp_backend.XdpBackend(ctx.obj["name"]).jobs()
    _emit(
        jobs, as_json, lambda js: [click.echo(json.dumps(j)) for j in js] or click.echo("no jobs")
    )


@main.group()
def worker():
    """Register and remove workers of a job."""


@worker.command("add")
@click.argument("job_id", type=click.IntRange(0, limits.MAX_JOBS - 1))
@click.argument("index", type=click.IntRange(0, limits.MAX_WORKERS - 1))
@click.argument("ip", callback=options.ipv4)
@click.option(
    "--worker-port",
    "port",
    type=click.IntRange(1, 65535),
    default=wire.UDP_PORT,
    show_default=True,
    help="The worker's UDP port (its results go there).",
)
@click.option(
    "--agg-port",
    type=click.IntRange(wire.UDP_PORT, wire.UDP_PORT + 15),
    default=wire.UDP_PORT,
    show_default=True,
    help="The aggregator port the worker sends to (its job's --agg-port).",
)
@click.option("--mac", default="00:00:00:00:00:00", help="Switch topology: the worker's MAC.")
@_json_option("the worker as registered")
@click.pass_context
def worker_add(ctx, job_id, index, ip, port, agg_port, mac, as_json):
    """Register worker INDEX of JOB_ID, sending from IP.

    \b
    Examples:
      sudo xdp-agg worker add 0 0 198.18.0.10
      sudo xdp-agg worker add 0 1 198.18.0.11 --mac 02:00:00:00:00:0b
    """
    spec = WorkerSpec(job_id, index, ip, port, agg_port, mac)
    xdp_backend.XdpBackend(ctx.obj["name"]).add_worker(spec)
    _emit(
        dataclasses.asdict(spec),
        as_json,
        lambda _: click.echo(f"worker {index} of job {job_id}: {ip}"),
    )


@worker.command("remove")
@click.argument("job_id", type=click.IntRange(0, limits.MAX_JOBS - 1))
@click.argument("index", type=click.IntRange(0, limits.MAX_WORKERS - 1))
@_json_option()
@click.pass_context
def worker_remove(ctx, job_id, index, as_json):
    """Unregister worker INDEX of JOB_ID.

    \b
    Example:
      sudo xdp-agg worker remove 0 1
    """
    xdp_backend.XdpBackend(ctx.obj["name"]).remove_worker(job_id, index)
    _emit(
        {"job_id": job_id, "index": index, "removed": True},
        as_json,
        lambda _: click.echo(f"worker {index} of job {job_id} removed"),
    )


@main.command()
@click.argument("slot", type=click.IntRange(0, wire.MAX_SLOTS - 1))
@_json_option()
@click.pass_context
def slots(ctx, slot, as_json):
    """One slot's state (both versions), for debugging.

    \b
    Example:
      sudo xdp-agg slots 3 --json
    """
    s = xdp_backend.slot_state(slot, ctx.obj["name"])

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
@options.click_options(options.ServeOptions)
@_json_option('what serve says as it starts (a line {"listening": ..., "notes": [...]})')
@click.pass_context
def serve(ctx, opts: options.ServeOptions, as_json):
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
    copy of the secret file (mode 0600). docs/operations.md ("Trust model") says what this
    protects.

    With --switchml-grpc, p4app-switchML's own hosts (its client library, dpdk backend) join
    too, through its controller's gRPC API: each session is a job on aggregator port 0xBEE0,
    slots from 0. That API has no credentials: it takes calls from --switchml-allow's networks
    only (by default the subnets of the aggregator's interfaces); give it an address only the
    SwitchML hosts reach.

    A job striped over several aggregators needs one control endpoint per aggregator, each in
    front of its own attached program (give each its own --group-base, so that their jobs'
    groups differ); the workers list all of them (hostlib.init(rank, n, [CONTROL, ...], job),
    docs/striping-and-trees.md).

    \b
    Examples:
      sudo xdp-agg --netns agg serve                      # on the interface's address
      sudo xdp-agg --netns agg serve --listen 198.18.0.1:48800
      sudo xdp-agg --netns agg serve --listen 198.18.0.1:48800 --results broadcast
      sudo xdp-agg serve --secret-file /etc/xdp-agg/lab.secret
      sudo xdp-agg --netns agg serve --switchml-grpc 198.18.0.1:50099  # p4app-switchML hosts
      sudo xdp-agg --netns agg serve --target bmv2 --ports p0,p1,p2,p3 --listen 0.0.0.0:48800
      sudo xdp-agg --name rack0 serve --parent-endpoint 198.18.0.1:48800 --rack-rank 0 --racks 2
      sudo xdp-agg serve --target bmv2 --ports eth0 --parent-endpoint 198.18.0.1:48800 \\
          --rack-rank 1 --racks 2                       # a bmv2 rack under the same root
    """
    name = ctx.obj["name"]
    try:
        endpoint = serving.resolve(name, opts)
    except ValueError as e:  # the parent options make no link
        raise click.BadParameter(
            str(e), param_hint="--parent-endpoint/--rack-rank/--racks"
        ) from None

    def announce(line: str) -> None:
        click.echo(line, err=True)  # the first line says "listening" (launchers wait for it)
        for note in endpoint.notes:
            click.echo(note, err=True)
        if as_json:
            click.echo(json.dumps({"listening": line, "notes": endpoint.notes}))

    serving.serve(
        name,
        opts,
        endpoint,
        netns=ctx.obj["netns"],
        announce=announce,
        warn=lambda line: click.echo(line, err=True),
    )


@main.command("service-install")
@click.argument("name", default="default", callback=_name)
@click.option("--interfaces", default="", help='The sample config\'s INTERFACES, e.g. "eth1".')
@click.option(
    "--listen",
    default=None,
    callback=options.listen,
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
@options.click_options(options.AttachOptions, param="attach")
@_json_option()
def install_service(name, interfaces, listen, root, exe, force, attach, as_json):
    """Write the systemd unit xdp-agg@.service and a sample /etc/xdp-agg/NAME.conf.

    The unit attaches aggregator NAME to the config's interfaces and runs the control endpoint;
    stopping it detaches; it restarts on failure. Edit the config, then enable the unit (this
    prints the commands). The options of `xdp-agg attach` (--topology ... --cpus) are
    the sample config's keys of the same names (TOPOLOGY ... CPUS).

    \b
    Examples:
      sudo xdp-agg service-install --interfaces eth1
      sudo xdp-agg service-install lab --interfaces "p0 p1 p2 p3" --listen 198.18.0.1:48800
      sudo xdp-agg service-install --interfaces eth1 --slot-cpus cpumap --cpus 0-3
      xdp-agg service-install --root /tmp/pkgroot --json
    """
    rep = service.install_files(
        Path(root),
        name,
        interfaces.split(),
        exe=exe,
        listen=f"{listen[0]}:{listen[1]}" if listen else "",
        attach=attach,
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
    help="The config file to read (default: /etc/xdp-agg/NAME.conf).",
)
@_json_option("what serve says as it starts (serve --json)")
@click.pass_context
def service_start(ctx, name, config_file, as_json):
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
    args = cfg.serve_args() + (["--json"] if as_json else [])
    sub = serve.make_context("serve", args, parent=ctx)
    if cfg.netns:
        links.enter_netns(cfg.netns)

    def say(line: str) -> None:
        click.echo(f"xdp-agg@{name}: {line}", err=True)

    if service.clear_leftover(name):
        say("detached what an earlier run left attached")
    state = xdp_backend.attach(cfg.interfaces, cfg.attach, name=name, netns=cfg.netns)
    say(
        f"attached to {', '.join(cfg.interfaces)} ({state.topology}, {state.xdp_mode} XDP, "
        f"{state.pool_slots} slots; {_attached_as(state.options)})"
    )
    with sub:
        serve.invoke(sub)


@main.command("service-stop")
@click.argument("name", callback=_name)
@_json_option()
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
@options.click_options(options.BenchOptions)
@_json_option()
def bench(opts: options.BenchOptions, as_json):
    """Micro-benchmark of the XDP program (BPF_PROG_TEST_RUN, one core).

    Prints ns per packet and aggregated elements per second per core for 64, 256, 768 and
    2048 elements per packet, for both variants (per-CPU partial sums, and the spin-lock
    baseline), the per-CPU program loaded as a multi-buffer (frags) program, the only one
    measured at 2048 (a jumbo frame), and the per-CPU program with unicast delivery (its copy
    program's n runs per result added: one copy per packet), beside a program that only parses
    and drops (the floor), all in one run. Needs root; attaches nothing.

    \b
    Examples:
      sudo xdp-agg bench
      sudo xdp-agg bench --workers 8 --repeats 3 --json
      sudo xdp-agg bench --slot-cpus      # two CPUs: rss (merge) against cpumap
      sudo xdp-agg bench --cpus 1,2,4,8   # scaling over CPUs, one job's shared slots
    """
    from xdp_switch import cpu_bench, microbench, slot_bench

    def progress(k, i, n):
        if not as_json:
            click.echo(f"  {k} elems/packet: pass {i}/{n}", err=True)

    if opts.cpus is not None:
        counts = opts.cpu_counts()
        rows = cpu_bench.run(
            counts,
            sizes=(256, 768),
            workers=opts.workers,
            rounds=opts.rounds,
            repeats=opts.repeats,
            progress=progress,
        )
        rep = {
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpus_available": len(os.sched_getaffinity(0)),
            "rows": rows,
            "not_run": cpu_bench.skipped(counts),
        }
        _emit(rep, as_json, lambda r: click.echo(cpu_bench.table(r["rows"], r["not_run"])))
        return
    if opts.slot_cpus:
        rows = slot_bench.run(workers=opts.workers, rounds=opts.rounds, repeats=opts.repeats)
        _emit(rows, as_json, lambda r: click.echo(slot_bench.table(r)))
        return
    res = microbench.run(
        workers=opts.workers, rounds=opts.rounds, repeats=opts.repeats, progress=progress
    )
    _emit([r.to_dict() for r in res], as_json, lambda _: click.echo(microbench.table(res)))


if __name__ == "__main__":
    main()
