"""Both CPUs drive the same slots at once; every result must match the serial model.

Two processes, pinned to CPU 0 and CPU 1, run the program with BPF_PROG_TEST_RUN on the
contributions of their half of the workers. Within a round both walk the slots in the same order
at the same pace, so packets of different workers for the same slot run on both CPUs at the same
time; a barrier between rounds keeps the protocol's rule that a worker only moves on to a slot's
next round after its result. Some packets are sent twice (a retransmission racing its original).
Checked: exactly one completion per slot and round, its sum and exponent equal the serial
reference model's, every answered retransmission carries that same sum, and the counters add up.
"""

import multiprocessing as mp
import os
import time

import numpy as np
import pytest
from packet_cases import frame, job, workers

import bpfsys
from aggproto import wire
from aggproto.model import Action, ReferenceAggregator

pytestmark = [pytest.mark.root, pytest.mark.bpf]

N, K, SLOTS, ROUNDS, DUP_P = 8, 256, 16, 24, 0.05


def _drive(cpu, fd, rounds, barrier, conn):
    os.sched_setaffinity(0, {cpu})
    out = []
    for frames in rounds:
        barrier.wait(timeout=60)
        for key, f in frames:
            t0 = time.monotonic_ns()
            act, data, _ = bpfsys.prog_test_run(fd, f)
            span = (t0, time.monotonic_ns())
            out.append(
                (key, act, data[wire.SWITCHML_OFFSET :] if act == bpfsys.XDP_TX else None, span)
            )
    conn.send(out)
    conn.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_two_cpus_same_slots(agg):
    prog, maps = agg
    fd = prog.progs["xdp_agg_ingress"]
    maps.create_job(job(n=N, elems=K, count=SLOTS))
    for w in workers(0, N):
        maps.add_worker(w)

    rng = np.random.default_rng(7)
    model = ReferenceAggregator()
    model.create_job(0, N, K, 0, SLOTS)
    for w in workers(0, N):
        model.add_worker(0, w.index, w.ip, w.agg_port)
    per_cpu = ([], [])  # per CPU: list of rounds, each a list of (key, frame)
    expected, dups = {}, 0
    for r in range(ROUNDS):
        rnd = ([], [])
        for s in range(SLOTS):
            for w in range(N):
                vals = rng.integers(-(2**31), 2**31, size=K, dtype=np.int64)
                f = frame(
                    w, vals, slot=s, version=r % 2, e0=int(rng.integers(-50, 50)), tsi=r * SLOTS + s
                )
                rnd[w % 2].append(((r, s, w, "new"), f))
                v = model.process(f"198.18.0.{10 + w}", wire.UDP_PORT, f[wire.SWITCHML_OFFSET :])
                if v.action == Action.TO_ALL:
                    expected[(r, s)] = v.payload
                if rng.random() < DUP_P:
                    rnd[w % 2].append(((r, s, w, "dup"), f))
                    dups += 1
        for c in (0, 1):
            per_cpu[c].append(rnd[c])
    assert len(expected) == ROUNDS * SLOTS

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
        p.join(timeout=60)
        assert p.exitcode == 0

    # Evidence that the CPUs really ran the same slot at the same time (syscall granularity).
    spans = [{}, {}]
    for c in (0, 1):
        for (r, s, _, _), _, _, span in results[c]:
            spans[c].setdefault((r, s), []).append(span)
    overlapping = sum(
        any(a0 < b1 and b0 < a1 for a0, a1 in spans[0][key] for b0, b1 in spans[1].get(key, []))
        for key in spans[0]
    )
    print(f"{overlapping} of {ROUNDS * SLOTS} slot rounds ran on both CPUs at once")
    assert overlapping >= ROUNDS * SLOTS // 10, (
        f"only {overlapping} slot rounds ran on both CPUs at once"
    )

    completions = {}
    answered = 0
    for res in results:
        for (r, s, w, kind), act, payload, _ in res:
            if kind == "new" and act == bpfsys.XDP_TX:
                assert (r, s) not in completions, f"slot {s} round {r} completed twice"
                completions[(r, s)] = payload
            elif kind == "new":
                assert act == bpfsys.XDP_DROP
            elif act == bpfsys.XDP_TX:  # a duplicate answered with the stored result
                answered += 1
                assert payload == expected[(r, s)], (
                    f"retransmission answer for slot {s} round {r} is wrong"
                )
            else:
                assert act == bpfsys.XDP_DROP
    assert set(completions) == set(expected), "a slot never completed"
    for key, payload in completions.items():
        assert payload == expected[key], (
            f"slot {key[1]} round {key[0]}: sum differs from the serial model"
        )
    c = maps.counters(0)
    assert c["completed"] == ROUNDS * SLOTS
    assert c["aggregated"] == ROUNDS * SLOTS * (N - 1)
    assert c["retx_answered"] == answered
    assert c["dup_pending"] + c["retx_answered"] == dups
    if prog.options["variant"] == "percpu":
        # the last round's completion gathered partial sums from both CPUs
        tags = {p.tag for p in maps.partials(0, (ROUNDS - 1) % 2)}
        assert len(tags) == 1 and 0 not in tags, "both CPUs should hold a partial of the last round"
