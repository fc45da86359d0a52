"""The packet table (tests/harness/packet_cases.py) through the serial reference model
(xdp_agg/proto/model.py) alone: no root, no BPF, no bmv2, so `make test-unit` runs every case.

For every step of every case, the model's action and reason must be the step's, and a result's
UDP payload (echoed header fields, the int32 sum, both exponents, what p4app-switchML's host
reads) must be what the table computed with numpy. The XDP and P4 runners (test_xdp_cases.py,
test_p4_cases.py) hold each target to the same model, frame by frame.
"""

import pytest
from harness.packet_cases import CASES, Case, check_model, check_payload, model_for

from xdp_agg.proto import wire
from xdp_agg.proto.model import Action

# The actions that put a frame out: the model must give their payload, and only theirs.
RESULTS = (Action.TO_ALL, Action.TO_SENDER, Action.TO_PARENT)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_packet_case_through_the_model(case: Case):
    model = model_for(case)
    for step in case.steps:
        v = check_model(model, step)
        if step.action not in RESULTS:
            assert v.payload is None, f"{step.what}: the model answers a {step.action.name}"
            continue
        assert v.payload is not None, f"{step.what}: the model gives no result"
        # the model rewrites the UDP payload only: the output frame keeps the request's headers
        check_payload(step, step.frame, step.frame[: wire.SWITCHML_OFFSET] + v.payload)


def test_the_table_has_every_action_and_result():
    """The table exercises every action (a table that lost its results would pass above)."""
    actions = {s.action for c in CASES for s in c.steps}
    assert actions == set(Action)
    assert all(c.steps for c in CASES), [c.name for c in CASES if not c.steps]
