"""DistributedDataParallel communication hooks that all-reduce gradient buckets through xdp-agg.

    comm = hostlib.init(rank, world, "198.18.0.1:48800", "run-7")
    ddp = DistributedDataParallel(model)                 # process group: gloo (or nccl)
    ddp.register_comm_hook(HookState(comm), allreduce_hook)
    # or, float32 gradients at 16 bits per element on the wire:
    ddp.register_comm_hook(HookState(comm), wire16_hook)

DDP calls the hook from the autograd thread as each bucket of gradients is ready; the hook hands
the bucket to the state's AllreduceChannel and returns its Future at once, so backward goes on
computing the next buckets while earlier ones are on the wire. The bucket is summed in place and
divided by the world size (DDP expects the average, as its default hook computes).

allreduce_hook sends a bucket at the width of its dtype (HostOptions.wire_bits, the
XDP_AGG_WIRE_BITS environment: by default bfloat16 and float16 buckets at 16 bits, float32 at
32); wire16_hook sends every bucket at 16 bits, float32 ones included: the analogue of torch's
bf16_compress_hook (torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py, torch 2.13:
`_compress_hook` casts the bucket to bfloat16 divided by the world size, all-reduces that copy
and copies the result back into the bucket), without the bfloat16 copy: hostlib converts the
float32 bucket straight to the 16-bit wire and writes the float32 sum back into it.
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
    wire_bits: the element width of allreduce_hook's buckets ("auto": by dtype, 16 or 32;
        HostOptions.wire_bits); default the XDP_AGG_WIRE_BITS environment variable, unset
        meaning "auto". wire16_hook sends at 16 bits whatever this says.
    """

    def __init__(
        self,
        comm: Communicator,
        *,
        fallback: str | FallbackGroup | None = None,
        timeout: float | None = None,
        wire_bits: int | str | None = None,
    ) -> None:
        if fallback is None or wire_bits is None:  # the environment's (HostOptions.from_env)
            env = HostOptions.from_env()
            fallback = env.fallback if fallback is None else fallback
            wire_bits = env.wire_bits if wire_bits is None else wire_bits
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
        self.channel = AllreduceChannel(
            comm,
            fallback=group,
            name="xdp-agg DDP hook",
            wire_bits=wire_bits,
        )

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
    bound in hostlib.scaling), at the width the state's policy gives their dtype (by default
    bfloat16 and float16 at 16 bits, float32 at 32; wire16_hook: every bucket at 16); CUDA
    buckets are staged through pinned host memory. A failed all-reduce fails the future (DDP
    raises it from backward) unless the state has a fallback.
    """
    return state.channel.submit(bucket.buffer(), average=True)


def wire16_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket over all ranks through the aggregator at 16
    bits per element, whatever its dtype (float32 buckets compressed; no copy is made).

    The analogue of torch's bf16_compress_hook for xdp-agg: the bucket's buffer goes to hostlib
    as it is, which block-scales it straight to the 16-bit wire (docs/protocol.md 5.6), and the
    average comes back into the buffer in its own dtype (float32 stays float32). The error per
    element of the sum is at most hostlib.scaling.error_bound(E, n, 16) = n 2^E / (2 M), M =
    floor((2^15 - 1) / n), about n^2 2^(E - 16), E the exponent of the largest magnitude of its
    packet's chunk over all ranks (|x| < 2^E), then divided by n, plus the rounding to the
    bucket's dtype. Every rank must register the same hook.
    """
    return state.channel.submit(bucket.buffer(), average=True, wire_bits=16)
