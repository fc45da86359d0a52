"""The switch topology's kernel forwarding: traffic between workers through the aggregator's box.

In the switch topology every worker has a /24 of its own with the aggregator's port ``p<i>`` as
the other address, and nothing between the /24s: gloo's rendezvous between two workers fails
("Network is unreachable"). With ``Testbed(topology="switch", kernel_forwarding=True)``:

* every worker gets the plan's route (``Plan.worker_routes``: 198.18.0.0/15, the benchmarking
  range, which holds every worker's /24) via its port's address ``198.18.(i+1).1``;
* the aggregator's namespace forwards IPv4 between its ports: ``net.ipv4.conf.p<i>.forwarding
  = 1`` on each port, nothing else (``all`` and ``default`` stay as they are, inside the
  testbed's own namespace anyway).

Frames that are not aggregation traffic pass the XDP aggregator (XDP_PASS) and the kernel routes
them from one port to the other. It is the slow path the switch forwarding work (XDP
``bpf_fib_lookup`` and a devmap redirect) replaces on the box's side; the workers' routes are
what that path needs too. Pure planning (commands()) needs no root
(tests/unit/test_kernel_forward.py).
"""

from __future__ import annotations

from . import nsexec


def commands(plan) -> list[tuple[str, list[str], str]]:
    """(namespace, argv, what) of every command that sets up the kernel forwarding of a switch
    `plan` (netns_testbed.plan.Plan): each of the plan's worker routes, on the worker's interface,
    and a forwarding sysctl per port.
    ValueError for another topology (one-arm hosts share a bridge: nothing to route)."""
    if plan.topology != "switch":
        raise ValueError(f"kernel forwarding is for the switch topology, not {plan.topology!r}")
    dev = {w.netns: w.ifname for w in plan.workers}
    out = [
        (
            ns,
            ["ip", "route", "replace", dst, "via", via, "dev", dev[ns]],
            f"route to {dst} via {via}",
        )
        for ns, dst, via in plan.worker_routes()
    ]
    agg = plan.aggregator
    out.append(
        (
            agg.netns,
            ["sysctl", "-q", "-w"] + [f"net.ipv4.conf.{p}.forwarding=1" for p in agg.ifnames],
            "forwarding on the aggregator's ports",
        )
    )
    return out


def apply(plan) -> None:
    """Run commands(plan), each in its namespace (TestbedError where one fails)."""
    for netns, argv, what in commands(plan):
        nsexec.check(netns, argv, what)
