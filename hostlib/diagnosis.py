"""Sentences for a timed-out all-reduce, from the control endpoint's `diagnose` answer.

A rank that died shows in the answer's `gone` (aggctl.server: when its control connection
closed or it left, and how many contributions the aggregator had from it then); the survivors'
AllreduceTimeout names it with both, so the user knows which rank to look at and that it, not
the network, stopped the job.
"""

from __future__ import annotations

import time


def gone_notes(diagnosis: dict, now: float | None = None) -> list[str]:
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
