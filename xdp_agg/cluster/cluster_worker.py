"""One worker of an end-to-end run: joins a job with hostlib, all-reduces, verifies, reports.

Started by xdp_agg.cluster.cluster inside a worker's namespace:

    python -m xdp_agg.cluster.cluster_worker --rank 0 --world 4 --control 198.18.0.1:48800 \
        --job demo --plan '[{"dtype": "float32", "count": 16777216, "reps": 1, "seed": 1}]'

Every rank makes its input from (seed, rank), so each can compute the exact sum of all ranks
locally and check its own result: int32 bit-exact (wrapping), floats within the block-scaling
bound of hostlib.scaling. One JSON line per plan entry on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import time

import numpy as np


def make_input(
    dtype: str,
    count: int,
    seed: int,
    rank: int,
    *,
    density: float = 1.0,
    same: bool = False,
    block: int = 256,
) -> np.ndarray:
    """The tensor rank `rank` contributes (deterministic, so every rank can rebuild it). With
    `density` below 1, only that share of its blocks of `block` elements is non-zero, the same
    blocks on every rank (`same`) or drawn for each (a sparse gradient, docs/protocol.md 8)."""
    rng = np.random.default_rng([seed, rank])
    x: np.ndarray
    if dtype == "int32":
        x = rng.integers(-(2**31), 2**31, size=count, dtype=np.int64).astype(np.int32)
    else:
        # gradients: mostly small, a few larger, so block scaling is exercised
        x = rng.standard_normal(count, dtype=np.float32) * np.float32(1e-3)
        x[::97] *= 100
        x = as_dtype(x, dtype)
    if density < 1.0:
        pick = np.random.default_rng([seed, 0 if same else rank, 7])
        keep = pick.random(-(-count // block)) < density
        x[~np.repeat(keep, block)[:count]] = 0
    return x


def expected_sum(dtype: str, count: int, seed: int, world: int, **shape) -> np.ndarray:
    """The exact sum of every rank's make_input (int32 wrapping; floats in float64); `shape`:
    make_input's density, same and block."""
    if dtype == "int32":
        acc = np.zeros(count, dtype=np.int32)
        for r in range(world):
            acc += make_input(dtype, count, seed, r, **shape)  # wraps like the aggregator
        return acc
    acc = np.zeros(count, dtype=np.float64)
    for r in range(world):
        acc += make_input(dtype, count, seed, r, **shape).astype(np.float64)
    return acc


def float_bound(
    dtype: str,
    count: int,
    seed: int,
    world: int,
    elems: int,
    result: np.ndarray,
    wire_bits: int = 32,
    **shape,
) -> np.ndarray:
    """Per-element bound n/(2f) + eps |r| (hostlib.scaling), with E the chunk's max exponent;
    `elems`: the job's words per packet (a chunk is 2 elems elements at `wire_bits` 16)."""
    from hostlib import scaling

    elems *= 32 // wire_bits
    pad = (-count) % elems
    e: np.ndarray | None = None
    for r in range(world):
        x = np.concatenate(
            [
                make_input(dtype, count, seed, r, **shape).astype(np.float32),
                np.zeros(pad, np.float32),
            ]
        )
        er = scaling.chunk_exponents(x.reshape(-1, elems)).astype(np.int32)
        e = er if e is None else np.maximum(e, er)
    assert e is not None  # world >= 1
    f = scaling.int_range(world, wire_bits) / np.exp2(e.astype(np.float64))
    quant = np.repeat(world / (2 * f), elems)[:count]
    # the result's rounding: float32's, then the type's (half an ulp each; eps is a whole one),
    # and half of float16's subnormal spacing
    out_ulp = np.finfo(np.float32).eps + (0 if dtype == "float32" else _eps(dtype))
    return quant + out_ulp * np.abs(result.astype(np.float64)) + 2.0**-25


def _eps(dtype: str) -> float:
    """The machine epsilon of a float dtype's name (bfloat16: 2^-7)."""
    return 2.0**-7 if dtype == "bfloat16" else float(np.finfo(np.dtype(dtype)).eps)


def as_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """x as `dtype` (bfloat16: ml_dtypes', which numpy alone does not name)."""
    if dtype == "bfloat16":
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16)
    return x.astype(dtype)


# comm.stats entries that are not counters (besides the strings): reported as they are
_PROPERTIES = ("elems", "lanes", "wire_bits")
# counters reported per aggregator of a striped job (hostlib's stats_per_aggregator)
_PER_AGGREGATOR = ("packets_sent", "retransmissions", "results", "elements", "allreduces")


def argv(rank: int, world: int, control: str, job: str, plan, *, python=None, **options):
    """The command line of one cluster_worker: rank of world, joined to job at the control
    endpoint(s) `control`, running `plan` (a list, or its JSON); `options`: more of its options
    by name (elems=768 -> --elems 768; True: a flag); `python`: the interpreter (this one)."""
    cmd = [python or sys.executable, "-m", "xdp_agg.cluster.cluster_worker"]
    cmd += ["--rank", str(rank), "--world", str(world), "--control", control, "--job", job]
    cmd += ["--plan", plan if isinstance(plan, str) else json.dumps(plan)]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is not None and value is not False:
            cmd += [flag, str(value)]
    return cmd


def join(args, **given):
    """hostlib.init for a worker process, from its --rank, --world, --control and --job, with
    the options its command line names (HostOptions.from_args: --elems, --window, --timeout,
    ... over the environment's; the benchmarks' workers take the same); `given`: more options
    by name (HostOptions fields)."""
    import hostlib

    opts = hostlib.HostOptions.from_args(args, **given)
    return hostlib.init(args.rank, args.world, args.control, args.job, opts)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument(
        "--control",
        required=True,
        help="HOST:PORT of xdp-agg serve; several, comma-separated, stripe the job over them",
    )
    ap.add_argument("--job", default="e2e")
    ap.add_argument(
        "--elems",
        type=lambda v: v if v == "auto" else int(v),
        default=None,
        help="int32 per packet, or auto (the default): the most the path MTU and the "
        "aggregator allow",
    )
    ap.add_argument("--window", type=int, default=None, help="slots per worker")
    ap.add_argument("--timeout", type=float, default=None, help="stall timeout, seconds")
    ap.add_argument(
        "--plan",
        required=True,
        help="JSON list of {dtype, count, reps, seed, verify, digest, until}; until: a path, "
        "all-reduce until rank 0 sees it (at least reps times)",
    )
    ap.add_argument("--progress", action="store_true")
    ap.add_argument(
        "--no-offload",
        action="store_true",
        help="UDP GSO and GRO off: a bmv2 aggregator (libpcap) must see one datagram per frame",
    )
    ap.add_argument(
        "--data-rank",
        type=int,
        default=None,
        help="whose input this worker makes (default --rank): a rack's worker in a two-level "
        "tree is rank i of its rack's job and one of --data-world workers summed",
    )
    ap.add_argument(
        "--data-world",
        type=int,
        default=None,
        help="how many workers' inputs make the exact sum (default --world)",
    )
    return ap


def _counters_report(comm, rank: int) -> dict:
    """What the aggregator counted for this worker, beside what this worker sent (both over
    the job and its companion jobs of other element widths: comm.stats adds theirs up too)."""
    comm.barrier()
    d = comm.status()
    mine = (d.get("counters") or {}).get(str(rank))
    for other in comm._companions.values():  # hostlib.communicator: "<job>~w16"
        theirs = (other.status().get("counters") or {}).get(str(rank))
        if mine is not None and theirs is not None:
            mine = {k: v + theirs.get(k, 0) if isinstance(v, int) else v for k, v in mine.items()}
    return {
        "rank": rank,
        "check": "counters",
        "aggregator": mine,
        "worker": comm.stats,
        "parent": d.get("parent"),  # a rack of a two-level tree: its parent link and counters
    }


def _go_on(comm, until: str | None, done: int, reps: int, rank: int) -> bool:
    """Whether the ranks run another all-reduce: `reps` of them, or with `until` (a path) at
    least `reps` and then as long as rank 0 does not see that file. Past `reps`, rank 0's view
    reaches every rank through a one-element all-reduce, so all of them stop after the same
    round (a rank deciding alone would leave the others waiting on a round it never sends)."""
    if until is None or done < reps:  # every rank knows this alike: nothing to agree on
        return done < reps
    flag = 1 if rank == 0 and not os.path.exists(until) else 0
    return bool(comm.allreduce(np.array([flag], dtype=np.int32))[0])


def _timed(
    comm, x, reps: int, until: str | None = None, rank: int = 0, sparse="auto", wire_bits=None
):
    """`reps` all-reduces of x in step with the other ranks (with `until`, see _go_on), dense
    or sparse as `sparse` says and at the element width `wire_bits` (Communicator.allreduce);
    the last result, the times and the (user, sys) CPU seconds of each."""
    times: list[float] = []
    cpu: list[tuple[float, float]] = []
    while _go_on(comm, until, len(times), reps, rank):
        comm.barrier()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        width = {} if wire_bits is None else {"wire_bits": wire_bits}  # None: the dtype's
        out = comm.allreduce(x, sparse=sparse, **width)
        times.append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu.append((r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime))
    return out, times, cpu


def _verify(
    report: dict, out, dtype: str, count: int, seed: int, world: int, elems: int, shape, bits=32
):
    """The result against the exact sum: bit-exact for int32, within the bound for floats at
    the element width `bits`; `shape`: the inputs' density, same and block (make_input)."""
    want = expected_sum(dtype, count, seed, world, **shape)
    if dtype == "int32":
        report["ok"] = bool(np.array_equal(out, want))
        report["mismatches"] = int(np.count_nonzero(out != want))
        return
    err = np.abs(out.astype(np.float64) - want)
    bound = float_bound(dtype, count, seed, world, elems, out, bits, **shape)
    report["ok"] = bool(np.all(err <= bound))
    report["max_abs_err"] = float(err.max())
    report["max_err_over_bound"] = float((err / bound).max())


def _allreduce_report(comm, item: dict, args, data_rank: int, data_world: int) -> dict:
    """One plan item: its all-reduces timed, their counters, and the result checked."""
    dtype, count = item["dtype"], int(item["count"])
    seed, reps = int(item.get("seed", 1)), int(item.get("reps", 1))
    # a sparse input: "density" of its blocks (the job's packets) non-zero, on the "same" ones
    shape = dict(
        density=float(item.get("density", 1.0)),
        same=bool(item.get("same", False)),
        block=comm.description.spec.elems,
    )
    x = make_input(dtype, count, seed, data_rank, **shape)
    before = dict(comm.stats)
    before_per = comm.stats_per_aggregator()
    sparse = item.get("sparse", "auto")
    bits = item.get("wire_bits")  # None: the dtype's default (Communicator.allreduce)
    out, times, cpu = _timed(comm, x, reps, item.get("until"), args.rank, sparse, bits)
    # cpu_s: user + sys seconds of this process per all-reduce (all its threads); on a
    # one-machine testbed sys includes the softirq work of the path (veth, bridge, the
    # XDP program) that runs in the sending system call
    report = {
        "rank": args.rank,
        "dtype": dtype,
        "count": count,
        "times": times,
        "cpu_s": [u + s for u, s in cpu],
        "cpu_user_s": [u for u, _ in cpu],
        "cpu_sys_s": [s for _, s in cpu],
        "native": comm._engine.native,
        "group": list(comm.description.group) if comm.description.group else None,
    }
    now = comm.stats
    # the counters' differences; the data path's strings and the job's sizes as they are
    report["stats"] = {
        k: v if isinstance(v, str) or k in _PROPERTIES else v - before.get(k, 0)
        for k, v in now.items()
    }
    report["per_aggregator"] = [
        {"control": now["control"], **{k: now[k] - was[k] for k in _PER_AGGREGATOR}}
        for now, was in zip(comm.stats_per_aggregator(), before_per)
    ]
    if item.get("verify", True):
        # the job's size (rank 0's; with --elems auto, what its path MTU allowed)
        report["elems"] = comm.description.spec.elems
        bits = comm.stats["wire_bits"]  # the width it ran at
        _verify(report, out, dtype, count, seed, data_world, report["elems"], shape, bits)
    if item.get("digest"):  # to compare two runs' results byte for byte
        report["sha256"] = hashlib.sha256(np.ascontiguousarray(out).tobytes()).hexdigest()
    return report


def main(argv=None) -> int:
    """Run the plan; one JSON report line per item on stdout."""
    args = _parser().parse_args(argv)
    data_rank = args.rank if args.data_rank is None else args.data_rank
    data_world = args.world if args.data_world is None else args.data_world
    plan = json.loads(args.plan)
    offload = {"gso": False, "gro": False} if args.no_offload else {}
    with join(args, progress=args.progress and args.rank == 0, **offload) as comm:
        for item in plan:
            if item.get("check") == "counters":
                report = _counters_report(comm, args.rank)
            else:
                report = _allreduce_report(comm, item, args, data_rank, data_world)
            print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
