"""netns_testbed.kernel_forward's plan (no root): the switch topology's workers routed to one
another through the aggregator's namespace."""

import pytest

from netns_testbed import kernel_forward
from netns_testbed.plan import make_plan
from netns_testbed.testbed import Testbed


def test_l2switch_kernel_forwarding_routes_each_worker_and_forwards_on_the_ports_only():
    cmds = kernel_forward.commands(make_plan("xtk", 3, "switch"))
    routes, (sysctl,) = cmds[:3], cmds[3:]
    for i, (netns, argv, _) in enumerate(routes):
        assert netns == f"xtkw{i}"
        assert argv == ["ip", "route", "replace", "198.18.0.0/15", "via", f"198.18.{i + 1}.1",
                        "dev", "eth0"]  # fmt: skip
    netns, argv, _ = sysctl
    assert netns == "xtkag"
    assert argv[3:] == [f"net.ipv4.conf.p{i}.forwarding=1" for i in range(3)]
    assert not any("all." in a or "default." in a or "ip_forward" in a for a in argv)


def test_l2switch_kernel_forwarding_is_for_the_switch_topology_only():
    with pytest.raises(ValueError, match="switch"):
        kernel_forward.commands(make_plan("xtk", 2, "one-arm"))
    with pytest.raises(ValueError, match="switch"):
        Testbed(workers=2, topology="one-arm", kernel_forwarding=True)
    tb = Testbed(workers=2, topology="switch", kernel_forwarding=True)
    assert tb.kernel_forwarding and tb.state()["kernel_forwarding"] is True
