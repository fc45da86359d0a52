"""What a real deployment gets: a model of the all-reduce time from measured per-packet costs,
checked against the testbed's cells, then used for deployments this machine cannot build
(docs/benchmarks.md, "What a deployment gets").

The model. A tensor of S bytes, k int32 per packet, so P = S / (4k) packets per worker (floats
add one window of exponent-only packets, ignored here: 0.3% at 64 MiB). In-network aggregation
moves every packet once up and once down each worker's link, so an all-reduce takes the longest
of four times, each a resource that every packet needs:

- link: P frames each way on a worker's link of R bit/s, P * wire_bytes(k) * 8 / R (frame + FCS +
  preamble and gap: the bytes a line actually carries);
- host: P packets through the worker's host library and kernel (send one, receive its result):
  P * (host_packet + host_byte * 4k) of CPU, spread over the worker's `lanes` (hostlib's
  HostOptions.lanes, each a thread on a core of its own), each lane beyond the first adding
  `lane_extra` of the CPU per packet (contention: measured on this machine at 2 lanes, where
  the worker's CPU per GiB grew by that share; extrapolated linearly beyond, since this machine
  has two CPUs): P * (host_packet + host_byte * 4k) * (1 + lane_extra * (lanes - 1)) / lanes;
- aggregator CPU: n * P contributions through the XDP program (xdp_packet + xdp_elem * k each)
  and n * P result copies sent (tx_copy each), spread over agg_cores;
- aggregator link: n * P frames each way through the aggregator's ports (agg_link bit/s in all).

The ring all-reduce bound (what gloo or NCCL can reach at best) is 2(n-1)/n * S * 8 / R.

On the testbed everything shares `cpus` CPUs (the workers, the kernel's forwarding through the
veths and the bridge, the aggregator), so the CPU term there is the whole system's,
n * P * c / cpus, with c the system-wide CPU per packet (fitted from the unshaped cells, where
nothing else bounds), and the same for gloo with c_gloo per byte moved (2(n-1)/n * S per
worker). `check` fits both from a results.json of bench.allreduce and prints the model beside
every 4 MiB and 64 MiB throughput cell; `predict` prints deployments.
Run: `python -m bench.perfmodel [--results FILE]`.

The aggregator's multi-core question (per-CPU partials, bpf/aggregate.h): when a slot's n
contributions arrive on several CPUs (RSS spreads workers, not slots), every contribution does
its three atomic updates (seen, arrivals, added) on a cache line another CPU wrote last
(`bounce` each: a line transfer), and the completing CPU adds the other CPUs' partials into the
result: (spread - 1) * k more element additions per round, spread = min(n, agg_cores). If each
worker instead chose its UDP source port per slot lane (lane = slot mod agg_cores), RSS would
hash lanes, not workers, to CPUs: every contribution of a slot on one CPU, no line bouncing,
nothing to gather. `predict` gives both.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.allreduce import RATES  # the link rates the testbed cells were shaped to
from xdp_agg.proto import wire

RESULTS = Path(__file__).resolve().parent / "results" / "results.json"
# the committed runs whose host rows (one worker, lanes 1 and 2) give the host costs: MTU 3500
# (768 int32 per packet) and MTU 9000 (2048)
HOST_RUNS = (RESULTS, RESULTS.parent / "mtu9000" / "results.json")
# `xdp-agg bench --cpus 1,2 --json`: 2 CPUs, a slot's flows spread or a lane per CPU
CPU_SCALING = RESULTS.parent / "cpu-scaling.json"
INPLACE_ELEMS = 768  # the largest packet summed in place (bpf/consts.h AGG_DIRECT_MAX_ELEMS)
ETH_WIRE_EXTRA = 4 + 8 + 12  # FCS, preamble + start delimiter, inter-frame gap


def wire_bytes(k: int) -> int:
    """Bytes a line carries for one packet of k int32 (one direction)."""
    return wire.frame_len(k) + ETH_WIRE_EXTRA


@dataclass(frozen=True)
class Costs:
    """Per-packet costs in seconds, each with where it was measured (see SOURCES)."""

    host_packet: float = 4.0e-6  # host library + kernel UDP, per packet sent and result received
    host_byte: float = 0.93e-9  # more per payload byte (copy, quantise, checksum-free UDP)
    lane_extra: float = 0.0  # more host CPU per packet per lane beyond the first (contention)
    xdp_packet: float = 280e-9  # the XDP program per contribution, zero elements
    xdp_elem: float = 0.36e-9  # the XDP program per int32 of a contribution
    xdp_elem_frags: float = 1.0e-9  # the same beyond one buffer (jumbo: copied through a map)
    tx_copy: float = 100e-9  # sending one copy of a result from XDP (estimate)
    bounce: float = 100e-9  # a slot's cache lines moving between CPUs, per contribution


SOURCES = {
    "host_packet": "bench/results/results.json and mtu9000/results.json: the 1-lane host rows "
    "(one worker's process CPU per GiB, float32 and int32) at 768 and 2048 int32 per packet, "
    "fitted a + b * bytes (fit_host)",
    "host_byte": "the same fit's slope",
    "lane_extra": "the same runs' host rows at 2 lanes: the worker's CPU per GiB over the 1-lane "
    "row's, less 1, mean over both dtypes and both runs (fit_lanes); beyond 2 lanes an "
    "extrapolation (two CPUs here)",
    "xdp_packet": "bench/results/xdp-compare/README.md: 301 ns at 64 int32 minus 64 x 0.36 ns",
    "xdp_elem": "bench/results/xdp-compare/README.md: (557 - 301) / (768 - 64) ns per int32",
    "xdp_elem_frags": "bench/results/frags: 1986-2143 ns per 2048-element packet in the "
    "multi-buffer program (0.97-1.05 ns per element, the per-packet part included)",
    "tx_copy": "estimate: one XDP_TX or devmap copy on a real NIC driver (not measured here)",
    "bounce": "bench/results/cpu-scaling.json (xdp-agg bench --cpus 1,2): the CPU per packet with "
    "a slot's flows on both CPUs over that with each lane on one, less the model's gather share, "
    "mean over 256 and 768 int32 (fit_bounce; 2 CPUs of one VM: a box's sockets may cost more)",
}


@dataclass(frozen=True)
class Deployment:
    """A cluster: n workers on links of `rate` bit/s, k int32 per packet (from the MTU), an
    aggregator box of agg_cores CPUs behind agg_link bit/s of ports."""

    n: int
    rate: float
    mtu: int = 9000
    agg_cores: int = 16
    agg_link: float = 400e9
    steered: bool = False  # slots steered to CPUs by the workers' source ports
    lanes: int = 1  # a worker's lanes (HostOptions.lanes): its host path on this many cores

    @property
    def k(self) -> int:
        """The largest packet size code that fits the MTU."""
        fits = [
            e
            for e in wire.SIZE_CODE_ELEMS.values()
            if wire.frame_len(e) - wire.ETH_HLEN <= self.mtu
        ]
        return max(fits)


def _host_rows(files) -> list[tuple[int, dict]]:
    """(bytes per packet, host row) of every host row in the bench.allreduce results `files`."""
    out = []
    for f in files:
        r = json.loads(Path(f).read_text())
        out += [(4 * r["meta"]["elems"], s) for s in r["summary"] if s["kind"] == "host"]
    return out


def fit_host(files=HOST_RUNS) -> tuple[float, float]:
    """(s per packet, s per payload byte) of one worker's host path: a least-squares line through
    the 1-lane host rows (CPU s per GiB, float32 and int32) of the results `files`."""
    pts = [
        (nbytes, s["cpu_s_per_gib"] * nbytes / 2**30)
        for nbytes, s in _host_rows(files)
        if s.get("lanes", 1) == 1
    ]
    if len({x for x, _ in pts}) < 2:
        raise ValueError(f"{files}: host rows of at least two packet sizes are needed")
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return my - b * mx, b


def fit_lanes(files=HOST_RUNS) -> dict[int, float]:
    """{lanes: the worker's CPU per GiB over the 1-lane row's} from the host rows of `files`
    (mean over the rows of each packet size and dtype that have a 1-lane row)."""
    rows = _host_rows(files)
    one = {(b, s["dtype"]): s["cpu_s_per_gib"] for b, s in rows if s.get("lanes", 1) == 1}
    ratios: dict[int, list[float]] = {}
    for b, s in rows:
        if (b, s["dtype"]) in one:
            ratios.setdefault(s.get("lanes", 1), []).append(
                s["cpu_s_per_gib"] / one[(b, s["dtype"])]
            )
    return {k: sum(v) / len(v) for k, v in sorted(ratios.items())}


def fit_bounce(path=CPU_SCALING, c: Costs = Costs()) -> float:
    """Seconds per contribution that spreading a slot over CPUs adds beyond the gather's element
    additions: from `xdp-agg bench --cpus` rows at 2 CPUs, sdfn's CPU per packet over fn's, less
    (spread - 1) * k element additions per round shared by the round's n packets."""
    rep = json.loads(Path(path).read_text())
    rows = {(r["placement"], r["elems_per_packet"]): r for r in rep["rows"] if r["cpus"] == 2}
    extra = []
    for (placement, k), r in rows.items():
        if placement == "sdfn" and ("fn", k) in rows:
            spread = min(r["workers"], 2)
            gather = (spread - 1) * k * c.xdp_elem / r["workers"]
            extra.append((r["cpu_ns_per_packet"] - rows[("fn", k)]["cpu_ns_per_packet"]) * 1e-9)
            extra[-1] -= gather
    if not extra:
        raise ValueError(f"{path}: no 2-CPU rows of both placements")
    return max(0.0, sum(extra) / len(extra))


def measured_costs(files=HOST_RUNS, scaling=CPU_SCALING) -> Costs:
    """Costs with the host terms and the cost of a spread slot fitted from the committed runs
    (fit_host, fit_lanes, fit_bounce)."""
    a, b = fit_host(files)
    extra = fit_lanes(files).get(2, 1.0) - 1.0
    c = replace(Costs(), host_packet=a, host_byte=b, lane_extra=max(0.0, extra))
    return replace(c, bounce=fit_bounce(scaling, c))


def predict(d: Deployment, size: int, c: Costs = Costs()) -> dict:
    """The model's times (seconds) for one all-reduce of `size` bytes, which one bounds it,
    and the speedup over the ring bound."""
    k = d.k
    P = math.ceil(size / (4 * k))
    spread = 1 if d.steered else min(d.n, d.agg_cores)
    # frames beyond one buffer take the multi-buffer program's copy (INPLACE_ELEMS)
    elem = c.xdp_elem_frags if k > INPLACE_ELEMS else c.xdp_elem
    per_contribution = c.xdp_packet + elem * k + (0 if d.steered else c.bounce)
    gather = (spread - 1) * k * elem  # per completed slot round
    times = {
        "link": P * wire_bytes(k) * 8 / d.rate,
        "host": P * (c.host_packet + c.host_byte * 4 * k) * _lane_cost(d, c) / d.lanes,
        "agg_cpu": (d.n * P * (per_contribution + c.tx_copy) + P * gather) / d.agg_cores,
        "agg_link": d.n * P * wire_bytes(k) * 8 / d.agg_link,
    }
    bound = max(times, key=times.get)
    ring = 2 * (d.n - 1) / d.n * size * 8 / d.rate
    return {
        **times,
        "time": times[bound],
        "bound": bound,
        "ring": ring,
        "speedup": ring / times[bound],
        # the host CPU per packet (per core) at which the host would keep up with the link
        "host_budget": times["link"] / P * d.lanes,
    }


def _lane_cost(d: Deployment, c: Costs) -> float:
    """The host's CPU per packet on d.lanes lanes over its CPU per packet on one."""
    return 1.0 + c.lane_extra * (d.lanes - 1)


# --- the testbed ------------------------------------------------------------------------------
def _cells(results: dict) -> list[dict]:
    """The 1-lane throughput cells of 4 MiB and more (what the testbed model is fitted on)."""
    return [
        s
        for s in results["summary"]
        if s["kind"] == "throughput"
        and s["bytes"] >= 4 << 20
        and "gloo" in s
        and s.get("lanes", 1) == 1
    ]


def fit(results: dict) -> tuple[float, float]:
    """(system-wide CPU s per xdp-agg packet, per byte gloo moves) from the unshaped cells, where
    the CPUs alone bound both: least squares of time * cpus = n * work * c through 0."""
    cpus, k = results["meta"]["cpus"], results["meta"]["elems"]
    xs, gs = [], []
    for s in _cells(results):
        if RATES[s["link"]] is None:
            n, size = s["n"], s["bytes"]
            xs.append((n * math.ceil(size / (4 * k)), s["xdp-agg"]["median_s"] * cpus))
            gs.append((n * 2 * (n - 1) / n * size, s["gloo"]["median_s"] * cpus))
    c = sum(w * t for w, t in xs) / sum(w * w for w, _ in xs)
    g = sum(w * t for w, t in gs) / sum(w * w for w, _ in gs)
    return c, g


def check(results: dict) -> list[dict]:
    """The testbed model beside every 4 MiB and 64 MiB throughput cell: max(CPU, link) for
    both systems, with the fitted per-packet and per-byte CPU."""
    c, g = fit(results)
    cpus, k = results["meta"]["cpus"], results["meta"]["elems"]
    rows = []
    for s in _cells(results):
        n, size, rate = s["n"], s["bytes"], RATES[s["link"]]
        P = math.ceil(size / (4 * k))
        ring = 2 * (n - 1) / n * size
        x = max(n * P * c / cpus, P * wire_bytes(k) * 8 / rate if rate else 0)
        y = max(n * ring * g / cpus, ring * 8 / rate if rate else 0)
        mx, my = s["xdp-agg"]["median_s"], s["gloo"]["median_s"]
        rows.append(
            {
                "n": n,
                "link": s["link"],
                "size": size,
                "xdp_measured": mx,
                "xdp_model": x,
                "xdp_error": x / mx - 1,
                "gloo_measured": my,
                "gloo_model": y,
                "gloo_error": y / my - 1,
            }
        )
    return rows


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _versus(row: dict, system: str) -> str:
    """'measured / model (error)' of one system in a check row, in ms."""
    m, x, e = (row[f"{system}_{w}"] for w in ("measured", "model", "error"))
    return f"{m * 1e3:.0f} / {x * 1e3:.0f} ({e:+.0%})"


def _check_table(results: dict) -> str:
    c, g = fit(results)
    meta = results["meta"]
    rows = [
        [
            str(r["n"]),
            r["link"],
            f"{r['size'] >> 20} MiB",
            _versus(r, "xdp"),
            _versus(r, "gloo"),
        ]
        for r in check(results)
    ]
    head = ["n", "link", "size", "xdp-agg ms: measured / model (error)", "gloo ms: the same"]
    return "\n".join(
        [
            f"Testbed ({meta['when']}, {meta['cpus']} CPUs, {meta['elems']} int32 per packet): "
            f"fitted {c * 1e6:.2f} us of CPU per xdp-agg packet per worker, "
            f"{g * 2**30:.2f} CPU s per GiB gloo moves",
            "",
            *_table(head, rows),
        ]
    )


def _deployments():
    """The deployments `predict` prints: 8-64 workers at 25 and 100 Gbit/s; MTU 1500 and 9000,
    slots spread by RSS or steered, the host path on 1, 2 or 4 lanes (a core each)."""
    kinds = ((1500, 0, 1), (9000, 0, 1), (9000, 1, 1), (9000, 1, 2), (9000, 1, 4))
    for rate in (25e9, 100e9):
        for n in (8, 16, 32, 64):
            for mtu, steered, lanes in kinds:
                yield Deployment(n, rate, mtu, steered=bool(steered), lanes=lanes)


def _predict_table(size: int, costs: Costs) -> str:
    terms = ("link", "host", "agg_cpu", "agg_link")
    rows = []
    for d in _deployments():
        p = predict(d, size, costs)
        rows.append(
            [str(d.n), f"{d.rate / 1e9:g}", str(d.mtu), "steered" if d.steered else "RSS"]
            + [str(d.lanes), f"{p['host_budget'] * 1e6:.2f}"]
            + [f"{p[t] * 1e3:.1f}" for t in terms]
            + [
                p["bound"],
                f"{p['time'] * 1e3:.1f}",
                f"{p['ring'] * 1e3:.1f}",
                f"{p['speedup']:.2f}x",
            ]
        )
    head = ["n", "Gbit/s", "MTU", "slots", "lanes", "host us/pkt budget", *terms]
    head += ["bound", "ms", "ring ms", "speedup"]
    return "\n".join(
        [
            f"Deployments, {size >> 20} MiB, a 16-core aggregator behind 400 Gbit/s of ports "
            "(times in ms; speedup: the ring bound over the model's time):",
            "",
            *_table(head, rows),
        ]
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(RESULTS), help="a results.json of bench.allreduce")
    ap.add_argument("--size", default=64 << 20, type=int, help="tensor bytes (default 64 MiB)")
    ap.add_argument("--host-us", type=float, help="host CPU per packet, us (default: SOURCES)")
    ap.add_argument("--json", action="store_true", help="the check and predictions as JSON")
    args = ap.parse_args(argv)
    results = json.loads(Path(args.results).read_text())
    costs = measured_costs()
    if args.host_us is not None:
        costs = replace(costs, host_packet=args.host_us * 1e-6)
    if args.json:
        preds = [{**asdict(d), **predict(d, args.size, costs)} for d in _deployments()]
        print(
            json.dumps({"fit": fit(results), "check": check(results), "predict": preds}, indent=1)
        )
        return 0
    print(_check_table(results))
    print()
    print(_predict_table(args.size, costs))
    print()
    lanes = ", ".join(f"{k} lane{'s' if k > 1 else ''} {v:.2f}" for k, v in fit_lanes().items())
    print(f"Host CPU per GiB against 1 lane, measured (host rows): {lanes}")
    for name, src in SOURCES.items():
        unit = " (of the CPU per packet)" if name == "lane_extra" else " s"
        print(f"{name} = {getattr(costs, name):.3g}{unit}: {src}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
