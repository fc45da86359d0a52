"""The formulas that index an aggregator's tables, written once for Python and C.

Every target keys its state the same way: a slot's two versions are pool entries
`slot * 2 + version` (the XDP program's `results` and `partials` maps, the P4 registers), counters
are rows of reasons `row * NUM_REASONS + reason` (row = job id, or limits.NO_JOB), and per-worker
counters `job * MAX_WORKERS + index`. KEYS is the one definition: the Python functions below are
compiled from it, and xdp_agg.codegen writes the same expressions into bpf/generated/abi.h as
macros (AGG_POOL_ENTRY, AGG_COUNTER_KEY, AGG_WORKER_KEY), so no side spells a formula by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

from .limits import MAX_WORKERS
from .reasons import NUM_REASONS


@dataclass(frozen=True)
class KeyFormula:
    """One key: its name, argument names and an expression in them (valid C and Python)."""

    name: str  # Python function name; the C macro is AGG_<NAME>
    args: tuple[str, ...]
    expr: str  # over args and the constants named in CONSTANTS
    doc: str


# Constants the expressions may use, under the names the C side #defines them (generated abi.h).
CONSTANTS = {"AGG_NUM_REASONS": NUM_REASONS, "AGG_MAX_WORKERS": MAX_WORKERS}

KEYS = (
    KeyFormula(
        "pool_entry",
        ("slot", "version"),
        "(slot) * 2 + (version)",
        "a slot's version: key of results, partials and the P4 registers",
    ),
    KeyFormula(
        "counter_key",
        ("row", "reason"),
        "(row) * AGG_NUM_REASONS + (reason)",
        "counter of a reason in a row (job id, or NO_JOB)",
    ),
    KeyFormula(
        "worker_key",
        ("job", "index"),
        "(job) * AGG_MAX_WORKERS + (index)",
        "per-worker counters of worker `index` of `job`",
    ),
)


def _compile(k: KeyFormula):
    code = compile(
        f"lambda {', '.join(k.args)}: {k.expr}", f"<xdp_agg.proto.keys.{k.name}>", "eval"
    )
    fn = eval(code, dict(CONSTANTS))  # noqa: S307 -- our own constant table, not input
    fn.__name__ = fn.__qualname__ = k.name
    fn.__doc__ = f"{k.doc}: {k.expr}"
    return fn


pool_entry = _compile(KEYS[0])
counter_key = _compile(KEYS[1])
worker_key = _compile(KEYS[2])
