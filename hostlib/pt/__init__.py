"""PyTorch integration of xdp-agg: a DDP communication hook and a torch.distributed backend.

Needs torch (the `torch` extra: pip install 'xdp-agg[torch]'); the rest of hostlib does not.

DDP communication hook (the process group stays gloo or nccl; gradients go through xdp-agg):

    import hostlib, hostlib.pt
    comm = hostlib.init(rank, world, "198.18.0.1:48800", "run-7")
    model = DistributedDataParallel(net)
    model.register_comm_hook(hostlib.pt.HookState(comm), hostlib.pt.allreduce_hook)
    # float32 gradients at 16 bits per element (torch's bf16_compress_hook, without the copy):
    model.register_comm_hook(hostlib.pt.HookState(comm), hostlib.pt.wire16_hook)

torch.distributed backend "xdpagg" (all_reduce through the aggregator, the rest through gloo):

    XDP_AGG_CONTROL=198.18.0.1:48800 torchrun ... train.py     # train.py:
    dist.init_process_group("xdpagg")                          #   or "cpu:xdpagg"

Installing the package registers the backend when torch is imported (a `torch.backends` entry
point), so an unmodified script finds it; `hostlib.pt.register_backend()` does the same by hand.

Modules: channel (the ordered all-reduce stream of tensors, its staging and its gloo fallback),
staging (CUDA tensors in chunks through pinned host buffers, copies overlapped with the
aggregation), hook (allreduce_hook, wire16_hook, HookState), backend (ProcessGroupXdpAgg,
register_backend), paths (which path each collective took: PathStats, FallbackWarning).
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what __getattr__ imports on first use, for type checkers ("as": exported)
    from .backend import BACKEND_NAME as BACKEND_NAME
    from .backend import ProcessGroupXdpAgg as ProcessGroupXdpAgg
    from .backend import register_backend as register_backend
    from .channel import AggregatorLost as AggregatorLost
    from .channel import AllreduceChannel as AllreduceChannel
    from .hook import HookState as HookState
    from .hook import allreduce_hook as allreduce_hook
    from .hook import wire16_hook as wire16_hook
    from .paths import FallbackWarning as FallbackWarning

# name -> submodule; imported on first use, so that the entry point below (run inside
# `import torch`) imports nothing that could fail before its own try
_EXPORTS = {
    "allreduce_hook": "hook",
    "wire16_hook": "hook",
    "HookState": "hook",
    "ProcessGroupXdpAgg": "backend",
    "register_backend": "backend",
    "BACKEND_NAME": "backend",
    "AllreduceChannel": "channel",
    "AggregatorLost": "channel",
    "FallbackWarning": "paths",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


def _autoload() -> None:
    """Entry point of the `torch.backends` group: torch calls it at the end of `import torch`.

    It must never raise: an exception here would make `import torch` fail in every program of
    the environment, so a broken registration becomes a warning.
    """
    try:
        from .backend import register_backend

        register_backend()
    except Exception as e:  # noqa: BLE001 - see the docstring
        warnings.warn(
            f"xdp-agg: the torch.distributed backend 'xdpagg' is not registered: {e!r}",
            stacklevel=2,
        )
