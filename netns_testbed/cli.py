"""``netns-testbed``: build, inspect, use and remove testbeds from a shell.

Testbeds built here stay up after the command exits; they are recorded in
/run/netns-testbed/<prefix>.json and removed with ``down``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import sys

import click

# Import submodules, not the package root: an editable install made before
# the package had an __init__.py maps it as a namespace package.
from . import nsexec, plan, registry, shaping
from .errors import TestbedError
from .reorder import DEFAULT_DELAY as DEFAULT_REORDER_DELAY
from .testbed import MAX_MTU, MIN_MTU, PLAIN_XDP_MAX_MTU, Testbed, require_root

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2

MAIN_HELP = f"""Build and remove network-namespace testbeds (N workers + 1 aggregator, or K).

\b
Examples:
  netns-testbed up --workers 4 --topology switch --rate 1gbit
  netns-testbed up -n 3 --prefix demo --loss-up 0.01 --json
  netns-testbed up -n 4 --aggregators 2 --agg-rate 300mbit   # for striped jobs
  netns-testbed status
  netns-testbed exec --prefix demo w0 -- ping -c 1 198.18.0.1
  netns-testbed exec --prefix demo agg -- ip -br addr
  netns-testbed set --prefix demo --rate 100mbit --loss-down 0.05
  netns-testbed down --prefix demo
  netns-testbed down --stale      # testbeds of programs that died
  netns-testbed down --all

\b
Exit codes:
  0  success (exec: the command's own exit code)
  1  error (not root, prefix in use, a tool missing, kernel refused...)
  2  usage error (bad option or value)

State files live in {registry.STATE_DIR}. Needs root except for status.
Shell completion (bash): eval "$(_NETNS_TESTBED_COMPLETE=bash_source netns-testbed)"
"""


def _parsed(parse):
    """A click callback: parse(value), None staying None, a ValueError a bad parameter."""

    def callback(ctx, param, value):
        try:
            return None if value is None else parse(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None

    return callback


def _rate_or_none(text: str) -> int | None:
    """A link rate as shaping.parse_rate reads it; 'none': no limit (None)."""
    return None if text.lower() == "none" else shaping.parse_rate(text)


_rate = _parsed(_rate_or_none)
_prefix = _parsed(plan.validate_prefix)


PROB = click.FloatRange(0.0, 1.0)


def _count_option(*names: str, lo: int, hi: int, default: int, help: str):
    """An option counting something, lo..hi, its default shown in --help."""
    return click.option(
        *names, type=click.IntRange(lo, hi), default=default, show_default=True, help=help
    )


def _fail(e: Exception) -> click.ClickException:
    return click.ClickException(str(e))


@contextlib.contextmanager
def _as_click_errors():
    """A bad value (ValueError) as a usage error (exit 2), a testbed failure as exit 1."""
    try:
        yield
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    except TestbedError as e:
        raise _fail(e) from None


def _print_state(tb: Testbed, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(tb.state(), indent=1, sort_keys=True))
    else:
        click.echo(_describe(tb.state()))


def _version() -> str:
    """The installed distribution's version (pyproject.toml); a bare checkout has none."""
    try:
        return importlib.metadata.version("xdp-agg")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed: pip install .)"


@click.group(help=MAIN_HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(_version(), prog_name="netns-testbed")
def main():
    pass


@main.command(
    help="""Build a testbed and leave it running.

\b
one-arm: bridge in <prefix>sw; aggregator eth0 198.18.0.1/24, worker i
         eth0 198.18.0.(10+i)/24; results to each job's multicast group
         (xdp-agg serve: 239.18.0.N for job N), or with --results broadcast
         to the subnet broadcast 198.18.0.255.
switch:  aggregator p<i> 198.18.(i+1).1/24 <-> worker i eth0 198.18.(i+1).2/24.
--aggregators K (one-arm): aggregator j in <prefix>ag<j> (j >= 1), eth0
         198.18.0.(1+j)/24, for jobs striped over K aggregators; aggregator
         j's jobs take their groups from the block 239.18.j.0/24 (serve
         --group-base), kept off the other aggregators' bridge ports (no
         unregistered multicast there); --agg-rate shapes each one's link.

\b
Example: netns-testbed up -n 4 --topology switch --rate 1gbit --mtu 3500"""
)
@_count_option(
    "-n", "--workers", lo=1, hi=plan.MAX_TESTBED_WORKERS, default=2, help="Number of workers."
)
@click.option(
    "--topology",
    type=click.Choice(plan.TOPOLOGIES),
    default="one-arm",
    show_default=True,
    help="one-arm: every host on one bridge; switch: a veth per worker into the aggregator.",
)
@click.option("--rate", callback=_rate, help="Per worker link rate, both directions (e.g. 1gbit).")
@click.option("--agg-rate", callback=_rate, help="Aggregator link rate (one-arm only).")
@_count_option(
    "--aggregators",
    lo=1,
    hi=plan.MAX_AGGREGATORS,
    default=1,
    help="Number of aggregators (more than 1: one-arm only).",
)
@click.option(
    "--mtu",
    type=int,
    default=1500,
    show_default=True,
    help=f"Link MTU, {MIN_MTU}..{MAX_MTU} (above {PLAIN_XDP_MAX_MTU}: xdp-agg attach --frags).",
)
@click.option("--loss-up", type=PROB, default=0.0, help="Drop probability worker -> aggregator.")
@click.option("--loss-down", type=PROB, default=0.0, help="Drop probability aggregator -> worker.")
@click.option(
    "--loss-scope",
    type=click.Choice(["aggregation", "all"]),
    default="aggregation",
    show_default=True,
    help="What --loss-up/--loss-down drop: aggregation UDP, or every IPv4 frame on the worker "
    "links (one-arm: TCP between workers crosses the same loss).",
)
@click.option(
    "--dup-up", type=PROB, default=0.0, help="Duplication probability worker -> aggregator."
)
@click.option(
    "--dup-down",
    type=PROB,
    default=0.0,
    help="Duplication probability aggregator -> worker (one-arm only).",
)
@click.option(
    "--reorder",
    type=PROB,
    default=0.0,
    help="Share of what --loss-scope names that a worker sends held back --reorder-delay, so "
    "that later frames overtake it.",
)
@click.option(
    "--reorder-delay",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=DEFAULT_REORDER_DELAY,
    show_default=True,
    help="Seconds a held frame waits.",
)
@_count_option(
    "--observers",
    lo=0,
    hi=plan.MAX_OBSERVERS,
    default=0,
    help="One-arm: hosts in no job on the bridge (o0.., 198.18.0.200..).",
)
@_count_option(
    "--agg-queues",
    lo=1,
    hi=plan.MAX_AGG_QUEUES,
    default=1,
    help="Receive and transmit queues of the aggregator's links (flows hashed over them, "
    "each queue's XDP on its own CPU).",
)
@click.option(
    "--mcast-snooping/--no-mcast-snooping",
    default=True,
    show_default=True,
    help="One-arm: the bridge snoops IGMP with a querier (groups reach members only).",
)
@click.option("--prefix", callback=_prefix, help="Name prefix (default: xt + 4 random hex digits).")
@click.option("--json", "as_json", is_flag=True, help="Print the state as JSON.")
def up(as_json, **params):
    with _as_click_errors():
        # options first: a usage error is worth knowing before asking for sudo
        tb = Testbed(**params, cleanup_at_exit=False)  # the options are its arguments
        require_root()
        tb.up()
    _print_state(tb, as_json)
    if not as_json:
        click.echo(f"remove with: netns-testbed down --prefix {tb.prefix}")


@main.command(
    help="""Remove a testbed (or several): processes started through the
library, namespaces, links, state file.

\b
--all also removes testbeds that running programs (e.g. a pytest session)
are using; --stale only those whose building program has exited without
cleaning up (testbeds made by `up` are never stale).

\b
Examples: netns-testbed down --prefix demo
          netns-testbed down --stale
          netns-testbed down --all"""
)
@click.option("--prefix", callback=_prefix, help="Testbed to remove.")
@click.option(
    "--all", "all_", is_flag=True, help=f"Remove every testbed recorded in {registry.STATE_DIR}."
)
@click.option("--stale", is_flag=True, help="Remove testbeds left behind by programs that died.")
@click.option("--json", "as_json", is_flag=True, help='Print {"removed": [prefixes]} as JSON.')
def down(prefix, all_, stale, as_json):
    if (prefix is not None) + all_ + stale != 1:
        raise click.UsageError("give exactly one of --prefix P, --stale or --all")
    try:
        require_root()
        if prefix is not None:
            prefixes = [prefix]
        else:
            prefixes = [
                st["prefix"]
                for st in registry.list_states()
                if all_ or (st.get("cleanup_at_exit") and not registry.owner_alive(st))
            ]
        if not prefixes and not as_json:
            click.echo("nothing to remove")
        failed, removed = [], []
        for p in prefixes:
            try:
                _down_one(p)
                removed.append(p)
                if not as_json:
                    click.echo(f"removed {p}")
            except TestbedError as e:
                if prefix is not None:
                    raise
                failed.append(f"{p}: {e}")
        if failed:
            raise TestbedError("; ".join(failed))
    except TestbedError as e:
        raise _fail(e) from None
    if as_json:
        click.echo(json.dumps({"removed": removed}))


def _down_one(prefix: str) -> None:
    if registry.load_state(prefix) is not None:
        Testbed.attach(prefix).down()
        return
    # No record (e.g. the state dir was wiped): fall back to the exact name
    # pattern of this prefix, so only our namespaces can match.
    pat = plan.netns_name_re(prefix)
    try:
        names = [n for n in os.listdir(nsexec.NETNS_DIR) if pat.match(n)]
    except FileNotFoundError:
        names = []
    if not names:
        raise TestbedError(f"no testbed with prefix {prefix!r} (see `netns-testbed status`)")
    errors = registry.CleanupRegistry(namespaces=sorted(names)).teardown()
    if errors:
        raise TestbedError("; ".join(errors))


@main.command(
    help="""Show recorded testbeds and whether their namespaces exist.

\b
Example: netns-testbed status --json"""
)
@click.option("--prefix", callback=_prefix, help="Only this testbed.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of states.")
def status(prefix, as_json):
    states = [st for st in registry.list_states() if prefix is None or st["prefix"] == prefix]
    for st in states:
        present = [ns for ns in st.get("namespaces", []) if os.path.exists(nsexec.netns_path(ns))]
        st["present_namespaces"] = present
        st["health"] = (
            "ok"
            if len(present) == len(st.get("namespaces", [])) and present
            else "partial"
            if present
            else "gone"
        )
        st["owner_alive"] = registry.owner_alive(st)
    if as_json:
        click.echo(json.dumps(states, indent=1, sort_keys=True))
        return
    if not states:
        click.echo("no testbeds" + (f" with prefix {prefix}" if prefix else ""))
        if prefix:
            sys.exit(EXIT_ERROR)
        return
    for st in states:
        owner = (
            "made by netns-testbed up"
            if not st.get("cleanup_at_exit")
            else f"owner pid {st.get('owner_pid')} "
            + ("running" if st["owner_alive"] else "gone: remove with down --stale")
        )
        click.echo(
            _describe(st) + f"\n  health: {st['health']} "
            f"({len(st['present_namespaces'])}/{len(st.get('namespaces', []))} namespaces),"
            f" {owner}"
        )


@main.command(
    name="exec",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    help="""Run CMD inside HOST's namespace (HOST: agg, sw, w0, w1, ...).

\b
--prefix may be omitted when exactly one testbed exists.
Examples: netns-testbed exec --prefix demo w1 -- ping -c 1 198.18.0.1
          netns-testbed exec agg -- tcpdump -ni eth0""",
)
@click.option("--prefix", callback=_prefix, help="Testbed (default: the only one).")
@click.argument("host")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_(prefix, host, cmd):
    try:
        require_root()
        if prefix is None:
            known = [st["prefix"] for st in registry.list_states()]
            if len(known) != 1:
                raise click.UsageError(
                    "several testbeds exist, pick one with --prefix: " + ", ".join(known)
                    if known
                    else "no testbeds recorded; create one with `netns-testbed up`"
                )
            prefix = known[0]
        tb = Testbed.attach(prefix)
        try:
            ns = tb.netns_of(host)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    except TestbedError as e:
        raise _fail(e) from None
    cmd = list(cmd)
    if cmd and cmd[0] == "--":  # click keeps "--" when interspersed args are off
        cmd = cmd[1:]
    if not cmd:
        raise click.UsageError("missing CMD after --")
    argv = nsexec.nsenter_argv(ns, cmd)
    try:
        os.execvp(argv[0], argv)  # replaces this process: CMD's exit code is ours
    except OSError as e:
        raise _fail(TestbedError(f"cannot run nsenter: {e}")) from None


@main.command(
    name="set",
    help="""Change rate, loss, duplication or reordering of a running testbed.

\b
Examples: netns-testbed set --prefix demo --rate 100mbit
          netns-testbed set --prefix demo --rate none --loss-up 0 --loss-down 0.1
          netns-testbed set --prefix demo --reorder 0.01 --reorder-delay 0.002""",
)
@click.option("--prefix", callback=_prefix, required=True, help="Testbed to change.")
@click.option("--rate", help="New per worker link rate, or 'none' to remove the limit.")
@click.option("--agg-rate", help="New aggregator link rate (one-arm), or 'none'.")
@click.option("--loss-up", type=PROB, help="New drop probability worker -> aggregator.")
@click.option("--loss-down", type=PROB, help="New drop probability aggregator -> worker.")
@click.option("--dup-up", type=PROB, help="New duplication probability worker -> aggregator.")
@click.option("--dup-down", type=PROB, help="New duplication probability aggregator -> worker.")
@click.option("--reorder", type=PROB, help="New share of held-back frames (0: none).")
@click.option(
    "--reorder-delay",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    help="New seconds a held frame waits.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the new state as JSON.")
def set_(prefix, rate, agg_rate, loss_up, loss_down, dup_up, dup_down, as_json, **reorder):
    with _as_click_errors():
        require_root()
        tb = Testbed.attach(prefix)
        if rate is not None or agg_rate is not None:
            new_rate = _rate(None, None, rate) if rate is not None else tb.rate_bits
            if agg_rate is not None:
                tb.set_rate(new_rate, agg_rate=_rate(None, None, agg_rate))
            else:
                tb.set_rate(new_rate)
        if any(x is not None for x in (loss_up, loss_down, dup_up, dup_down)):
            tb.set_loss(
                tb.loss_up if loss_up is None else loss_up,
                tb.loss_down if loss_down is None else loss_down,
                dup_up=dup_up,
                dup_down=dup_down,
            )
        if reorder["reorder"] is not None or reorder["reorder_delay"] is not None:
            p = tb.reorder if reorder["reorder"] is None else reorder["reorder"]
            tb.set_reorder(p, reorder["reorder_delay"])
    _print_state(tb, as_json)


def _describe(st: dict) -> str:
    """Human-readable summary of a state dict."""
    lines = [
        f"testbed {st['prefix']} [{st.get('status')}]: {st['topology']}, "
        f"{st['n_workers']} workers, mtu {st['mtu']}, rate {st.get('rate') or 'unlimited'}"
        + (f", agg rate {st['agg_rate']}" if st.get("agg_rate") else "")
        + f", loss up/down {st.get('loss_up', 0)}/{st.get('loss_down', 0)}"
        + (
            f", dup up/down {st.get('dup_up', 0)}/{st.get('dup_down', 0)}"
            if st.get("dup_up") or st.get("dup_down")
            else ""
        )
        + (
            f", reorder {st['reorder']} held {st.get('reorder_delay', 0) * 1e3:g} ms"
            if st.get("reorder")
            else ""
        )
    ]
    for j, ag in enumerate(st.get("aggregators") or [st["aggregator"]]):
        name = "agg" if j == 0 else f"agg{j}"
        for ifname, ip, mac in zip(ag["ifnames"], ag["ips"], ag["macs"]):
            lines.append(f"  {name:<4} {ag['netns']:<12} {ifname:<5} {ip:<15} {mac}")
    for w in st["workers"]:
        lines.append(
            f"  w{w['index']:<3} {w['netns']:<12} {w['ifname']:<5} {w['ip']:<15} {w['mac']}"
            f"  -> {w['agg_ip']} ({w['agg_ifname']})"
        )
    for o in st.get("observers", []):
        lines.append(
            f"  o{o['index']:<3} {o['netns']:<12} {o['ifname']:<5} {o['ip']:<15} {o['mac']}"
            "  (in no job)"
        )
    if st.get("group_ip"):
        snooping = "IGMP snooping with a querier" if st.get("mcast_snooping") else "no snooping"
        lines.append(f"  subnet broadcast {st['group_ip']}; bridge: {snooping}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
