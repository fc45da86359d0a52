"""The AF_XDP data path's redirect program (hostlib/xsk_prog.c) through BPF_PROG_TEST_RUN, one
table of frames: what goes to a lane's socket and what goes to the kernel. The program is loaded
as the data path loads it, for the ports of a job's 4 lanes and of its 16-bit companion job's 2
(one program and UMEM a queue: hostlib/_xsk.c), but with XDP_DROP where a port's slot has no
socket (its XSKMAP is empty), so that "to lane l" (drop) and "to the kernel" (pass) differ; the
netns tests show the real sockets receiving (tests/root/test_afxdp_netns.py). A test run's frames
come in on queue 0."""

from __future__ import annotations

import os

import pytest
from scapy.layers.inet import ICMP, IP, UDP
from scapy.layers.l2 import ARP, Ether

from xdp_agg import bpfsys

pytestmark = [pytest.mark.root]

BASE, LANES = 40000, 4
W16_BASE, W16_LANES = 41000, 2  # the companion job's ports
PORTS = [*range(BASE, BASE + LANES), *range(W16_BASE, W16_BASE + W16_LANES)]
MAC = dict(src="02:00:00:00:00:0a", dst="02:00:00:00:00:01")


def _udp(dport: int, **ip) -> bytes:
    return bytes(
        Ether(**MAC)
        / IP(src="198.18.0.1", dst="198.18.0.10", **ip)
        / UDP(sport=0xBEE0, dport=dport)
        / (b"\0" * 64)
    )


CASES = [
    *((f"lane {lane}'s port", _udp(BASE + lane), "drop") for lane in range(LANES)),
    ("the port below the lanes", _udp(BASE - 1), "pass"),
    ("the port after the lanes", _udp(BASE + LANES), "pass"),
    *((f"wire16 lane {lane}'s port", _udp(W16_BASE + lane), "drop") for lane in range(W16_LANES)),
    ("the port below the wire16 lanes", _udp(W16_BASE - 1), "pass"),
    ("the port after the wire16 lanes", _udp(W16_BASE + W16_LANES), "pass"),
    ("ARP", bytes(Ether(**MAC) / ARP(pdst="198.18.0.10")), "pass"),
    ("ICMP", bytes(Ether(**MAC) / IP(dst="198.18.0.10") / ICMP()), "pass"),
    ("a first fragment", _udp(BASE, flags="MF"), "pass"),
    ("a later fragment", _udp(BASE, frag=8), "pass"),
    ("IP options", _udp(BASE, options=[b"\x01\x01\x01\x00"]), "pass"),
    ("a short frame", _udp(BASE)[:40], "pass"),
]


@pytest.fixture(scope="module")
def programs():
    from hostlib import _fastpath

    fds = {q: _fastpath.xsk_test_program(PORTS, q) for q in (0, 1)}
    yield fds
    for fd in fds.values():
        os.close(fd)


@pytest.mark.parametrize("what, frame, want", CASES, ids=[c[0] for c in CASES])
def test_each_frame_goes_where_it_should(programs, what, frame, want):
    action, out, _ = bpfsys.prog_test_run(programs[0], frame)
    assert bpfsys.XDP_ACTIONS[action] == want, what
    assert out == frame  # the program never changes a frame


def test_a_lane_on_another_queue_is_the_kernel_s(programs):
    """The program of queue 1's sockets passes a lane's frame that came in on queue 0."""
    action, _, _ = bpfsys.prog_test_run(programs[1], _udp(BASE))
    assert bpfsys.XDP_ACTIONS[action] == "pass"


def test_bad_arguments_are_refused():
    from hostlib import _fastpath

    with pytest.raises(ValueError):
        _fastpath.xsk_test_program(list(range(BASE, BASE + 65)), 0)
    with pytest.raises(ValueError):
        _fastpath.xsk_test_program([0], 0)
