"""Outcomes of a suite run and its reruns (tests/unit/test_torch_suite.py): a test that failed and
passed when run again is flaky, named as such in the output and the summary, and never counted
as passed."""

from __future__ import annotations

OUTCOMES = ("passed", "failed", "skipped", "flaky")


def settle(first: dict, again: dict | None) -> dict:
    """A test's outcome from its first run (not passed) and its rerun (None: it did not run):
    "flaky" when the rerun passed, else the rerun's outcome (or the first's); the detail keeps
    both runs."""
    if again is None:
        return first
    outcome = "flaky" if again["outcome"] == "passed" else again["outcome"]
    detail = f"first run: {first['detail']}\nrerun: {again['detail']}"
    return {**again, "outcome": outcome, "detail": detail}


def count(outcomes: dict) -> dict:
    """{outcome: how many} over OUTCOMES."""
    counts = dict.fromkeys(OUTCOMES, 0)
    for v in outcomes.values():
        counts[v["outcome"]] += 1
    return counts


def summary(outcomes: dict) -> dict:
    """What the run writes as JSON: the counts and the flaky tests by name."""
    flaky = sorted(n for n, v in outcomes.items() if v["outcome"] == "flaky")
    return {"counts": count(outcomes), "flaky": flaky}
