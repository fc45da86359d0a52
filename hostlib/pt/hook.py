"""A DistributedDataParallel communication hook that all-reduces gradient buckets through xdp-agg.

    comm = hostlib.init(rank, world, "198.18.0.1:48800", "run-7")
    ddp = DistributedDataParallel(model)                 # process group: gloo (or nccl)
    ddp.register_comm_hook(HookState(comm), allreduce_hook)

DDP calls the hook from the autograd thread as each bucket of gradients is ready; the hook hands
the bucket to the state's AllreduceChannel and returns its Future at once, so backward goes on
computing the next buckets while earlier ones are on the wire. The bucket is summed in place and
divided by the world size (DDP expects the average, as its default hook computes).
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's
# annotations with dist.GradBucket and Future[Tensor] as objects, and rejects strings.
from datetime import timedelta

import torch
import torch.distributed as dist

from ..communicator import Communicator
from ..options import HostOptions
from .channel import AllreduceChannel, FallbackGroup


class HookState:
    """What allreduce_hook needs: the all-reduce channel over a hostlib Communicator.

    comm: a hostlib Communicator of the same ranks as the DDP process group (rank r of one is
        rank r of the other).
    fallback: None (default: the XDP_AGG_FALLBACK environment variable; unset means none): an
        aggregator failure raises hostlib.pt.AggregatorLost from backward(). "gloo": make a
        dedicated gloo group now (a collective call: every rank must construct its HookState at
        the same point) and continue over it after a failure, logged once. Or a process group
        of your own, used by nothing else.
    timeout: seconds the fallback group's collectives may take (the agreement after a failure);
        default the communicator's own stall timeout plus 30.
    """

    def __init__(
        self,
        comm: Communicator,
        *,
        fallback: str | FallbackGroup | None = None,
        timeout: float | None = None,
    ) -> None:
        if fallback is None:
            fallback = HostOptions.from_env().fallback
        group: FallbackGroup | None
        if isinstance(fallback, str):
            if fallback != "gloo":
                raise ValueError(
                    f"fallback must be None, 'gloo' or a process group, not {fallback!r}"
                )
            wait = timeout if timeout is not None else comm.timeout + 30
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=wait))
        else:
            group = fallback
        self.comm = comm
        self.channel = AllreduceChannel(comm, fallback=group, name="xdp-agg DDP hook")

    @property
    def on_fallback(self) -> bool:
        """True once gradients go over gloo (after an aggregator failure)."""
        return self.channel.on_fallback

    def close(self) -> None:
        """Finish pending buckets and stop the channel's thread (the communicator stays open)."""
        self.channel.close()


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket over all ranks through the aggregator.

    Returns a Future of the bucket's buffer, averaged in place, without waiting for it. float32,
    float16 and bfloat16 buckets are block-scaled through the aggregator's int32 sums (error
    bound in hostlib.scaling); CUDA buckets are staged through pinned host memory. A failed
    all-reduce fails the future (DDP raises it from backward) unless the state has a fallback.
    """
    return state.channel.submit(bucket.buffer(), average=True)
