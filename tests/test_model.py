"""The serial reference model against the packet table (no root needed)."""

import numpy as np
import pytest
from packet_cases import CASES

from aggproto import wire
from aggproto.model import Action, ReferenceAggregator


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_model_follows_the_table(case):
    model = ReferenceAggregator()
    for j in case.jobs:
        model.create_job_spec(j)
    for w in case.workers:
        model.add_worker(w.job_id, w.index, w.ip, w.agg_port, w.mac)
    for step in case.steps:
        v = model.process_frame(step.frame)
        assert (v.action, v.reason) == (step.action, step.reason), step.what
        if step.values is not None:
            msg = wire.Message.from_bytes(v.payload)
            np.testing.assert_array_equal(msg.values, step.values)
            assert msg.e0 == step.e0
        if step.raw_check is not None:  # the model gives the UDP payload: read it as a frame
            step.raw_check(step.frame[: wire.SWITCHML_OFFSET] + v.payload)


def test_recreated_job_starts_clean():
    m = ReferenceAggregator()
    m.create_job(0, 2, 32, 0, 4)
    m.add_worker(0, 0, "198.18.0.10")
    p = wire.Message(1, 0, 0, 1, 0, 0, 0, 0, np.ones(32, np.int32)).to_bytes()
    assert m.process("198.18.0.10", wire.UDP_PORT, p).action == Action.DROP
    m.create_job(0, 2, 32, 0, 4)
    assert m.process("198.18.0.10", wire.UDP_PORT, p).reason.name == "AGGREGATED"
