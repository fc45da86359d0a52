"""The XDP program loads on a machine of any size: every build, compiled for 1 to 1024 possible
CPUs, passes the verifier, and the instructions the verifier processes do not grow with them.

CI runs on 2 CPUs, an aggregator box has 8 to 128 and a cloud VM may report more possible CPUs
than it has. Built for N CPUs (bpfsys.possible_cpus replaced in a child process, the way the
loader asks), the gather used to be a loop over CPUs that the verifier walked once per CPU: the
program passed the verifier's limit of 1,000,000 processed instructions from 5 CPUs on
(../shared/design/platform.md). Each build's count (bpf_prog_info.verified_insns) is checked
against its budget in tests/data/verifier_budget.json: a change that makes verification grow
fails here and has to say why, by raising the budget in the same commit. Each build is the
object built with the project, loaded as attach loads it (xdp_switch/objload.py).

A kernel without may_goto (before 6.9), at which the program's loops converge, loads the object
with each may_goto turned into a jump never taken (objload.without_may_goto): the verifier walks
those loops step by step, within the limit and the budgets "<build> without may_goto".
"""

import json
import multiprocessing as mp
import re
from pathlib import Path

import pytest

from xdp_agg import bpfsys
from xdp_agg.bpfsys.insn import (
    BPF_ADD,
    BPF_ALU64_IMM,
    BPF_DW,
    BPF_EXIT_INSN,
    BPF_JLT,
    BPF_JMP_IMM,
    BPF_LDX_MEM,
    BPF_MOV64_IMM,
    BPF_REG_0,
    BPF_REG_1,
)
from xdp_switch import bpfbuild, objload

CPU_COUNTS = (1, 2, 3, 4, 5, 8, 16, 64, 256, 1024)
# (variant, slot_cpus, frags): every build attach can make
BUILDS = {
    "percpu": ("percpu", "rss", False),
    "percpu-frags": ("percpu", "rss", True),
    "percpu-cpumap": ("percpu", "cpumap", False),
    "percpu-cpumap-frags": ("percpu", "cpumap", True),
    "spinlock": ("spinlock", "rss", False),
    "spinlock-frags": ("spinlock", "rss", True),
}
BUDGET_FILE = Path(__file__).resolve().parents[1] / "data" / "verifier_budget.json"


def _verify(args):
    """In a child: load one build as if the machine had `cpus` possible CPUs; its programs'
    verified-instruction counts, or the LoadError's text."""
    build, cpus = args
    from xdp_switch import loader

    bpfsys.possible_cpus = lambda: cpus  # what the loader sizes the program for
    variant, slot_cpus, frags = BUILDS[build]
    try:
        prog = loader.load(pool_slots=256, variant=variant, slot_cpus=slot_cpus, frags=frags)
    except loader.LoadError as e:
        return build, cpus, str(e)
    prog.close()
    return build, cpus, prog.verified


def verified(build: str) -> dict:
    """{cpus: {program: count}} of one build, two loads at a time (the verifier's walk of the
    aggregator takes a few tenths of a second each)."""
    with mp.get_context("fork").Pool(2) as pool:
        out = pool.map(_verify, [(build, n) for n in CPU_COUNTS], chunksize=1)
    return {cpus: counts for _, cpus, counts in out}


@pytest.mark.root
@pytest.mark.bpf
@pytest.mark.slow
@pytest.mark.parametrize("build", BUILDS)
def test_loads_for_every_cpu_count_within_budget(build):
    budget = json.loads(BUDGET_FILE.read_text())[build]
    by_cpus = verified(build)
    refused = {n: c for n, c in by_cpus.items() if isinstance(c, str)}
    assert not refused, f"{build} refused at {sorted(refused)} CPUs: {list(refused.values())[0]}"
    first = by_cpus[CPU_COUNTS[0]]
    grew = {n: c for n, c in by_cpus.items() if c != first}
    assert not grew, f"{build}: verification depends on the CPUs: {first} at 1 CPU, {grew}"
    over = {p: (c, budget[p]) for p, c in first.items() if c > budget[p]}
    assert not over, (
        f"{build}: the verifier processed more instructions than budgeted {over} "
        f"(count, budget): find why, then raise the budget in {BUDGET_FILE.name}"
    )
    assert set(first) == set(budget), f"{build}: programs {sorted(first)}, budget {sorted(budget)}"


@pytest.mark.root
@pytest.mark.bpf
@pytest.mark.slow
@pytest.mark.parametrize("build", BUILDS)
def test_loads_without_may_goto_within_budget(build, monkeypatch):
    """As a kernel without may_goto loads it (forced here, on one that has it)."""
    monkeypatch.setattr(objload, "may_goto_supported", lambda: False)  # the forked loads' too
    budget = json.loads(BUDGET_FILE.read_text())[f"{build} without may_goto"]
    by_cpus = verified(build)
    refused = {n: c for n, c in by_cpus.items() if isinstance(c, str)}
    assert not refused, f"{build} refused at {sorted(refused)} CPUs: {list(refused.values())[0]}"
    assert len({tuple(sorted(c.items())) for c in by_cpus.values()}) == 1, by_cpus
    first = by_cpus[CPU_COUNTS[0]]
    over = {p: (c, budget[p]) for p, c in first.items() if c > budget[p]}
    assert not over, f"{build} without may_goto: over budget {over} (count, budget)"


@pytest.mark.root
@pytest.mark.bpf
def test_without_may_goto_changes_only_may_goto():
    """The copy differs from the object in the opcode and dst_reg of each may_goto alone."""
    obj = objload.object_for(bpfbuild.Flavour(), ()).read_bytes()
    copy = objload.without_may_goto(obj)
    assert len(obj) == len(copy)
    moved = {i - i % 8 for i in range(len(obj)) if obj[i] != copy[i]}  # the instructions changed
    assert moved, "the object has no may_goto"
    for at in moved:
        assert obj[at : at + 2] == bytes([objload.MAY_GOTO, 0]), at
        assert copy[at : at + 2] == bytes([objload.NEVER, 10]), at  # if r10 == 0 goto
        assert obj[at + 2 : at + 8] == copy[at + 2 : at + 8], at  # the same target


@pytest.mark.root
def test_a_refusal_names_the_processed_instruction_limit():
    """A loop the verifier walks two million times: the message says it was the limit."""
    loop = [
        BPF_MOV64_IMM(BPF_REG_1, 0),
        BPF_ALU64_IMM(BPF_ADD, BPF_REG_1, 1),
        BPF_JMP_IMM(BPF_JLT, BPF_REG_1, 2_000_000, -2),  # if r1 < 2000000 goto -2
        BPF_MOV64_IMM(BPF_REG_0, bpfsys.XDP_PASS),
        BPF_EXIT_INSN(),
    ]
    with pytest.raises(bpfsys.ProgLoadError) as e:
        bpfsys.prog_load(bpfsys.PROG_TYPE_XDP, loop, "too_long")
    why = objload.explain(e.value.log)
    assert "1,000,000" in why and "processed instructions" in why, why


@pytest.mark.root
def test_a_refusal_names_the_failing_instruction():
    """A read past the context: the message names that instruction and the verifier's word."""
    bad = [BPF_LDX_MEM(BPF_DW, BPF_REG_0, BPF_REG_1, 4000), BPF_EXIT_INSN()]
    with pytest.raises(bpfsys.ProgLoadError) as e:
        bpfsys.prog_load(bpfsys.PROG_TYPE_XDP, bad, "bad_ctx")
    why = objload.explain(e.value.log)
    assert re.match(r"at instruction 0 \(0: \(79\) r0 = \*\(u64 \*\)\(r1 \+4000\)\): ", why), why
    assert "invalid bpf_context access" in why, why
