"""The sparse rows of `python -m bench.allreduce --density` (docs/protocol.md section 8).

Per cell (n workers, a link, a tensor size, a *union* block density and a pattern): the same
float32 tensor all-reduced three ways, side by side on one testbed, the order rotated every
repetition: xdp-agg sparse (only the blocks some worker has travel), xdp-agg dense (every block)
and gloo (ring all-reduce of every element). A block is one packet's elements (the job's elems).

The density is the union's, the share of blocks some worker has data in: that is what a sparse
all-reduce must move. With pattern "same" every worker has data in the same blocks (each worker's
density is the union's); with "indep" each worker draws its own blocks, with the probability
1 - (1 - d)^(1/n) that makes the expected union d, so a worker holds data in only a share of the
union and sends header-only (or padded) empty contributions for the rest.

Every repetition checks that the sparse result equals the dense one byte for byte ("exact").
The union counted on the result, each worker's packets and skipped blocks per sparse all-reduce
and the bound (the union's share of S*8/R, each direction) are in each cell.

Targets (issue 41), evaluated per cell in the Markdown: at a union density of 10% on 1 Gbit/s,
sparse >= 4x dense xdp-agg and >= 5x gloo; at 100%, sparse no more than 5% slower than dense.
"""

from __future__ import annotations

import statistics

from bench import md_table

SPARSE = "xdp-agg sparse"  # bench.worker's name for the sparse all-reduce
DENSE = "xdp-agg"
GLOO = "gloo"
PATTERNS = ("same", "indep")
DEFAULT_DENSITIES = "100,50,10,1"
# issue 41's targets: (union density, link) -> {ratio name: minimum}
TARGETS = {
    (0.1, "1gbit"): {"vs_dense": 4.0, "vs_gloo": 5.0},
    (1.0, None): {"vs_dense": 1 / 1.05},  # any link: at most 5% slower than dense
}


def densities(text: str) -> list[float]:
    """--density: "100,50,10,1" (percent) -> [1.0, 0.5, 0.1, 0.01]."""
    out = [float(x) / 100 for x in text.split(",")]
    if any(not 0 < d <= 1 for d in out):
        raise ValueError("densities are percentages in (0, 100]")
    return out


def plan(sizes: list[int], dens: list[float], patterns: list[str], reps: int) -> list[dict]:
    """bench.worker's plan items of the sparse rows (float32)."""
    return [
        {"bytes": b, "reps": reps, "kind": "sparse", "density": d, "pattern": p}
        for b in sizes
        for d in dens
        for p in patterns
        if not (p == "indep" and d >= 1.0)  # at 100% both patterns are the same tensor
    ]


def row_fields(reports: list[dict]) -> dict:
    """What a sparse row keeps of every rank's report: rank 0's shape, the union and whether
    every rank's every sparse result equalled its dense one; the counts as the mean worker's."""
    sp = [r["sparse"] for r in reports]
    mean = lambda k: statistics.fmean(s[k] for s in sp)  # noqa: E731
    return {
        **{k: sp[0][k] for k in ("density", "pattern", "per_worker_density", "blocks")},
        "union_blocks": sp[0]["union_blocks"],
        "union_agrees": len({s["union_blocks"] for s in sp}) == 1,
        "checked": sum(s["checked"] for s in sp),
        "equal_to_dense": sum(s["equal_to_dense"] for s in sp),
        **{k: mean(k) for k in ("packets_sent", "bytes_sent", "empty_sent", "blocks_skipped")},
        # per sparse all-reduce (each rank's mean), summed over the ranks
        "sparse_retransmissions": round(sum(s["retransmissions"] for s in sp)),
    }


def summarize(cell: dict, row: dict, rate_bps: float | None) -> None:
    """Add a sparse cell's figures to its summary `cell` (which has each system's medians)."""
    sp = dict(row["sparse"])
    sp["union_density"] = sp["union_blocks"] / sp["blocks"] if sp["blocks"] else 0.0
    sp["exact"] = sp["checked"] > 0 and sp["equal_to_dense"] == sp["checked"]
    t = {k: cell[k]["median_s"] for k in (SPARSE, DENSE, GLOO)}
    sp["vs_dense"] = t[DENSE] / t[SPARSE]
    sp["vs_gloo"] = t[GLOO] / t[SPARSE]
    if rate_bps:
        sp["bound_union_s"] = sp["union_density"] * cell["bytes"] * 8 / rate_bps
        cell[SPARSE]["of_bound"] = sp["bound_union_s"] / t[SPARSE]
    sp["targets"] = targets(sp, cell["link"])
    cell["sparse"] = sp


def targets(sp: dict, link: str) -> dict:
    """The issue's targets that apply to this cell: {"vs_dense >= 4": True, ...}."""
    out = {}
    for (density, on), want in TARGETS.items():
        if abs(sp["density"] - density) > 1e-9 or (on is not None and on != link):
            continue
        for k, lo in want.items():
            out[f"{k} >= {lo:.3g}"] = sp[k] >= lo
    return out


def markdown(summary: list[dict]) -> list[str]:
    """The sparse rows' table and the targets' verdicts (none without sparse rows)."""
    cells = [s for s in summary if s["kind"] == "sparse"]
    if not cells:
        return []
    ms = lambda d: f"{d['median_s'] * 1e3:.1f} ({(d['max_s'] - d['min_s']) * 1e3:.1f})"  # noqa
    rows = []
    for s in cells:
        sp = s["sparse"]
        bound = f"{s[SPARSE]['of_bound']:.0%}" if "of_bound" in s[SPARSE] else "-"
        rows.append(
            [s["n"], s["link"], f"{s['bytes'] >> 20} MiB", sp["pattern"], f"{sp['density']:.0%}"]
            + [f"{sp['union_density']:.1%}", f"{sp['per_worker_density']:.2%}"]
            + [ms(s[SPARSE]), ms(s[DENSE]), ms(s[GLOO])]
            + [f"{sp['vs_dense']:.2f}x", f"{sp['vs_gloo']:.2f}x", bound]
            + [f"{sp['packets_sent']:.0f} ({sp['empty_sent']:.0f})"]
            + [f"{sp['bytes_sent'] / 2**20:.1f}", "yes" if sp["exact"] else "NO"]
            + [sp["sparse_retransmissions"], _verdicts(sp["targets"])]
        )
    columns = ["n", "link", "size", "pattern", "union (target)", "union counted"]
    columns += ["per worker", "sparse ms (spread)", "dense ms (spread)", "gloo ms (spread)"]
    columns += ["sparse vs dense", "sparse vs gloo", "sparse % of union bound"]
    columns += ["packets/worker (empty)", "MiB sent/worker", "exact", "retx", "targets"]
    head = [
        "",
        "Sparse all-reduces (float32; union = the share of blocks some worker has data in; "
        "\"vs\" = the other's median time over sparse's; packets and MiB per worker and sparse "
        "all-reduce; exact = every sparse result equal to the dense one, byte for byte, on "
        "every rank; retx = retransmissions per sparse all-reduce, all ranks together):",
        "",
    ]
    return head + md_table(columns, rows)


def _full(cell: dict) -> bool:
    return cell["sparse"]["density"] >= 1.0


def _verdicts(t: dict) -> str:
    return ", ".join(f"{k}: {'met' if ok else 'MISSED'}" for k, ok in t.items()) or "-"


def plot(summary: list[dict], path) -> None:
    """One panel per (link, n): each system's median time against the union density (log
    axes), sparse once per pattern."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [s for s in summary if s["kind"] == "sparse"]
    panels = sorted({(s["link"], s["n"]) for s in cells})
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (link, n) in zip(axes[0], panels):
        mine = sorted(
            (s for s in cells if (s["link"], s["n"]) == (link, n)),
            key=lambda s: s["sparse"]["density"],
        )
        for pattern, style in zip(PATTERNS, ("o-", "v--")):
            # the 100% cell is both patterns' (one tensor)
            pts = [s for s in mine if s["sparse"]["pattern"] == pattern or _full(s)]
            ax.plot(
                [s["sparse"]["density"] * 100 for s in pts],
                [s[SPARSE]["median_s"] * 1e3 for s in pts],
                style,
                color="tab:green",
                label=f"xdp-agg sparse ({pattern})",
            )
        same = [s for s in mine if s["sparse"]["pattern"] == "same"]
        for system, color in ((DENSE, "tab:blue"), (GLOO, "tab:orange")):
            ax.plot(
                [s["sparse"]["density"] * 100 for s in same],
                [s[system]["median_s"] * 1e3 for s in same],
                "s:",
                color=color,
                label=f"{system} dense" if system == DENSE else system,
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{mine[0]['bytes'] >> 20} MiB float32, {link}, n={n}", fontsize=9)
        ax.set_xlabel("union block density, %")
        ax.set_ylabel("ms per all-reduce (median)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
