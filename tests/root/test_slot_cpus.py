"""xdp_switch.slot_cpus: the slot -> CPU rule, CPU lists, and the RSS report's reading."""

import subprocess

import pytest

from xdp_switch import slot_cpus


def test_lane_cpu_cuts_a_job_into_contiguous_ranges():
    owners = [slot_cpus.lane_cpu(i, 8, [0, 1]) for i in range(8)]
    assert owners == [0, 0, 0, 0, 1, 1, 1, 1]
    # 4 host lanes of 16 slots on 2 CPUs: whole lanes, two per CPU
    lanes = [
        {slot_cpus.lane_cpu(i, 16, [2, 5]) for i in range(4 * lane, 4 * lane + 4)}
        for lane in range(4)
    ]
    assert lanes == [{2}, {2}, {5}, {5}]
    # a count that does not divide: every CPU gets a range, none empty
    assert sorted({slot_cpus.lane_cpu(i, 5, [0, 1, 2]) for i in range(5)}) == [0, 1, 2]


def test_parse_cpus():
    assert slot_cpus.parse_cpus("0") == [0]
    assert slot_cpus.parse_cpus("1,0") == [0, 1]
    for bad in ("", "a", "0-x", "99999"):
        with pytest.raises(ValueError):
            slot_cpus.parse_cpus(bad)


@pytest.mark.parametrize(
    "letters, fits",
    [("sdfn", False), ("sd", False), ("fn", True), ("f", True), ("dn", False)],
)
def test_hash_advice(letters, fits):
    ok, advice = slot_cpus._hash_advice("eth1", letters)
    assert ok == fits
    if not fits:
        assert "ethtool -N eth1 rx-flow-hash udp4 fn" in advice


@pytest.mark.root
def test_veth_has_no_rss_hash():
    subprocess.run(
        ["ip", "link", "add", "tcs0", "type", "veth", "peer", "name", "tcs1"], check=True
    )
    try:
        r = slot_cpus.rss_report("tcs0")
    finally:
        subprocess.run(["ip", "link", "del", "tcs0"], check=True)
    assert r["driver"] == "veth" and r["hash"] is None and not r["fits"]
    assert "--slot-cpus cpumap" in r["advice"]


def test_alternating_runs_every_case_each_pass_and_swaps_who_goes_first():
    """The side-by-side benchmarks' order: keys in order on even passes, reversed on odd ones."""
    from xdp_switch.microbench import alternating

    order, passes = [], []
    runs = alternating(["a", "b", "c"], 3, lambda k: order.append(k) or len(order), passes.append)
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert runs == {"a": [1, 6, 7], "b": [2, 5, 8], "c": [3, 4, 9]} and passes == [0, 1, 2]
