"""Host CPU per element of the C fast path (hostlib._fastpath), per dtype x wire width.

    .venv/bin/python tools/fastpath_ns.py [--elements N] [--words K] [--skip-loop]

Two measures, each with the AVX2 kernels (where the CPU has them) and the scalar ones, the
least thread CPU time of several runs (a shared machine's noise only adds):

- kernels: chunk exponents, quantise (fill's conversion) and dequantise (accept_result's), ns
  per element, through the module's test entry points over one tensor in chunks of a packet's
  elements (K words: K elements at 32 bits, 2K at 16);
- loop: a whole all-reduce in the C loop against a scripted aggregator on loopback
  (tests/harness/echo.py, in a thread of this process), ns of the loop's own thread CPU time
  (time.thread_time: the C loop runs in the calling thread with the GIL released) per
  element: kernels, headers, timers and the socket calls, not the aggregator's.

A timing script, not a test: it asserts nothing (docs/design.md, "The host library").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # harness.echo

DTYPES = ("float32", "bfloat16", "float16")


def as_dtype(x: np.ndarray, name: str) -> np.ndarray:
    """x as `name` (bfloat16: ml_dtypes')."""
    if name == "bfloat16":
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16)
    return x.astype(name)


def best(fn, reps: int) -> float:
    """The least thread CPU time of `reps` calls of fn, s (CPU time: a shared machine's other
    processes take wall time from it, not CPU time)."""
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return min(times)


def kernels(fp, x: np.ndarray, name: str, bits: int, words: int, reps: int) -> tuple:
    """(exponents, quantise, dequantise) ns per element of x."""
    k = words * 32 // bits
    e, _ = fp.chunk_exponents(x, k, name)
    q = fp.quantise(x, e, 4, k, name, bits)
    ts = (
        best(lambda: fp.chunk_exponents(x, k, name), reps),
        best(lambda: fp.quantise(x, e, 4, k, name, bits), reps),
        best(lambda: fp.dequantise(q, e, 4, k, name, bits), reps),
    )
    return tuple(t / x.size * 1e9 for t in ts)


def loop(x: np.ndarray, bits: int, words: int, reps: int) -> float:
    """The C loop's own thread CPU per element of one all-reduce of x, ns (best of reps)."""
    from harness.echo import EchoAggregator

    from hostlib.engine import EngineConfig, StreamEngine
    from hostlib.udp_io import DatagramSocket

    agg = EchoAggregator()
    sock = DatagramSocket((agg.worker_ip(), 0))
    cfg = EngineConfig(0, 4, words, 0, 64, agg.address, native=True, wire_bits=bits)
    eng = StreamEngine(sock, cfg)
    out = np.empty_like(x)
    try:
        times = []
        for _ in range(reps):
            t0 = time.thread_time()
            eng.allreduce(x, out)
            times.append(time.thread_time() - t0)
        return min(times) / x.size * 1e9
    finally:
        sock.close()
        agg.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elements", type=int, default=1 << 22, help="tensor length (kernels)")
    ap.add_argument("--loop-elements", type=int, default=1 << 20, help="tensor length (loop)")
    ap.add_argument("--words", type=int, default=768, help="payload words per packet")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--skip-loop", action="store_true")
    args = ap.parse_args()
    from hostlib.engine import _fastpath as fp

    rng = np.random.default_rng(0)
    n = args.elements
    base = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)).astype(np.float32)
    modes = ["avx2", "scalar"] if fp.simd() == "avx2" else ["scalar"]
    print("mode    dtype     bits   exps  quant dequant kernels   loop   (ns per element)")
    for mode in modes:
        fp.set_simd(mode)
        for name in DTYPES:
            x = as_dtype(base, name)
            for bits in (32, 16):
                e, q, d = kernels(fp, x, name, bits, args.words, args.reps)
                lp = (
                    ""
                    if args.skip_loop
                    else f"{loop(x[: args.loop_elements], bits, args.words, 3):6.2f}"
                )
                cols = f"{e:6.2f} {q:6.2f} {d:7.2f} {e + q + d:7.2f} {lp:>6}"
                print(f"{mode:7} {name:9} {bits:4d} {cols}")


if __name__ == "__main__":
    main()
