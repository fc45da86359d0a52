"""One rank of tests/root/test_torch_fsdp.py, started by torchrun (xdp_agg.cluster.torchrun) on the
testbed: FSDP2, DeviceMesh, DTensor, functional collectives, HSDP and PREMUL_SUM on the xdpagg
backend, HSDP with a bfloat16 reduce_dtype (its replicate all-reduces at 16 bits), and a rank
killed mid-training under --max-restarts 1. Prints `REPORT <json>` when done.

    torchrun ... tests/torch_fsdp_worker.py fsdp|hsdp|hsdp-wire16|restart [--steps N]

(hsdp-wire16 also runs without torchrun, on env:// rendezvous: tests/root/test_torch_wire16.py.)

Every rank builds the same model (seed 0) and its own batches from (rank, step), and trains it
twice: sharded on xdpagg, and replicated by DDP on a gloo group of all ranks (the reference).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

import hostlib.pt


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 8),
    )


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)


def _shard(
    model: torch.nn.Module,
    mesh,
    divide: float | None = None,
    mp: MixedPrecisionPolicy | None = None,
) -> torch.nn.Module:
    """fully_shard each Linear, then the root (FSDP2's usual wrapping); `mp`: its mixed
    precision policy (default: none, float32 throughout)."""
    kw = {"mp_policy": mp} if mp is not None else {}
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    if divide is not None:  # reduce-scatter with PREMUL_SUM(1/divide), then all-reduce SUM
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(divide)
    return model


def _train(model, rank: int, steps: int, on_step=None) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        if on_step is not None:
            on_step(step)
        x, y = _batch(rank, step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _compare(mesh, rank: int, steps: int, gloo, divide: float | None = None, mp=None) -> dict:
    """FSDP2/HSDP on `mesh` against DDP on gloo: per-step losses and final parameters."""
    net = _model()
    ref = DDP(copy.deepcopy(net), process_group=gloo)
    sharded = _shard(net, mesh, divide, mp)
    t0 = time.perf_counter()
    losses = _train(sharded, rank, steps)
    seconds = time.perf_counter() - t0
    ref_losses = _train(ref, rank, steps)
    full = [p.full_tensor() for p in sharded.parameters()]
    with torch.no_grad():
        param_err = max(float((a - b).abs().max()) for a, b in zip(full, ref.parameters()))
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "param_err": param_err,
        "seconds": seconds,
    }


def _packets(pg) -> int:
    return pg.comm.stats["packets_sent"]


def _checks_fsdp(mesh, rank: int, n: int) -> dict:
    """Functional collectives and DTensor redistribution on the 1-D mesh."""
    pg = mesh.get_group()
    out = {"group_name": pg.group_name, "group_desc": pg.group_desc, "job": pg.job}
    before = _packets(pg)
    r = fc.all_reduce(torch.full((1000,), rank + 1.0), "sum", mesh)
    out["functional all_reduce"] = bool(torch.equal(r.wait(), torch.full((1000,), n * (n + 1) / 2)))
    out["functional all_reduce on the wire"] = _packets(pg) > before
    before = _packets(pg)
    part = DTensor.from_local(torch.full((600,), float(rank)), mesh, [Partial()])
    rep = part.redistribute(mesh, [Replicate()]).to_local()
    out["DTensor Partial->Replicate"] = bool(torch.equal(rep, torch.full((600,), n * (n - 1) / 2)))
    out["DTensor Partial->Replicate on the wire"] = _packets(pg) > before
    sh = distribute_tensor(torch.arange(8.0 * n), mesh, [Shard(0)])
    out["DTensor Shard local"] = bool(torch.equal(sh.to_local(), torch.arange(8.0) + 8 * rank))
    full = sh.redistribute(mesh, [Replicate()]).to_local()
    out["DTensor Shard->Replicate"] = bool(torch.equal(full, torch.arange(8.0 * n)))
    return out


def _checks_premul(pg, rank: int, n: int) -> dict:
    """PREMUL_SUM on the aggregator path (number and tensor factors) and in reduce-scatter."""
    out = {}
    x = torch.full((3000,), rank + 1.0)
    before = _packets(pg)
    dist.all_reduce(x, op=dist.ReduceOp.PREMUL_SUM(0.25), group=pg)
    want = torch.full_like(x, n * (n + 1) / 8)
    out["all_reduce PREMUL_SUM(0.25)"] = bool(torch.allclose(x, want))
    out["all_reduce PREMUL_SUM on the wire"] = _packets(pg) > before
    y = torch.full((3000,), 2.0)
    dist.all_reduce(y, op=dist.ReduceOp.PREMUL_SUM(torch.tensor(0.5)), group=pg)
    out["all_reduce PREMUL_SUM(tensor 0.5)"] = bool(torch.allclose(y, torch.full_like(y, n)))
    inp = torch.arange(4.0 * n) + rank
    keep = inp.clone()
    rs = torch.zeros(4)
    dist.reduce_scatter_tensor(rs, inp, op=dist.ReduceOp.PREMUL_SUM(0.5), group=pg)
    want = 0.5 * (n * (torch.arange(4.0) + 4 * rank) + n * (n - 1) / 2)
    out["reduce_scatter_tensor PREMUL_SUM(0.5)"] = bool(torch.allclose(rs, want))
    out["reduce_scatter_tensor input unchanged"] = bool(torch.equal(inp, keep))
    return out


def run_fsdp(args, rank: int, n: int, gloo) -> dict:
    mesh = init_device_mesh("cpu", (n,))
    report = {"checks": _checks_fsdp(mesh, rank, n)}
    report["checks"].update(_checks_premul(mesh.get_group(), rank, n))
    report["fsdp"] = _compare(mesh, rank, args.steps, gloo)
    report["allreduces"] = mesh.get_group().channel.stats["allreduces"]
    return report


def _replicate_counters(rg) -> dict:
    """The control endpoint's view of the replicate group's job: the aggregator's per-worker
    contribution counters."""
    diag = rg.comm.status()
    return {r: c.get("contributions", 0) for r, c in diag.get("counters", {}).items()}


def run_hsdp(args, rank: int, n: int, gloo) -> dict:
    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("replicate", "shard"))
    rg, sg = mesh.get_group("replicate"), mesh.get_group("shard")
    report = {
        "types": [type(g).__name__ for g in (rg, sg)],
        "jobs": {"default": dist.group.WORLD.job, "replicate": rg.job, "shard": sg.job},
        "names": {"replicate": rg.group_name, "shard": sg.group_name},
        "replicate_ranks": dist.get_process_group_ranks(rg),
    }
    before = rg.channel.stats["allreduces"]
    report["hsdp"] = _compare(mesh, rank, args.steps, gloo)
    report["hsdp_allreduces"] = rg.channel.stats["allreduces"] - before
    premuls = sg.premul_sums
    report["premul"] = _compare(mesh, rank, args.steps, gloo, divide=float(n))
    report["premul"]["shard_premul_sums"] = sg.premul_sums - premuls
    report["hsdp"]["shard_premul_sums"] = premuls
    report["replicate_allreduces"] = rg.channel.stats["allreduces"]
    report["replicate_counters"] = _replicate_counters(rg)
    dist.barrier(group=rg)  # both have read the counters before either leaves the job
    report["shard_allreduces"] = sg.channel.stats["allreduces"]
    for g in (rg, sg):  # their aggregator jobs end here; the test counts the jobs left
        dist.destroy_process_group(g)
    return report


def run_hsdp_wire16(args, rank: int, n: int, gloo) -> dict:
    """HSDP (replicate 2, shard n/2) with MixedPrecisionPolicy(reduce_dtype=bfloat16), as FSDP2
    users who reduce in bfloat16 run it: the shard groups reduce-scatter bfloat16 (gloo), the
    replicate groups all-reduce the bfloat16 shards through the aggregator, at 16 bits per
    element (the width hostlib.pt gives bfloat16; XDP_AGG_WIRE_BITS=32 would say 32)."""
    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("replicate", "shard"))
    rg = mesh.get_group("replicate")
    before = dict(rg.channel.stats)
    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    report = {"hsdp": _compare(mesh, rank, args.steps, gloo, mp=mp)}
    report["replicate_allreduces"] = rg.channel.stats["allreduces"] - before["allreduces"]
    report["replicate_wire16"] = rg.channel.stats["wire16"] - before["wire16"]
    report["replicate_wire_bits"] = rg.comm.stats["wire_bits"]
    report["path_stats"] = rg.path_stats()
    report["shard_path_stats"] = mesh.get_group("shard").path_stats()
    dist.barrier(group=rg)
    return report


def run_restart(args, rank: int, n: int, gloo) -> dict:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    mesh = init_device_mesh("cpu", (n,))
    print(f"JOB {attempt} {getattr(mesh.get_group(), 'job', '-')}", flush=True)

    def crash(step):
        if attempt == 0 and rank == args.kill_rank and step == args.kill_step:
            if args.vanish:
                _vanish()
            print(f"KILLED rank {rank} at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup at all, as a crash

    model = _shard(_model(), mesh)
    losses = _train(model, rank, args.steps, on_step=crash)
    return {"attempt": attempt, "steps": len(losses), "losses": losses}


def _vanish() -> None:
    """Make this rank's death look like its host's: drop every further packet of its open
    control connections (their FIN and RST too, with iptables in this worker's namespace), so
    the control endpoint sees them stay open and silent; only the job lease ends the job."""
    port = os.environ["XDP_AGG_CONTROL"].rpartition(":")[2]
    out = subprocess.run(
        ["ss", "-Htn", "state", "established", f"( dport = :{port} )"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for line in out.splitlines():
        local = line.split()[-2]  # Recv-Q Send-Q Local:Port Peer:Port
        sport = local.rpartition(":")[2]
        rule = ["OUTPUT", "-p", "tcp", "--sport", sport, "--dport", port, "-j", "DROP"]
        subprocess.run(["iptables", "-A", *rule], check=True)
        print(f"VANISHED control connection from port {sport}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=["fsdp", "hsdp", "hsdp-wire16", "restart"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--kill-rank", type=int, default=2)
    ap.add_argument("--kill-step", type=int, default=3)
    ap.add_argument("--backend", default="xdpagg")
    ap.add_argument("--vanish", action="store_true", help="the killed rank's FIN never arrives")
    args = ap.parse_args()
    torch.set_num_threads(1)
    hostlib.pt.register_backend()  # the entry point does it where the package is installed
    dist.init_process_group(args.backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    fn = {
        "fsdp": run_fsdp,
        "hsdp": run_hsdp,
        "hsdp-wire16": run_hsdp_wire16,
        "restart": run_restart,
    }[args.scenario]
    report = {"rank": rank, "world": n, **fn(args, rank, n, gloo)}
    dist.destroy_process_group()
    print("REPORT " + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
