"""PyTorch integration of xdp-agg: a DDP communication hook and a torch.distributed backend.

Needs torch (the `torch` extra: pip install 'xdp-agg[torch]'); the rest of hostlib does not.

DDP communication hook (the process group stays gloo or nccl; gradients go through xdp-agg):

    import hostlib, hostlib.pt
    comm = hostlib.init(rank, world, aggregator="198.18.0.1:48800", job="run-7")
    model = DistributedDataParallel(net)
    model.register_comm_hook(hostlib.pt.HookState(comm), hostlib.pt.allreduce_hook)

torch.distributed backend "xdpagg" (all_reduce through the aggregator, the rest through gloo):

    XDP_AGG_CONTROL=198.18.0.1:48800 torchrun ... train.py     # train.py:
    dist.init_process_group("xdpagg")                          #   or "cpu:xdpagg"

Installing the package registers the backend when torch is imported (a `torch.backends` entry
point), so an unmodified script finds it; `hostlib.pt.register_backend()` does the same by hand.

Modules: channel (the ordered all-reduce stream of tensors, its staging and its gloo fallback),
hook (allreduce_hook, HookState), backend (ProcessGroupXdpAgg, register_backend).
"""

from __future__ import annotations

import warnings

from .backend import BACKEND_NAME, ProcessGroupXdpAgg, register_backend
from .channel import AggregatorLost, AllreduceChannel
from .hook import HookState, allreduce_hook

__all__ = [
    "allreduce_hook",
    "HookState",
    "ProcessGroupXdpAgg",
    "register_backend",
    "BACKEND_NAME",
    "AllreduceChannel",
    "AggregatorLost",
]


def _autoload() -> None:
    """Entry point of the `torch.backends` group: torch calls it at the end of `import torch`.

    It must never raise: an exception here would make `import torch` fail in every program of
    the environment, so a broken registration becomes a warning.
    """
    try:
        register_backend()
    except Exception as e:  # noqa: BLE001 - see the docstring
        warnings.warn(f"xdp-agg: the torch.distributed backend 'xdpagg' is not registered: {e!r}",
                      stacklevel=2)
