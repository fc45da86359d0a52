"""The loss rows of bench.allreduce: both systems under the testbed's random loss, and under a
burst, each against its own clean time in the same run (docs/protocol.md 4.4).

--loss P[,P...]   every worker link drops each frame with probability P, both ways, for both
                  systems alike: the testbed's loss scope "all" (netns_testbed.faults), so
                  gloo's TCP between workers crosses the same loss as xdp-agg's datagrams. One
                  set of worker processes per value, on the same testbed; 0 is the clean row.
--early-loss on,off
                  hostlib's early loss detection (HostOptions.early_loss): "off" runs the hosts
                  on timers alone, as before it, beside "on" in the same run.
--burst-ms MS     also a "burst" row per size, on the clean path: rank 0's namespace drops every
                  IPv4 frame, both ways, for MS milliseconds from `BURST_AT` into each timed
                  all-reduce of either system (nftables in its namespace; the drop's real span
                  is measured and reported), against the clean row of the same set.
--reorder P[,P...]
                  also a row per value without loss: each worker holds back a share P of the
                  frames it sends (every IPv4 frame, so gloo's TCP too) for --reorder-delay-ms,
                  so that later frames overtake them (netns_testbed.reorder).

Each row says "loss" (or "burst_ms", or "reorder") and "early_loss", and per system
"vs_clean": its median time over the same system's clean median (no loss, no reordering, same
n, link, size, dtype, width, lanes and early-loss setting). The engine counters of the row say
where the slowdown comes from: losses found early, timer expiries and spurious resends, summed
over the ranks.
"""

from __future__ import annotations

import argparse
import subprocess
import threading
import time

BURST_AT = 0.01  # seconds into an all-reduce that a burst starts
BURST_TABLE = "bench_burst"  # the nftables table of a burst, in rank 0's namespace
ENGINE_COUNTS = ("early_losses", "timeouts", "spurious")


def options(ap: argparse.ArgumentParser) -> None:
    """--loss, --early-loss, --burst-ms, --reorder and --reorder-delay-ms."""
    ap.add_argument(
        "--loss",
        type=probabilities,
        default=[0.0],
        help="loss probabilities each way on every worker link, comma-separated, e.g. "
        "0,0.001,0.01,0.05 (gloo's TCP crosses the same loss); 0 is each system's clean row",
    )
    ap.add_argument(
        "--loss-scope",
        choices=("all", "aggregation"),
        default="all",
        help="what --loss drops: every frame (all: gloo's TCP too), or xdp-agg's datagrams "
        "alone (aggregation: gloo runs clean and its loss cells say '-'), for a loss gloo's "
        "rendezvous and barriers do not survive (n = 8 at 10%%)",
    )
    ap.add_argument(
        "--early-loss",
        type=early_settings,
        default=[True],
        help="hostlib's early loss detection: on, off, or on,off (off: timers only, as before)",
    )
    ap.add_argument(
        "--burst-ms",
        type=float,
        default=0.0,
        help="also a burst row per size: every frame of rank 0 dropped, both ways, for this "
        "many ms from 10 ms into each all-reduce",
    )
    ap.add_argument(
        "--reorder",
        type=lambda text: probabilities(text)[1:],
        default=[],
        help="also a row per share of frames each worker holds back (no loss), e.g. 0.01,0.05",
    )
    ap.add_argument(
        "--reorder-delay-ms",
        type=float,
        default=0.5,
        help="how long a held frame waits (default 0.5 ms)",
    )


def probabilities(text: str) -> list[float]:
    """--loss: "0,0.01" -> [0.0, 0.01], each in [0, 1); 0 first, added when missing."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated probabilities, not {text!r}") from None
    if any(not 0.0 <= p < 1.0 for p in values):
        raise argparse.ArgumentTypeError(f"each loss must be in [0, 1): {text!r}")
    return [0.0] + sorted(set(values) - {0.0})


def early_settings(text: str) -> list[bool]:
    """--early-loss: "on", "off", "on,off" -> [True], [False], [True, False]."""
    words = text.split(",")
    if any(w not in ("on", "off") for w in words):
        raise argparse.ArgumentTypeError(f"on, off or on,off, not {text!r}")
    return [w == "on" for w in dict.fromkeys(words)]


def lossy(args) -> bool:
    """Whether the run needs the testbed's loss on every frame (loss scope "all")."""
    return any(p > 0 for p in args.loss) or args.burst_ms > 0 or bool(args.reorder)


def disturbed(c: dict) -> bool:
    """Whether a cell ran under loss or reordering (not the clean path)."""
    return bool(c.get("loss") or c.get("reorder"))


def what(c: dict) -> str:
    """A lossy cell's disturbance in words: its loss, its burst or its reordering."""
    if c["kind"] == "burst":
        out = f"burst {c['burst_ms']:.0f} ms"
        return out + (f" (measured {c['burst_actual_ms']:.0f})" if c.get("burst_actual_ms") else "")
    if c.get("reorder"):
        return f"reorder {c['reorder']:g}"
    return f"{c['loss']:g}"


def burst_items(plan: list[dict], burst_ms: float) -> list[dict]:
    """A burst item beside each throughput item of the plan (none without --burst-ms)."""
    if burst_ms <= 0:
        return []
    return [
        {**item, "kind": "burst", "burst_ms": burst_ms}
        for item in plan
        if item["kind"] == "throughput"
    ]


def ratios(cells: list[dict]) -> None:
    """Each lossy or burst cell's "vs_clean": per system, its median over the clean cell's of
    the same setting in the same run (absent where there is none)."""

    def key(c):
        return (c["n"], c["link"], c["bytes"], c["dtype"], c["wire_bits"], c["lanes"])

    clean = {
        (*key(c), c.get("early_loss", True)): c
        for c in cells
        if c["kind"] == "throughput" and not disturbed(c)
    }
    for c in cells:
        ref = clean.get((*key(c), c.get("early_loss", True)))
        if ref is None or ref is c or c["kind"] not in ("throughput", "burst"):
            continue
        c["vs_clean"] = {
            s: c[s]["median_s"] / ref[s]["median_s"] for s in systems_disturbed(c) if s in ref
        }


def systems_disturbed(c: dict) -> tuple[str, ...]:
    """The systems a lossy cell's loss reached: gloo's TCP only with --loss-scope all."""
    if c.get("loss_scope") == "aggregation" and c.get("loss"):
        return ("xdp-agg",)
    return ("xdp-agg", "gloo")


def engine_counts(engine: list[dict]) -> dict[str, int]:
    """The engine counters that say where a lossy row's time went, summed over the ranks."""
    return {k: int(sum(e.get(k, 0) for e in engine)) for k in ENGINE_COUNTS}


def markdown(cells: list[dict], size, retx) -> list[str]:
    """The loss table (none when the run had neither loss nor a burst). `size` and `retx` are
    bench.allreduce's cell formatters."""
    from bench import md_table

    rows = [
        c
        for c in cells
        if c["kind"] in ("throughput", "burst")
        and ("vs_clean" in c or (not disturbed(c) and _has_lossy(cells, c)))
    ]
    if not any(disturbed(c) or c["kind"] == "burst" for c in rows):
        return []
    scope = "both systems"
    if any(c.get("loss_scope") == "aggregation" for c in rows):
        scope = "xdp-agg's datagrams only: gloo ran clean"
    L = [
        "",
        f"Under loss (each way, every worker link, {scope}) and a burst (every frame of "
        "rank 0 dropped, both ways, for burst_ms) or reordering (a share of each worker's frames "
        "held back): each system's median time and its ratio to "
        "its own clean time in the same run; engine counters summed over the ranks:",
        "",
    ]
    body = []
    for c in rows:
        a, g = c["xdp-agg"], c["gloo"]
        clean = c["kind"] == "throughput" and not disturbed(c)
        vs = c.get("vs_clean", {"xdp-agg": 1.0, "gloo": 1.0} if clean else {})
        ratio = lambda s: f"{vs[s]:.2f}x" if s in vs else "-"  # noqa: E731
        e = c.get("engine_counts", {})
        body.append(
            [c["n"], c["link"], size(c["bytes"]), c["dtype"], c["wire_bits"]]
            + ["on" if c.get("early_loss", True) else "off", what(c)]
            + [f"{a['median_s'] * 1e3:.1f}", ratio("xdp-agg")]
            + (
                [f"{g['median_s'] * 1e3:.1f}", ratio("gloo"), f"{c['speedup']:.2f}x"]
                if "gloo" in systems_disturbed(c)
                else ["- (no loss)", "-", "-"]
            )
            + [retx(c)]
            + [e.get(k, "-") for k in ENGINE_COUNTS]
        )
    columns = ["n", "link", "size", "dtype", "wire_bits", "early loss", "loss"]
    columns += ["xdp-agg ms", "vs clean", "gloo ms", "vs clean", "speedup"]
    columns += ["retx (% of sent; causes)", "found early", "timer expiries", "spurious"]
    return L + md_table(columns, body)


def _has_lossy(cells: list[dict], clean: dict) -> bool:
    """Whether some lossy or burst cell compares with the clean cell `clean`."""
    return any(
        (disturbed(c) or c["kind"] == "burst")
        and "vs_clean" in c
        and (c["n"], c["link"], c["bytes"]) == (clean["n"], clean["link"], clean["bytes"])
        for c in cells
    )


class Burst:
    """Rank 0's side of a burst item: every IPv4 frame of its namespace's eth0 dropped, both
    ways, for `ms` milliseconds from BURST_AT into the all-reduce that `start` is called at the
    beginning of. The drop's real span (from the rule's load to its removal, both done) is in
    `spans`; `wait` joins it before the next all-reduce."""

    def __init__(self, ms: float, ifname: str = "eth0") -> None:
        self.ms, self.ifname = ms, ifname
        self.spans: list[float] = []
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        time.sleep(BURST_AT)
        chains = "".join(
            f'  chain {hook} {{ type filter hook {hook} device "{self.ifname}" priority -20; '
            "policy accept; meta protocol ip drop; }\n"
            for hook in ("ingress", "egress")
        )
        self._nft(f"table netdev {BURST_TABLE} {{\n{chains}}}\n")
        t0 = time.monotonic()
        time.sleep(self.ms / 1e3)
        self._nft(f"delete table netdev {BURST_TABLE}\n")
        self.spans.append(time.monotonic() - t0)

    @staticmethod
    def _nft(script: str) -> None:
        subprocess.run(["nft", "-f", "-"], input=script, text=True, check=True)
