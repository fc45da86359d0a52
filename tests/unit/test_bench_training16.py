"""bench.training16's summary and table (no root: reports as examples/train.py writes them)."""

from bench import training16


def _report(loss: float, acc: float, t: float) -> dict:
    return {"loss": [2.0, loss], "final_accuracy": acc, "time_per_iter_s": t}


def test_wire16_training_summary_compares_with_gloos_spread():
    """Each system's final loss and accuracy over the seeds, and whether its mean lies within
    gloo float32's range over the same seeds (widened by the system's own half-range)."""
    seeds = [0, 1]
    reports = {}
    for key, loss, acc in (
        ("gloo", (0.30, 0.34), (0.90, 0.94)),
        ("gloo-bf16", (0.31, 0.33), (0.91, 0.93)),
        ("xdpagg-32", (0.30, 0.34), (0.90, 0.94)),
        ("xdpagg-16", (0.60, 0.62), (0.70, 0.72)),  # trains worse: outside the spread
    ):
        for seed, lo, ac in zip(seeds, loss, acc):
            reports[f"{key}.s{seed}"] = _report(lo, ac, 0.01 * (seed + 1))
    s = training16.summarize(reports, seeds)
    assert s["gloo"]["loss_range"] == [0.30, 0.34] and abs(s["gloo"]["loss_mean"] - 0.32) < 1e-12
    assert s["gloo-bf16"]["within_gloo_spread"] and s["xdpagg-32"]["within_gloo_spread"]
    assert not s["xdpagg-16"]["within_gloo_spread"]
    assert s["gloo"]["time_per_iter_s"] == 0.015
    md = training16.markdown(
        {"meta": {"workers": 4, "seeds": seeds, "models": ["digits"]}, "digits": {"summary": s}}
    )
    assert "| xdpagg-16 | 0.6000, 0.6200 | 0.6100 | 0.7000, 0.7200 | 0.7100 | 15.0 | NO |" in md


def test_wire16_training_systems_run_every_seed():
    keys = [k for k, *_ in training16.seeded([0, 3])]
    assert keys[:4] == ["xdpagg-16.s0", "xdpagg-32.s0", "gloo-bf16.s0", "gloo.s0"]
    assert len(keys) == 8 and all(own[-2:] == ("--seed", k[-1]) for k, *_, own in
                                  training16.seeded([0, 3]))  # fmt: skip
