"""Which path each collective of an xdpagg group took: the aggregator, or the gloo delegate.

A PyTorch user cannot see from the outside whether `dist.all_reduce(t)` went through the
aggregator or through gloo (float64, MAX, ...): the answer is the same, the speed is not.
`PathStats` counts the calls per (collective, op, dtype, path, wire width) and warns once per
(collective, op, dtype) when an all-reduce that could have gone through the aggregator falls
back to gloo, with the reason. `ProcessGroupXdpAgg.path_stats()` returns the counts. The wire
width (`wire_bits`) says at how many bits per element the aggregator's calls travelled: "16",
"32", or "16+32" for a coalesced list with streams of both; "-" for gloo's.
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator

import torch

AGGREGATOR = "aggregator"
GLOO = "gloo"


class FallbackWarning(UserWarning):
    """An all-reduce of an xdpagg group went through gloo instead of the aggregator (its op or
    dtype is not one the wire carries). Issued once per collective, op and dtype; silence it with
    warnings.filterwarnings("ignore", category=hostlib.pt.FallbackWarning)."""


def op_name(op: object) -> str:
    """A ReduceOp's name: "SUM", "MAX", "PREMUL_SUM", ... (None: a collective without an op)."""
    if op is None:
        return "-"
    inner = getattr(op, "op", op)  # a ReduceOp wraps a RedOpType
    return getattr(inner, "name", str(inner))


def dtype_name(tensors: object) -> str:
    """The dtype of a call's tensors ("float32"; "float32+int64" for a mixed list)."""
    names = sorted({str(t.dtype).removeprefix("torch.") for t in _flat(tensors)})
    return "+".join(names) if names else "-"


def _flat(x: object) -> Iterator[torch.Tensor]:
    """The tensors in a collective's arguments (nested lists of them; other arguments skipped)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat(y)


class PathStats:
    """Counts of calls per (collective, op, dtype, path, wire width), and the one-time fallback
    warning."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._counts: Counter[tuple[str, str, str, str, str]] = Counter()
        self._warned: set[tuple[str, str, str]] = set()
        self._lock = threading.Lock()  # async collectives may complete on other threads

    def record(
        self,
        collective: str,
        op: object,
        tensors: object,
        path: str,
        reason: str | None = None,
        wire_bits: Iterable[int] = (),
    ) -> None:
        """Count one call; warn (once per collective, op, dtype) when `reason` says why an
        all-reduce went to gloo. `wire_bits`: the widths the aggregator's call travelled at
        (none for gloo's)."""
        key = (collective, op_name(op), dtype_name(tensors))
        bits = "+".join(map(str, sorted(set(wire_bits)))) or "-"
        with self._lock:
            self._counts[key + (path, bits)] += 1
            first = reason is not None and key not in self._warned
            if first:
                self._warned.add(key)
        if first:
            warnings.warn(
                f"{self.name}: {collective} with {key[1]} of {key[2]} goes through gloo, not the "
                f"aggregator: {reason} (counted in path_stats(); warned once)",
                FallbackWarning,
                stacklevel=4,
            )

    def rows(self) -> list[dict[str, object]]:
        """[{collective, op, dtype, path, wire_bits, calls}], sorted."""
        with self._lock:
            items = sorted(self._counts.items())
        return [
            {"collective": c, "op": o, "dtype": d, "path": p, "wire_bits": b, "calls": n}
            for (c, o, d, p, b), n in items
        ]

    def total(self, path: str) -> int:
        """Calls that took `path` (AGGREGATOR or GLOO), over every collective."""
        with self._lock:
            return sum(n for k, n in self._counts.items() if k[3] == path)
