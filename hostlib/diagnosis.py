"""Sentences for a timed-out all-reduce, from the control endpoint's `diagnose` answer.

Communicator adds explain_timeout's text to an AllreduceTimeout: the cause first (the aggregator
lost the job, ranks that never registered or are gone), then ranks lagging in contributions, and
whether the aggregator counted anything from this rank at all.

A rank that died shows in the answer's `gone` (xdp_agg.ctl.server: when its control connection
closed or it left, and how many contributions the aggregator had from it then); the survivors'
AllreduceTimeout names it with both, so the user knows which rank to look at and that it, not
the network, stopped the job.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any


def gone_notes(diagnosis: dict[str, Any], now: float | None = None) -> list[str]:
    """One sentence per rank that left or lost its control connection, oldest first."""
    now = time.time() if now is None else now
    top = diagnosis.get("most_contributions") or 0
    gone = diagnosis.get("gone") or {}
    # ranks that were behind when they went stopped the job; ranks that left level with the
    # others are survivors that gave up first: named only when nobody was behind
    behind = {
        r: g
        for r, g in gone.items()
        if (g.get("contributions") is None) or g["contributions"] < top
    }
    gone = behind or gone
    notes = []
    for rank, g in sorted(gone.items(), key=lambda kv: (kv[1].get("at") or 0, int(kv[0]))):
        if g.get("state") == "left":
            text = f"rank {rank} left the job"
        else:
            text = f"rank {rank}'s control connection closed"
        at = g.get("at")
        if at:
            stamp = time.strftime("%H:%M:%S", time.localtime(at))
            text += f" at {stamp} ({max(0.0, now - at):.1f} s ago)"
        c = g.get("contributions")
        if c is not None:
            text += f", it was behind by {max(0, top - c)} contributions ({c} of {top})"
        notes.append(text + ": it died or was stopped; the job cannot finish without it")
    return notes


def explain_timeout(d: dict[str, Any], rank: int, my_address: str, packets: int) -> str:
    """What the control endpoint's `diagnose` answer `d` says about a timed-out all-reduce of
    rank `rank` (data address `my_address`, `packets` packets): "Control endpoint: ..."."""
    if d.get("lost"):  # the cause: what the ranks did afterwards says nothing more
        note = f"the aggregator lost this job: {d['lost']}; no sum can come; start the run "
        return f"Control endpoint: {note}again (every rank)."
    notes = []
    if d.get("missing"):
        notes.append(f"rank(s) {_join(d['missing'])} never registered")
    gone = gone_notes(d)
    notes += gone
    if d.get("left") and not gone:
        notes.append(f"rank(s) {_join(d['left'])} left the job or lost their connection")
    counters = d.get("counters") or {}
    mine = counters.get(str(rank), {}).get("contributions")
    lagging = {int(r): c for r, c in (d.get("lagging") or {}).items() if int(r) != rank}
    if lagging:
        top = d.get("most_contributions", 0)
        notes.append(
            "lagging: "
            + ", ".join(f"rank {r} ({c} contributions)" for r, c in sorted(lagging.items()))
            + f" reached the aggregator, the most advanced rank {top}"
        )
    if mine == 0 and packets:
        notes.append(
            f"the aggregator counted no contribution from this rank ({my_address}): "
            "it does not receive this worker's packets or does not know its address"
        )
    if not notes and "counters" not in d:
        notes.append(
            "every rank is registered; the aggregator offers no per-worker counters, so an "
            "idle rank cannot be told apart from an aggregator that does not answer"
        )
    elif not notes:
        notes.append("every rank is registered and none is behind in contributions")
    return "Control endpoint: " + "; ".join(notes) + "."


def _join(ranks: Iterable[object]) -> str:
    return ", ".join(str(r) for r in ranks)
