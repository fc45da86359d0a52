"""Accuracy of 16-bit all-reduces on real gradients (issue item 5): xdp-agg against gloo.

    nice -n 10 .venv/bin/python -m bench.accuracy                  # the full study, ~15 min
    nice -n 10 .venv/bin/python -m bench.accuracy --models digits --workers 2,4 --steps 10

For each model of examples/train.py (digits, wide, recsys), at initialisation and after --steps
steps of ordinary local SGD training, each of n ranks (n = 2, 4, 8, 16) computes the gradient
of its own batch (rank r's share of the step's global batch, as in training), flattened into
DDP's buckets. Six ways of summing the n gradients are compared, each against the float64 sum
of exactly what that way is given:

  1. xdp16-bf16: xdp-agg at 16 bits, the gradients cast to bfloat16, the result in bfloat16
  2. xdp16-f32:  xdp-agg at 16 bits, float32 gradients (the compressed option), result float32
  3. xdp32-f32:  xdp-agg at 32 bits, float32 gradients (today's path)
  4. gloo-bf16:  gloo's all-reduce of the bfloat16 gradients
  5. gloo-f32:   gloo's all-reduce of the float32 gradients
  6. gloo-hook:  DDP's bf16_compress_hook on float32 gradients: cast to bfloat16, divide by n,
                 gloo all-reduce, cast back (its result is the mean: compared with s / n)

xdp-agg's results are computed with hostlib.scaling exactly as the hosts compute them: per
bucket, one all-reduce, cut into chunks of one packet's elements (--elems words: 2 elements a
word at 16 bits), each worker's chunk exponent, their maximum E, q = rint(x f) with f = M / 2^E,
the 16-bit q packed into int32 words (xdp_agg.proto.wire.pack_pairs), the words summed,
unpacked (wire.unpack_pairs) and divided by f in float64, rounded once to the output dtype. The
aggregator's part, the int32 sum of the words, is exact: every sum is checked to stay within
+-(2^31 - 1) (no wrap) and, at 16 bits, the unpacked sums to equal the sums of q, so summing
here with numpy gives the aggregator's bytes. gloo is real: torch.distributed's gloo backend,
n processes on 127.0.0.1.

Metrics per (model, point, n, way), over all of the gradient: the relative L2 error
||r - s|| / ||s||, the largest |r - s| over the largest |s|, the share of the active elements
(some rank's input is not zero there) whose error exceeds one bfloat16 ulp of |s|, and for
xdp-agg whether every element's error is within scaling.error_bound(E, n, bits) + u |r|
(u = 2^-8 for bfloat16, 2^-24 for float32): a violation is a bug, reported loudly.

Buckets: DDP's own assignment after its first iteration (Reducer::rebuild_buckets), the
parameters in the order their gradients become ready (reverse parameter order for these
models), the first bucket closed at dist._DEFAULT_FIRST_BUCKET_BYTES (1 MiB), the others at
bucket_cap_mb (25 MiB), computed by torch's dist._compute_bucket_assignment_by_size as
torch/nn/parallel/distributed.py does, and compared with a real DDP's
rebuilt_per_bucket_param_indices (world size 1; --no-check-buckets skips it). DDP divides the
gradients by n before all-reducing; for n a power of two that scaling is exact in every
format here and changes no relative error, so the study sums the ranks' gradients as they are.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import socket
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from bench import machine, md_table, write_results
from hostlib import scaling
from xdp_agg.proto import wire

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "accuracy"
MODELS = ("digits", "wide", "recsys")
POINTS = ("init", "trained")
WAYS = ("xdp16-bf16", "xdp16-f32", "xdp32-f32", "gloo-bf16", "gloo-f32", "gloo-hook")
XDP_WAYS = {  # way -> (wire bits, input dtype, output dtype)
    "xdp16-bf16": (16, "bf16", "bf16"),
    "xdp16-f32": (16, "f32", "f32"),
    "xdp32-f32": (32, "f32", "f32"),
}
GLOO_WAYS = ("gloo-bf16", "gloo-f32", "gloo-hook")  # the order of the gloo workers' outputs
UNIT = {"bf16": 2.0**-8, "f32": 2.0**-24}  # unit roundoff of the result's dtype
TINY = {"bf16": 2.0**-134, "f32": 2.0**-150}  # half the smallest subnormal: rounding near 0
MB = 1024 * 1024
# float64 slack of the bound check (hostlib/scaling.py, docs/protocol.md 5.4): the product x f
# (inexact at 32 bits, up to 2^-22 units) and the float64 sums and division
PRODUCT_SLACK = 2.0**-20


def load_train():
    """examples/train.py as a module (make_model, Batches, load_digits_split, recsys_batch)."""
    spec = importlib.util.spec_from_file_location(
        "xdp_agg_train_example", ROOT / "examples/train.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --- numbers ----------------------------------------------------------------------------------


def bf16_spacing(x: np.ndarray) -> np.ndarray:
    """The spacing of bfloat16 numbers at |x| (one ulp; float64): 2^(floor(log2|x|) - 7), and
    the subnormal spacing 2^-133 below 2^-126 (and at 0)."""
    _, e = np.frexp(np.asarray(x, dtype=np.float64))
    return np.ldexp(1.0, np.maximum(e, -125) - 8)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float64 `x` rounded once to bfloat16 (to nearest, ties to even), as float32 values (which
    hold every bfloat16 exactly). One rounding: not float64 -> float32 -> bfloat16."""
    x = np.asarray(x, dtype=np.float64)
    step = bf16_spacing(x)
    return (np.rint(x / step) * step).astype(np.float32)  # x / step and the product: exact


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 `x` cast to bfloat16 by torch (what gloo's and the hook's inputs are), widened
    back to float32 (exact)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).float().numpy()


# --- xdp-agg, as the hosts compute it -----------------------------------------------------------


def xdpagg_allreduce(x: np.ndarray, bits: int, elems: int, out: str) -> tuple[np.ndarray, dict]:
    """One all-reduce of the (n, L) float32 rows `x` through xdp-agg at `bits` bits with `elems`
    words per packet, its result rounded to `out` ("bf16" or "f32"): (r (L,) float32, info)
    with info["tol"], info["strict"] (L,) float64: the bound per element without its u |r|
    term (with and without the float64 slack), info["double_rounding"]: for bfloat16, how many
    elements would differ had the result been rounded to float32 first."""
    n, length = x.shape
    chunk = elems * wire.elems_per_word(bits)
    m = -(-length // chunk)

    def rows(i: int) -> np.ndarray:  # worker i's chunks, the last zero-padded (4.1)
        xi = np.zeros(m * chunk, dtype=np.float32)
        xi[:length] = x[i]
        return xi.reshape(m, chunk)

    big_e = np.full(m, scaling.E_MIN, dtype=np.int8)
    for i in range(n):  # each worker's exponents; the aggregator keeps their maximum
        np.maximum(big_e, scaling.chunk_exponents(rows(i)), out=big_e)
    f = scaling.scale_factors(big_e, n, bits)
    limit = scaling.int_range(n, bits) if (big_e >= scaling.E_MAX).any() else None
    work = np.empty((m, chunk), dtype=np.float64)
    words = np.zeros((m, chunk // wire.elems_per_word(bits)), dtype=np.int64)
    qsum = np.zeros((m, chunk), dtype=np.int64) if bits == 16 else None
    for i in range(n):
        q = scaling.quantise_scaled(rows(i), f, limit, work=work)
        if qsum is not None:
            qsum += q
            q = wire.pack_pairs(q)
        words += q  # the aggregator's sum of int32 words
    if np.abs(words).max(initial=0) > 2**31 - 1:
        raise AssertionError(f"an int32 word sum wrapped at {bits} bits, n = {n}")
    sums = words.astype(np.int32)
    if qsum is not None:
        sums = wire.unpack_pairs(sums)
        if not np.array_equal(sums, qsum):
            raise AssertionError("unpacked 16-bit sums differ from the sums of q")
    info: dict = {"double_rounding": 0}
    if out == "f32":
        r = scaling.dequantise_scaled(sums, f)
    else:
        r64 = np.divide(sums, f[:, None], dtype=np.float64)
        r = round_bf16(r64)
        info["double_rounding"] = int((round_bf16(r64.astype(np.float32)) != r).sum())
    quant = scaling.error_bound(big_e, n, bits)
    slack = quant * PRODUCT_SLACK + n * np.ldexp(1.0, big_e.astype(np.int32) - 52)
    info["strict"] = np.repeat(quant, chunk)[:length]
    info["tol"] = np.repeat(quant + slack, chunk)[:length]
    return r.reshape(-1)[:length], info


# --- metrics ------------------------------------------------------------------------------------


class Errors:
    """Errors of one way of summing, accumulated over buckets: the sums of squares for the
    relative L2 error, the largest error and reference, the elements above one bfloat16 ulp,
    and (xdp-agg) the bound's violations and its largest use."""

    def __init__(self, bounded: bool) -> None:
        self.sq_err = self.sq_ref = self.max_err = self.max_ref = 0.0
        self.above_ulp = self.count = self.active = 0
        self.bounded = bounded
        self.violations = 0
        self.max_bound_use = 0.0  # max |r - s| / (error_bound + u |r|), no slack
        self.first_violation: dict | None = None

    def add(
        self,
        r: np.ndarray,
        s: np.ndarray,
        active: np.ndarray,
        bound: dict | None = None,
        dtype: str = "",
    ) -> None:
        """Count one bucket's result `r` against its float64 reference `s`; `active`: the
        elements some rank's input is not zero at (where the >ulp share is counted: an element
        that is zero everywhere sums to zero every way); `bound`: xdp-agg's info
        (xdpagg_allreduce) and `dtype` its result's dtype, to check the bound."""
        d = np.abs(r.astype(np.float64) - s)
        self.sq_err += float(np.dot(d, d))
        self.sq_ref += float(np.dot(s, s))
        self.max_err = max(self.max_err, float(d.max(initial=0.0)))
        self.max_ref = max(self.max_ref, float(np.abs(s).max(initial=0.0)))
        self.above_ulp += int(((d > bf16_spacing(s)) & active).sum())
        self.count += d.size
        self.active += int(active.sum())
        if bound is None:
            return
        rounding = UNIT[dtype] * np.abs(r.astype(np.float64)) + TINY[dtype]
        bad = d > bound["tol"] + rounding
        self.violations += int(bad.sum())
        use = d / (bound["strict"] + rounding)
        self.max_bound_use = max(self.max_bound_use, float(use.max(initial=0.0)))
        if bad.any() and self.first_violation is None:
            i = int(np.flatnonzero(bad)[0])
            self.first_violation = {"index": i, "r": float(r[i]), "s": float(s[i])}

    def result(self) -> dict:
        """The metrics: rel_l2, max_rel, above_ulp (a share of the active elements), and the
        bound's for xdp-agg."""
        out = {
            "rel_l2": math.sqrt(self.sq_err / self.sq_ref) if self.sq_ref else 0.0,
            "max_rel": self.max_err / self.max_ref if self.max_ref else 0.0,
            "above_ulp": self.above_ulp / self.active if self.active else 0.0,
            "elements": self.count,
            "active": self.active,
        }
        if self.bounded:
            out["bound_ok"] = self.violations == 0
            out["violations"] = self.violations
            out["max_bound_use"] = self.max_bound_use
            if self.first_violation is not None:
                out["first_violation"] = self.first_violation
        return out


def score_point(x: np.ndarray, res: np.ndarray | None, bounds: list, elems: int) -> dict:
    """Every way's metrics for one point: `x` the (n, L) float32 gradients, `res` gloo's
    (3, L) results (gloo_allreduces) or None, `bounds` the buckets' [a, b) ranges, each bucket
    one all-reduce: {"ways": {way: metrics}, "checks": {...}}."""
    n = x.shape[0]
    errs = {w: Errors(bounded=w in XDP_WAYS) for w in WAYS if res is not None or w in XDP_WAYS}
    double = 0
    for a, b in bounds:
        xs = np.asarray(x[:, a:b])
        xb = to_bf16(xs)  # the bfloat16 gradients, as torch casts them
        s32 = xs.sum(axis=0, dtype=np.float64)
        sbf = xb.sum(axis=0, dtype=np.float64)
        act = (xs != 0).any(axis=0)
        for way, (bits, src, out) in XDP_WAYS.items():
            r, info = xdpagg_allreduce(xb if src == "bf16" else xs, bits, elems, out)
            errs[way].add(r, sbf if src == "bf16" else s32, act, info, out)
            double += info["double_rounding"]
        del xb
        if res is not None:
            errs["gloo-bf16"].add(np.asarray(res[0, a:b]), sbf, act)
            errs["gloo-f32"].add(np.asarray(res[1, a:b]), s32, act)
            errs["gloo-hook"].add(np.asarray(res[2, a:b]), s32 / n, act)  # the hook's: the mean
    checks = {"int_sums_exact": True, "bf16_double_rounding_diffs": double}
    return {"ways": {w: e.result() for w, e in errs.items()}, "checks": checks}


# --- gloo ---------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank: int, n: int, port: int, folder: str, bounds: list) -> None:
    """Rank `rank` of n: all-reduces its rows of folder/x.npy (points, n, L) per bucket three
    ways (bf16, f32, bf16_compress_hook's); rank 0 writes the results to folder/r.npy
    (points, 3, L), every rank a CRC of its results to folder/crc.npy (points, n, 3)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n, init_method=f"tcp://127.0.0.1:{port}")
    x = np.load(os.path.join(folder, "x.npy"), mmap_mode="r")
    res = np.load(os.path.join(folder, "r.npy"), mmap_mode="r+") if rank == 0 else None
    crc = np.load(os.path.join(folder, "crc.npy"), mmap_mode="r+")
    for p in range(x.shape[0]):
        sums = [0, 0, 0]
        for a, b in bounds:
            g = torch.from_numpy(np.array(x[p, rank, a:b]))
            for j in (0, 2, 1):  # one at a time (n ranks share the memory), float32 last
                if j == 0:
                    t = g.to(torch.bfloat16)
                elif j == 1:
                    t = g  # a copy of the rank's rows already: reduced in place, last
                else:
                    # bf16_compress_hook (torch/distributed/algorithms/ddp_comm_hooks/
                    # default_hooks.py, _compress_hook): buffer.to(bfloat16).div_(world_size),
                    # all_reduce, then copy_ back into the float32 buffer
                    t = g.to(torch.bfloat16).div_(n)
                dist.all_reduce(t)
                o = t.float().numpy() if j != 1 else t.numpy()
                sums[j] = zlib.crc32(o.tobytes(), sums[j])
                if res is not None:
                    res[p, j, a:b] = o
                del t, o
        crc[p, rank] = sums
    if res is not None:
        res.flush()
    crc.flush()
    dist.barrier()
    dist.destroy_process_group()


def gloo_allreduces(folder: str, n: int, bounds: list) -> tuple[np.ndarray, bool]:
    """Spawn n gloo ranks over folder/x.npy: (their results (points, 3, L), whether every rank
    got the same bytes)."""
    import torch.multiprocessing as mp

    x = np.load(os.path.join(folder, "x.npy"), mmap_mode="r")
    points, _, length = x.shape
    np.lib.format.open_memmap(
        os.path.join(folder, "r.npy"), "w+", np.float32, (points, 3, length)
    ).flush()
    np.lib.format.open_memmap(
        os.path.join(folder, "crc.npy"), "w+", np.int64, (points, n, 3)
    ).flush()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_gloo_worker, args=(n, free_port(), folder, bounds), nprocs=n, join=True)
    crc = np.load(os.path.join(folder, "crc.npy"))
    agree = bool((crc == crc[:, :1]).all())
    return np.load(os.path.join(folder, "r.npy"), mmap_mode="r"), agree


# --- gradients ----------------------------------------------------------------------------------


def ddp_buckets(model, cap_mb: int = 25) -> list[list[int]]:
    """DDP's buckets of `model`'s parameters (their indices, each bucket in its order) after its
    first iteration: Reducer::rebuild_buckets assigns the parameters in the order their
    gradients became ready (the reverse of the parameter order for these models) with
    dist._compute_bucket_assignment_by_size, the first bucket limited to
    dist._DEFAULT_FIRST_BUCKET_BYTES (1 MiB) and the others to bucket_cap_mb (25 MiB): see
    _BucketCapacityConfig and _ddp_init_helper in torch/nn/parallel/distributed.py."""
    import torch.distributed as dist

    params = list(model.parameters())
    order = list(range(len(params)))[::-1]
    buckets, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in order],
        [dist._DEFAULT_FIRST_BUCKET_BYTES, cap_mb * MB],
        [False] * len(order),
        order,
    )
    return [list(b) for b in buckets]


def real_ddp_buckets(train, kind: str, data: tuple, batch: int) -> list[list[int]]:
    """The buckets a real DDP (gloo, world size 1) rebuilt for `kind` after its first
    iteration, from its logging data (filled in at iteration 10)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group(
        "gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}"
    )
    try:
        model = DDP(train.make_model(kind))
        batches = train.Batches(*data, batch, 0, 1, kind)
        for step in range(11):
            x, y = batches.get(step)
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
        text = model._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]
    finally:
        dist.destroy_process_group()
    return [[int(i) for i in b.split()] for b in text.split(",")]


def model_data(train, kind: str) -> tuple:
    """(x, y) of Batches for `kind`: the digits' training split, or (None, None)."""
    if kind == "digits":
        x, y, _, _ = train.load_digits_split()
        return x, y
    return None, None


def rank_batch(train, kind: str, data: tuple, n: int, rank: int, step: int, batch: int):
    """Rank `rank`'s batch of step `step` in a job of n ranks (train.Batches: its 1/n share of
    the step's global batch; the digits' shuffle depends on the steps before)."""
    batches = train.Batches(*data, batch, rank, n, kind)
    for s in range(step if kind == "digits" else 0):
        batches.get(s)
    return batches.get(step)


def train_locally(train, kind: str, data: tuple, args) -> tuple:
    """`kind` after args.steps steps of SGD (train.py's: momentum 0.9, args.lr) on the global
    batches of args.train_world ranks of args.batch (DDP's step, run locally):
    (model, [first loss, last loss])."""
    import torch
    import torch.nn.functional as F

    model = train.make_model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    batches = [
        train.Batches(*data, args.batch, r, args.train_world, kind) for r in range(args.train_world)
    ]
    losses = []
    for step in range(args.steps):
        xs, ys = zip(*(b.get(step) for b in batches))
        opt.zero_grad()
        loss = F.cross_entropy(model(torch.cat(xs)), torch.cat(ys))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses[:1] + losses[-1:]


def flat_gradient(model, buckets: list[list[int]], x, y) -> np.ndarray:
    """The gradient of the mean cross-entropy of (x, y), flattened in bucket order (float32)."""
    import torch
    import torch.nn.functional as F

    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    params = list(model.parameters())
    return torch.cat([params[i].grad.reshape(-1) for b in buckets for i in b]).numpy()


def bucket_bounds(model, buckets: list[list[int]]) -> list[tuple[int, int]]:
    """Each bucket's [a, b) in the flattened gradient."""
    params = list(model.parameters())
    out, at = [], 0
    for b in buckets:
        size = sum(params[i].numel() for i in b)
        out.append((at, at + size))
        at += size
    return out


# --- the study ----------------------------------------------------------------------------------


def model_setup(train, kind: str, args) -> dict:
    """`kind`'s data, its initial and trained models, DDP's buckets (checked against a real
    DDP's with args.check_buckets) and what the report says about them."""
    data = model_data(train, kind)
    init = train.make_model(kind)
    buckets = ddp_buckets(init)
    names = [name for name, _ in init.named_parameters()]
    bounds = bucket_bounds(init, buckets)
    info: dict = {
        "params": sum(p.numel() for p in init.parameters()),
        "buckets": [
            {"elements": b - a, "params": [names[i] for i in bk]}
            for (a, b), bk in zip(bounds, buckets)
        ],
    }
    if args.check_buckets:
        real = real_ddp_buckets(train, kind, data, args.batch)
        info["ddp_buckets_match"] = real == buckets
        if real != buckets:
            print(
                f"WARNING: {kind}: real DDP's buckets {real} differ from {buckets}", file=sys.stderr
            )
    t0 = time.monotonic()
    trained, losses = train_locally(train, kind, data, args)
    info["train_loss_first_last"] = losses
    info["train_s"] = round(time.monotonic() - t0, 1)
    return {
        "data": data,
        "init": init,
        "trained": trained,
        "buckets": buckets,
        "bounds": bounds,
        "info": info,
    }


def study_point(train, kind: str, setup: dict, n: int, point: str, args, folder: str) -> dict:
    """One row: n ranks' gradients of `kind` at `point`, all-reduced every way."""
    model = setup[point]
    step = 0 if point == "init" else args.steps
    bounds = setup["bounds"]
    path = os.path.join(folder, "x.npy")
    x = np.lib.format.open_memmap(path, "w+", np.float32, (1, n, bounds[-1][1]))
    for r in range(n):
        xy = rank_batch(train, kind, setup["data"], n, r, step, args.batch)
        x[0, r] = flat_gradient(model, setup["buckets"], *xy)
    x.flush()
    res, agree = gloo_allreduces(folder, n, bounds) if args.gloo else (None, None)
    row = {"model": kind, "point": point, "step": step, "n": n}
    row.update(score_point(x[0], None if res is None else res[0], bounds, args.elems))
    row["checks"]["gloo_ranks_agree"] = agree
    del x, res
    for name in ("x.npy", "r.npy", "crc.npy"):
        if os.path.exists(os.path.join(folder, name)):
            os.remove(os.path.join(folder, name))
    return row


def violations(rows: list[dict]) -> list[str]:
    """'model point n way: count' for every xdp-agg way whose bound failed somewhere."""
    return [
        f"{r['model']} {r['point']} n={r['n']} {w}: {m['violations']} elements, first "
        f"{m.get('first_violation')}"
        for r in rows
        for w, m in r["ways"].items()
        if m.get("bound_ok") is False
    ]


def run_study(args) -> dict:
    """Every (model, point, n) of `args`: the report (meta, models, rows)."""
    import torch

    torch.set_num_threads(args.threads)
    train = load_train()
    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.monotonic()
    rows, models = [], {}
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="xdp-agg-accuracy-", dir=shm) as folder:
        for kind in args.models:
            setup = model_setup(train, kind, args)
            models[kind] = setup["info"]
            for n in args.workers:
                for point in POINTS:
                    row = study_point(train, kind, setup, n, point, args, folder)
                    rows.append(row)
                    print(progress_line(row), flush=True)
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "models": list(args.models),
        "workers": list(args.workers),
        "steps": args.steps,
        "train_world": args.train_world,
        "batch_per_rank": args.batch,
        "lr": args.lr,
        "elems": args.elems,
        "chunk_elements": {"16": 2 * args.elems, "32": args.elems},
        "gloo": args.gloo,
        "wall_s": round(time.monotonic() - t0, 1),
        **machine(load_before),
    }
    return {"meta": meta, "models": models, "rows": rows}


def progress_line(row: dict) -> str:
    """One line per row as the study goes: each way's relative L2 error."""
    ways = " ".join(f"{w} {m['rel_l2']:.2e}" for w, m in row["ways"].items())
    return f"{row['model']} {row['point']} n={row['n']}: {ways}"


# --- the report ---------------------------------------------------------------------------------

LEGEND = """Each way's cell group: **L2** the relative L2 error ||r - s|| / ||s||, **max** the
largest |r - s| over the largest |s|, **>ulp** the share of the active elements (**active**: some
rank's input is not zero there; the others sum to zero every way) whose error exceeds one
bfloat16 ulp of |s|; s is the float64 sum of exactly what the way is given (the bfloat16
gradients for xdp16-bf16 and gloo-bf16, the float32 ones for the others; the mean s / n for
gloo-hook, whose result is the mean). **bound**: whether every element of the three xdp-agg ways
is within scaling.error_bound(E, n, bits) + u |r| (u = 2^-8 for a bfloat16 result, 2^-24 for
float32), and the largest share of it used. xdp-agg's results are computed with hostlib.scaling
as the hosts compute them; the aggregator's int32 sums of words are exact (checked: no sum
leaves +-(2^31 - 1), and the unpacked 16-bit sums equal the sums of q), so they are its bytes.
gloo's are real gloo all-reduces (torch.distributed, n processes on 127.0.0.1)."""

WHY = """Why: xdp-agg scales each chunk (one packet: 1536 elements at 16 bits) by its largest
magnitude over all workers and gives each worker floor((2^15 - 1) / n) units of it: 14 bits at
n = 2, 11 at n = 16, before the sign. Its error is absolute within the chunk, about
n^2 2^(E - 16), the same for an element as large as the chunk's largest as for one a thousand
times smaller, then the result is rounded once to bfloat16 (8 bits, relative to the element).
gloo's bfloat16 ring rounds every partial sum to bfloat16: n - 1 roundings of 2^-9 relative to
the partial sum, each element at its own scale, so its error grows with n (slowly) but small
elements keep their relative accuracy. xdp-agg is therefore better where the chunk's elements
are of similar size and n is small (its integer sum adds no rounding; only the final bfloat16
rounding and a quantisation well below it), and worse for elements far below their chunk's
largest, whose few significant units (fewer as n grows) are where the >ulp share comes from."""


def cell(m: dict) -> list[str]:
    """A way's three cells: L2, max, >ulp."""
    return [f"{m['rel_l2']:.2e}", f"{m['max_rel']:.1e}", f"{100 * m['above_ulp']:.1f}%"]


def bound_cell(row: dict) -> str:
    """ok (largest use of the bound) or the violations, for the xdp-agg ways of a row."""
    xdp = [row["ways"][w] for w in XDP_WAYS]
    bad = sum(m["violations"] for m in xdp)
    use = max(m["max_bound_use"] for m in xdp)
    return f"ok ({use:.3f})" if bad == 0 else f"**VIOLATED ({bad})**"


def results_table(rows: list[dict]) -> list[str]:
    """One row per model, point and n; a column group per way."""
    ways = [w for w in WAYS if all(w in r["ways"] for r in rows)]
    cols = ["model", "point", "n", "active"]
    for w in ways:
        cols += [f"{w} L2", "max", ">ulp"]
    body = []
    for r in rows:
        any_way = next(iter(r["ways"].values()))
        active = f"{100 * any_way['active'] / max(any_way['elements'], 1):.1f}%"
        cells = [r["model"], r["point"], r["n"], active]
        for w in ways:
            cells += cell(r["ways"][w])
        body.append(cells + [bound_cell(r)])
    return md_table(cols + ["bound"], body)


def headline(rows: list[dict]) -> list[str]:
    """Relative L2 error per way and n: the geometric mean over models and points, and the
    range."""
    ways = [w for w in WAYS if all(w in r["ways"] for r in rows)]
    body = []
    for n in sorted({r["n"] for r in rows}):
        vals = {w: [r["ways"][w]["rel_l2"] for r in rows if r["n"] == n] for w in ways}
        body.append(
            [n]
            + [
                f"{math.exp(np.mean(np.log(np.maximum(v, 1e-300)))):.2e} "
                f"({min(v):.1e}-{max(v):.1e})"
                for v in vals.values()
            ]
        )
    return md_table(["n"] + ways, body)


def reading(rows: list[dict]) -> list[str]:
    """The comparisons that matter, in numbers: 16-bit xdp-agg against gloo's bfloat16 ring on
    the same input, and the compressed option against bf16_compress_hook."""
    out = []
    pairs = (("xdp16-bf16", "gloo-bf16"), ("xdp16-f32", "gloo-hook"))
    for n in sorted({r["n"] for r in rows}):
        at = [r for r in rows if r["n"] == n]
        parts = []
        for a, b in pairs:
            if not all(b in r["ways"] for r in at):
                continue
            ratio = [r["ways"][a]["rel_l2"] / max(r["ways"][b]["rel_l2"], 1e-300) for r in at]
            wins = sum(x < 1 for x in ratio)
            ua = [100 * r["ways"][a]["above_ulp"] for r in at]
            ub = [100 * r["ways"][b]["above_ulp"] for r in at]
            parts.append(
                f"{a} / {b} L2 {min(ratio):.2f}-{max(ratio):.2f} (lower in {wins} of "
                f"{len(at)}), >ulp {min(ua):.1f}-{max(ua):.1f}% against "
                f"{min(ub):.1f}-{max(ub):.1f}%"
            )
        if parts:
            out.append(f"- n = {n}: " + "; ".join(parts) + ".")
    return out


def parameters(report: dict) -> list[str]:
    """The run's parameters and checks, as a list."""
    meta = report["meta"]
    out = [
        f"- torch {meta['torch']}; {meta['cpus']} CPUs, load average {meta['load_before']} "
        f"before, {meta['load_after']} after; {meta['wall_s']:.0f} s.",
        f"- Gradients of each rank's batch of {meta['batch_per_rank']} (its share of the step's "
        f"global batch), at initialisation (step 0) and after {meta['steps']} steps of local "
        f"SGD (lr {meta['lr']}, momentum 0.9) on the global batches of "
        f"{meta['train_world']} ranks.",
        f"- xdp-agg: {meta['elems']} words per packet: chunks of "
        f"{meta['chunk_elements']['16']} elements at 16 bits, {meta['chunk_elements']['32']} "
        "at 32; one all-reduce per DDP bucket.",
    ]
    for kind, info in report["models"].items():
        sizes = ", ".join(str(b["elements"]) for b in info["buckets"])
        check = {True: "as a real DDP's", False: "NOT as a real DDP's", None: "not checked"}[
            info.get("ddp_buckets_match")
        ]
        out.append(
            f"- {kind}: {info['params']} parameters, buckets of {sizes} elements ({check}); "
            f"training loss {info['train_loss_first_last'][0]:.3f} -> "
            f"{info['train_loss_first_last'][-1]:.3f}."
        )
    rows = report["rows"]
    agree = all(r["checks"]["gloo_ranks_agree"] in (True, None) for r in rows)
    double = sum(r["checks"]["bf16_double_rounding_diffs"] for r in rows)
    out.append(
        f"- Checks: integer sums exact in every row; gloo's ranks got the same bytes: {agree}; "
        f"xdp16-bf16 results that a float64 -> float32 -> bfloat16 double rounding would change: "
        f"{double} elements in all."
    )
    return out


def markdown(report: dict) -> str:
    """The report as Markdown: the table, the headline, the reading and the parameters."""
    rows = report["rows"]
    bad = violations(rows)
    lines = ["# Accuracy of 16-bit all-reduces: xdp-agg against gloo, on real gradients", ""]
    if bad:
        lines += ["**THE ERROR BOUND WAS VIOLATED (a bug):**", ""] + [f"- {b}" for b in bad] + [""]
    lines += results_table(rows) + [
        "",
        LEGEND,
        "",
        "Relative L2 error, geometric mean over the models and points (range):",
        "",
    ]
    lines += headline(rows) + ["", "Reading:", ""] + reading(rows) + ["", WHY, ""]
    lines += ["Parameters:", ""] + parameters(report)
    return "\n".join(lines) + "\n"


def workers_list(text: str) -> list[int]:
    """--workers: "2,4,8,16" -> [2, 4, 8, 16]."""
    out = [int(x) for x in text.split(",")]
    if any(n < 1 or n > 64 for n in out):
        raise argparse.ArgumentTypeError("workers are 1 to 64")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--models",
        type=lambda t: t.split(","),
        default=list(MODELS),
        help="comma-separated, of " + ", ".join(MODELS),
    )
    ap.add_argument("--workers", type=workers_list, default=[2, 4, 8, 16], help="n, e.g. 2,4")
    ap.add_argument("--steps", type=int, default=100, help="local SGD steps before 'trained'")
    ap.add_argument(
        "--train-world",
        type=int,
        default=4,
        help="ranks whose global batch each training step takes",
    )
    ap.add_argument("--batch", type=int, default=32, help="samples per rank (train.py's)")
    ap.add_argument("--lr", type=float, default=0.05, help="train.py's learning rate")
    ap.add_argument("--elems", type=int, default=768, help="int32 words per packet")
    ap.add_argument(
        "--no-gloo",
        dest="gloo",
        action="store_false",
        help="xdp-agg's ways only (no gloo processes)",
    )
    ap.add_argument(
        "--no-check-buckets",
        dest="check_buckets",
        action="store_false",
        help="skip comparing the buckets with a real DDP's",
    )
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the main process")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="folder for results.json/.md")
    args = ap.parse_args(argv)
    wire.size_code_for(args.elems)
    bad_models = set(args.models) - set(MODELS)
    if bad_models:
        ap.error(f"unknown models {sorted(bad_models)}")
    report = run_study(args)
    write_results(args.out, "results", report, markdown(report))
    bad = violations(report["rows"])
    for b in bad:
        print(f"ERROR BOUND VIOLATED: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
