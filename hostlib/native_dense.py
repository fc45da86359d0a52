"""The native dense loop: a dense all-reduce (docs/protocol.md section 4; floats: 5.2) in the C
loop, whose dense round strategy (hostlib/fp_dense.c) sends the bytes of hostlib.numpy_dense
(tests/unit/test_fastpath.py compares them): P, w and the exponents as its transfers make them.
"""

from __future__ import annotations

import numpy as np

from . import scaling
from .native_stream import NativeStream, _fastpath, shower


class NativeDenseLoop:
    """Runs a StreamState's dense all-reduces on its NativeStream."""

    def __init__(self, stream: NativeStream) -> None:
        self.stream = stream
        self.state = stream.state

    def run(self, kind: str, src: np.ndarray, dst: np.ndarray, timeout: float | None) -> None:
        """One all-reduce of the flat `src` into `dst`, both of dtype `kind` (engine.DTYPES):
        the C loop quantises from that type and dequantises into it directly."""
        state, k, L = self.state, self.state.elems_per_packet, src.size
        Pd = -(-L // k)
        w = min(state.cfg.window, Pd)
        exps = None
        is_float = kind != "int32"
        if is_float:
            exps, bad = _fastpath.chunk_exponents(src, k, kind)  # before anything is sent
            if bad >= 0:
                raise scaling.nonfinite_error(src[bad], bad)
        P = Pd + w if is_float else Pd
        if P == 0:
            return
        with state.allreduce(P, w, timeout, elements=L) as ar:
            res: _fastpath._AllreduceResult | None = None
            try:
                res = self.stream.fast.allreduce(
                    kind,
                    src,
                    dst,
                    P,
                    w,
                    ar.job_number,
                    state.versions[:w].tobytes(),
                    exps,
                    ar.timeout,
                    progress=shower(ar),
                    progress_every=0.25,
                )
                if res["status"] != "done":
                    raise state.stalled(ar, res["results_here"], res["busy"])
            finally:
                self.stream.account(res, ar)
