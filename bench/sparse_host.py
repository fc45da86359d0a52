"""`python -m bench.sparse_host`: the C loop's sparse all-reduces against its dense ones, on one
host, side by side (docs/protocol.md section 8; hostlib/fp_sparse.c).

What the host library itself costs, without an aggregator's or a network's: one worker's
StreamEngine (the C loop, kernel UDP socket, GSO/GRO) all-reduces through a *reflector* on the
loopback, a small C program (compiled here with the system's cc) that sends every datagram back
to its sender with recvmmsg/sendmmsg. A reflected contribution is a valid result of a job of one
worker, dense or sparse (the sum of one contribution is itself, and the smallest next the
worker's own). The engine runs on CPU 0 and the reflector on CPU 1 (2-CPU machines: each has
its own).

For each dtype (int32, float32): the dense all-reduce, and the sparse one at each block density
of `--densities` (the share of blocks of k elements that are non-zero, drawn at random), in
`--rounds` alternating rounds of `--reps` timed all-reduces (after one warm-up each), the
variants' order reversed every other round. Per variant: the median time, the tensor's MB/s,
the packets sent per all-reduce, the time per packet sent (ns), the engine thread's CPU time
(user + sys, the C loop's and its system calls'), and the time as a share of the dense one's.
With --numpy, the numpy sparse loop (hostlib.numpy_sparse) at the last density too.

No root. Writes bench/results/sparse-host.{json,md} (or --out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import write_results
from hostlib.engine import EngineConfig, StreamEngine
from hostlib.udp_io import DatagramSocket

REFLECTOR_C = r"""
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
enum { N = 64, MAX = 9216 };
static char buf[N][MAX];
int main(int argc, char **argv)
{
    int fd = socket(AF_INET, SOCK_DGRAM, 0), big = 32 << 20;
    struct sockaddr_in a = {.sin_family = AF_INET};
    inet_pton(AF_INET, argc > 1 ? argv[1] : "127.0.0.1", &a.sin_addr);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &big, sizeof big);
    setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &big, sizeof big);
    socklen_t len = sizeof a;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || getsockname(fd, (void *)&a, &len) < 0)
        return 1;
    printf("%d\n", ntohs(a.sin_port));
    fflush(stdout);
    struct mmsghdr m[N];
    struct iovec iov[N];
    struct sockaddr_in src[N];
    for (;;) {
        memset(m, 0, sizeof m);
        for (int i = 0; i < N; i++) {
            iov[i] = (struct iovec){buf[i], MAX};
            m[i].msg_hdr = (struct msghdr){.msg_name = &src[i], .msg_namelen = sizeof src[i],
                                           .msg_iov = &iov[i], .msg_iovlen = 1};
        }
        int n = recvmmsg(fd, m, N, MSG_WAITFORONE, NULL);
        for (int i = 0; i < n; i++)
            iov[i].iov_len = m[i].msg_len;
        for (int i = 0; i < n;) {
            int s = sendmmsg(fd, m + i, n - i, 0);
            i += s > 0 ? s : n - i; /* a refused one is lost: the engine resends it */
        }
    }
}
"""


def start_reflector(ip: str, cpu: int, workdir: str) -> tuple[subprocess.Popen, int]:
    """The reflector compiled and running on `cpu`, bound to ip; (its process, its port)."""
    src, exe = Path(workdir, "reflector.c"), Path(workdir, "reflector")
    src.write_text(REFLECTOR_C)
    subprocess.run(["cc", "-O2", "-o", str(exe), str(src)], check=True)
    proc = subprocess.Popen(
        [str(exe), ip], stdout=subprocess.PIPE, preexec_fn=lambda: os.sched_setaffinity(0, {cpu})
    )
    return proc, int(proc.stdout.readline())


def tensor(dtype, length: int, k: int, density: float, rng) -> np.ndarray:
    """`length` random values of `dtype`, all but a `density` share of the k-blocks zeroed."""
    if dtype == np.int32:
        x = rng.integers(-(2**20), 2**20, size=length, dtype=np.int32)
    else:
        x = rng.standard_normal(length).astype(np.float32)
    keep = rng.random(-(-length // k)) < density
    x[~np.repeat(keep, k)[:length]] = 0
    return x


def timed(eng: StreamEngine, x: np.ndarray, sparse: bool, reps: int) -> list[dict]:
    """One warm-up, then `reps` timed all-reduces of x: wall and thread CPU seconds, packets."""
    out = np.empty_like(x)
    run = eng.allreduce
    run(x, out, sparse=sparse)
    got = []
    for _ in range(reps):
        sent = eng.stats["packets_sent"]
        t0, c0 = time.perf_counter(), time.thread_time()
        run(x, out, sparse=sparse)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        got.append({"wall": wall, "cpu": cpu, "packets": eng.stats["packets_sent"] - sent})
    # a world of one: the result is the input (floats: to the block scaling's precision)
    if x.dtype == np.int32:
        assert np.array_equal(out, x), "wrong sum"
    else:
        assert np.allclose(out, x, rtol=0, atol=1e-6 * float(np.abs(x).max() or 1)), "wrong sum"
    return got


def variants(densities: list[float], numpy: bool) -> list[tuple[str, str, float]]:
    """(dtype, loop, density) of every variant: dense (density 1), C sparse at each density,
    numpy sparse at the last one with --numpy."""
    out = []
    for dtype in ("int32", "float32"):
        out.append((dtype, "c-dense", 1.0))
        out += [(dtype, "c-sparse", d) for d in densities]
        if numpy:
            out.append((dtype, "numpy-sparse", densities[-1]))
    return out


def run_rounds(args, engines: dict, tensors: dict) -> dict:
    """Every variant once per round, the order reversed every other round; key -> samples."""
    keys = variants(args.densities, args.numpy)
    samples: dict = {k: [] for k in keys}
    for r in range(args.rounds):
        for key in keys if r % 2 == 0 else keys[::-1]:
            dtype, loop, density = key
            eng = engines["numpy" if loop.startswith("numpy") else "c"]
            x = tensors[(dtype, density)]
            samples[key] += timed(eng, x, loop.endswith("sparse"), args.reps)
    return samples


def summary(args, samples: dict) -> list[dict]:
    """Per variant: medians, MB/s of tensor, ns per packet, time relative to dense."""
    rows = []
    for (dtype, loop, density), got in samples.items():
        wall = statistics.median(s["wall"] for s in got)
        packets = statistics.median(s["packets"] for s in got)
        rows.append(
            {
                "dtype": dtype,
                "loop": loop,
                "density": density,
                "median_ms": 1e3 * wall,
                "MB_per_s": args.mib * 1.048576 / wall,
                "packets": packets,
                "ns_per_packet": 1e9 * wall / max(packets, 1),
                "cpu_ms": 1e3 * statistics.median(s["cpu"] for s in got),
            }
        )
    dense = {r["dtype"]: r["median_ms"] for r in rows if r["loop"] == "c-dense"}
    for r in rows:
        r["vs_dense"] = r["median_ms"] / dense[r["dtype"]]
    return rows


def table(meta: dict, rows: list[dict]) -> str:
    """The results as a Markdown table."""
    cols = ["dtype", "loop", "density", "median ms", "MB/s", "packets", "ns/packet", "CPU ms"]
    lines = [
        f"Run {meta['when']}: one worker, {meta['mib']} MiB tensors, {meta['elems']} elements "
        f"per packet, window {meta['window']}, through a reflector on the loopback (engine on "
        f"CPU 0, reflector on CPU 1); {meta['rounds']} rounds of {meta['reps']} all-reduces; "
        f"{meta['cpus']} CPUs, load average {meta['load_before']} before, {meta['load_after']} "
        f"after.",
        "",
        "| " + " | ".join(cols + ["time vs dense"]) + " |",
        "|" + "---|" * (len(cols) + 1),
    ]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['loop']} | {r['density']:g} | {r['median_ms']:.2f} | "
            f"{r['MB_per_s']:.0f} | {r['packets']:.0f} | {r['ns_per_packet']:.0f} | "
            f"{r['cpu_ms']:.2f} | {r['vs_dense']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def parse(argv=None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mib", type=int, default=16, help="tensor size, MiB")
    ap.add_argument("--elems", type=int, default=256)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--densities", default="1,0.5,0.1,0.01")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--numpy", action="store_true", help="the numpy sparse loop too")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    args.densities = [float(d) for d in args.densities.split(",")]
    return args


def main(argv=None) -> None:
    """Run the rounds, write the results."""
    args = parse(argv)
    load = [round(x, 2) for x in os.getloadavg()]
    ip = "127.0.0.1"
    os.sched_setaffinity(0, {0})
    rng = np.random.default_rng(1)
    length = (args.mib << 20) // 4
    tensors = {
        (dt, d): tensor(np.dtype(dt).type, length, args.elems, d, rng)
        for dt in ("int32", "float32")
        for d in [1.0] + args.densities
    }
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start_reflector(ip, 1, tmp)
        socks = {n: DatagramSocket((ip, 0)) for n in ("c", "numpy")}
        try:
            engines = {
                n: StreamEngine(
                    socks[n],
                    EngineConfig(1, 1, args.elems, 0, args.window, (ip, port), native=n == "c"),
                )
                for n in socks
            }
            rows = summary(args, run_rounds(args, engines, tensors))
        finally:
            for s in socks.values():
                s.close()
            proc.terminate()
            proc.wait()
    meta = {"when": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count()}
    meta.update(mib=args.mib, elems=args.elems, window=args.window, rounds=args.rounds)
    meta.update(reps=args.reps, load_before=load, load_after=[round(x, 2) for x in os.getloadavg()])
    write_results(args.out, "sparse-host", {"meta": meta, "rows": rows}, table(meta, rows))


if __name__ == "__main__":
    main()
