"""One benchmark worker: joins both an xdp-agg job (hostlib) and a gloo process group, then times
both systems' all-reduce of the same tensor (the plan item's dtype, xdp-agg at its width, gloo on
its "gloo_dtype"), alternating, behind a common barrier.

Besides the times, each all-reduce's CPU seconds (user + sys of this process, all its threads:
gloo's too) and, over a measurement set, the difference of the engine's statistics. With
--layout and --agg-name, rank 0 also snapshots every drop counter of the testbed and the
aggregator's counters (netns_testbed.counters) around each xdp-agg all-reduce of a throughput
or host set, behind barriers, outside the timed span, so that gloo's traffic between them is
not counted; the sum of those differences goes out with the set for bench.allreduce to
attribute the retransmissions.

With --syscpu, rank 0 also reads system-wide CPU time (/proc/stat) and the aggregator's BPF run
time around each all-reduce of either system, behind barriers (bench.cpustat), and the rest of
the machine's CPU rate over a quiet second before each measurement set.

Run by bench.allreduce inside a worker namespace; prints one JSON line per measurement set.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import ml_dtypes
import numpy as np

from bench.density import SPARSE
from bench.lossrows import Burst
from hostlib.sparsity import nonzero_blocks
from xdp_agg.cluster.cluster_worker import as_dtype, join, make_input


def _parser() -> argparse.ArgumentParser:
    """The command line's options."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--control", required=True)
    ap.add_argument("--gloo", required=True, help="HOST:PORT of rank 0 for gloo's TCP rendezvous")
    ap.add_argument("--job", required=True)
    ap.add_argument("--elems", type=lambda v: v if v == "auto" else int(v), default=None)
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument(
        "--plan",
        required=True,
        help='JSON: [{"bytes": N, "reps": R, "kind": "throughput"|"latency"|"host"|"sparse"'
        '|"burst", '
        '"dtype": "float32"|"int32"}] (host: xdp-agg alone; sparse: also "density", the '
        'union block density, and "pattern", "same" or "indep")',
    )
    ap.add_argument(
        "--counted",
        action="store_true",
        help="every rank: rank 0 snapshots counters around each xdp-agg all-reduce "
        "(the extra barriers must be the same on all ranks)",
    )
    ap.add_argument("--layout", default=None, help="JSON of netns_testbed.counters.Layout (rank 0)")
    ap.add_argument("--agg-name", default=None, help="the aggregator's --name, for its counters")
    ap.add_argument(
        "--syscpu",
        action="store_true",
        help="every rank: rank 0 reads system-wide CPU (/proc/stat) and the aggregator's BPF run "
        "time around each all-reduce (bench.cpustat; the extra barriers are on all ranks)",
    )
    ap.add_argument(
        "--profile",
        default=None,
        help="cProfile xdp-agg's all-reduces of this size into --profile-out",
    )
    ap.add_argument("--profile-out", default=None)
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    comm = join(args, timeout=60)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.gloo}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=120),
    )
    counters = _Counters(args) if args.rank == 0 and args.layout else None
    meter = None
    if args.syscpu and args.rank == 0:
        from bench import cpustat

        meter = cpustat.Meter(cpustat.aggregator_prog_fds(args.agg_name) if args.agg_name else [])
    try:
        for item in json.loads(args.plan):
            out = _run_item(args, comm, dist, torch, item, counters, meter)
            print(json.dumps(out), flush=True)
    finally:
        dist.destroy_process_group()
        comm.close()
    return 0


def _inputs(item: dict, rank: int, world: int, block: int):
    """This rank's tensor of a plan item (its dtype and elements), seeded by rank and size. A sparse
    item's (kind "sparse") has its blocks of `block` elements zero but for a share: the same
    blocks on every rank ("same": that share is the union density), or drawn for each rank
    with the probability that makes the union density the item's ("indep")."""
    count = max(1, int(item.get("elements", int(item["bytes"]) // 4)))
    if item.get("kind") == "sparse":
        same = item["pattern"] == "same"
        density = per_worker_density(float(item["density"]), world, same)
        return make_input(
            item.get("dtype", "float32"),
            count,
            count,
            rank,
            density=density,
            same=same,
            block=block,
        )
    rng = np.random.default_rng([rank, count])
    dtype = item.get("dtype", "float32")
    if dtype == "int32":
        return rng.integers(-(2**20), 2**20, size=count, dtype=np.int32)
    x = rng.standard_normal(count).astype(np.float32)
    return as_dtype(x, dtype)


def per_worker_density(union: float, world: int, same: bool) -> float:
    """The share of its blocks each worker has data in for a union density `union`: the same,
    when every worker has the same blocks; 1 - (1 - union)^(1/n) when each draws its own."""
    return union if same or union >= 1.0 else 1.0 - (1.0 - union) ** (1.0 / world)


def _run_item(args, comm, dist, torch, item: dict, counters, meter) -> dict:
    """One plan item on every system: warm-up, then the timed repetitions, the systems' order
    rotated every repetition; this rank's report."""
    nbytes, reps = int(item["bytes"]), int(item["reps"])
    kind, dtype = item.get("kind", "throughput"), item.get("dtype", "float32")
    block = int(comm.stats["elems"])
    x = _inputs(item, args.rank, args.world, block)
    runs, sparse = _systems(item, comm, dist, torch, x)
    for fn in runs.values():  # warm-up: connections, buffers, page faults
        dist.barrier()
        fn()
    times = {k: [] for k in runs}
    cpu = {k: [] for k in runs}
    count_drops = args.counted and kind in ("throughput", "host")
    deltas = []
    spans = {k: [] for k in runs}
    background = None
    if args.syscpu:  # the rest of the machine's rate, while every rank waits
        dist.barrier()
        if meter:
            background = meter.background(1.0)
        dist.barrier()
    # a burst item: rank 0's frames dropped for a while in every timed all-reduce (bench.lossrows)
    burst = Burst(float(item["burst_ms"])) if kind == "burst" and args.rank == 0 else None
    before = comm.stats
    names = list(runs)
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]  # who goes first rotates
        for name in order:
            snap = count_drops and name == "xdp-agg"
            dist.barrier()
            if snap:
                s0 = counters.snapshot() if counters else None
                dist.barrier()
            if args.syscpu:  # the span: from here to every rank done (the barrier below)
                m0 = meter.start() if meter else None
                dist.barrier()
            c0 = _cpu_seconds()
            s_before = comm.stats if name == SPARSE else None
            t0 = time.perf_counter()
            if burst:
                burst.start()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
            if burst:
                burst.wait()  # the frames flow again before the next all-reduce
            cpu[name].append(_cpu_seconds() - c0)
            if s_before is not None:
                sparse.count(s_before, comm.stats)
            if snap or args.syscpu:
                dist.barrier()  # every rank is done: its socket's counters are final
            if meter:
                spans[name].append(meter.span(m0))
            if snap and counters:
                deltas.append(counters.diff(s0, counters.snapshot()))
        if sparse:
            sparse.check()  # outside the timed spans
    after = comm.stats
    # the counters' differences (data_path and its reason are strings: as they are)
    engine = {
        k: v if isinstance(v, str) else v - before.get(k, 0) for k, v in after.items() if k != "rtt"
    }
    engine["rtt"] = after.get("rtt", 0.0)  # the smoothed round trip at the end, not a difference
    out = {
        "rank": args.rank,
        "bytes": nbytes,
        "kind": kind,
        "dtype": dtype,
        "wire_bits": comm.stats.get("wire_bits", 32),
        "times": times,
        "cpu": cpu,
        "engine": engine,
        "retransmissions": engine["retransmissions"],
        "packets": engine["packets_sent"],
    }
    if sparse:
        out["sparse"] = sparse.report(item, args.world, block)
    if burst:
        out["burst_spans"] = burst.spans
    if deltas:
        out["counters"] = counters.sum(deltas)
    if meter:
        out["syscpu"] = spans
        out["background_cpu_per_s"] = background
    if args.profile and int(args.profile) == nbytes:
        profile_one(comm, dist, x, runs["xdp-agg"].y, args)
    return out


class _Run:
    """One system's all-reduce of x, as a call: xdp-agg's into a preallocated y (dense, or
    sparse), at `wire_bits`, gloo's in place on its own tensor (so neither pays for allocating
    and faulting in an output)."""

    def __init__(self, comm, x, sparse: bool, wire_bits: int = 32) -> None:
        self.comm, self.x, self.y, self.sparse = comm, x, np.empty_like(x), sparse
        self.wire_bits = wire_bits

    def __call__(self) -> None:
        self.comm.allreduce(self.x, out=self.y, sparse=self.sparse, wire_bits=self.wire_bits)


def torch_view(torch, x: np.ndarray):
    """A torch tensor of a copy of x, bfloat16 too (numpy's bfloat16 is ml_dtypes')."""
    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(x.copy())


def _gloo(item: dict, dist, torch, x):
    """gloo's all-reduce of x in its "gloo_dtype": in place, or for a float32 tensor on a
    bfloat16 copy, copied back (timed: what DDP's bf16_compress_hook does every bucket)."""
    t = torch_view(torch, x)
    if item.get("gloo_dtype", item.get("dtype", "float32")) == item.get("dtype", "float32"):
        return lambda: dist.all_reduce(t)
    copy = torch.empty(t.shape, dtype=torch.bfloat16)

    def compressed() -> None:
        copy.copy_(t)
        dist.all_reduce(copy)
        t.copy_(copy)

    return compressed


def _systems(item: dict, comm, dist, torch, x):
    """The all-reduces a plan item times, by name, and for a sparse item its _SparseCheck:
    xdp-agg dense; gloo but in host rows; xdp-agg sparse in sparse rows."""
    kind = item.get("kind", "throughput")
    runs = {"xdp-agg": _Run(comm, x, sparse=False, wire_bits=item.get("wire_bits", 32))}
    if kind != "host":
        runs["gloo"] = _gloo(item, dist, torch, x)
    if kind != "sparse":
        return runs, None
    runs[SPARSE] = _Run(comm, x, sparse=True)
    return runs, _SparseCheck(runs["xdp-agg"].y, runs[SPARSE].y)


class _SparseCheck:
    """A sparse item's evidence: after every repetition, the sparse result must equal the dense
    one byte for byte (docs/protocol.md 8: the agreed exponents are the same maxima); the
    sparse all-reduces' own packets, bytes and skipped blocks."""

    COUNTS = ("packets_sent", "bytes_sent", "empty_sent", "blocks_skipped", "retransmissions")

    def __init__(self, dense_y: np.ndarray, sparse_y: np.ndarray) -> None:
        self.dense_y, self.sparse_y = dense_y, sparse_y
        self.checked = self.equal = 0
        self.counts = dict.fromkeys(self.COUNTS, 0)
        self.runs = 0

    def count(self, before: dict, after: dict) -> None:
        self.runs += 1
        for k in self.COUNTS:
            self.counts[k] += after[k] - before[k]

    def check(self) -> None:
        self.checked += 1
        # byte for byte, without copying either (a view of the bits, not a float compare)
        self.equal += np.array_equal(self.dense_y.view(np.uint8), self.sparse_y.view(np.uint8))

    def report(self, item: dict, world: int, block: int) -> dict:
        blocks = -(-self.sparse_y.size // block)
        same = item["pattern"] == "same"
        return {
            "density": item["density"],
            "pattern": item["pattern"],
            "per_worker_density": per_worker_density(float(item["density"]), world, same),
            "blocks": blocks,
            "union_blocks": nonzero_blocks(self.sparse_y, block)[0],
            "checked": self.checked,
            "equal_to_dense": self.equal,
            **{k: v / max(1, self.runs) for k, v in self.counts.items()},  # per all-reduce
        }


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, all threads (gloo's included)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class _Counters:
    """Rank 0's view of the testbed's drop counters and the aggregator's counters by reason."""

    def __init__(self, args) -> None:
        from netns_testbed import counters
        from xdp_switch import backend as xdp_backend

        self.mod = counters
        self.layout = counters.Layout.from_dict(json.loads(args.layout))
        # opened once: each open_instance opens every pinned map
        self.maps = xdp_backend.open_instance(args.agg_name)[1] if args.agg_name else None

    def _aggregator(self) -> dict:
        """What xdp_backend.stats reports (reasons per job, counters per worker)."""
        from xdp_agg.proto.limits import NO_JOB

        m = self.maps
        out = {"unattributed": m.counters(NO_JOB), "jobs": {}}
        for j in m.jobs():
            ws = {w.index: m.worker_counters(j, w.index) for _, w in m.workers() if w.job == j}
            out["jobs"][j] = {"reasons": m.counters(j), "workers": ws}
        return out

    def snapshot(self) -> dict:
        return self.mod.snapshot(self.layout, self._aggregator if self.maps else None)

    def diff(self, a: dict, b: dict) -> dict:
        return self.mod.diff(a, b)

    def sum(self, deltas: list[dict]) -> dict:
        return self.mod.sum_deltas(deltas)


def profile_one(comm, dist, x, y, args) -> None:
    """One more xdp-agg all-reduce of x, profiled: cProfile of rank 0's Python and, where perf is
    installed, a system-wide perf sample of both CPUs (every worker, the kernel's forwarding and
    the XDP program) while it runs. Rank 0 writes both to --profile-out."""
    if args.rank != 0:
        dist.barrier()
        comm.allreduce(x, out=y)
        return
    tmp = tempfile.mkdtemp(prefix="xdp-agg-perf-")
    perf_data = os.path.join(tmp, "perf.data")
    perf = None
    if shutil.which("perf"):
        try:
            perf = _Perf(tmp, perf_data)
        except (OSError, RuntimeError):
            perf = None
    prof = cProfile.Profile()
    dist.barrier()
    if perf is not None:
        perf.enable()
    prof.enable()
    t0 = time.perf_counter()
    comm.allreduce(x, out=y)
    wall = time.perf_counter() - t0
    prof.disable()
    if perf is not None:
        perf.stop()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    with open(args.profile_out, "w") as f:
        f.write(
            f"Profile of one xdp-agg all-reduce of {x.nbytes} bytes float32, n={args.world} "
            f"(wall {wall:.3f} s)\n\n"
        )
        if perf is not None:
            f.write(perf_summary(perf_data, wall))
        f.write("\n== cProfile of rank 0's Python, by own time ==\n")
        f.write(buf.getvalue())
    shutil.rmtree(tmp, ignore_errors=True)


class _Perf:
    """`perf record -a` started with its events disabled, enabled for exactly the profiled span."""

    def __init__(self, tmp: str, data: str) -> None:
        self.ctl, self.ack = os.path.join(tmp, "ctl"), os.path.join(tmp, "ack")
        os.mkfifo(self.ctl)
        os.mkfifo(self.ack)
        self.proc = subprocess.Popen(
            [
                "perf",
                "record",
                "-D",
                "-1",
                "--control",
                f"fifo:{self.ctl},{self.ack}",
                "-e",
                "cpu-clock",
                "-F",
                "2000",
                "-a",
                "-g",
                "-o",
                data,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:  # the fifo has a reader once perf is up; never block on a perf that failed
            try:
                fd = os.open(self.ctl, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    self.proc.wait()
                    raise RuntimeError("perf record did not start")
                time.sleep(0.05)
        os.set_blocking(fd, True)
        self.ctl_f = os.fdopen(fd, "w")
        self.ack_f = open(self.ack, "r")

    def _command(self, what: str) -> None:
        self.ctl_f.write(what + "\n")
        self.ctl_f.flush()
        self.ack_f.readline()

    def enable(self) -> None:
        self._command("enable")

    def stop(self) -> None:
        self._command("disable")
        self.ctl_f.close()
        self.ack_f.close()
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(120)


_KERNEL_PATHS = [  # inclusive kernel functions worth naming, with what they stand for
    ("udp_sendmsg", "workers' sendmsg: GSO send, and the forwarding + XDP that its softirq runs"),
    ("do_recvmmsg", "workers' recvmmsg: dequeue and copy of results"),
    ("net_rx_action", "softirq receive processing (all namespaces)"),
    ("br_handle_frame", "the bridge (one-arm switch): forwarding and flooding"),
    ("veth_xdp_rcv_skb", "aggregator ingress: veth to XDP (copy into the XDP buffer, program run)"),
    ("skb_segment", "GSO segmentation before the aggregator's XDP"),
    ("__udp4_lib_mcast_deliver", "broadcast results delivered to worker sockets"),
    ("ip_error", "broadcast copies the bridge's own stack discards"),
    ("clear_page_erms", "zeroing fresh pages (page faults)"),
    ("do_poll", "poll(): waiting"),
]


def perf_summary(path: str, wall: float) -> str:
    """CPU time split by what ran (from `perf report`), as text."""

    def report(*extra):
        r = subprocess.run(
            ["perf", "report", "-i", path, "--stdio", "-q", "-g", "none", *extra],
            capture_output=True,
            text=True,
            timeout=300,
        )
        return r.stdout

    groups: dict[str, float] = {}
    for line in report("--no-children", "--sort", "comm,dso").splitlines():
        parts = line.split()
        if len(parts) < 3 or not parts[0].endswith("%"):
            continue
        pct, comm, dso = float(parts[0][:-1]), parts[1], " ".join(parts[2:])
        if comm == "swapper":
            key = "idle (no runnable task)"
        elif dso.startswith("bpf_prog") and "xdp_agg" in dso:
            key = "XDP aggregator program"
        elif "kernel" in dso:
            key = "kernel (network stack, syscalls, scheduler)"
        elif "multiarray" in dso or "umath" in dso:
            key = "numpy (scaling, copies, bookkeeping)"
        elif "python" in dso:
            key = "Python interpreter"
        elif dso.startswith("lib"):
            key = f"C libraries ({dso.split('.')[0]})"
        else:
            key = "other"
        groups[key] = groups.get(key, 0.0) + pct
    out = [
        "== perf, system-wide over both CPUs "
        "(cpu-clock samples; 100% = 2 CPUs x the sampled time) ==",
        "",
    ]
    for key, pct in sorted(groups.items(), key=lambda kv: -kv[1]):
        out.append(f"  {pct:6.2f}%  {key}")
    children = report("--children", "--sort", "sym")
    incl = {}
    for line in children.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0].endswith("%") and parts[2] == "[k]":
            incl.setdefault(parts[3], float(parts[0][:-1]))
    out += [
        "",
        "Kernel paths (inclusive: a path's share contains what it calls, so they overlap):",
        "",
    ]
    for sym, what in _KERNEL_PATHS:
        if sym in incl:
            out.append(f"  {incl[sym]:6.2f}%  {sym:28s} {what}")
    out += ["", "Top symbols by own time:", ""]
    top = [ln for ln in report("--no-children", "--sort", "dso,sym").splitlines() if ln.strip()][
        :30
    ]
    out += ["  " + ln.strip() for ln in top]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
