"""A model of the per-CPU program's slot state (bpf/aggregate.h), with CPUs as numbers of any
size, so that what the 2-CPU machines here cannot run is checked: contributions of one slot
folded on any of up to 8192 CPUs, in any interleaving the program allows, are gathered exactly.

It mirrors the C step by step: the arrival count gives a contribution its round and its
position in it (a mod n), the CPU folds it into its own partial (overwriting a partial tagged
with another round), notes itself in contrib_cpus under that position, and counts `added`; the
CPU whose addition completes the round gathers, for each position, the partial of the CPU noted
there, unless that is its own CPU or a partial it gathered already (count zeroed), then adds its
own. What the model leaves
out: the seen bits and duplicates (the packet table covers them) and the wire format.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MAX_WORKERS = 64  # AGG_MAX_WORKERS


@dataclass
class Partial:
    """One CPU's partial of a (slot, version): struct agg_partial."""

    tag: int = -1
    count: int = 0
    total: np.ndarray | None = None


@dataclass
class SlotVersion:
    """The state of one (slot, version) across CPUs."""

    n: int
    arrivals: int = 0
    added: int = 0
    partials: dict[int, Partial] = field(default_factory=dict)  # CPU -> its partial
    contrib_cpus: list[int] = field(default_factory=lambda: [0] * MAX_WORKERS)
    dedupe: bool = True  # False: the mutant that gathers a CPU once per position noted on it
    by_worker: bool = False  # True: the mutant that notes CPUs by worker index, not position

    def arrive(self) -> tuple[int, int]:
        """The arrival count's fetch_add: the contribution's round and position in it."""
        a = self.arrivals
        self.arrivals += 1
        return a // self.n, a % self.n

    def fold(self, cpu: int, pos: int, rnd: int, values: np.ndarray) -> None:
        """fold() into the CPU's own partial, then note_cpu() at `pos`."""
        p = self.partials.setdefault(cpu, Partial())
        if p.tag != rnd:
            p.tag, p.count, p.total = rnd, 1, values.astype(np.int64)
        else:
            p.count += 1
            p.total = p.total + values
        self.contrib_cpus[pos % MAX_WORKERS] = cpu

    def finish(self, cpu: int, rnd: int) -> np.ndarray | None:
        """The `added` count's fetch_add; the completing CPU's gathered sum, else None."""
        self.added += 1
        if self.added != (rnd + 1) * self.n:
            return None
        own = self.partials[cpu]
        total = np.zeros_like(own.total)
        if own.count != self.n:
            for i in range(self.n):  # bpf_loop(n, agg_gather_<K>)
                c = self.contrib_cpus[i]
                q = self.partials.get(c)
                if c == cpu or q is None or q.tag != rnd or (self.dedupe and q.count == 0):
                    continue
                total = total + q.total
                q.count = 0
        return total + own.total
