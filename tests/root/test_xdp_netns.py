"""The aggregator attached to real veths in namespaces, driven through the `xdp-agg` CLI.

- the one-arm and switch topologies: workers' UDP contributions come back summed to every worker
  (switch exercises the devmap broadcast and the per-port egress program);
- ping and a TCP transfer through the attached interface keep working;
- `status --json` / `stats --json` show the program and its counters;
- `detach` leaves no program on the interface, no pin, no map.
"""

import json
import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from xdp_agg import bpfsys
from xdp_agg.proto import wire
from xdp_switch import pins

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns]

# A worker: send one contribution, print the result it receives (or null after the timeout).
WORKER = r"""
import json, socket, sys
import numpy as np
from xdp_agg.proto import wire
agg, w, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
slot = int(sys.argv[4]) if len(sys.argv) > 4 else 1
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", wire.UDP_PORT))
s.settimeout(0.3)
vals = (np.arange(k) + 1000 * w).reshape(1, -1)
pkt = wire.build_payloads(job_number=5, size_code=wire.size_code_for(k), tsi=42, slot=slot,
                          version=0, values=vals, e0=w).tobytes()
for attempt in range(20):   # retransmit until the result arrives, as the host library does
    s.sendto(pkt, (agg, wire.UDP_PORT))
    try:
        data, src = s.recvfrom(65536)
    except socket.timeout:
        continue
    m = wire.Message.from_bytes(data)
    print(json.dumps({"values": m.values.tolist(), "e0": m.e0, "tsi": m.tsi,
                      "src": src[0], "sport": src[1]}))
    break
else:
    print("null")
"""


def xdp_agg(tb, *args, check=True):
    """Run the CLI in the aggregator's namespace (it enters it itself: bpffs stays visible)."""
    cmd = [sys.executable, "-m", "xdp_agg.app.cli", "--netns", tb.aggregator.netns, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({r.returncode}): {r.stderr}")
    return r


@pytest.fixture
def instance():
    """A unique aggregator name, detached and unpinned after the test whatever happens."""
    name = f"t{uuid.uuid4().hex[:8]}"
    yield name
    inst = pins.Instance(name)
    if inst.exists():
        state = inst.load_state() if inst.state_path.exists() else None
        if state and state.netns:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "xdp_agg.app.cli",
                    "--netns",
                    state.netns,
                    "--name",
                    name,
                    "detach",
                ],
                capture_output=True,
                timeout=60,
            )
        if inst.exists():
            inst.remove()


def _run_workers(tb, k, slot=1, cpu=None):
    """Every worker sends one contribution to `slot` (from CPU `cpu` when given) and waits."""
    pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
    procs = [
        tb.popen(
            w,
            [*pin, sys.executable, "-c", WORKER, w.agg_ip, str(w.index), str(k), str(slot)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for w in tb.workers
    ]
    return [json.loads(p.communicate(timeout=30)[0]) for p in procs]


def _expected(n, k):
    return (sum(np.arange(k) + 1000 * w for w in range(n))).tolist()


@pytest.mark.parametrize("topology", ["one-arm", "switch"])
def test_aggregates_over_veths(testbed_factory, instance, topology):
    n, k = 3, 64
    tb = testbed_factory(workers=n, topology=topology)
    xdp_agg(tb, "--name", instance, "attach", *tb.agg_interfaces)
    _create_job(tb, instance, n, k)
    _check_results(tb, _run_workers(tb, k), n, k)
    _check_stats(tb, instance, topology, n)


def _create_job(tb, instance, n, k):
    group = ["--group", tb.group_ip] if tb.group_ip else []
    xdp_agg(
        tb,
        "--name",
        instance,
        "job",
        "create",
        "0",
        "--workers",
        str(n),
        "--elems",
        str(k),
        "--slots",
        "0:8",
        *group,
    )
    for w in tb.workers:
        xdp_agg(tb, "--name", instance, "worker", "add", "0", str(w.index), w.ip, "--mac", w.mac)


def _check_results(tb, results, n, k):
    for w, r in zip(tb.workers, results):
        assert r is not None, f"worker {w.index} got no result"
        assert r["values"] == _expected(n, k)
        assert r["e0"] == n - 1 and r["tsi"] == 42 and r["sport"] == wire.UDP_PORT
        assert r["src"] == w.agg_ip


def _check_stats(tb, instance, topology, n):
    st = json.loads(xdp_agg(tb, "--name", instance, "stats", "--json").stdout)
    job = st["jobs"]["0"]
    assert job["reasons"]["completed"] == 1
    assert job["reasons"]["aggregated"] == n - 1
    if topology == "switch":
        assert job["reasons"]["egress_sent"] == n
    assert sum(c["contributions"] for c in job["workers"].values()) == n


@pytest.mark.parametrize("topology", ["one-arm", "switch"])
def test_cpumap_aggregates_on_the_slots_cpu(testbed_factory, instance, topology):
    """--slot-cpus cpumap: every worker sends from CPU 0 a contribution to a slot the table gives
    CPU 1 (the second half of the job's slots 0..7); the sum is right and was made on CPU 1
    alone: only CPU 1's partial of that slot carries a round (on veth the program on the
    interface runs on the sender's CPU, so without the redirect CPU 0's would)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    n, k, slot = 3, 64, 5
    tb = testbed_factory(workers=n, topology=topology)
    args = ("attach", *tb.agg_interfaces, "--slot-cpus", "cpumap", "--cpus", "0-1", "--json")
    att = json.loads(xdp_agg(tb, "--name", instance, *args).stdout)
    assert att["options"]["slot_cpus"] == "cpumap" and att["options"]["cpus"] == [0, 1]
    # veth has no receive hash to set: the report says so, and points at the cpumap
    assert all(r["driver"] == "veth" and r["hash"] is None for r in att["rss"]), att["rss"]
    _create_job(tb, instance, n, k)
    _check_results(tb, _run_workers(tb, k, slot=slot, cpu=0), n, k)
    _check_stats(tb, instance, topology, n)
    st = json.loads(xdp_agg(tb, "--name", instance, "slots", str(slot), "--json").stdout)
    assert st["cpu"] == 1
    tags = [int(t, 16) for t in st["versions"][0]["partial_tags"]]
    assert tags[1] != 0 and not any(tags[:1] + tags[2:]), tags


@pytest.mark.parametrize("slot_cpus", ["rss", "cpumap"])
def test_ping_and_tcp_pass_and_detach_leaves_nothing(testbed_factory, instance, slot_cpus):
    """ARP, ping and TCP through the attached interface, with the aggregator on it (rss) or the
    steering program in front of the cpumap (cpumap: not ours, so never redirected)."""
    tb = testbed_factory(workers=1, topology="one-arm")
    w = tb.workers[0]
    xdp_agg(tb, "--name", instance, "attach", "eth0", "--slot-cpus", slot_cpus)
    status = json.loads(xdp_agg(tb, "--name", instance, "status", "--json").stdout)
    assert status["interfaces"][0]["attached"] and status["topology"] == "one-arm"
    prog_id = status["prog_id"]
    fd = bpfsys.obj_get(str(pins.Instance(instance).map_path("jobs")))
    jobs_map_id = bpfsys.map_info(fd).id
    os.close(fd)

    ping = tb.run(w, ["ping", "-c", "3", "-i", "0.2", "-W", "1", w.agg_ip])
    assert ping.returncode == 0, ping.stdout + ping.stderr

    server = tb.popen(
        "agg",
        [
            sys.executable,
            "-c",
            "import socket,sys\n"
            "s=socket.create_server(('0.0.0.0',5001)); c,_=s.accept(); n=0\n"
            "while True:\n    b=c.recv(1<<16)\n    if not b: break\n    n+=len(b)\n"
            "print(n)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    client = tb.run(
        w,
        [
            sys.executable,
            "-c",
            "import socket,time\n"
            "for i in range(50):\n"
            "    try:\n        c=socket.create_connection((%r,5001),timeout=2); break\n"
            "    except OSError: time.sleep(0.1)\n"
            "c.sendall(b'x'*(4<<20)); c.close()" % w.agg_ip,
        ],
        timeout=60,
    )
    assert client.returncode == 0, client.stderr
    assert server.communicate(timeout=30)[0].strip() == str(4 << 20)

    stats = json.loads(xdp_agg(tb, "--name", instance, "stats", "--json").stdout)
    assert stats["unattributed"]["pass"] > 0  # ARP, ICMP and TCP went by, untouched

    rep = json.loads(xdp_agg(tb, "--name", instance, "detach", "--json").stdout)
    assert rep["detached"] == ["eth0"]
    link = tb.run("agg", ["ip", "-d", "link", "show", "dev", "eth0"]).stdout
    assert "xdp" not in link.split("\n")[0] and "prog/xdp" not in link
    assert not pins.Instance(instance).exists()
    assert (
        subprocess.run(
            ["bpftool", "prog", "show", "id", str(prog_id)], capture_output=True
        ).returncode
        != 0
    )
    # the kernel frees a cpumap's entries (and so the programs and maps they hold) from a work
    # item after an RCU grace period: look a bounded number of times
    for _ in range(50 if slot_cpus == "cpumap" else 1):
        shown = subprocess.run(
            ["bpftool", "map", "show", "id", str(jobs_map_id)], capture_output=True
        )
        if shown.returncode != 0:
            break
        time.sleep(0.1)
    assert shown.returncode != 0, "the aggregator's maps outlived detach"


def test_attach_refuses_an_interface_with_another_program(testbed_factory, instance):
    tb = testbed_factory(workers=1, topology="one-arm")
    xdp_agg(tb, "--name", instance, "attach", "eth0")
    other = xdp_agg(tb, "--name", instance + "b", "attach", "eth0", check=False)
    assert other.returncode == 1
    assert "already attached to eth0" in other.stderr
    again = xdp_agg(tb, "--name", instance, "attach", "eth0", check=False)
    assert again.returncode == 1 and "already attached" in again.stderr
    assert not pins.Instance(instance + "b").exists()
