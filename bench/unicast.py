"""`python -m bench.unicast`: results by unicast (a copy per worker) against one group copy.

    sudo .venv/bin/python -m bench.unicast [--workers 8] [--size 64MiB] [--rounds 3]

`xdp-agg serve --results multicast` (a job's result leaves once, by XDP_TX, to its group) against
`--results unicast` (a devmap broadcast of n copies, each addressed by the copy program to one
worker: docs/protocol.md 3.5), alternately; bench.modes says how each run goes and what it
measures. The aggregator's BPF seconds hold the copy program's n runs per result; the kernel's
clone, queue and transmit of each copy are in the CPU column (softirq). `xdp-agg bench` gives the
programs' own cost per packet (UNICAST_CASE).

Writes bench/results/unicast.{json,md} (or --out). Root and the XDP build.
"""

from __future__ import annotations

import sys

from bench import modes

MODES = ("multicast", "unicast")


def _setup(args, mode: str) -> None:
    args.serve_args = ("--results", mode)


COMPARED = modes.Compared(
    "unicast", "results", MODES, _setup, "results to the group against a copy per worker"
)


if __name__ == "__main__":
    sys.exit(modes.main(COMPARED, __doc__, workers=8))
