"""The suite driver's bookkeeping (tests/harness/suite_outcomes.py), without torch."""

from harness.suite_outcomes import count, settle, summary


def _o(outcome: str, detail: str = "") -> dict:
    return {"outcome": outcome, "detail": detail}


def test_a_test_that_passes_on_its_rerun_is_flaky_not_passed():
    got = settle(_o("failed", "rank 1 exited 1"), _o("passed"))
    assert got["outcome"] == "flaky" and "rank 1 exited 1" in got["detail"]
    outcomes = {"t_a": got, "t_b": _o("passed"), "t_c": settle(_o("failed"), _o("failed"))}
    assert count(outcomes) == {"passed": 1, "failed": 1, "skipped": 0, "flaky": 1}
    assert summary(outcomes)["flaky"] == ["t_a"]


def test_a_rerun_that_did_not_run_keeps_the_first_outcome():
    first = _o("failed", "x")
    assert settle(first, None) is first
