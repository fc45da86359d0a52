"""Bmv2Backend's control-plane logic against a recording fake of simple_switch_CLI.

No bmv2 needed: this checks which commands a job and a worker become (table entries, multicast
group and nodes, slot clearing), the bookkeeping behind jobs(), and the refusals. The commands
themselves run against a real simple_switch in tests/root/test_p4_cases.py.
"""

import dataclasses
import re

import pytest
from harness import packet_cases
from harness.p4 import PORTS, FakeCLI

from xdp_agg.proto import keys, reasons
from xdp_agg.proto.jobs import WorkerSpec
from xdp_agg.targets.bmv2 import Bmv2Backend, Bmv2Error, PortSpec, SwitchCLI, job_mgid


def spec(job_id=3, n=2, elems=64, base=10, count=4):
    """A job of the packet table's (its addresses), with this file's usual sizes."""
    return packet_cases.job(job_id, n, elems, base, count)


def test_job_and_worker_become_entries_group_and_node():
    cli = FakeCLI()
    b = Bmv2Backend(cli, PORTS)
    b.create_job(spec())
    # both versions of slots 10..13 cleared: register entries 20..27
    for reg in ("slot_seen", "slot_count"):
        assert [
            int(c.split()[2]) for c in cli.log if c.startswith(f"register_write {reg} ")
        ] == list(range(20, 28))
    assert f"mc_mgrp_create {job_mgid(3)}" in cli.log
    assert "table_add jobs set_job 3 => 2 1 10 14 5 0 0 0 0" in cli.log  # no parent, dense
    cli.log.clear()
    b.add_worker(
        WorkerSpec(
            3, 1, "198.18.2.2", 40000, mac="02:00:00:00:02:02", extra={"agg_ip": "198.18.2.1"}
        )
    )
    # the source MAC matched too (ternary; priority 1: the other keys are exact)
    assert cli.log[0] == (
        "table_add workers set_worker 198.18.2.2 48864 02:00:00:00:02:02&&&ff:ff:ff:ff:ff:ff "
        "=> 3 1 1"
    )
    # placed behind port 1 (the port whose address the worker reached), sourced from it
    assert cli.log[1] == (
        "table_add worker_addr to_worker 3 1 => 02:00:00:00:02:02 198.18.2.2 40000 "
        "02:00:00:00:02:01 198.18.2.1"
    )
    assert cli.log[2] == "mc_node_create 1 1"
    assert re.fullmatch(r"mc_node_associate 5 \d+", cli.log[3])
    node = int(cli.log[3].split()[-1])
    jobs = b.jobs()
    assert [j["job_id"] for j in jobs] == [3]
    assert jobs[0]["workers"][0]["switch_port"] == 1
    cli.log.clear()
    b.delete_job(3)
    assert cli.log[:2] == ["mc_node_dissociate 5 %d" % node, "mc_node_destroy %d" % node]
    assert any(c.startswith("table_delete jobs ") for c in cli.log)
    assert "mc_mgrp_destroy 5" in cli.log
    assert b.jobs() == []


def test_worker_falls_back_to_the_jobs_address_and_needs_a_port():
    cli = FakeCLI()
    b = Bmv2Backend(cli, [PortSpec(0, "s0"), PortSpec(1, "s1")])
    b.create_job(spec(job_id=0, elems=32, base=0))
    b.add_worker(WorkerSpec(0, 0, "198.18.0.10", 48864, mac="02:00:00:00:00:0a", extra={"port": 1}))
    assert cli.log[-3].endswith("02:00:00:00:00:01 198.18.0.1")  # the job's agg_mac/agg_ip
    with pytest.raises(ValueError, match="which switch port"):
        b.add_worker(WorkerSpec(0, 1, "198.18.0.11", 48864, mac="02:00:00:00:00:0b"))
    with pytest.raises(ValueError, match="not a port"):
        b.add_worker(
            WorkerSpec(0, 1, "198.18.0.11", 48864, mac="02:00:00:00:00:0b", extra={"port": 7})
        )


def test_refusals():
    b = Bmv2Backend(FakeCLI(), PORTS, pool_slots=64)
    for elems in (128, 512, 768):  # the XDP program's sizes only
        with pytest.raises(ValueError, match="32, 64 or 256 elements per packet, not"):
            b.create_job(spec(elems=elems))
    b.create_job(spec(job_id=3, base=16, count=8, elems=256))  # p4app's 1024-byte packets
    assert "set_job 3 => 2 3 16 24" in " ".join(b.cli.log), b.cli.log[-3:]
    b.delete_job(3)
    with pytest.raises(ValueError, match="outside the pool"):
        b.create_job(spec(base=60, count=8))
    with pytest.raises(ValueError, match="a job has 1..64"):
        b.create_job(spec(n=65))
    b.create_job(spec(job_id=1, base=0, count=8))
    with pytest.raises(ValueError, match="overlap"):
        b.create_job(spec(job_id=2, base=4, count=8))
    with pytest.raises(ValueError, match="outside 0..1"):
        b.add_worker(WorkerSpec(1, 2, "198.18.1.2", 1, extra={"port": 0}))
    b.add_worker(WorkerSpec(1, 0, "198.18.1.2", 1, extra={"port": 0}))
    with pytest.raises(ValueError, match="already worker 0 of job 1"):
        b.add_worker(WorkerSpec(1, 1, "198.18.1.2", 1, extra={"port": 0}))
    with pytest.raises(ValueError, match="already has a worker 0"):  # as the XDP backend
        b.add_worker(WorkerSpec(1, 0, "198.18.1.3", 1, extra={"port": 0}))
    b.add_worker(WorkerSpec(1, 0, "198.18.1.2", 2, extra={"port": 1}))  # same address: updated


def test_sparse_jobs_of_32_and_64_elements():
    """A sparse job's entry says so, and its slots' open rounds are cleared with the bitmaps;
    256 elements are refused sparse (Bmv2Backend.sparse_elems: the switch cannot grow an empty
    request into such a result), not dense."""
    cli = FakeCLI()
    b = Bmv2Backend(cli, PORTS)
    assert b.sparse_elems() == (32, 64) and b.pads_empty() is False
    b.create_job(dataclasses.replace(spec(), sparse=True))
    assert "table_add jobs set_job 3 => 2 1 10 14 5 0 0 1 0" in cli.log
    opened = [int(c.split()[2]) for c in cli.log if c.startswith("register_write slot_round_open ")]
    assert opened == list(range(20, 28))
    with pytest.raises(ValueError, match="sparse jobs of 32 or 64 elements per packet, not 256"):
        b.create_job(dataclasses.replace(spec(job_id=4, base=20, elems=256), sparse=True))
    b.create_job(spec(job_id=4, base=20, elems=256))  # dense: fine


def test_a_16_bit_job_says_its_width():
    """set_job's last parameter is the job's width bit (p4/udp_receiver.p4 drops a packet of
    the other width), and jobs() reports the job's wire_bits."""
    cli = FakeCLI()
    b = Bmv2Backend(cli, PORTS)
    b.create_job(packet_cases.job(3, 2, 64, 10, 4, wire_bits=16))
    assert "table_add jobs set_job 3 => 2 1 10 14 5 0 0 0 1" in cli.log
    b.create_job(dataclasses.replace(spec(job_id=4, base=20), sparse=True, wire_bits=16))
    assert "table_add jobs set_job 4 => 2 1 20 24 6 0 0 1 1" in cli.log
    assert [j["wire_bits"] for j in b.jobs()] == [16, 16]
    b.create_job(spec(job_id=4, base=20))
    assert [j["wire_bits"] for j in b.jobs()] == [16, 32]


def _rack(job_id=3, parent_ip="198.18.2.9", uplink=0xBEE7, **kw):
    """A rack job of a two-level tree (docs/protocol.md section 3.7)."""
    return dataclasses.replace(
        spec(job_id=job_id, **kw),
        parent_ip=parent_ip,
        parent_mac="02:00:00:00:09:09",
        parent_port=0xBEE4,
        parent_slot_base=100,
        uplink_port=uplink,
        worker_port=40000,
    )


def test_rack_job_becomes_its_parent_link():
    cli = FakeCLI()
    ports = [dataclasses.replace(p, prefixlen=24) for p in PORTS]  # 198.18.1.0/24, .2.0/24
    b = Bmv2Backend(cli, ports)
    assert b.uplink_address("198.18.2.9") == ("198.18.2.1", "02:00:00:00:02:01")
    b.create_job(_rack())
    # the parent's slot base in the jobs entry; the link: the parent's addressing, port 1 (the
    # parent's subnet) and our address there, our slot base, its slot base, our own port
    link = (
        "table_add parent_link set_parent_link 3 => 02:00:00:00:09:09 198.18.2.9 48868 48871 1 "
        "02:00:00:00:02:01 198.18.2.1 10 100 48864"
    )
    # its results are recognised by (its address, our uplink port), from any MAC
    parent = "table_add workers set_parent 198.18.2.9 48871 0&&&0 => 3 1"
    job = "table_add jobs set_job 3 => 2 1 10 14 5 1 100 0 0"
    # the link first: no packet finds the job without it
    assert cli.log.index(link) < cli.log.index(job) and cli.log.index(parent) < cli.log.index(job)
    st = b.parent_status(3)
    assert (st["address"], st["uplink_port"], st["switch_port"]) == ("198.18.2.9:48868", 0xBEE7, 1)
    assert set(st["counters"]) == set(reasons.PARENT_REASONS)
    with pytest.raises(ValueError, match="another uplink port"):
        b.create_job(_rack(job_id=4, base=40))
    b.create_job(dataclasses.replace(spec(job_id=4, base=40), agg_port=0xBEE7))
    with pytest.raises(ValueError, match="already worker"):  # the parent's key is taken
        b.add_worker(WorkerSpec(4, 0, "198.18.2.9", 40000, agg_port=0xBEE7, extra={"port": 1}))
    b.delete_job(4)
    cli.log.clear()
    b.delete_job(3)
    assert sum(c.startswith("table_delete") for c in cli.log) == 3  # jobs, parent_link, workers
    assert b.parent_status(3) is None


def test_rack_job_needs_a_port_toward_its_parent():
    b = Bmv2Backend(FakeCLI(), PORTS)  # /32 ports: no parent is on their subnets
    with pytest.raises(ValueError, match="set_parent_port"):
        b.create_job(_rack())
    b.set_parent_port("198.18.2.9", 0)
    b.create_job(_rack())
    assert b.parent_status(3)["switch_port"] == 0
    with pytest.raises(ValueError, match="not a port"):
        b.set_parent_port("198.18.2.9", 7)


def test_add_workers_batches_into_two_cli_calls():
    class CountingCLI(FakeCLI):
        calls = 0

        def run(self, commands, check=True):
            CountingCLI.calls += 1
            return super().run(commands, check)

    cli = CountingCLI()
    b = Bmv2Backend(cli, PORTS)
    b.create_job(spec(job_id=0, n=40, base=0))
    CountingCLI.calls = 0
    b.add_workers(
        [WorkerSpec(0, i, f"198.18.1.{10 + i}", 1, extra={"port": i % 2}) for i in range(40)]
    )
    assert CountingCLI.calls == 2
    assert sum(c.startswith("mc_node_associate 2 ") for c in cli.log) == 40
    assert [w["switch_port"] for w in b.jobs()[0]["workers"]] == [i % 2 for i in range(40)]
    CountingCLI.calls = 0
    b.delete_job(0)
    assert CountingCLI.calls == 1 and b.jobs() == []


def test_recreating_a_job_replaces_it():
    cli = FakeCLI()
    b = Bmv2Backend(cli, PORTS)
    b.create_job(spec(job_id=4, base=0))
    b.add_worker(WorkerSpec(4, 0, "198.18.1.2", 1, extra={"port": 0}))
    b.create_job(spec(job_id=4, base=0, n=3))
    assert [j["num_workers"] for j in b.jobs()] == [3]
    assert b.jobs()[0]["workers"] == []
    assert "mc_mgrp_destroy 6" in cli.log


def test_counters_add_ingress_and_egress_by_reason():
    cli = FakeCLI()
    b = Bmv2Backend(cli, PORTS)
    row = 2
    cli.counters[("ingress_reasons", keys.counter_key(row, reasons.Reason.COMPLETED))] = 3
    cli.counters[("egress_reasons", keys.counter_key(row, reasons.Reason.EGRESS_SENT))] = 6
    c = b.counters(row)
    assert c["completed"] == 3 and c["egress_sent"] == 6
    assert sum(c.values()) == 9 and set(c) == {r.name.lower() for r in reasons.Reason}


def test_cli_output_is_split_by_prompt_and_errors_raise(monkeypatch):
    import subprocess

    def fake_run(argv, input, **kw):
        outs = ["Entry has been added with handle 7", "Error: Table 'nope' not found"]
        text = (
            "Obtaining JSON from switch...\nDone\n"
            + "".join(f"RuntimeCmd: {o}\n" for o in outs)
            + "RuntimeCmd: \n"
        )
        return subprocess.CompletedProcess(argv, 0, text, "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr("shutil.which", lambda name: f"/usr/local/bin/{name}")
    cli = SwitchCLI(9090)
    assert cli.run(["a", "b"], check=False) == [
        "Entry has been added with handle 7",
        "Error: Table 'nope' not found",
    ]
    with pytest.raises(Bmv2Error, match="nope"):
        cli.run(["a", "b"])


def test_serve_bmv2_starts_its_control_endpoint(monkeypatch, tmp_path):
    """`xdp-agg serve --target bmv2` wires the bmv2 backend into a listening control endpoint
    with the deployment secret and limits (a fake switch: this runs without p4c and bmv2, so CI
    sees it; `pytest -m p4` runs the real one)."""
    import xdp_agg.targets.bmv2 as bm
    from xdp_agg.app import options, serving
    from xdp_agg.ctl import server as srv

    stopped, seen = [], {}

    class FakeSwitch:
        def stop(self):
            stopped.append(True)

    backend = Bmv2Backend(FakeCLI(), PORTS)

    def run_once(self):  # what Ctrl-C would end: check the endpoint, then stop it
        seen.update(backend=self.backend, address=self.address, secret=self._guard.secret)
        seen["sparse"] = self.defaults.sparse
        self.stop()

    monkeypatch.setattr(bm, "missing_tools", lambda: [])
    monkeypatch.setattr(bm, "port_specs", lambda names, netns=None: PORTS)
    monkeypatch.setattr(bm, "launch", lambda *a, **k: (FakeSwitch(), backend))
    monkeypatch.setattr(srv.ControlEndpoint, "run_until_interrupted", run_once)
    lines = []

    def opts(**changes):
        return options.ServeOptions(target="bmv2", ports="p0,p1", workdir=str(tmp_path), **changes)

    def endpoint(secret=None, parent=None):
        return serving.Endpoint("127.0.0.1", 0, secret, None, parent, [])

    serving.serve_bmv2(opts(), endpoint(b"s" * 32), announce=lines.append)
    assert seen["backend"] is backend and seen["address"][0] == "127.0.0.1"
    assert seen["secret"] == b"s" * 32  # the deployment secret reached the endpoint
    assert stopped == [True] and "control endpoint listening" in lines[0]
    assert seen["sparse"] is False
    # serve --sparse: the jobs take sparse all-reduces where the program runs them
    serving.serve_bmv2(opts(sparse=True), endpoint())
    assert seen["sparse"] is True
    stopped.clear()
    # with a parent (serve --parent-endpoint): every job a rack, through TreeBackend
    from xdp_agg.ctl.tree import ParentLink, TreeBackend

    link = ParentLink(("198.18.2.9", 48800), 1, 2)
    serving.serve_bmv2(opts(), endpoint(parent=link))
    assert isinstance(seen["backend"], TreeBackend) and seen["backend"].inner is backend
    assert seen["backend"].link is link and stopped == [True]
