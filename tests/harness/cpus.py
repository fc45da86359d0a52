"""The two-CPU driver: frames run through the loaded XDP program (BPF_PROG_TEST_RUN) by two
processes pinned to CPUs 0 and 1, in step phase by phase, so that both CPUs work on the same
slots at once. The concurrency tests of one slot (test_xdp_concurrency) and of a tree job's
paths (test_tree_concurrency) share it.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time

import pytest

from xdp_agg import bpfsys
from xdp_agg.proto import wire

BARRIER_TIMEOUT = 60.0


def _drive(cpu, fd, phases, barrier, conn):
    """One CPU's side: each phase's (key, frame) run in order once both CPUs reached it;
    (key, action, the SwitchML part of a transmitted result, (start, end) in ns) per frame."""
    os.sched_setaffinity(0, {cpu})
    out = []
    for frames in phases:
        barrier.wait(timeout=BARRIER_TIMEOUT)
        for key, f in frames:
            t0 = time.monotonic_ns()
            act, data, _ = bpfsys.prog_test_run(fd, f)
            span = (t0, time.monotonic_ns())
            # a result leaves by XDP_TX, or by redirect (the cpumap build, a devmap broadcast)
            sent = act in (bpfsys.XDP_TX, bpfsys.XDP_REDIRECT)
            out.append((key, act, data[wire.SWITCHML_OFFSET :] if sent else None, span))
    conn.send(out)
    conn.close()


def run_on_two_cpus(fd: int, per_cpu: list) -> list[list[tuple]]:
    """per_cpu[c]: CPU c's phases, each a list of (key, frame). Both CPUs at once, in step
    phase by phase; each CPU's (key, action, result, span) list."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(2)
    procs, pipes = [], []
    for c in (0, 1):
        rd, wr = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_drive, args=(c, fd, per_cpu[c], barrier, wr))
        p.start()
        procs.append(p)
        pipes.append(rd)
    results = [pipes[c].recv() for c in (0, 1)]
    for p in procs:
        p.join(timeout=BARRIER_TIMEOUT)
        assert p.exitcode == 0
    return results


@pytest.fixture
def two_cpus():
    """run_on_two_cpus, for tests that skip (with the reason) on a machine of one CPU."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    return run_on_two_cpus


@contextlib.contextmanager
def on_each_cpu_in_turn():
    """A function run(step_index, fn) that runs fn() pinned to the CPUs this process may use,
    in turn (step i on the (i + offset)-th), with the affinity restored afterwards: so that
    BPF_PROG_TEST_RUN, which runs the program on the calling CPU, spreads the packets of one
    slot over every CPU the machine has, as a NIC's receive queues would."""
    cpus = sorted(os.sched_getaffinity(0))

    def run(i: int, fn):
        os.sched_setaffinity(0, {cpus[i % len(cpus)]})
        return fn()

    try:
        yield run
    finally:
        os.sched_setaffinity(0, cpus)
