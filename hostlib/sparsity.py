"""Whether an all-reduce runs sparse (docs/protocol.md section 8.5).

Every rank of a communicator must make the same choice for the same all-reduce: a round with a
dense contribution and a sparse one never completes (the aggregator drops the second kind,
`drop_sparse_mismatch`). So `sparse="auto"` cannot follow each rank's own tensor, whose density
differs from rank to rank (one rank's embedding rows are another's zeros). It follows what every
rank holds identically: the result of the previous all-reduce of the same kind and length, whose
*union* block density (the share of blocks some rank had data in) is what a sparse all-reduce
must move. The first all-reduce of a kind and length runs sparse, which costs at most the
22-byte headers where every block turns out non-zero. After a sparse all-reduce the loop has
counted the union itself (Engine.last_union: the results that carried data); after a dense one
it is sampled on the result.
"""

from __future__ import annotations

import numpy as np

# "auto" runs sparse while the union block density of the previous all-reduce of the same kind
# and length is below this share. Measured (docs/benchmarks.md, "Sparse all-reduces through the
# aggregator"): a sparse all-reduce's time follows the union density, and at 100% it is within
# 1% of the dense one (0.99x through XDP, n = 4 at 1 Gbit/s; 1.008x on the host); at 98% it is
# already 1.01x faster, at 95% 1.05x, at 90% 1.10x. A wrong sparse choice costs at most ~1%, a
# wrong dense one 1 - density: so sparse up to where the two meet.
AUTO_DENSITY = 0.98
# the density is estimated on every SAMPLE_STRIDE-th block of the result (the same blocks on
# every rank), so that it costs a small share of a pass over the tensor
SAMPLE_STRIDE = 8
# kinds and lengths remembered (DDP's buckets repeat every step; a few dozen is plenty)
MEMORY = 256


def check_sparse_arg(sparse: object) -> None:
    """ValueError unless `sparse` is True, False or "auto"."""
    if not (sparse is True or sparse is False or (isinstance(sparse, str) and sparse == "auto")):
        raise ValueError(f"sparse must be True, False or 'auto', not {sparse!r}")


class SparseChooser:
    """Chooses dense or sparse per all-reduce, identically on every rank (module docstring).

    `job_sparse`: whether the job takes sparse all-reduces (JobSpec.sparse); `elems`: its
    elements per packet, the block size.
    """

    def __init__(self, job_sparse: bool, elems: int) -> None:
        self.job_sparse, self.elems = job_sparse, elems
        self._density: dict[tuple[str, int], float] = {}

    def check(self, sparse: object) -> None:
        """ValueError for a `sparse` this job cannot run (or that is no choice at all)."""
        check_sparse_arg(sparse)
        if sparse is True and not self.job_sparse:
            raise ValueError(
                "sparse=True on a dense job: the aggregator takes sparse all-reduces only on "
                "jobs created sparse (xdp-agg serve --sparse; docs/protocol.md section 8)"
            )

    def choose(self, sparse: object, kind: str, size: int) -> bool:
        """True when this all-reduce (of `kind` "int32" or "float32", `size` elements) runs
        sparse; `sparse` as the caller gave it (True, False, "auto")."""
        self.check(sparse)
        if sparse is True:
            return True
        if sparse is False or not self.job_sparse:
            return False
        density = self._density.get((kind, size))
        return density is None or density < AUTO_DENSITY

    def observe(
        self, kind: str, size: int, result: np.ndarray, union: tuple[int, int] | None = None
    ) -> float:
        """Remember the union block density of a finished all-reduce: `union`, (blocks some
        rank had data in, blocks), where its loop counted them (a sparse all-reduce's results
        with data: exact, and free), else sampled on its flat `result` (union_density)."""
        d = union[0] / union[1] if union and union[1] else union_density(result, self.elems)
        if len(self._density) >= MEMORY:
            self._density.pop(next(iter(self._density)))
        self._density[(kind, size)] = d
        return d

    def density(self, kind: str, size: int) -> float | None:
        """The union density remembered for all-reduces of this kind and length, if any."""
        return self._density.get((kind, size))


def union_density(result: np.ndarray, elems: int) -> float:
    """The share of non-zero blocks of `elems` elements among every SAMPLE_STRIDE-th block of
    the flat `result` (the last, padded block counted like the others)."""
    nonzero, sampled = nonzero_blocks(result, elems, SAMPLE_STRIDE)
    return nonzero / sampled if sampled else 0.0


def nonzero_blocks(result: np.ndarray, elems: int, stride: int = 1) -> tuple[int, int]:
    """(blocks with a non-zero element, blocks looked at) among every `stride`-th block of
    `elems` elements of the flat `result`, the last, padded block counted like the others."""
    blocks = -(-result.size // elems)
    full = result.size // elems
    rows = result[: full * elems].reshape(full, elems)[::stride]
    nonzero = int(np.count_nonzero(np.any(rows != 0, axis=1)))
    sampled = len(rows)
    if full < blocks and full % stride == 0:  # the padded block is a sampled one
        nonzero += int(np.any(result[full * elems :] != 0))
        sampled += 1
    return nonzero, sampled
