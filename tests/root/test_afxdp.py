"""The AF_XDP data path of the C loop (hostlib/_xsk.c, hostlib/afxdp.py) between two namespaces.

A veth pair: the worker's end and a world-of-one aggregator (tests/afxdp_peer.py answers every
packet with its own bytes, which is the sum of one contribution). Checked here: the results are
the numpy engine's byte for byte, also under the engine's seeded loss and duplication; the frames
the peer receives are the kernel path's but for the IPv4 id (a counter either way) and the
checksums that depend on it or that the kernel leaves partial on a veth; the choice falls back to
the kernel socket, with the reason, where AF_XDP cannot run. tests/root/test_afxdp_netns.py runs
jobs through the XDP aggregator in the testbed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from hostlib.engine import EngineConfig, StreamEngine, _fastpath
from hostlib.options import HostOptions
from hostlib.udp_io import DatagramSocket
from netns_testbed import nsexec, xdp_pass

netns = pytest.mark.netns

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the helpers
WORKER_IP, PEER_IP = "198.19.250.1", "198.19.250.2"
LOCAL, AGG = f"{WORKER_IP}:40000", f"{PEER_IP}:48879"


@pytest.fixture
def pair():
    """Two namespaces joined by a veth (worker end "w0", peer end "p0"); removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    tag = uuid.uuid4().hex[:6]
    ns = (f"afx{tag}w", f"afx{tag}p")
    script = f"""
ip netns add {ns[0]}; ip netns add {ns[1]}
ip link add afx{tag}w type veth peer name afx{tag}p
ip link set afx{tag}w netns {ns[0]} name w0; ip link set afx{tag}p netns {ns[1]} name p0
ip -n {ns[0]} addr add {WORKER_IP}/24 dev w0; ip -n {ns[1]} addr add {PEER_IP}/24 dev p0
ip -n {ns[0]} link set w0 up; ip -n {ns[1]} link set p0 up
"""
    try:
        subprocess.run(["sh", "-ec", script], check=True, capture_output=True, timeout=30)
        yield ns
    finally:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=30)


class Peer:
    """tests/afxdp_peer.py in the peer namespace, stopped (by its stdin) on exit."""

    def __init__(self, netns: str, capture: bool = False, listen: str = AGG) -> None:
        argv = [sys.executable, os.path.join(HERE, "afxdp_peer.py"), "--listen", listen]
        argv += ["--capture", "p0"] if capture else []
        self.proc = nsexec.popen(
            netns, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert self.proc.stderr.readline().strip() == b"ready"

    def frames(self) -> list[bytes]:
        out, _ = self.proc.communicate(timeout=30)
        return [bytes.fromhex(f) for f in json.loads(out)["frames"]]

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.communicate(timeout=30)


def run_worker(netns: str, *args: str, prefix: tuple[str, ...] = ()) -> dict:
    """tests/afxdp_worker.py in `netns` with `args`; its JSON report."""
    argv = [*prefix, sys.executable, os.path.join(HERE, "afxdp_worker.py")]
    argv += ["--local", LOCAL, "--agg", AGG, *args]
    cp = nsexec.run(netns, argv, capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout.splitlines()[-1])


@pytest.mark.root
@netns
@pytest.mark.parametrize("lanes", [1, 3])
def test_results_are_the_numpy_engines_byte_for_byte_also_under_loss_and_duplication(pair, lanes):
    """Clean and with seeded loss/duplication both ways, the C loop over AF_XDP gives the bytes
    of the numpy loop over the kernel socket (as many lanes, on the same slots); the loss is
    recovered by resends. With lanes, each lane's socket shares the first one's UMEM on the
    veth's one queue, and every result reaches its lane's AF_XDP socket: none comes through the
    kernel sockets (the program would pass a lane's results there if its socket were not in
    the map)."""
    faults = "0.05,0.05,0.1,0.1,3"
    k = ("--lanes", str(lanes))
    with Peer(pair[1]):
        ref = run_worker(pair[0], "--native", "0", "--path", "udp", *k)
        clean = run_worker(pair[0], "--path", "afxdp", *k)
        lossy = run_worker(pair[0], "--path", "afxdp", "--faults", faults, *k)
    assert ref["data_path"] == "udp" and ref["int32_equal"]
    for rep in (clean, lossy):
        # veth: copy mode only; one path for every lane (else comma-separated)
        assert rep["data_path"] in ("afxdp-copy-drv", "afxdp-copy-skb"), rep
        assert rep["reason"] == ""
        assert (rep["int32"], rep["float32"]) == (ref["int32"], ref["float32"])
        assert rep["stats"]["recv_calls"] == 0, rep["stats"]
    st = lossy["stats"]
    assert st["fault_drops"] > 0 and st["retransmissions"] > 0 and st["duplicates"] > 0


@pytest.mark.root
@netns
@pytest.mark.parametrize("lanes", [1, 3])
def test_sparse_results_are_the_numpy_engines_byte_for_byte(pair, lanes):
    """Sparse all-reduces (a fifth of the blocks non-zero): the C loop over AF_XDP sends
    header-only frames (22 bytes of UDP payload) beside full ones and gets the numpy sparse
    loop's results over the kernel socket, clean and under loss and duplication."""
    faults = "0.05,0.05,0.1,0.1,3"
    k = ("--lanes", str(lanes), "--sparse", "0.2", "--count", "100000")
    with Peer(pair[1]):
        ref = run_worker(pair[0], "--native", "0", "--path", "udp", *k)
        clean = run_worker(pair[0], "--path", "afxdp", *k)
        lossy = run_worker(pair[0], "--path", "afxdp", "--faults", faults, *k)
    assert ref["data_path"] == "udp" and ref["int32_equal"]
    for rep in (ref, clean, lossy):
        # with lanes, each lane all-reduces its part, sparse too
        assert rep["stats"]["sparse_allreduces"] == 2 * lanes and rep["stats"]["empty_sent"] > 0
    for rep in (clean, lossy):
        assert rep["data_path"] in ("afxdp-copy-drv", "afxdp-copy-skb"), rep
        assert (rep["int32"], rep["float32"]) == (ref["int32"], ref["float32"])
        assert rep["stats"]["recv_calls"] == 0, rep["stats"]
        assert rep["stats"]["blocks_skipped"] == ref["stats"]["blocks_skipped"]
    st = lossy["stats"]
    assert st["fault_drops"] > 0 and st["retransmissions"] > 0 and st["duplicates"] > 0


@pytest.mark.root
@netns
@pytest.mark.parametrize("path", ["afxdp", "auto"])
@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize("first", ["companion", "main"])
def test_wire16_companion_shares_the_queue_over_afxdp_and_closes_in_either_order(
    pair, lanes, first, path
):
    """A 16-bit companion job's AF_XDP sockets join the main job's on the veth's one queue (one
    UMEM, each socket's port in the program's maps: hostlib/_xsk.c), lanes too: its bfloat16
    all-reduce and the main job's int32 ones before and after it are the numpy loop's bytes, every
    result through an AF_XDP socket. Either job closes first (the main job's first socket
    registered the UMEM) and the other's next all-reduce still runs over AF_XDP, exactly."""
    k = ("--lanes", str(lanes), "--count", "30000", "--wire16", first)
    with Peer(pair[1]):
        ref = run_worker(pair[0], "--native", "0", "--path", "udp", *k)
        got = run_worker(pair[0], "--path", path, *k)
    assert ref["data_path"] == ref["w16_data_path"] == "udp" and ref["int32_equal"]
    paths = ("afxdp-copy-drv", "afxdp-copy-skb")
    assert got["data_path"] in paths and got["reason"] == "", got
    assert got["w16_data_path"] == got["data_path"] and got["w16_reason"] == "", got
    assert got["last_data_path"] == got["data_path"]
    for name in ("int32", "float32", "bfloat16", "int32_after", "last"):
        assert got[name] == ref[name], name
    assert got["int32_after"] == got["int32"]  # the echo: the same int32 contribution
    # no result came through a kernel socket: the main job's, its companion's, the survivor's
    assert got["stats"]["recv_calls"] == got["w16_stats"]["recv_calls"] == 0, got
    assert got["last_stats"]["recv_calls"] == 0 and got["w16_stats"]["results"] > 0


@pytest.mark.root
@netns
def test_a_striped_job_runs_every_stripe_over_afxdp(pair):
    """A job striped over two aggregators (two peers' ports) with 2 lanes each: its 4 AF_XDP
    sockets share the veth's one queue (hostlib/_xsk.c), every stripe over AF_XDP, the numpy
    loop's bytes, no result through a kernel socket."""
    k = ("--lanes", "2", "--stripes", "2", "--count", "30000")
    second = f"{PEER_IP}:{int(AGG.rsplit(':', 1)[1]) + 1}"
    with Peer(pair[1]), Peer(pair[1], listen=second):
        ref = run_worker(pair[0], "--native", "0", "--path", "udp", *k)
        got = run_worker(pair[0], "--path", "afxdp", *k)
    assert ref["data_path"] == "udp" and ref["int32_equal"]
    # one path for every lane of every stripe (else comma-separated)
    assert got["data_path"] in ("afxdp-copy-drv", "afxdp-copy-skb") and got["reason"] == ""
    assert (got["int32"], got["float32"]) == (ref["int32"], ref["float32"])
    assert got["stats"]["recv_calls"] == 0, got["stats"]


def _masked(frame: bytes) -> bytes:
    """A frame without the IPv4 id and header checksum (bytes 18-19, 24-25) and the UDP
    checksum (40-41): the kernel numbers its datagrams by socket from a random start, and
    leaves veth a partial UDP checksum (CHECKSUM_PARTIAL); AF_XDP frames send none (0)."""
    return frame[:18] + frame[20:24] + frame[26:40] + frame[42:]


def _ipv4_checksum_ok(frame: bytes) -> bool:
    s = sum(int.from_bytes(frame[i : i + 2], "big") for i in range(14, 34, 2))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s == 0xFFFF


@pytest.mark.root
@netns
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_frames_on_the_wire_are_the_kernel_paths(pair, sparse):
    """The peer receives the same frames from both paths (the kernel's without GSO: a veth
    carries a GSO send as one super-frame, which a NIC would cut into these very datagrams);
    sparse ones too, whose IPv4 and UDP lengths differ from frame to frame."""
    small = ("--count", "20000") + (("--sparse", "0.3") if sparse else ())
    with Peer(pair[1], capture=True) as peer:
        run_worker(pair[0], "--path", "udp", "--gso", "0", *small)
        kernel = peer.frames()
    with Peer(pair[1], capture=True) as peer:
        run_worker(pair[0], "--path", "afxdp", *small)
        xdp = peer.frames()
    # resends are copies, and the window's timing orders a batch: compare the distinct frames
    distinct = [sorted({_masked(f) for f in got}) for got in (kernel, xdp)]
    if sparse:  # header-only frames and full ones
        assert {len(f) for f in xdp} == {42 + 22, 42 + 22 + 4 * 256}
    else:
        assert len(distinct[0]) == 79 + 79 + 64  # int32: 79 packets; float32: 79 + one window
    assert distinct[0] == distinct[1]
    assert all(_ipv4_checksum_ok(f) and f[40:42] == b"\0\0" for f in xdp)
    assert kernel[0][20:22] == xdp[0][20:22] == b"\x40\x00"  # DF, as the kernel sends UDP


@pytest.mark.root
@netns
def test_auto_falls_back_to_the_kernel_socket_with_the_reason(pair):
    """auto: without CAP_NET_RAW (no AF_XDP socket) and on an interface that has an XDP
    program already, the kernel socket carries the job and data_path_reason says why; "afxdp"
    refuses to start instead."""
    drop = ("setpriv", "--bounding-set", "-net_raw,-net_admin,-bpf,-sys_admin", "--")
    with Peer(pair[1]):
        ref = run_worker(pair[0], "--path", "udp", "--count", "5000")
        unpriv = run_worker(pair[0], "--path", "auto", "--count", "5000", prefix=drop)
        xdp_pass.attach_pass({pair[0]: ["w0"]})  # as the testbed does on ends facing XDP
        busy = run_worker(pair[0], "--path", "auto", "--count", "5000")
        argv = [sys.executable, os.path.join(HERE, "afxdp_worker.py"), "--local", LOCAL]
        cp = nsexec.run(
            pair[0],
            [*argv, "--agg", AGG, "--path", "afxdp"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert unpriv["data_path"] == "udp" and "socket(AF_XDP)" in unpriv["reason"], unpriv
    assert busy["data_path"] == "udp" and "XDP program already" in busy["reason"], busy
    for rep in (unpriv, busy):
        assert rep["int32"] == ref["int32"] and rep["float32"] == ref["float32"]
    assert cp.returncode != 0 and "data_path='afxdp' cannot run" in cp.stderr


@pytest.mark.skipif(
    _fastpath is None, reason="hostlib._fastpath is not built (python setup.py build_ext --inplace)"
)
def test_the_loopback_has_no_afxdp_and_the_choice_is_checked(monkeypatch):
    """No root needed: an aggregator on the loopback gives the kernel socket and the reason;
    the environment picks the path when the caller does not; nonsense is refused."""
    sock = DatagramSocket(("127.0.0.1", 0))
    try:
        cfg = EngineConfig(1, 1, 32, 0, 4, ("127.0.0.1", 9), native=True, data_path="auto")
        eng = StreamEngine(sock, cfg)
        assert eng.data_path == "udp" and "loopback" in eng.data_path_reason
        numpy_eng = StreamEngine(sock, EngineConfig(1, 1, 32, 0, 4, ("127.0.0.1", 9), native=False))
        assert (numpy_eng.data_path, numpy_eng.data_path_reason) == ("udp", "")
    finally:
        sock.close()
    monkeypatch.setenv("XDP_AGG_DATA_PATH", "auto")
    assert HostOptions.from_env().data_path == "auto"
    assert HostOptions.from_env(data_path="udp").data_path == "udp"
    monkeypatch.delenv("XDP_AGG_DATA_PATH")
    assert HostOptions.from_env().data_path == "udp"
    with pytest.raises(ValueError, match="data_path must be one of"):
        HostOptions(data_path="dpdk")
