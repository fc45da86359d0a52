"""The forwarding cases (tests/harness/forward_cases.py) on the P4 twin: bmv2's `l2_forward`
table (p4/forwarder.p4), a static MAC table with flooding, on veths. The cases it runs have
their MAC table given (Bmv2Backend.add_mac, as the XDP runner seeds its learned table); the
box's own MACs lead to the host's port, as XDP_PASS leads to the box's stack. What comes out of
every port is captured: FORWARD out of its port alone, unchanged; FLOOD out of every other port
(the host's included: bmv2's flood group has it); TO_HOST out of the host's port; DROP nowhere.
Skipped, with the reason, where simple_switch or p4c is missing (harness.p4.p4_skip_reason).
"""

from __future__ import annotations

import pytest
from harness.forward_cases import BOX_MACS, CASES, PORTS, FwdCase, FwdModel, Verdict, check_model
from harness.p4 import VethLab

pytestmark = [pytest.mark.root, pytest.mark.netns, pytest.mark.p4]

HOST_PORT = PORTS  # the box's own stack: where its MACs lead
NPORTS = PORTS + 1


@pytest.fixture(scope="module")
def lab(p4_json, tmp_path_factory):
    from xdp_agg.targets.bmv2 import Bmv2Backend

    lab = VethLab(p4_json, NPORTS, log_path=tmp_path_factory.mktemp("bmv2") / "switch.log")
    lab.up()
    try:
        backend = Bmv2Backend(lab.switch.cli(), lab.ports)
        backend.setup(unknown_unicast="flood")
        for mac in BOX_MACS:
            backend.add_mac(mac, HOST_PORT)
        lab.backend = backend
        yield lab
    finally:
        lab.down()


def _expected_ports(step, in_port: int) -> list[int]:
    if step.verdict == Verdict.DROP:
        return []
    if step.verdict == Verdict.TO_HOST:
        return [HOST_PORT]
    if step.verdict == Verdict.FORWARD:
        return [step.out_port]
    return sorted(p for p in range(NPORTS) if p != in_port)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_l2switch_p4_case(lab, case: FwdCase):
    if "bmv2" in case.not_on:
        pytest.skip(case.not_on["bmv2"])
    for mac, port in case.table.items():
        lab.backend.add_mac(mac, port)
    model = FwdModel(case)
    for step in case.steps:
        check_model(model, step)
        want = _expected_ports(step, step.in_port)
        outs = lab.exchange(step.in_port, step.frame, len(want))
        assert sorted(p for p, _ in outs) == want, f"{step.what}: out of the wrong ports"
        for _, data in outs:
            assert data == step.frame, f"{step.what}: a forwarded frame was modified"
