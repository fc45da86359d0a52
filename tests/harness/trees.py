"""Reading the reports of a two-level tree's workers (xdp_agg.cluster.tree.TreeCluster.run_workers):
the XDP tree tests and the bmv2 one share them."""

from __future__ import annotations


def count_ok(reports) -> int:
    """How many verified results the workers reported; fails on the first wrong one."""
    n = 0
    for g, reps in enumerate(reports):
        for r in reps:
            if "ok" in r:
                assert r["ok"], f"worker {g}: wrong result for {r['dtype']} x {r['count']}: {r}"
                n += 1
    return n


def rack_checks(reports, r: int, per_rack: int) -> list[dict]:
    """Rack r's workers' counters-check reports."""
    return [
        x
        for reps in reports[r * per_rack : (r + 1) * per_rack]
        for x in reps
        if x.get("check") == "counters"
    ]


def parent_counters(reports, r: int, per_rack: int) -> dict:
    """Rack r's parent-link counters as its endpoint reported them to its workers' last
    counters check (the jobs are gone once the workers leave); the latest of its workers'."""
    seen = [x["parent"]["counters"] for x in rack_checks(reports, r, per_rack)]
    return max(seen, key=lambda c: c["forwarded_up"] + c["resent_up"] + c["parent_result"])


def rack_retransmissions(reports, r: int, per_rack: int) -> int:
    """Rack r's workers' retransmissions since they joined, as their counters checks report them
    (comm.stats): these include the checks' own barriers, data-path all-reduces too, which no
    all-reduce report's "stats" covers."""
    return sum(x["worker"]["retransmissions"] for x in rack_checks(reports, r, per_rack))


def retransmissions(reports) -> int:
    """Retransmissions the workers counted, over all their all-reduces."""
    return sum(x["stats"]["retransmissions"] for reps in reports for x in reps if "stats" in x)
