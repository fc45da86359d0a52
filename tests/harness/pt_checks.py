"""What the hostlib.pt tests compare with and run on, besides the fake device (fake_device.py):
inputs of many magnitudes (varied_input), byte equality (same_bytes), the staged path against the
CPU path (staged_mismatches), and ranks as threads with a gloo group for the fallback
(ThreadGroup)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch


class ThreadGroup:
    """n ranks as threads that sum exactly through one barrier: every rank's tensor (exchange),
    a gloo group's allreduce (MIN, else SUM) and broadcast for the fallback (member), and the
    threads themselves (run)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=10)
        self.slots: list = [None] * n

    def exchange(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t`, stacked in rank order (each rank calls it with its own)."""
        self.slots[rank] = t.clone()
        self.barrier.wait()
        vals = torch.stack(self.slots)
        self.barrier.wait()
        return vals

    def member(self, rank: int):
        """Rank `rank`'s process group: allreduce and broadcast, each done when it returns."""
        import torch.distributed as dist

        group = self
        done = SimpleNamespace(wait=lambda: True)

        class Member:
            def allreduce(self, tensors, opts):
                vals = group.exchange(rank, tensors[0])
                red = vals.min(0).values if opts.reduceOp == dist.ReduceOp.MIN else vals.sum(0)
                tensors[0].copy_(red)
                return done

            def broadcast(self, tensors, opts):
                tensors[0].copy_(group.exchange(rank, tensors[0])[opts.rootRank])
                return done

        return Member()

    def run(self, rank_main) -> None:
        """rank_main(r) for every rank r, each on a thread of its own; waits for them all."""
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)


def varied_input(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """n values of `dtype` of many magnitudes (so that block scaling rounds differently per
    packet); int32 ones within +-2^20."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int32:
        return torch.randint(-(2**20), 2**20, (n,), dtype=torch.int32, generator=g)
    scale = torch.logspace(-3, 3, n) if n > 1 else torch.ones(1)  # float16 holds 3x that
    return (torch.randn(n, generator=g) * scale[torch.randperm(n, generator=g)]).to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b are of one dtype and hold the same bytes."""
    return a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def staged_mismatches(staged, cpu, dtypes, sizes, seed: int = 0) -> list[tuple[str, int, bool]]:
    """(dtype, n, average) of each all-reduce through channel `staged` whose result is not the
    CPU channel `cpu`'s to the byte: for every dtype of `dtypes` and n of `sizes`, the input
    varied_input(dtype, n, n + seed), SUM and AVG (SUM alone for int32, whose AVG is refused)."""
    wrong = []
    for dtype in dtypes:
        for n in sizes:
            for avg in (False,) if dtype == torch.int32 else (False, True):
                x = varied_input(dtype, n, seed=n + seed)
                a, b = x.clone(), x.clone()
                staged.submit(a, average=avg).wait()
                cpu.submit(b, average=avg).wait()
                if not same_bytes(a, b):
                    wrong.append((str(dtype), n, avg))
    return wrong
