"""The native sparse loop: a sparse all-reduce (docs/protocol.md section 8) in the C loop, whose
sparse round strategy (hostlib/fp_sparse.c) runs it with the timers and window the loop gives
every strategy, and sends the bytes of hostlib.numpy_sparse (tests/unit/test_sparse_host.py compares
them).
"""

from __future__ import annotations

import numpy as np

from . import scaling
from .errors import bad_next_error
from .native_stream import NativeStream, _fastpath, shower


class NativeSparseLoop:
    """Runs a StreamState's sparse all-reduces (docs/protocol.md section 8) on its
    NativeStream, sharing its _fastpath.Engine with the dense loop (the RTT estimate and
    congestion window of the dense all-reduces). The blocks are found in C too
    (_fastpath.block_scan: one pass over the tensor, before the all-reduce starts);
    hostlib.numpy_sparse.NumpySparseLoop is the reference."""

    def __init__(self, stream: NativeStream) -> None:
        self.stream = stream
        self.state = stream.state
        self.union_blocks = 0  # blocks of the last all-reduce whose result had data
        self.blocks = 0  # and its blocks

    def run(self, kind: str, src: np.ndarray, dst: np.ndarray, timeout: float | None) -> None:
        """One sparse all-reduce of the flat `src` into `dst`, both of dtype `kind`
        (engine.DTYPES); a block is a packet's elements."""
        state = self.state
        if src.size == 0:
            return
        nonzero, exps, bad, count = _fastpath.block_scan(src, state.elems_per_packet, kind)
        if bad >= 0:  # before anything is sent
            raise scaling.nonfinite_error(src[bad], bad)
        B = len(nonzero)
        w = min(state.cfg.window, B)
        rounds = np.ones(w, dtype=np.int64)  # the C loop counts each slot's rounds in here
        self.union_blocks, self.blocks = 0, B
        with state.allreduce(B, w, timeout, elements=src.size) as ar:
            ar.uses = rounds  # versions advance by the rounds each slot ran (8.2), also on failure
            state.stats["sparse_allreduces"] += 1
            res = None
            try:
                res = self.stream.fast.allreduce_sparse(
                    dtype=kind,
                    src=src,
                    dst=dst,
                    w=w,
                    job_number=ar.job_number,
                    versions=state.versions[:w].tobytes(),
                    nonzero=nonzero,
                    exponents=exps,
                    rounds=rounds,
                    timeout=ar.timeout,
                    progress=shower(ar),
                    progress_every=0.25,
                    pad_empty=state.cfg.pad_empty,
                )
                self.union_blocks = res["union_blocks"]
                if res["status"] == "stalled":
                    raise state.stalled(ar, res["results_here"], res["busy"])
                if res["status"] == "bad_next" and res["bad"] is not None:
                    s, p, q, mine = res["bad"]
                    raise bad_next_error(state.cfg.slot_base + s, p, q, mine, s, B, w)
            finally:
                self.stream.account(res, ar)
            state.stats["blocks_skipped"] += B - count
