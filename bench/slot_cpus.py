"""`python -m bench.slot_cpus`: --slot-cpus rss against cpumap, side by side, in the testbed.

The aggregator attached with --slot-cpus rss (the per-CPU merge: on veth a packet is aggregated
on its sender's CPU) or cpumap (each slot on the CPU that owns it), alternately; bench.modes says
how each run goes and what it measures.

Writes bench/results/slot-cpus.{json,md} (or --out). Root and the XDP build.
"""

from __future__ import annotations

import sys

from bench import modes

MODES = ("rss", "cpumap")


def _setup(args, mode: str) -> None:
    args.slot_cpus = mode


COMPARED = modes.Compared("slot-cpus", "slot CPUs", MODES, _setup, "--slot-cpus rss against cpumap")


if __name__ == "__main__":
    sys.exit(modes.main(COMPARED, __doc__))
