"""Both CPUs drive the same slots at once; every result must match the serial model.

Two processes, pinned to CPU 0 and CPU 1, run the program with BPF_PROG_TEST_RUN on the
contributions of their half of the workers. Both walk the slots in the same order, and a barrier
before every slot round starts both CPUs on it together, so packets of different workers for the
same slot run on both CPUs at the same time; the barriers also keep the protocol's rule that a
worker only moves on to a slot's next round after its result. Some packets are sent twice (a
retransmission racing its original). Checked: exactly one completion per slot and round, its sum
and exponent equal the serial reference model's, every answered retransmission carries that same
sum, and the counters add up.

Why the first test alone does not catch races, and what the others add. The race that matters is
between a contribution's arrival count (`arrivals`) and the end of its addition into a partial:
the program must not gather a slot before every contribution of the round is added in, which is
why it completes on the `added` count. A mutant that completes on the arrival count instead
(`-DAGG_TEST_MUTANT_COMPLETE_ON_ARRIVAL`, bpf/aggregate.h) only goes wrong when the contribution
that arrived first finishes its addition *after* the n-th arrival has added its own and
gathered. In the normal program both additions take the same few hundred ns, so that needs an
accident such as an interrupt at the right instruction: the mutant passed the first test in 10
of 10 runs (both variants) and 5 of 5 runs of the 800 slot rounds below built without the window.

`test_race_window_*` therefore run test-only builds (loader.race_test_cflags, never used in
production) that spin a random 0..RACE_DELAY_NS ns between the arrival count and the addition.
Random, because a fixed delay keeps the arrival order and so closes no window; with the jitter,
a later arrival overtakes an earlier one whenever it draws the shorter delay. The runs use few
slots with one worker per CPU (n = 2: every slot round is one packet from each CPU, both sent at
once) for many rounds, the barrier between rounds keeping the CPUs in step, so most slot rounds
overlap. The real program (both variants), whose completion waits for `added`, must be exact in
every one; `test_race_window_catches_the_mutant` builds the mutant with the same settings and
asserts that the same checker reports its lost additions, proving the claim on every run.
Measured on 2 CPUs, wrong sums of the mutant per run of 800 slot rounds (runs caught): no window
0 (0 of 5), 1 us 2-13 (10 of 10), 2 us 11-18 (10 of 10), 5 us 28-45 (5 of 5), 20 us (the
setting used) 149-179 (10 of 10, both variants); the real program: no problem in 10 of 10 runs
of each variant at 20 us.

Sparse jobs (docs/protocol.md section 8, bpf/sparse.h) run the same tests on rounds of data,
empty and dense contributions: each round's first two contributions race to install its key
(compare-and-swap), and the completing CPU gathers the other's sums, smallest next and the e0
that travels with it. A build whose gather maxed e0 over every partial, whatever its next, failed
test_two_cpus_sparse_rounds (wrong results in most rounds); the mutant is caught on sparse rounds
too (122-158 problems per run of 800 slot rounds, one run of each variant).
"""

import numpy as np
import pytest
from harness.builds import AGG_BUILDS_CPUMAP, load_agg_build
from harness.packet_cases import frame, job, worker_ip, workers

from xdp_agg import bpfsys
from xdp_agg.proto import wire
from xdp_agg.proto.model import Action, ReferenceAggregator

pytestmark = [pytest.mark.root, pytest.mark.bpf]

N, K, SLOTS, ROUNDS, DUP_P = 8, 256, 16, 24, 0.05
SPARSE_K = 64  # the sparse run's packets (frames built one by one with scapy)
# The widened-window runs: one worker per CPU, few slots, many rounds (see the docstring).
RACE_N, RACE_K, RACE_SLOTS, RACE_ROUNDS, RACE_DUP_P = 2, 64, 2, 400, 0.02
RACE_DELAY_NS = 20_000


def _frames(n, k, bits=32):
    """A frame builder for worker w: scapy builds each worker's headers once (UDP checksum 0:
    none), numpy the SwitchML part of every packet (checked once against scapy's); `bits`: the
    job's element width (its packets' width bit)."""
    size = wire.size_code_for(k)
    head = dict(job_number=0, size_code=size, wire_bits=bits)
    heads = {}
    for w in range(n):
        zeros = np.zeros(k, dtype=np.int64)
        ref = bytearray(frame(w, zeros, slot=1, version=1, e0=-3, tsi=5, wire_bits=bits))
        ref[wire.SWITCHML_OFFSET - 2 : wire.SWITCHML_OFFSET] = b"\0\0"
        heads[w] = bytes(ref[: wire.SWITCHML_OFFSET])
        sml = wire.build_payloads(**head, tsi=5, slot=1, version=1, e0=-3, values=np.zeros((1, k)))
        assert bytes(ref[wire.SWITCHML_OFFSET :]) == sml[0].tobytes()

    def make(w, vals, *, slot, version, e0, tsi):
        sml = wire.build_payloads(**head, tsi=tsi, slot=slot, version=version, e0=e0, values=[vals])
        return heads[w] + sml[0].tobytes()

    return make


def _words(n, k, bits, rng):
    """One worker's k payload words: any int32, or at 16 bits k packed pairs of elements within
    the headroom of n workers (docs/protocol.md 5.6)."""
    if bits == 16:
        m = wire.pair_range(n)
        return wire.pack_pairs(rng.integers(-m, m + 1, size=2 * k, dtype=np.int64))
    return rng.integers(-(2**31), 2**31, size=k, dtype=np.int64)


def _dense_rounds(n, k, slots, rounds, rng, bits=32):
    """The contributions of a dense job: frames(r, s) -> every worker's frame of slot s in
    round r, random values and exponents (16-bit elements at `bits` 16)."""
    make = _frames(n, k, bits)

    def frames(r, s):
        out = []
        for w in range(n):
            vals = _words(n, k, bits, rng)
            e0 = int(rng.integers(-50, 50))
            out.append(make(w, vals, slot=s, version=r % 2, e0=e0, tsi=r * slots + s))
        return out

    return frames


def _sparse_rounds(n, k, slots, rounds, rng):
    """The contributions of a sparse job (docs/protocol.md section 8): one round in five dense,
    the others at block r * slots + s, each worker with data (60%) or empty, naming a next
    block just after (so that the smallest next, and the e0 that travels with it, often come
    from an empty contribution folded on the other CPU). Half the empty ones are padded (8.1)
    with the values they would have had: room for the result, never added."""
    blocks = rounds * slots + 8

    def frames(r, s):
        block, out = r * slots + s, []
        dense = rng.random() < 0.2
        for w in range(n):
            e0 = int(rng.integers(-50, 50))
            kw = dict(slot=s, version=r % 2, e0=e0, tsi=r * slots + s)
            vals = rng.integers(-(2**31), 2**31, size=k, dtype=np.int64)
            if dense:
                out.append(frame(w, vals, size=wire.size_code_for(k), **kw))
                continue
            has = rng.random() < 0.6
            nxt = block + int(rng.integers(1 if has else 0, 4))
            sp = wire.Sparse(block, nxt, blocks)
            if not has and rng.random() < 0.5:
                kw["msg_type"] = wire.MSG_TYPE_SPARSE_EMPTY  # padded with vals
            elif not has:
                vals = ()
            out.append(frame(w, vals, size=wire.size_code_for(k), sparse=sp, **kw))
        return out

    return frames


def _plan(n, k, slots, rounds, dup_p, seed, sparse=False, bits=32):
    """Every round's frames per CPU (even workers on CPU 0, odd on CPU 1), the serial model's
    result of each (round, slot) and the number of duplicates sent; a `sparse` job's rounds
    are _sparse_rounds', a dense job of `bits` 16 has 16-bit elements."""
    rng = np.random.default_rng(seed)
    if sparse:
        contributions = _sparse_rounds(n, k, slots, rounds, rng)
    else:
        contributions = _dense_rounds(n, k, slots, rounds, rng, bits)
    model = ReferenceAggregator()
    model.create_job(0, n, k, 0, slots, sparse=sparse, wire_bits=bits)
    for w in workers(0, n):
        model.add_worker(0, w.index, w.ip, w.agg_port, w.mac)
    per_cpu = ([], [])  # per CPU: list of phases (one per slot round), each a list of (key, frame)
    expected, dups = {}, 0
    for r in range(rounds):
        for s in range(slots):
            rnd = ([], [])
            for w, f in enumerate(contributions(r, s)):
                rnd[w % 2].append(((r, s, w, "new"), f))
                v = model.process(worker_ip(w), wire.UDP_PORT, f[wire.SWITCHML_OFFSET :])
                if v.action == Action.TO_ALL:
                    expected[(r, s)] = v.payload
                if rng.random() < dup_p:
                    rnd[w % 2].append(((r, s, w, "dup"), f))
                    dups += 1
            # One phase per slot round: both CPUs start each slot round together (the barrier),
            # so the slot's contributions overlap even when the machine is loaded. With one
            # phase per round the CPUs drifted apart on a loaded CI machine (7 of 384 overlapped).
            for c in (0, 1):
                per_cpu[c].append(rnd[c])
    assert len(expected) == rounds * slots
    return per_cpu, expected, dups


def _overlapping(results):
    """Slot rounds that ran on both CPUs at the same time (syscall granularity)."""
    spans = [{}, {}]
    for c in (0, 1):
        for (r, s, _, _), _, _, span in results[c]:
            spans[c].setdefault((r, s), []).append(span)
    return sum(
        any(a0 < b1 and b0 < a1 for a0, a1 in spans[0][key] for b0, b1 in spans[1].get(key, []))
        for key in spans[0]
    )


SENT = (bpfsys.XDP_TX, bpfsys.XDP_REDIRECT)  # a result out: TX, or the cpumap build's redirect


def _check(results, expected):
    """What went wrong, as messages (none for a correct aggregator): a completion twice or
    never, a sum (or exponent) that differs from the serial model's, a wrong retransmission
    answer, an action other than TX or DROP. Also returns the number of answered duplicates."""
    problems, completions, answered = [], {}, 0
    for res in results:
        for (r, s, _, kind), act, payload, _ in res:
            if act not in (*SENT, bpfsys.XDP_DROP):
                problems.append(f"slot {s} round {r}: action {act}")
            elif kind == "new" and act in SENT:
                if (r, s) in completions:
                    problems.append(f"slot {s} round {r} completed twice")
                completions[(r, s)] = payload
                if payload != expected[(r, s)]:
                    problems.append(f"slot {s} round {r}: sum differs from the serial model")
            elif kind == "dup" and act in SENT:  # answered with the stored result
                answered += 1
                if payload != expected[(r, s)]:
                    problems.append(f"retransmission answer for slot {s} round {r} is wrong")
    problems += [f"slot {s} round {r} never completed" for r, s in set(expected) - set(completions)]
    return problems, answered


def _two_cpus(run, prog, maps, n, k, slots, rounds, dup_p, seed, sparse=False, bits=32):
    """One run of the plan on a fresh job (`sparse` or not, of `bits`-bit elements) through
    `run` (the harness's two-CPU driver); (problems, answered, duplicates sent, overlapping)."""
    for j in list(maps.jobs()):
        maps.delete_job(j)
    maps.create_job(job(n=n, elems=k, count=slots, sparse=sparse, wire_bits=bits))
    for w in workers(0, n):
        maps.add_worker(w)
    per_cpu, expected, dups = _plan(n, k, slots, rounds, dup_p, seed, sparse, bits)
    results = run(prog.progs["xdp_agg_ingress"], per_cpu)
    problems, answered = _check(results, expected)
    return problems, answered, dups, _overlapping(results)


def _assert_counters(maps, slot_rounds, n, answered, dups):
    c = maps.counters(0)
    assert c["completed"] == slot_rounds
    assert c["aggregated"] == slot_rounds * (n - 1)
    assert c["retx_answered"] == answered
    assert c["dup_pending"] + c["retx_answered"] == dups


def _assert_two_cpus(maps, problems, answered, dups, overlapping):
    """The checks of _two_cpus' run (ROUNDS rounds of SLOTS slots, N workers): enough slot
    rounds ran on both CPUs at once, no problems, and the counters."""
    print(f"{overlapping} of {ROUNDS * SLOTS} slot rounds ran on both CPUs at once")
    assert overlapping >= ROUNDS * SLOTS // 10, (
        f"only {overlapping} slot rounds ran on both CPUs at once"
    )
    assert not problems, "\n".join(problems[:20])
    _assert_counters(maps, ROUNDS * SLOTS, N, answered, dups)


@pytest.mark.parametrize("bits", [32, 16], ids=["int32", "wire16"])
def test_two_cpus_same_slots(two_cpus, agg, bits):
    """The same slots on both CPUs; a job of 16-bit elements (docs/protocol.md 5.6) too, whose
    packed words every build sums as it sums int32."""
    prog, maps = agg
    _assert_two_cpus(
        maps, *_two_cpus(two_cpus, prog, maps, N, K, SLOTS, ROUNDS, DUP_P, 7, bits=bits)
    )
    if prog.options["variant"] == "percpu":
        # the last round's completion gathered partial sums from both CPUs
        tags = {p.tag for p in maps.partials(0, (ROUNDS - 1) % 2)}
        assert len(tags) == 1 and 0 not in tags, "both CPUs should hold a partial of the last round"


def test_two_cpus_sparse_rounds(two_cpus, agg):
    """The same on a sparse job (docs/protocol.md section 8): contributions with data, empty
    ones and dense rounds of the same slots on both CPUs at once. Each round's first two
    contributions race to install its key (bpf/sparse.h claim_round); the completing CPU gathers
    the other CPU's sums, smallest next and its e0; every result and answer is the model's,
    bytes and length."""
    prog, maps = agg
    _assert_two_cpus(
        maps, *_two_cpus(two_cpus, prog, maps, N, SPARSE_K, SLOTS, ROUNDS, DUP_P, 8, sparse=True)
    )


def _race_build(build, mutant):
    """A test-only build with the widened race window (loader.race_test_cflags), and with
    `mutant` the racy completion on the arrival count; (prog, maps), then cleaned up. `build`:
    a variant, or "percpu-cpumap", the aggregator of --slot-cpus cpumap (as its cpumap entries
    run it), which must stay exact when a slot's packets still reach two CPUs."""
    from xdp_switch import loader
    from xdp_switch.ctl_maps import AggMaps

    variant, _, cpumap = build.partition("-")
    cflags = loader.race_test_cflags(RACE_DELAY_NS, mutant=mutant)
    prog = loader.load(pool_slots=16, variant=variant, cflags=cflags, slot_cpus=cpumap or "rss")
    loader.prepare_test_runs(prog)
    yield prog, AggMaps(prog.maps, prog.pool_slots)
    prog.close()


RACE_BUILDS = ["percpu", "spinlock", "percpu-cpumap"]


@pytest.fixture(scope="module", params=AGG_BUILDS_CPUMAP)
def agg_prog(request):
    """conftest's builds and the one of --slot-cpus cpumap."""
    yield from load_agg_build(request.param)


@pytest.fixture(scope="module", params=RACE_BUILDS)
def race_build(request):
    """The real program of each variant, built with the widened race window."""
    yield from _race_build(request.param, mutant=False)


@pytest.fixture(scope="module", params=RACE_BUILDS)
def mutant_build(request):
    """The mutant that completes a slot on the arrival count, with the same window."""
    yield from _race_build(request.param, mutant=True)


def _race_run(run, prog, maps, sparse=False):
    slot_rounds = RACE_ROUNDS * RACE_SLOTS
    problems, answered, dups, overlapping = _two_cpus(
        run, prog, maps, RACE_N, RACE_K, RACE_SLOTS, RACE_ROUNDS, RACE_DUP_P, 12, sparse
    )
    print(f"{overlapping} of {slot_rounds} slot rounds overlapped, {len(problems)} problems")
    assert overlapping >= slot_rounds // 4, f"only {overlapping} slot rounds ran on both at once"
    return problems, answered, dups


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_race_window_exact(two_cpus, race_build, sparse):
    """Many rounds on two slots, one worker per CPU, the widened window: the real program of
    both variants is exact in every slot round, and the counters add up; on a sparse job too,
    where every round's two contributions also race to install its key."""
    prog, maps = race_build
    problems, answered, dups = _race_run(two_cpus, prog, maps, sparse)
    assert not problems, "\n".join(problems[:20])
    _assert_counters(maps, RACE_ROUNDS * RACE_SLOTS, RACE_N, answered, dups)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_race_window_catches_the_mutant(two_cpus, mutant_build, sparse):
    """The same run on the mutant that completes on the arrival count: the checks above find
    its lost additions (a sum that differs from the serial model's, a completion twice or never).
    Measured: 115-189 problems (wrong sums, wrong retransmission answers) per run of 800 slot
    rounds, in 10 of 10 runs of this file (see the module docstring)."""
    prog, maps = mutant_build
    problems, _, _ = _race_run(two_cpus, prog, maps, sparse)
    caught = [p for p in problems if "differs" in p or "completed twice" in p or "never" in p]
    assert caught, "the mutant completing on the arrival count was not caught"
