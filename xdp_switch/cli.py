"""`xdp-agg`: attach the XDP aggregator and manage its jobs, workers and counters.

Exit codes (every command):
  0  success
  1  the operation failed (the message says why and what to do)
  2  usage error (bad option or argument)
  3  environment: not root, no bpffs, bcc or kernel headers missing
"""

from __future__ import annotations

import json
import sys
import time

import click

from aggproto import limits, wire
from aggproto.jobs import Delivery, JobSpec, WorkerSpec

from . import aggregator, links, loader

EXIT_FAILED, EXIT_USAGE, EXIT_ENV = 1, 2, 3
_ENV_HINTS = ("needs root", "run with sudo", "bpffs", "kernel headers", "python3-bpfcc")


def _fail(msg: str) -> None:
    code = EXIT_ENV if any(h in msg for h in _ENV_HINTS) else EXIT_FAILED
    click.echo(f"xdp-agg: {msg}", err=True)
    sys.exit(code)


def _emit(obj, as_json: bool, text) -> None:
    if as_json:
        click.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))
    else:
        text(obj)


def _guard(fn):
    """Turn our errors into a message and an exit code instead of a traceback."""

    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except (aggregator.AggregatorError, links.LinkError, loader.LoadError, ValueError, OSError, RuntimeError) as e:
            _fail(str(e))

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


@click.group(
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Exit codes: 0 ok, 1 operation failed, 2 usage error, 3 environment (root, bpffs, bcc, headers).",
)
@click.option("--name", default="default", show_default=True, help="Aggregator instance (pins under /sys/fs/bpf/xdp-agg/NAME).")
@click.option("--netns", default=None, help="Run in this network namespace (kept: /sys/fs/bpf stays visible).")
@click.pass_context
def main(ctx, name, netns):
    """In-network gradient aggregation (SwitchML protocol) in XDP.

    \b
    Examples:
      sudo xdp-agg attach eth0                      # one-arm mode on eth0
      sudo xdp-agg attach p0 p1 p2 p3               # switch mode over four ports
      sudo xdp-agg job create 0 --workers 4 --elems 256 --slots 0:128 --group 198.18.0.255
      sudo xdp-agg worker add 0 0 198.18.0.10
      sudo xdp-agg stats --watch
      sudo xdp-agg detach
    """
    ctx.ensure_object(dict)
    ctx.obj["name"] = name
    ctx.obj["netns"] = netns
    if netns:
        try:
            links.enter_netns(netns)
        except links.LinkError as e:
            _fail(str(e))


@main.command()
@click.argument("ifaces", nargs=-1, required=True)
@click.option("--mode", "xdp_mode", type=click.Choice(["native", "skb"]), default="native", show_default=True, help="XDP attach mode.")
@click.option("--topology", type=click.Choice(aggregator.MODES), default=None, help="Default: one-arm for one interface, switch for several.")
@click.option("--pool-slots", type=click.IntRange(1, wire.MAX_SLOTS), default=limits.DEFAULT_POOL_SLOTS, show_default=True, help="Aggregation slots shared by all jobs.")
@click.option("--variant", type=click.Choice(list(loader.VARIANTS)), default="percpu", show_default=True,
              help="percpu: per-CPU partial sums (the design); spinlock: one locked sum per slot (the baseline).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_context
@_guard
def attach(ctx, ifaces, xdp_mode, topology, pool_slots, variant, as_json):
    """Compile, load and attach the aggregator to IFACES; it stays after this command exits.

    \b
    Examples:
      sudo xdp-agg attach eth0
      sudo xdp-agg --netns agg attach p0 p1 --mode skb
    """
    state = aggregator.attach(
        list(ifaces), name=ctx.obj["name"], mode=topology, xdp_mode=xdp_mode, pool_slots=pool_slots,
        netns=ctx.obj["netns"], variant=variant,
    )
    _emit(
        state.to_dict(),
        as_json,
        lambda s: click.echo(
            f"attached {s['name']} ({s['mode']}, {s['xdp_mode']}) to {', '.join(i['ifname'] for i in s['interfaces'])}; "
            f"program id {s['prog_id']}, {s['pool_slots']} slots"
        ),
    )


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@_guard
def detach(ctx, as_json):
    """Detach our program from every interface it was attached to and remove its pins.

    A program that is no longer ours on an interface is left alone (and reported).
    """
    rep = aggregator.detach(ctx.obj["name"])
    _emit(rep, as_json, lambda r: click.echo(
        f"detached {r['name']} from {', '.join(r['detached']) or 'nothing'}"
        + (f"; left alone (not ours any more): {', '.join(r['left_alone'])}" if r["left_alone"] else "")
    ))


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@_guard
def status(ctx, as_json):
    """Program, interfaces and jobs of the aggregator."""
    st = aggregator.status(ctx.obj["name"])

    def text(s):
        click.echo(f"{s['name']}: {s['mode']} mode, {s['xdp_mode']} XDP, program id {s['prog_id']}, {s['pool_slots']} slots")
        for i in s["interfaces"]:
            click.echo(f"  {i['ifname']} (ifindex {i['ifindex']}): {'attached' if i['attached'] else 'NOT attached (program ' + str(i['current_prog_id']) + ')'}")
        for j in s["jobs"]:
            click.echo(f"  job {j['job_id']}: {len(j['workers'])}/{j['num_workers']} workers, {j['elems']} elems/packet, slots {j['slot_base']}..{j['slot_base'] + j['slot_count'] - 1}, {j['delivery']}")

    _emit(st, as_json, text)


def _print_stats(s) -> None:
    nz = {k: v for k, v in s["unattributed"].items() if v}
    click.echo("no job: " + (", ".join(f"{k}={v}" for k, v in nz.items()) or "-"))
    for j, js in s["jobs"].items():
        click.echo(f"job {j}: " + (", ".join(f"{k}={v}" for k, v in js["reasons"].items() if v) or "-"))
        for w, c in js["workers"].items():
            click.echo(f"  worker {w}: " + ", ".join(f"{k}={v}" for k, v in c.items()))


@main.command()
@click.option("--watch", is_flag=True, help="Refresh every --interval seconds until interrupted.")
@click.option("--interval", type=float, default=1.0, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@_guard
def stats(ctx, watch, interval, as_json):
    """Packet counters by reason: without a job, per job, and per worker."""
    while True:
        s = aggregator.stats(ctx.obj["name"])
        if watch and not as_json:
            click.clear()
            click.echo(time.strftime("%H:%M:%S"))
        _emit(s, as_json, _print_stats)
        if not watch:
            return
        time.sleep(interval)


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
@click.option("--elems", type=click.Choice([str(n) for n in wire.SIZE_CODE_ELEMS.values()]), default="256", show_default=True)
@click.option("--slots", "slots", default="0:128", show_default=True, help="BASE:COUNT of the pool.")
@click.option("--port", "agg_port", type=click.IntRange(wire.UDP_PORT, wire.UDP_PORT + 15), default=wire.UDP_PORT, show_default=True)
@click.option("--group", "group_ip", default="0.0.0.0", help="One-arm: group (multicast or subnet broadcast) address of results.")
@click.option("--group-mac", default=None, help="Default: derived from --group (multicast) or ff:ff:ff:ff:ff:ff.")
@click.option("--agg-ip", default=None, help="Source address of results (default: the interface's first address).")
@click.option("--udp-checksum", is_flag=True,
              help="Verify each contribution's UDP checksum (0 = none sent) and drop wrong ones; costs a pass over "
                   "the payload per packet (README: UDP checksums).")
@click.pass_context
@_guard
def job_create(ctx, job_id, num_workers, elems, slots, agg_port, group_ip, group_mac, agg_ip, udp_checksum):
    """Create job JOB_ID (its slots start cleared).

    \b
    Example:
      sudo xdp-agg job create 0 --workers 4 --elems 256 --slots 0:128 --group 198.18.0.255
      sudo xdp-agg job create 1 --workers 2 --slots 128:64 --port 48865 --udp-checksum
    """
    state, _ = aggregator.open_instance(ctx.obj["name"])
    first = links.addresses(state.interfaces[0]["ifname"])
    base, count = _slot_range(slots)
    spec = JobSpec(
        job_id=job_id,
        num_workers=num_workers,
        elems=int(elems),
        slot_base=base,
        slot_count=count,
        agg_port=agg_port,
        agg_ip=agg_ip or (first["ipv4"][0] if first["ipv4"] else "0.0.0.0"),
        agg_mac=first["mac"],
        group_ip=group_ip,
        group_mac=group_mac or group_mac_for(group_ip),
        udp_checksum=udp_checksum,
    )
    aggregator.XdpBackend(ctx.obj["name"]).create_job(spec)
    click.echo(f"job {job_id} created: {num_workers} workers, {elems} elems/packet, slots {base}..{base + count - 1}")


def group_mac_for(ip: str) -> str:
    """The Ethernet address of an IPv4 group: 01:00:5e + low 23 bits, or broadcast."""
    octets = [int(x) for x in ip.split(".")]
    if 224 <= octets[0] <= 239:
        return "01:00:5e:%02x:%02x:%02x" % (octets[1] & 0x7F, octets[2], octets[3])
    return "ff:ff:ff:ff:ff:ff"


@job.command("delete")
@click.argument("job_id", type=click.IntRange(0, limits.MAX_JOBS - 1))
@click.pass_context
@_guard
def job_delete(ctx, job_id):
    """Delete a job and its workers."""
    aggregator.XdpBackend(ctx.obj["name"]).delete_job(job_id)
    click.echo(f"job {job_id} deleted")


@job.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@_guard
def job_list(ctx, as_json):
    """The configured jobs and their workers."""
    jobs = aggregator.XdpBackend(ctx.obj["name"]).jobs()
    _emit(jobs, as_json, lambda js: [click.echo(json.dumps(j)) for j in js] or click.echo("no jobs"))


@main.group()
def worker():
    """Register and remove workers of a job."""


@worker.command("add")
@click.argument("job_id", type=click.IntRange(0, limits.MAX_JOBS - 1))
@click.argument("index", type=click.IntRange(0, limits.MAX_WORKERS - 1))
@click.argument("ip")
@click.option("--port", type=click.IntRange(1, 65535), default=wire.UDP_PORT, show_default=True, help="The worker's UDP port.")
@click.option("--agg-port", type=click.IntRange(wire.UDP_PORT, wire.UDP_PORT + 15), default=wire.UDP_PORT, show_default=True)
@click.option("--mac", default="00:00:00:00:00:00", help="Switch mode: the worker's MAC.")
@click.pass_context
@_guard
def worker_add(ctx, job_id, index, ip, port, agg_port, mac):
    """Register worker INDEX of JOB_ID, sending from IP.

    \b
    Example:
      sudo xdp-agg worker add 0 1 198.18.0.11 --mac 02:00:00:00:00:0b
    """
    aggregator.XdpBackend(ctx.obj["name"]).add_worker(WorkerSpec(job_id, index, ip, port, agg_port, mac))
    click.echo(f"worker {index} of job {job_id}: {ip}")


@worker.command("remove")
@click.argument("job_id", type=click.IntRange(0, limits.MAX_JOBS - 1))
@click.argument("index", type=click.IntRange(0, limits.MAX_WORKERS - 1))
@click.pass_context
@_guard
def worker_remove(ctx, job_id, index):
    """Unregister worker INDEX of JOB_ID."""
    aggregator.XdpBackend(ctx.obj["name"]).remove_worker(job_id, index)
    click.echo(f"worker {index} of job {job_id} removed")


@main.command()
@click.argument("slot", type=click.IntRange(0, wire.MAX_SLOTS - 1))
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@_guard
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
@click.option("--listen", default="0.0.0.0:48800", show_default=True, help="HOST:PORT of the control endpoint (TCP).")
@click.option("--group", "group_ip", default=None, help="One-arm: where results go (default: the interface's subnet broadcast).")
@click.option("--barrier-timeout", type=float, default=120.0, show_default=True, help="Longest a worker waits for the others to register.")
@click.option("--target", type=click.Choice(["xdp", "bmv2"]), default="xdp", show_default=True,
              help="xdp: the attached aggregator (--name); bmv2: the P4 program in simple_switch on --ports.")
@click.option("--ports", default=None, help="bmv2: comma-separated interfaces, switch port i = the i-th.")
@click.option("--workdir", default="/tmp/xdp-agg-bmv2", show_default=True, help="bmv2: where the compiled program goes.")
@click.option("--udp-checksum", is_flag=True, help="xdp: every job created verifies its contributions' UDP checksums.")
@click.pass_context
@_guard
def serve(ctx, listen, group_ip, barrier_timeout, target, ports, workdir, udp_checksum):
    """Run the control endpoint: rank 0 creates jobs, every worker registers.

    The host library (hostlib.init) talks to this; nobody types worker tables. Jobs get a slot
    range, an aggregator port and a job id, and are deleted when their workers leave. Runs until
    interrupted. With --target bmv2 it also starts simple_switch with the P4 program on --ports
    (p4c and bmv2 must be installed, see p4/README.md) and stops it on exit: the host library
    talks to bmv2 exactly as to the XDP aggregator.

    \b
    Examples:
      sudo xdp-agg --netns agg serve --listen 198.18.0.1:48800
      sudo xdp-agg --netns agg serve --target bmv2 --ports p0,p1,p2,p3
    """
    from aggctl.server import RendezvousServer

    host, _, port = listen.rpartition(":")
    host = host or "0.0.0.0"
    if target == "xdp":
        server = RendezvousServer(
            aggregator.XdpBackend(ctx.obj["name"]), host, int(port),
            {**serve_defaults(ctx.obj["name"], group_ip, barrier_timeout), "udp_checksum": udp_checksum},
            fill_worker=_fill_worker,
        )
        click.echo(f"control endpoint listening on {host}:{port} (aggregator {ctx.obj['name']}); Ctrl-C stops it", err=True)
        server.run_until_interrupted()
        return
    from aggctl import bmv2_backend as bm

    if not ports:
        raise click.UsageError("--target bmv2 needs --ports IFACE,IFACE,...")
    missing = bm.missing_tools()
    if missing:
        _fail(f"{', '.join(missing)} not on PATH: install p4c and bmv2 as p4/README.md says")
    switch, backend = bm.launch(bm.port_specs(ports.split(","), netns=ctx.obj["netns"]), workdir,
                                netns=ctx.obj["netns"], unknown_unicast="drop")
    try:
        server = RendezvousServer(
            backend, host, int(port),
            {"delivery": Delivery.BROADCAST, "barrier_timeout": barrier_timeout},
            fill_worker=backend.fill_worker,
        )
        click.echo(f"control endpoint listening on {host}:{port} (bmv2 on {ports}); Ctrl-C stops it", err=True)
        server.run_until_interrupted()
    finally:
        switch.stop()


def serve_defaults(name: str, group_ip: str | None, barrier_timeout: float) -> dict:
    """What the control endpoint puts into the jobs it creates, from the attached aggregator."""
    import ipaddress

    state, _ = aggregator.open_instance(name)
    first = links.addresses(state.interfaces[0]["ifname"])
    d = {"pool_slots": state.pool_slots, "barrier_timeout": barrier_timeout}
    if state.mode == "switch":
        d["delivery"] = Delivery.BROADCAST
        return d
    if not first["ipv4_nets"]:
        raise aggregator.AggregatorError(f"{first['ifname']} has no IPv4 address: workers need one to send to")
    net = ipaddress.IPv4Interface(first["ipv4_nets"][0])
    group_ip = group_ip or str(net.network.broadcast_address)
    d.update(delivery=Delivery.GROUP_TX, group_ip=group_ip, group_mac=group_mac_for(group_ip),
             agg_ip=str(net.ip), agg_mac=first["mac"])
    return d


def _fill_worker(ws: WorkerSpec, local) -> None:
    # switch mode: the address the worker reached us at is our address on its port
    ws.extra["agg_ip"] = local[0]


@main.command()
@click.option("--workers", type=click.IntRange(1, limits.MAX_WORKERS), default=4, show_default=True, help="Workers per job in the stream.")
@click.option("--rounds", type=click.IntRange(1, 10_000), default=20, show_default=True, help="Rounds over 64 slots per repetition.")
@click.option("--repeats", type=click.IntRange(1, 100), default=5, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@_guard
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
