"""What matching a worker's source MAC costs the XDP program per packet (the price of refusing a
registered IP from another MAC).

Runs the same stream of contributions (4 workers, 64 slots, 20 rounds) through the loaded
per-CPU program with the workers registered with their MACs (matched) and without (all zeros: not
matched), alternating, 7 passes each, on one core; prints the median kernel-measured ns per packet
and the ratio. Run as root: `.venv/bin/python -m bench.mac_match`.
"""

from __future__ import annotations

import os
import statistics

from xdp_agg.proto import wire
from xdp_agg.proto.jobs import JobSpec, WorkerSpec
from xdp_switch import loader
from xdp_switch import microbench as mb
from xdp_switch.ctl_maps import AggMaps

WORKERS, SLOTS, ROUNDS, PASSES = 4, 64, 20, 7


def _pass(prog, maps: AggMaps, k: int, frames, match: bool) -> float:
    maps.create_job(JobSpec(0, WORKERS, k, 0, SLOTS, agg_ip="198.18.0.1", group_ip="198.18.0.255"))
    for w in range(WORKERS):
        mac = mb._mac(w) if match else "00:00:00:00:00:00"
        maps.add_worker(WorkerSpec(0, w, f"198.18.0.{10 + w}", wire.UDP_PORT, mac=mac))
    ns = mb.measure(prog.progs[loader.PROG_INGRESS], frames)
    if maps.counters(0)["completed"] != SLOTS * ROUNDS:
        raise RuntimeError("the stream did not complete every slot: the program misbehaves")
    return ns


def main() -> None:
    os.sched_setaffinity(0, {0})
    prog = loader.load(pool_slots=SLOTS, variant="percpu")
    maps = AggMaps(prog.maps, prog.pool_slots)
    try:
        for k in (32, 256):
            frames = mb.stream(k, WORKERS, SLOTS, ROUNDS)
            runs = {True: [], False: []}
            for _ in range(PASSES):
                for match in (True, False):
                    runs[match].append(_pass(prog, maps, k, frames, match))
            on, off = statistics.median(runs[True]), statistics.median(runs[False])
            print(
                f"{k:4d} elements: MAC matched {on:7.1f} ns/packet, not matched {off:7.1f}, "
                f"ratio {on / off:.3f}"
            )
    finally:
        prog.close()


if __name__ == "__main__":
    main()
