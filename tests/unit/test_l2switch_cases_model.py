"""The forwarding cases (tests/harness/forward_cases.py) through their serial model alone: no
root, no BPF, no bmv2. Every step's verdict, counter and port must be the model's, and the
table events a case names must be the ones the model counts; the XDP and P4 runners
(test_l2switch_xdp_cases.py, test_l2switch_p4_cases.py) hold each target to the same model.
"""

import pytest
from harness.forward_cases import CASES, FwdCase, FwdModel, Verdict, check_model


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_l2switch_case_through_the_model(case: FwdCase):
    model = FwdModel(case)
    for step in case.steps:
        check_model(model, step)
        assert (step.out_port is not None) == (step.verdict == Verdict.FORWARD), step.what
    for event, n in case.events.items():
        assert model.events[event] == n, f"{case.name}: {event}"
    assert model.snooped() == (case.groups, case.routers), case.name


def test_l2switch_table_has_every_verdict_in_both_modes():
    for mode in ("routed", "switched"):
        verdicts = {s.verdict for c in CASES if c.mode == mode for s in c.steps}
        want = set(Verdict) - ({Verdict.FLOOD} if mode == "routed" else set())
        assert verdicts == want, mode
    assert any("bmv2" not in c.not_on for c in CASES), "no case runs on both twins"
