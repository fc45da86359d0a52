"""Data-parallel training with torch DDP over xdp-agg or gloo: an ordinary torchrun script.

    torchrun --nnodes 4 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        examples/train.py --backend xdpagg          # XDP_AGG_CONTROL=host:port in the env

In the netns testbed: `sudo .venv/bin/python -m xdp_agg.cluster.torchrun --workers 4 --
examples/train.py --backend xdpagg`, or both systems side by side: `python -m bench.training`.

The script is what a user writes: init_process_group(--backend), DistributedDataParallel, an
optimizer loop. With --backend xdpagg, DDP's gradient all-reduces go through the aggregator (the
backend "xdpagg" of hostlib.pt, registered when torch is imported); with gloo, through gloo;
with gloo and --hook, through the aggregator by the DDP communication hook, gloo doing the rest.
--parallel fsdp shards the model with FSDP2 (fully_shard on a 1-D DeviceMesh: reduce-scatter
and all-gather, which the backend delegates to gloo); --parallel hsdp on a 2-D (replicate 2,
shard n/2) mesh, whose replicate all-reduces go through the aggregator (docs/pytorch.md).

Models:
- digits: an MLP on scikit-learn's handwritten digits (load_digits: 1797 8x8 images shipped
  inside scikit-learn, no download), 80/20 split, each rank a disjoint shard of every global
  batch. Loss per step (mean over ranks) and test accuracy every --eval-every steps.
- wide: an MLP of 25.2 M parameters (4096-4096-2048-10) on synthetic inputs: every step
  all-reduces 100 MB of gradients, the communication-bound case.
- recsys: an embedding-heavy recommender (an nn.EmbeddingBag of 262,144 items x 32, 8.4 M
  parameters, then a small MLP) on synthetic sessions of 8 items drawn from a power law, the
  label a hidden linear score of the items: each step's embedding gradient (33.5 MB, dense) is
  zero outside the rows of the items seen, most of its blocks all zero, which a sparse job of
  xdp-agg leaves at home (docs/protocol.md section 8). Accuracy on 4,096 held-out sessions.

Rank 0 prints a summary and writes --out (JSON): time per iteration (median after --warmup
steps), the compute-only time per iteration (the same steps on a local copy of the model, with
no communication), the communication share 1 - compute/iteration, losses, accuracies.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def load_digits_split(seed: int = 0):
    """(x_train, y_train, x_test, y_test) of scikit-learn's digits, pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    tr, te = perm[:cut], perm[cut:]
    return x[tr], y[tr], x[te], y[te]


RECSYS_ITEMS, RECSYS_DIM, RECSYS_SESSION = 1 << 18, 32, 8
RECSYS_TEST_STEP = 10**6  # the recommender's test sessions: recsys_batch of this step, rank 0


class Recommender(torch.nn.Module):
    """Mean of a session's item embeddings, then an MLP to click / no click."""

    def __init__(self) -> None:
        super().__init__()
        self.items = torch.nn.EmbeddingBag(RECSYS_ITEMS, RECSYS_DIM, mode="mean")
        self.head = torch.nn.Sequential(
            torch.nn.Linear(RECSYS_DIM, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2)
        )

    def forward(self, sessions: torch.Tensor) -> torch.Tensor:
        return self.head(self.items(sessions))


def recsys_batch(step: int, rank: int, b: int):
    """b sessions of RECSYS_SESSION items (a power law over the items: a few are popular) and
    their labels, from a hidden score per item that is the same on every rank."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    u = torch.rand(b, RECSYS_SESSION, generator=g)
    sessions = (RECSYS_ITEMS * u**3).long().clamp_(max=RECSYS_ITEMS - 1)
    return sessions, (_item_scores()[sessions].sum(1) > 0).long()


@functools.lru_cache(maxsize=1)
def _item_scores() -> torch.Tensor:
    return torch.randn(RECSYS_ITEMS, generator=torch.Generator().manual_seed(1))


def make_model(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)  # every rank starts from the same parameters (DDP checks it too)
    if kind == "recsys":
        return Recommender()
    if kind == "digits":
        layers = [64, 256, 256, 10]
    else:
        layers = [4096, 4096, 2048, 10]
    mods = []
    for a, b in zip(layers, layers[1:]):
        mods += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1])


class Batches:
    """Each step's global batch, shuffled per epoch (same order on every rank); a rank takes
    its 1/n of it."""

    # a seed's batches are another run's steps: seed s, step t is step t + s * SEED_STRIDE
    SEED_STRIDE = 100_000  # below RECSYS_TEST_STEP for 9 seeds of fewer steps than this

    def __init__(self, x, y, per_rank: int, rank: int, n: int, kind: str, seed: int = 0) -> None:
        self.x, self.y, self.b, self.rank, self.n, self.kind = x, y, per_rank, rank, n, kind
        self.seed = seed
        self._order = torch.empty(0, dtype=torch.int64)
        self._pos, self._epoch = 0, 0

    def get(self, step: int):
        step += self.seed * self.SEED_STRIDE
        if self.kind == "recsys":
            return recsys_batch(step, self.rank, self.b)
        if self.kind == "wide":
            g = torch.Generator().manual_seed(step * 1000 + self.rank)
            return torch.randn(self.b, 4096, generator=g), torch.randint(
                0, 10, (self.b,), generator=g
            )
        glob = self.b * self.n
        if self._pos + glob > len(self._order):
            epoch_seed = self.seed * self.SEED_STRIDE + self._epoch
            self._order = torch.randperm(
                len(self.x), generator=torch.Generator().manual_seed(epoch_seed)
            )
            self._pos, self._epoch = 0, self._epoch + 1
        idx = self._order[self._pos + self.rank * self.b : self._pos + (self.rank + 1) * self.b]
        self._pos += glob
        return self.x[idx], self.y[idx]


def wrap(net: torch.nn.Module, parallel: str, n: int) -> torch.nn.Module:
    """DDP, or FSDP2 on a 1-D (fsdp) or (replicate 2, shard n/2) (hsdp) DeviceMesh."""
    if parallel == "ddp":
        return DDP(net)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if parallel == "fsdp":
        mesh = init_device_mesh("cpu", (n,))
    else:
        mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("replicate", "shard"))
    for layer in net.modules():
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def compress_hook(kind: str):
    """torch's own bf16_compress_hook or fp16_compress_hook (default_hooks._compress_hook: the
    bucket cast to the 16-bit dtype, divided by the world size, all-reduced by the process group
    and copied back), under a name of its own: DDP refuses hooks *named* bf16_compress_hook
    unless CUDA and NCCL 2.10+ are there (torch 2.13.0, nn/parallel/distributed.py,
    register_comm_hook), while gloo all-reduces bfloat16 on the CPU as it is."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[kind]

    # no annotations: this file's are strings (__future__), which DDP's check rejects
    def gloo_compress_hook(state, bucket):
        return default_hooks._compress_hook(dtype, state, bucket)

    return gloo_compress_hook


def accuracy(model: torch.nn.Module, x, y) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--backend", default="xdpagg", help="xdpagg, cpu:xdpagg or gloo")
    ap.add_argument("--parallel", choices=["ddp", "fsdp", "hsdp"], default="ddp")
    ap.add_argument("--model", choices=["digits", "wide", "recsys"], default="digits")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    ap.add_argument("--calib", type=int, default=20, help="compute-only steps to time")
    ap.add_argument("--out", default=None, help="rank 0 writes its JSON report here")
    ap.add_argument(
        "--hook-wire-bits",
        choices=["auto", "16", "32"],
        default="auto",
        help="with --hook: the element width of the buckets (docs/protocol.md 5.6): 16, "
        "hostlib.pt.wire16_hook (float32 gradients compressed to 16 bits, the analogue of "
        "bf16_compress_hook); 32, or auto (by dtype: float32 at 32), allreduce_hook",
    )
    ap.add_argument(
        "--seed", type=int, default=0, help="the parameters' initialisation and the batches"
    )
    ap.add_argument(
        "--compress",
        choices=["bf16", "fp16"],
        default=None,
        help="DDP over the process group (e.g. gloo) with torch's own bf16_compress_hook or "
        "fp16_compress_hook (torch.distributed.algorithms.ddp_comm_hooks.default_hooks): the "
        "gradients all-reduced in 16 bits, the baseline of xdp-agg's 16-bit hook",
    )
    ap.add_argument(
        "--hook",
        action="store_true",
        help="keep --backend (e.g. gloo) as the process group and send the gradients "
        "through xdp-agg with the DDP communication hook (XDP_AGG_CONTROL)",
    )
    args = ap.parse_args(argv)

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if "xdpagg" in args.backend and "xdpagg" not in dist.Backend.backend_list:
        import hostlib.pt  # not installed as a package (no entry point): register by hand

        hostlib.pt.register_backend()
    dist.init_process_group(args.backend)
    rank, n = dist.get_rank(), dist.get_world_size()

    if args.model == "digits":
        xtr, ytr, xte, yte = load_digits_split()
    else:
        xtr = ytr = xte = yte = None
        if args.model == "recsys":  # held out: the seed of a step no run reaches
            xte, yte = recsys_batch(RECSYS_TEST_STEP, 0, 4096)
    batches = Batches(xtr, ytr, args.batch, rank, n, args.model, args.seed)
    net = make_model(args.model, args.seed)
    params = sum(p.numel() for p in net.parameters())
    local = copy.deepcopy(net)  # for the compute-only timing
    model = wrap(net, args.parallel, n)
    state = None
    if args.hook:
        import hostlib
        import hostlib.pt
        from hostlib.options import HostOptions, control_from_env

        # the job's name from the run id torchrun gives every node (all ranks agree on it)
        job = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'train')}.hook"
        # the control endpoint and the options (elems, window, ...) from the XDP_AGG_*
        # environment, as the backend takes them (hostlib.options)
        comm = hostlib.init(rank, n, control_from_env(), job, HostOptions.from_args(args))
        if args.hook_wire_bits == "16":  # every bucket at 16 bits: wire16_hook
            state = hostlib.pt.HookState(comm)
            model.register_comm_hook(state, hostlib.pt.wire16_hook)
        else:  # the buckets' dtype decides ("auto"), or 32
            bits = args.hook_wire_bits if args.hook_wire_bits == "auto" else 32
            state = hostlib.pt.HookState(comm, wire_bits=bits)
            model.register_comm_hook(state, hostlib.pt.allreduce_hook)
    if args.compress:
        if args.hook or args.parallel != "ddp":
            raise SystemExit(
                "--compress is a DDP hook of the process group: not with --hook or FSDP"
            )
        model.register_comm_hook(None, compress_hook(args.compress))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    losses, times, accs = [], [], []
    dist.barrier()
    for step in range(args.steps):
        x, y = batches.get(step)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()  # DDP all-reduces the gradient buckets, overlapping the backward pass
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if xte is not None and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            if args.parallel != "ddp":  # a sharded forward is collective: every rank runs it
                accs.append((step + 1, accuracy(model, xte, yte)))
            elif rank == 0:
                accs.append((step + 1, accuracy(model.module, xte, yte)))

    # compute-only: the same work on a local copy, no communication (every rank, at once, so
    # that the CPU is shared as during training)
    lopt = torch.optim.SGD(local.parameters(), lr=args.lr, momentum=0.9)
    dist.barrier()
    calib = []
    for step in range(args.calib + args.warmup):
        x, y = batches.get(step)
        t0 = time.perf_counter()
        lopt.zero_grad()
        F.cross_entropy(local(x), y).backward()
        lopt.step()
        calib.append(time.perf_counter() - t0)

    # mean loss over ranks per step, and the slowest rank's time per step (delegated to gloo
    # under xdpagg: a list of Python objects)
    gathered = [None] * n
    dist.all_gather_object(gathered, {"losses": losses, "times": times, "calib": calib})
    if rank == 0:
        mean_loss = [statistics.fmean(g["losses"][i] for g in gathered) for i in range(len(losses))]
        step_time = [max(g["times"][i] for g in gathered) for i in range(len(times))]
        comp = [max(g["calib"][i] for g in gathered) for i in range(len(calib))]
        t_iter = statistics.median(step_time[args.warmup :])
        t_comp = statistics.median(comp[args.warmup :])
        report = {
            "backend": args.backend
            + (f" + xdp-agg hook ({args.hook_wire_bits} bits)" if args.hook else "")
            + (f" + torch {args.compress}_compress_hook" if args.compress else ""),
            "seed": args.seed,
            "parallel": args.parallel,
            "model": args.model,
            "world_size": n,
            "params": params,
            "steps": args.steps,
            "batch_per_rank": args.batch,
            "lr": args.lr,
            "time_per_iter_s": t_iter,
            "compute_per_iter_s": t_comp,
            "comm_share": max(0.0, 1.0 - t_comp / t_iter),
            "loss": mean_loss,
            "step_time_s": step_time,
            "accuracy": accs,
            "final_accuracy": accs[-1][1] if accs else None,
        }
        pg = dist.distributed_c10d._get_default_group()
        if hasattr(pg, "channel"):
            report["xdpagg"] = {
                "job": pg.job,
                "on_fallback": pg.channel.on_fallback,
                "channel": pg.channel.stats,
                "engine": pg.comm.stats,
            }
            if args.parallel == "hsdp":  # the replicate dimension's all-reduces
                rg = next(model.parameters()).device_mesh.get_group("replicate")
                report["xdpagg"]["replicate"] = {"job": rg.job, "channel": rg.channel.stats}
        acc = f", final accuracy {report['final_accuracy']:.4f}" if accs else ""
        print(
            f"{report['backend']} {args.parallel}: {args.model} "
            f"({params / 1e6:.2f} M parameters), n={n}: "
            f"{t_iter * 1e3:.1f} ms per iteration, {t_comp * 1e3:.1f} ms of it compute "
            f"(communication {report['comm_share']:.0%}), final loss {mean_loss[-1]:.4f}{acc}",
            flush=True,
        )
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f)
    if state is not None:
        state.close()
        state.comm.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
