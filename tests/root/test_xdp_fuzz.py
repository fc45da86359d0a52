"""A seeded fuzz of the data plane: 150,000 frames through BPF_PROG_TEST_RUN, each against the
serial model (the offline half of the hostile-traffic tests; test_xdp_junk_live.py is the live one).

The frames start from valid contributions of registered workers of two jobs (sizes 32 and 64,
their slots, both versions, few enough slots that rounds complete and retransmissions get
answered; the multi-buffer (frags) variant has a third job of 2048 int32 per packet, 8244-byte
frames that span buffers) and are then, at random, left alone or broken: header bytes of every
layer changed (IPv4 version/ihl/lengths/flags/fragment offset/protocol/TTL, UDP ports and
length, every byte of our header), cut anywhere, extended with a trailer, given IPv4 options, a
VLAN tag, made IPv6, sent from an unregistered address or to another port, or replaced by random
bytes. For every frame the XDP action and, for results, the output bytes must be the model's; at
the end every counter by reason must equal the model's count of that reason. Frames that are
not ours must leave untouched. Deterministic: the seed fixes every frame.
"""

import socket
import struct
from collections import Counter

import numpy as np
import pytest
from harness.packet_cases import (
    AGG_IP,
    AGG_MAC,
    WORKER_PORT,
    frame,
    job,
    worker_ip,
    worker_mac,
    workers,
)

from xdp_agg import bpfsys
from xdp_agg.proto import wire
from xdp_agg.proto.jobs import Delivery
from xdp_agg.proto.limits import MAX_JOBS, NO_JOB
from xdp_agg.proto.model import Action, ReferenceAggregator

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.slow]

FRAMES = 50_000  # per program variant: 150,000 in all
JOBS = [
    job(0, n=3, elems=32, base=0, count=6),
    job(1, n=2, elems=64, base=6, count=4, port=wire.UDP_PORT + 1),
]
JUMBO_JOB = job(2, n=2, elems=2048, base=10, count=4, port=wire.UDP_PORT + 2)  # frags only
HOSTS = {0: range(0, 3), 1: range(3, 5), 2: range(5, 7)}  # worker host numbers per job


def _setup(maps, model, jobs):
    for j in jobs:
        maps.create_job(j)
        model.create_job(j.job_id, j.num_workers, j.elems, j.slot_base, j.slot_count)
    for j in jobs:
        ws = workers(j.job_id, j.num_workers, first=HOSTS[j.job_id][0], port=j.agg_port)
        for w in ws:
            maps.add_worker(w)
            model.add_worker(w.job_id, w.index, w.ip, w.agg_port, w.mac)


def _ip_checksum(h: bytes) -> int:
    s = sum(int.from_bytes(h[i : i + 2], "big") for i in range(0, len(h), 2))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def _frame(host: int, port: int, udp_payload: bytes) -> bytes:
    """Ethernet/IPv4/UDP around a UDP payload, as packet_cases.frame builds it (without scapy:
    the fuzz builds 100,000 of them)."""
    ip = bytearray(
        struct.pack(
            ">BBHHHBBH4s4s",
            0x45,
            0,
            20 + 8 + len(udp_payload),
            1,
            0,
            64,
            17,
            0,
            socket.inet_aton(worker_ip(host)),
            socket.inet_aton(AGG_IP),
        )
    )
    ip[10:12] = _ip_checksum(bytes(ip)).to_bytes(2, "big")
    udp = struct.pack(">HHHH", WORKER_PORT, port, 8 + len(udp_payload), 0)
    eth = bytes.fromhex(AGG_MAC.replace(":", "")) + bytes.fromhex(worker_mac(host).replace(":", ""))
    return eth + b"\x08\x00" + bytes(ip) + udp + udp_payload


def _valid(rng, jobs=JOBS) -> bytes:
    j = jobs[rng.integers(len(jobs))]
    host = int(rng.choice(list(HOSTS[j.job_id])))
    slot = j.slot_base + int(rng.integers(-1, j.slot_count + 1))  # sometimes just outside
    vals = rng.integers(-(2**31), 2**31, size=(1, j.elems), dtype=np.int64)
    e = [int(x) for x in rng.integers(-128, 128, size=2)]
    payload = wire.build_payloads(
        job_number=0,
        size_code=wire.size_code_for(j.elems),
        tsi=int(rng.integers(2**32)),
        slot=max(slot, 0),
        version=int(rng.integers(2)),
        values=vals,
        e0=e[0],
        e1=e[1],
    )
    return _frame(host, j.agg_port, payload.tobytes())


# byte offsets of the fields worth changing: IPv4 (from 14), UDP (from 34), ours (from 42)
_HOT = [14, 16, 17, 20, 21, 22, 23, 36, 37, 38, 39, 42, 43, 48, 49]


def _broken(rng, f: bytes) -> bytes:
    b = bytearray(f)
    kind = int(rng.integers(10))
    if kind == 0:  # a few bytes anywhere in the headers, hot fields first
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.choice(_HOT)) if rng.random() < 0.7 else int(rng.integers(min(len(b), 60)))
            b[at] = int(rng.integers(256))
    elif kind == 1:  # cut anywhere (XDP needs an Ethernet header's worth)
        b = b[: int(rng.integers(14, len(b)))]
    elif kind == 2:  # a trailer
        b += bytes(rng.integers(256, size=int(rng.integers(1, 64)), dtype=np.uint8))
    elif kind == 3:  # IPv4 options: ihl grows, the total length may or may not follow
        words = int(rng.integers(1, 11))
        b[14] = 0x40 | (5 + words)
        b[34:34] = bytes(4 * words)
        if rng.random() < 0.5:
            tot = int.from_bytes(b[16:18], "big") + 4 * words
            b[16:18] = tot.to_bytes(2, "big")
    elif kind == 4:  # a VLAN tag
        b[12:12] = b"\x81\x00" + int(rng.integers(4096)).to_bytes(2, "big")
    elif kind == 5:  # IPv6 ethertype over the same bytes
        b[12:14] = b"\x86\xdd"
    elif kind == 6:  # fragments: MF or an offset
        b[20] = int(rng.choice([0x20, 0x00, 0x3F]))
        b[21] = int(rng.integers(256))
    elif kind == 7:  # another UDP destination port, ours or not
        b[36:38] = int(
            rng.choice([0xBEE0, 0xBEE5, 0xBEEF, 0xBEF0, 53, int(rng.integers(65536))])
        ).to_bytes(2, "big")
    elif kind == 8:  # an unregistered source
        b[26:30] = bytes([198, 18, 7, int(rng.integers(256))])
    else:  # random bytes after the Ethernet header
        b = b[:14] + bytes(rng.integers(256, size=int(rng.integers(0, 200)), dtype=np.uint8))
    return bytes(b)


def _frame_like_packet_cases(f: bytes) -> bytes:
    """packet_cases.frame (scapy) for the same worker, port and UDP payload as `f`."""
    m = wire.Message.from_bytes(f[wire.SWITCHML_OFFSET :])
    host = next(
        h for hs in HOSTS.values() for h in hs if worker_ip(h) == socket.inet_ntoa(f[26:30])
    )
    return frame(
        host,
        m.values,
        port=int.from_bytes(f[36:38], "big"),
        slot=m.slot,
        version=m.version,
        tsi=m.tsi,
        e0=m.e0,
        e1=m.e1,
    )


def _xdp_action(v) -> int:
    return {
        Action.PASS: bpfsys.XDP_PASS,
        Action.DROP: bpfsys.XDP_DROP,
        Action.TO_ALL: bpfsys.XDP_TX,
        Action.TO_SENDER: bpfsys.XDP_TX,
    }[v.action]


def _counters(maps) -> Counter:
    total = Counter()
    for row in list(range(MAX_JOBS)) + [NO_JOB]:
        for name, n in maps.counters(row).items():
            total[name] += n
    return total


def test_fuzzed_frames_match_the_model(agg):
    prog, maps = agg
    fd = prog.progs["xdp_agg_ingress"]
    jobs = JOBS + ([JUMBO_JOB] if prog.options["frags"] else [])
    assert all(j.delivery == Delivery.GROUP_TX for j in jobs)
    model = ReferenceAggregator()
    _setup(maps, model, jobs)
    rng = np.random.default_rng(2026)
    probe = _valid(np.random.default_rng(1))  # the fast builder makes packet_cases.frame's bytes
    assert probe == _frame_like_packet_cases(probe)
    before = _counters(maps)
    want = Counter()
    for i in range(FRAMES):
        f = _valid(rng, jobs)
        if rng.random() < 0.5:
            f = _broken(rng, f)
        v = model.process_frame(f)
        want[v.reason.name.lower()] += 1
        act, out, _ = bpfsys.prog_test_run(fd, f)
        where = f"frame {i}: {f[:64].hex()}"
        assert act == _xdp_action(v), f"{where}: XDP {bpfsys.XDP_ACTIONS[act]}, model {v}"
        if v.action is Action.PASS:
            assert out == f, f"{where}: a frame that is not ours was changed"
        elif v.payload is not None:
            assert out[wire.SWITCHML_OFFSET :] == v.payload, f"{where}: result bytes differ"
    got = _counters(maps) - before
    assert got == +want, f"counters {dict(got)} vs model {dict(want)}"
    assert want["completed"] > 100 and want["drop_bad_length"] > 100 and want["pass"] > 100
