"""One worker's stream engine(s) in a namespace for tests/root/test_afxdp.py: all-reduces an int32
and a float32 tensor through the aggregator at --agg over the data path --path, prints one JSON
line: the data path, the reason, a SHA-256 of each result's bytes and the engine's counters.

    python tests/afxdp_worker.py --local 198.19.250.1:40000 --agg 198.19.250.2:48879 \
        --path afxdp --faults 0.1,0.1,0.2,0.2,4 --lanes 3

With --lanes k, lane l has its own socket on the --local port + l and its part of the 64 slots
(hostlib.striping.lane_windows), as hostlib.init makes them. With --sparse D, a share D of the
tensors' blocks (256 elements) is non-zero and the all-reduces run sparse (docs/protocol.md 8).

With --wire16 FIRST, a 16-bit companion job (job 2, as many lanes, on the --local port + 100 +
lane: hostlib.communicator's companion) joins after those two all-reduces, as hostlib does on a
first bfloat16 all-reduce: a bfloat16 all-reduce on it, the int32 one again on the main job, then
FIRST ("main" or "companion") closes and the other runs once more (its int32 or bfloat16) before
it closes too; the report adds their hashes and the companion's data path and counters.

With --stripes S, the job is striped over S aggregators, the --agg port + j for stripe j, its
lanes on the --local port + 10 j + lane (hostlib.striping.StripedEngine).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hostlib.engine import EngineConfig, Faults, StreamEngine  # noqa: E402
from hostlib.striping import StripedEngine, lane_windows  # noqa: E402
from hostlib.udp_io import DatagramSocket  # noqa: E402


def _endpoint(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def main() -> int:
    """Run the all-reduces; one JSON line on stdout."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--local", type=_endpoint, required=True)
    ap.add_argument("--agg", type=_endpoint, required=True)
    ap.add_argument("--path", default="udp")
    ap.add_argument("--native", type=int, default=1)
    ap.add_argument("--gso", type=int, default=1)
    ap.add_argument("--count", type=int, default=200_000)
    ap.add_argument("--faults", default="", help="send_loss,recv_loss,send_dup,recv_dup,seed")
    ap.add_argument("--lanes", type=int, default=1)
    ap.add_argument("--sparse", type=float, default=None, help="density of non-zero blocks")
    ap.add_argument("--wire16", choices=("main", "companion"), help="which closes first")
    ap.add_argument("--stripes", type=int, default=1)
    args = ap.parse_args()
    faults = None
    if args.faults:
        *p, seed = args.faults.split(",")
        faults = Faults(*(float(x) for x in p), seed=int(seed))
    eng = _engine(args, faults)
    rng = np.random.default_rng(7)
    x = rng.integers(-(2**31), 2**31, size=args.count, dtype=np.int64).astype(np.int32)
    f = (rng.standard_normal(args.count) * 1e-3).astype(np.float32)
    sparse = args.sparse is not None
    if sparse:  # the same blocks of both zero: each block's last elements may be a tail's
        zero = np.repeat(rng.random(-(-args.count // 256)) >= args.sparse, 256)[: args.count]
        x[zero], f[zero] = 0, 0
    out_i, out_f = np.empty_like(x), np.empty_like(f)
    eng.allreduce(x, out_i, sparse=sparse)
    eng.allreduce(f, out_f, sparse=sparse)
    report = {
        "data_path": eng.data_path,
        "reason": eng.data_path_reason,
        "int32": hashlib.sha256(out_i.tobytes()).hexdigest(),
        "int32_equal": bool(np.array_equal(out_i, x)),
        "float32": hashlib.sha256(out_f.tobytes()).hexdigest(),
        "stats": eng.stats,
    }
    if args.wire16:
        report.update(_wire16(args, faults, eng, x, rng))
    else:
        _close(eng)
    print(json.dumps(report), flush=True)
    return 0


def _wire16(args, faults: Faults | None, eng, x: np.ndarray, rng) -> dict:
    """The companion job's part (--wire16): its engine joins beside the main job's, a bfloat16
    all-reduce on it, the int32 one on the main job again; args.wire16 closes first, the other
    runs once more and closes."""
    comp = _engine(args, faults, wire_bits=16)
    b = (rng.standard_normal(x.size) * 1e-2).astype(ml_dtypes.bfloat16)
    out_b, out_i = np.empty_like(b), np.empty_like(x)
    comp.allreduce(b, out_b)
    eng.allreduce(x, out_i)
    rep = {
        "w16_data_path": comp.data_path,
        "w16_reason": comp.data_path_reason,
        "bfloat16": _sha(out_b),
        "int32_after": _sha(out_i),
    }
    first, last, a = (eng, comp, b) if args.wire16 == "main" else (comp, eng, x)
    _close(first)
    out = np.empty_like(a)
    last.allreduce(a, out)
    rep.update(last=_sha(out), last_stats=dict(last.stats), w16_stats=dict(comp.stats))
    rep["last_data_path"] = last.data_path
    _close(last)
    return rep


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


def _engine(args, faults: Faults | None, wire_bits: int = 32):
    """The job's engine (job 1; the 16-bit companion: job 2, on ports 100 higher): a
    StreamEngine, or a StripedEngine of --lanes at each of --stripes aggregators."""
    slots = lane_windows(0, 64, args.lanes)
    host, port = args.agg
    aggs = [(host, port + j) for j in range(args.stripes)]
    engines = [
        _lane(args, lane, part, faults, wire_bits, j)
        for j in range(args.stripes)
        for lane, part in enumerate(slots)
    ]
    return engines[0] if len(engines) == 1 else StripedEngine(engines, aggs, args.lanes)


def _close(eng) -> None:
    """Close the engine (its AF_XDP sockets), then its lanes' kernel sockets, as a
    Communicator does."""
    eng.close()
    for e in getattr(eng, "engines", [eng]):
        e.state.sock.close()


def _lane(
    args,
    lane: int,
    slots: tuple[int, int],
    faults: Faults | None,
    wire_bits: int = 32,
    stripe: int = 0,
) -> StreamEngine:
    """Lane `lane`'s engine at stripe `stripe`: job 1 (2 at 16 bits), one worker, 256 int32
    words per packet, its `slots` (base, window), its socket on the --local port + 10 stripe +
    lane (+ 100 at 16 bits), sending to the --agg port + stripe; independent losses per lane."""
    host, port = args.local
    port += (100 if wire_bits == 16 else 0) + 10 * stripe
    agg = (args.agg[0], args.agg[1] + stripe)
    sock = DatagramSocket((host, port + lane), gso=bool(args.gso))
    cfg = EngineConfig(
        1 if wire_bits == 32 else 2,
        1,
        256,
        *slots,
        agg,
        rto=0.005,
        timeout=10,
        native=bool(args.native),
        data_path=args.path,
        lane=lane,
        lanes=args.lanes,
        wire_bits=wire_bits,
    )
    if faults is not None and (lane or stripe):
        faults = dataclasses.replace(faults, seed=faults.seed + lane + 64 * stripe)
    return StreamEngine(sock, cfg, faults)


if __name__ == "__main__":
    sys.exit(main())
