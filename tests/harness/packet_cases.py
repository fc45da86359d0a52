"""The table of packet cases every aggregator target must pass (XDP now, bmv2 too).

Each case configures jobs and workers, then feeds frames one by one; each step states the
expected action, the counter reason and, for results, the exact int32 values and exponent,
computed here with numpy (not by the code under test). The runners check the output frame's
addressing and bytes too, and that the serial reference model agrees with every expectation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
from scapy.layers.inet import ICMP, IP, TCP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import ARP, Ether

from harness import p4app_host
from xdp_agg.proto import wire
from xdp_agg.proto.jobs import Delivery, JobSpec, WorkerSpec
from xdp_agg.proto.limits import MAX_WORKERS
from xdp_agg.proto.model import Action, ReferenceAggregator, Verdict
from xdp_agg.proto.reasons import Reason
from xdp_agg.proto.scapy_layer import Exponents, Sparse, SwitchML, sml_frame

AGG_IP = "198.18.0.1"
AGG_MAC = "02:00:00:00:00:01"
GROUP_IP = "198.18.0.255"
GROUP_MAC = "ff:ff:ff:ff:ff:ff"
WORKER_PORT = 0xBEE0
# Two levels: the parent aggregator of the tree cases, and the ports between the levels.
PARENT_IP = "198.18.1.1"
PARENT_MAC = "02:00:00:00:01:01"
PARENT_PORT = 0xBEE4  # the parent job's aggregator port
UPLINK_PORT = 0xBEE7  # the rack job's port toward the parent
RACK_WORKER_PORT = 40000  # the rack's workers' port: parent results go down to it
PARENT_SLOT_BASE = 100  # the parent job's slots: our slot_base + i is its 100 + i


def worker_ip(i: int) -> str:
    return f"198.18.{i // 200}.{10 + i % 200}"


def worker_mac(i: int) -> str:
    return f"02:00:00:00:{i >> 8:02x}:{i & 0xFF:02x}"


def job(
    job_id=0,
    n=2,
    elems=32,
    base=0,
    count=16,
    port=wire.UDP_PORT,
    delivery=Delivery.GROUP_TX,
    udp_checksum=False,
    tree=False,
    parent_base=PARENT_SLOT_BASE,
    sparse=False,
    wire_bits=32,
) -> JobSpec:
    parent = {}
    if tree:
        parent = dict(
            parent_ip=PARENT_IP,
            parent_mac=PARENT_MAC,
            parent_port=PARENT_PORT,
            parent_slot_base=parent_base,
            uplink_port=UPLINK_PORT,
            worker_port=RACK_WORKER_PORT,
        )
    return JobSpec(
        job_id=job_id,
        num_workers=n,
        elems=elems,
        slot_base=base,
        slot_count=count,
        agg_port=port,
        delivery=delivery,
        agg_ip=AGG_IP,
        agg_mac=AGG_MAC,
        group_ip=GROUP_IP,
        group_mac=GROUP_MAC,
        udp_checksum=udp_checksum,
        sparse=sparse,
        wire_bits=wire_bits,
        **parent,
    )


def workers(job_id: int, n: int, first: int = 0, port=wire.UDP_PORT) -> list[WorkerSpec]:
    return [
        WorkerSpec(job_id, i, worker_ip(first + i), WORKER_PORT, port, worker_mac(first + i))
        for i in range(n)
    ]


def frame(w: int, values, *, port=wire.UDP_PORT, src_mac=None, sport=WORKER_PORT, **kw) -> bytes:
    """A contribution of worker host `w` (its address and, unless given, its MAC) to
    aggregator port `port`, from UDP port `sport`."""
    return bytes(
        sml_frame(
            src_ip=worker_ip(w),
            src_mac=src_mac or worker_mac(w),
            dst_ip=AGG_IP,
            dst_mac=AGG_MAC,
            sport=sport,
            dport=port,
            values=values,
            **kw,
        )
    )


def parent_frame(values, *, slot: int, version: int = 0, src_ip=PARENT_IP, **kw) -> bytes:
    """The parent aggregator's result for its slot `slot`, as it sends it to the group of its
    workers (the racks): from its job's port to the rack's uplink port."""
    return bytes(
        sml_frame(
            src_ip=src_ip,
            src_mac=PARENT_MAC,
            dst_ip="198.18.1.255",
            dst_mac="ff:ff:ff:ff:ff:ff",
            sport=PARENT_PORT,
            dport=UPLINK_PORT,
            values=values,
            slot=slot,
            version=version,
            **kw,
        )
    )


def relength(
    f: bytes,
    *,
    ip_len: int | None = None,
    udp_len: int | None = None,
    cut: int = 0,
    trailer: bytes = b"",
) -> bytes:
    """A frame whose IPv4 total length and/or UDP length say something else than it holds:
    `cut` bytes removed from its end, `trailer` appended after it (as an Ethernet trailer), the
    IPv4 checksum right for the new header (so that only the lengths lie)."""
    pkt = Ether(f)
    if ip_len is not None:
        pkt[IP].len = ip_len
    if udp_len is not None:
        pkt[UDP].len = udp_len
    del pkt[IP].chksum
    b = bytes(pkt)
    return (b[: len(b) - cut] if cut else b) + trailer


def with_request_fields(f: bytes, *, ttl: int, ip_id: int, tos: int = 0, df: bool = False) -> bytes:
    """A valid contribution whose TTL, IP id, ToS and DF flag are not what results carry (the
    aggregator must not echo them)."""
    pkt = Ether(f)
    pkt[IP].ttl, pkt[IP].id, pkt[IP].tos = ttl, ip_id, tos
    if df:
        pkt[IP].flags = "DF"
    del pkt[IP].chksum
    return bytes(pkt)


def with_width_bit(f: bytes, wire16: int) -> bytes:
    """The frame with the SwitchML header's width bit set to `wire16` (nothing else changed:
    the UDP checksum is 0 in the table's frames, so none goes stale)."""
    b = bytearray(f)
    b[wire.SWITCHML_OFFSET] &= ~wire.TYPE_SIZE_WIRE16_MASK & 0xFF
    b[wire.SWITCHML_OFFSET] |= wire.TYPE_SIZE_WIRE16_MASK if wire16 else 0
    return bytes(b)


@dataclass
class Step:
    """One frame in, and what must come out."""

    what: str
    frame: bytes
    action: Action
    reason: Reason
    values: np.ndarray | None = None  # exact result payload for TO_ALL / TO_SENDER
    e0: int | None = None
    e1: int = 0  # the result's e1 (max over the round's contributions)
    sender: int | None = None  # worker host a TO_SENDER answer goes back to
    pool_index: int | None = None  # the output's pool index when not the request's (two levels)
    # reads the output frame as another implementation would (the p4app-switchML host cases)
    raw_check: Callable[[bytes], None] | None = None
    # a sparse result's header (block, next, blocks); its values None: an empty result
    sparse: wire.Sparse | None = None


@dataclass
class Case:
    name: str
    jobs: list[JobSpec]
    workers: list[WorkerSpec]
    steps: list[Step] = field(default_factory=list)

    @property
    def sparse(self) -> bool:
        """A case with a sparse job (docs/protocol.md section 8)."""
        return any(j.sparse for j in self.jobs)

    @property
    def wire16(self) -> bool:
        """A case with a job of 16-bit elements (docs/protocol.md section 5.6)."""
        return any(j.wire_bits == 16 for j in self.jobs)


def dropped(what: str, f: bytes, reason: Reason) -> Step:
    """The step whose frame is dropped, counted as `reason`."""
    return Step(what, f, Action.DROP, reason)


def completes(what: str, f: bytes, total, e0: int | None = 0, **kw) -> Step:
    """The step whose frame completes its slot: `total` (and exponent e0) to every worker."""
    return Step(what, f, Action.TO_ALL, Reason.COMPLETED, total, e0, **kw)


def answered(what: str, f: bytes, total, e0: int | None = 0, **kw) -> Step:
    """The step whose frame, a retransmission for a completed slot, is answered with the stored
    `total` (and exponent e0) to its sender alone (`sender=` says which host)."""
    return Step(what, f, Action.TO_SENDER, Reason.RETX_ANSWERED, total, e0, **kw)


def ip_checksum_ok(pkt) -> bool:
    """True when the IPv4 header checksum of a scapy packet is right."""
    ip = pkt[IP].copy()
    want = ip.chksum
    del ip.chksum
    return IP(bytes(ip))[IP].chksum == want


def result_udp_len(step: Step, k: int) -> int:
    """The UDP length of the result a step expects (k elements per packet)."""
    if step.sparse is not None:
        return wire.UDP_HLEN + wire.sparse_payload_len(k, step.values is None)
    return wire.UDP_HLEN + wire.udp_payload_len(k)


def check_sparse_payload(step: Step, request: bytes, out: bytes) -> None:
    """A sparse result (docs/protocol.md section 8): the request's job number, tsi, pool index
    and size; the kind, sparse header, exponents and values the step expects; nothing after."""
    req, sml = SwitchML(request[wire.SWITCHML_OFFSET :]), SwitchML(out[wire.SWITCHML_OFFSET :])
    for f in ("tsi", "job_number", "pool_index", "size"):
        assert getattr(sml, f) == getattr(req, f), f"{step.what}: {f} not echoed"
    empty = step.values is None
    kind = wire.MSG_TYPE_SPARSE_EMPTY if empty else wire.MSG_TYPE_SPARSE
    assert (sml.msg_type, sml.wire16) == (kind, req.wire16), f"{step.what}: msg_type, width"
    assert (sml[Exponents].e0, sml[Exponents].e1) == (step.e0, step.e1), f"{step.what}: exponents"
    sp = sml[Sparse]
    got = wire.Sparse(sp.block, sp.next, sp.blocks)
    assert got == step.sparse, f"{step.what}: sparse header {got}"
    k = 0 if empty else wire.elems_for(req.size)
    assert len(out) - wire.SWITCHML_OFFSET == wire.SPARSE_VALUES_AT + 4 * k, step.what
    if not empty:
        np.testing.assert_array_equal(sp.values, step.values, err_msg=step.what)


def check_payload(step: Step, request: bytes, out: bytes) -> None:
    """The SwitchML part of a result frame `out` answering the frame `request`: header fields
    echoed (the pool index as the step says when it says one), the width bit the request's (its
    job's: 0 at 32 bits, as p4app-switchML's results), exponents and int32 words as the step
    expects, and what p4app-switchML's host reads there (raw_check).
    Every target's runner and the model's check use this."""
    if step.sparse is not None:
        return check_sparse_payload(step, request, out)
    req, sml = SwitchML(request[wire.SWITCHML_OFFSET :]), SwitchML(out[wire.SWITCHML_OFFSET :])
    for f in ("tsi", "job_number", "pool_index", "size", "msg_type", "wire16"):
        if f == "pool_index" and step.pool_index is not None:
            assert sml.pool_index == step.pool_index, f"{step.what}: pool index"
            continue
        assert getattr(sml, f) == getattr(req, f), f"{step.what}: {f} not echoed"
    assert (sml[Exponents].e0, sml[Exponents].e1) == (step.e0, step.e1), f"{step.what}: exponents"
    k = wire.elems_for(req.size)
    got = np.frombuffer(out[wire.PAYLOAD_OFFSET : wire.PAYLOAD_OFFSET + 4 * k], ">i4")
    np.testing.assert_array_equal(got, step.values, err_msg=step.what)
    np.testing.assert_array_equal(sml[Exponents].values, step.values, err_msg=step.what)
    if step.raw_check is not None:
        step.raw_check(out)


def check_result(step: Step, req, out) -> None:
    """A result frame (scapy `out`, answering `req`): its SwitchML part as check_payload says,
    UDP checksum 0, IPv4 checksum right, the IPv4 fields and lengths of a result."""
    check_payload(step, bytes(req), bytes(out))
    k = wire.elems_for(req[SwitchML].size)
    assert out[UDP].chksum == 0, step.what
    assert ip_checksum_ok(out), f"{step.what}: bad IPv4 checksum"
    # every result leaves as p4app-switchML's sender writes it, whatever the request carried
    assert (out[IP].ttl, out[IP].id, out[IP].tos, int(out[IP].flags)) == (
        wire.RESULT_TTL,
        wire.RESULT_IP_ID,
        wire.RESULT_TOS,
        wire.RESULT_IP_FLAGS,
    ), f"{step.what}: IPv4 fields of a result"
    assert out[UDP].len == result_udp_len(step, k), f"{step.what}: UDP length"
    assert out[IP].len == wire.IPV4_HLEN + out[UDP].len, f"{step.what}: IPv4 length"


def model_for(case: Case) -> ReferenceAggregator:
    """The serial reference model (xdp_agg.proto.model) with the case's jobs and workers."""
    model = ReferenceAggregator()
    for j in case.jobs:
        model.create_job_spec(j)
    for w in case.workers:
        model.add_worker(w.job_id, w.index, w.ip, w.agg_port, w.mac)
    return model


def check_model(model: ReferenceAggregator, step: Step, outs: Iterable[bytes] = ()) -> Verdict:
    """The model's verdict on the step's frame: the step's action and reason, and for a result
    the same UDP payload bytes as every frame a target put out (`outs`, whole frames)."""
    v = model.process_frame(step.frame)
    assert (v.action, v.reason) == (step.action, step.reason), f"model disagrees on {step.what}"
    for out in outs:
        if v.payload is not None:
            assert v.payload == out[wire.SWITCHML_OFFSET :], f"model's bytes differ on {step.what}"
    return v


def check_to_parent(step: Step, out) -> None:
    """A rack job's partial sum (scapy `out`) leaves as every target's rack sends it up: from
    our MAC and address and the uplink port, to the parent's job (docs/protocol.md 3.7)."""
    assert (out.dst, out.src, out[IP].src, out[IP].dst) == (
        PARENT_MAC,
        AGG_MAC,
        AGG_IP,
        PARENT_IP,
    ), step.what
    assert (out[UDP].sport, out[UDP].dport) == (UPLINK_PORT, PARENT_PORT), step.what


def _vals(rng, k, lo=-1000, hi=1000):
    return rng.integers(lo, hi, size=k, dtype=np.int64)


def _wrap(x) -> np.ndarray:
    return ((np.asarray(x, dtype=np.int64) + 2**31) % 2**32 - 2**31).astype(np.int32)


def complete_round(
    rng,
    n,
    k,
    *,
    slot=0,
    version=0,
    hosts=None,
    port=wire.UDP_PORT,
    tag="",
    exps=None,
    sport=WORKER_PORT,
):
    """Steps for one full round of a slot: n-1 partials dropped, the n-th returns the sum;
    every request from UDP port `sport`."""
    hosts = hosts if hosts is not None else list(range(n))
    vals = [_vals(rng, k) for _ in range(n)]
    exps = exps if exps is not None else [int(e) for e in rng.integers(-20, 20, size=n)]
    steps = []
    for i, h in enumerate(hosts):
        f = frame(
            h, vals[i], port=port, slot=slot, version=version, e0=exps[i], tsi=1000 + i, sport=sport
        )
        if i < n - 1:
            steps.append(dropped(f"{tag}w{i} partial", f, Reason.AGGREGATED))
        else:
            steps.append(completes(f"{tag}w{i} completes", f, _wrap(sum(vals)), max(exps)))
    return steps, vals, exps


# --- the table: one function per case, registered in order ------------------------------------
# Each takes the table's one random generator (seeded once and used in registration order, so
# every value is the same run to run) and returns its case(s); build_cases() calls them all.
CASE_FUNCTIONS: list[Callable[[np.random.Generator], list[Case]]] = []


def case(fn: Callable[[np.random.Generator], list[Case]]):
    """Register a case function of the table (in the order the functions are defined)."""
    CASE_FUNCTIONS.append(fn)
    return fn


@case
def complete_n3_k(rng) -> list[Case]:
    cases = []
    for k in (32, 64, 256, 768):
        c = Case(f"complete_n3_k{k}", [job(n=3, elems=k)], workers(0, 3))
        c.steps, _, _ = complete_round(rng, 3, k, slot=2)
        cases.append(c)
    return cases


@case
def duplicate_not_counted_twice(rng) -> list[Case]:
    c = Case("duplicate_not_counted_twice", [job(n=2)], workers(0, 2))
    a, b = _vals(rng, 32), _vals(rng, 32)
    c.steps = [
        dropped("w0", frame(0, a, slot=1, e0=4), Reason.AGGREGATED),
        dropped("w0 again", frame(0, a, slot=1, e0=4), Reason.DUP_PENDING),
        completes("w1 completes", frame(1, b, slot=1, e0=-3), _wrap(a + b), 4),
    ]
    return [c]


@case
def retransmission_after_completion(rng) -> list[Case]:
    c = Case("retransmission_after_completion", [job(n=2)], workers(0, 2))
    a, b = _vals(rng, 32), _vals(rng, 32)
    c.steps = [
        dropped("w0", frame(0, a, slot=3, tsi=7, e0=1), Reason.AGGREGATED),
        completes("w1 completes", frame(1, b, slot=3, tsi=7, e0=2), _wrap(a + b), 2),
        answered("w0 retransmits", frame(0, a, slot=3, tsi=7, e0=1), _wrap(a + b), 2, sender=0),
        answered("w1 retransmits", frame(1, b, slot=3, tsi=7, e0=2), _wrap(a + b), 2, sender=1),
    ]
    return [c]


@case
def versions_alternate_and_slots_are_reused(rng) -> list[Case]:
    c = Case("versions_alternate_and_slots_are_reused", [job(n=2, count=4)], workers(0, 2))
    for r in range(5):  # v0, v1, v0, v1, v0 on slot 1: each first contribution overwrites
        steps, _, _ = complete_round(rng, 2, 32, slot=1, version=r % 2, tag=f"round {r} ")
        c.steps += steps
    return [c]


@case
def one_worker(rng) -> list[Case]:
    c = Case("one_worker", [job(n=1)], workers(0, 1))
    for r in range(3):
        a = _vals(rng, 32)
        c.steps.append(
            completes(f"round {r}", frame(0, a, slot=0, version=r % 2, e0=r), _wrap(a), r)
        )
    return [c]


@case
def int32_wraps_around(rng) -> list[Case]:
    c = Case("int32_wraps_around", [job(n=3)], workers(0, 3))
    big = np.full(32, 2**31 - 1, dtype=np.int64)
    big[::2] = -(2**31)
    c.steps = [
        dropped("w0", frame(0, big, slot=0), Reason.AGGREGATED),
        dropped("w1", frame(1, big, slot=0), Reason.AGGREGATED),
        completes("w2", frame(2, big, slot=0), _wrap(3 * big), 0),
    ]
    return [c]


@case
def many_workers_40(rng) -> list[Case]:
    c = Case("many_workers_40", [job(n=40, elems=64)], workers(0, 40))
    c.steps, _, _ = complete_round(rng, 40, 64, slot=5)
    return [c]


@case
def two_jobs_isolated(rng) -> list[Case]:
    c = Case(
        "two_jobs_isolated",
        [job(0, n=2, base=0, count=8), job(1, n=2, base=8, count=8, port=wire.UDP_PORT + 1)],
        workers(0, 2) + workers(1, 2, first=2, port=wire.UDP_PORT + 1),
    )
    a0, b0, a1, b1 = (_vals(rng, 32) for _ in range(4))
    c.steps = [
        dropped("job0 w0", frame(0, a0, slot=3), Reason.AGGREGATED),
        dropped("job1 w0", frame(2, a1, slot=11, port=wire.UDP_PORT + 1), Reason.AGGREGATED),
        completes(
            "job1 w1 completes", frame(3, b1, slot=11, port=wire.UDP_PORT + 1), _wrap(a1 + b1), 0
        ),
        completes("job0 w1 completes", frame(1, b0, slot=3), _wrap(a0 + b0), 0),
        dropped("job0 worker to job1's slot", frame(0, a0, slot=11), Reason.DROP_SLOT_RANGE),
        dropped(
            "job0 worker to job1's port",
            frame(0, a0, slot=3, port=wire.UDP_PORT + 1),
            Reason.DROP_UNKNOWN_SOURCE,
        ),
    ]
    return [c]


@case
def bad_packets_dropped_and_counted(rng) -> list[Case]:
    c = Case("bad_packets_dropped_and_counted", [job(n=2, base=4, count=4)], workers(0, 2))
    a = _vals(rng, 32)
    full = frame(0, a, slot=5)
    c.steps = [
        dropped("payload truncated", full[:-4], Reason.DROP_TRUNCATED),
        dropped("headers truncated", full[: wire.SWITCHML_OFFSET + 6], Reason.DROP_TRUNCATED),
        dropped("wrong size code", frame(0, _vals(rng, 64), slot=5), Reason.DROP_BAD_SIZE),
        dropped("unregistered source", frame(7, a, slot=5), Reason.DROP_UNKNOWN_SOURCE),
        dropped("slot below range", frame(0, a, slot=3), Reason.DROP_SLOT_RANGE),
        dropped("slot above range", frame(0, a, slot=8), Reason.DROP_SLOT_RANGE),
        dropped("reserved pool bit", frame(0, a, pool_index=0x4005), Reason.DROP_SLOT_RANGE),
        dropped("other message type", frame(0, a, slot=5, msg_type=2), Reason.DROP_BAD_TYPE),
        dropped("valid after all that", frame(0, a, slot=5), Reason.AGGREGATED),
    ]
    return [c]


@case
def lengths_must_agree(rng) -> list[Case]:
    # Lengths that lie, each from a registered worker with its full payload present: dropped
    # and counted before any state changes. The valid contributions after them show that no
    # worker bit, accumulator or exponent moved: w0 still aggregates, w1 completes the exact sum.
    c = Case("lengths_must_agree", [job(n=2, base=0, count=4)], workers(0, 2))
    a, b = _vals(rng, 32), _vals(rng, 32)
    good = frame(0, a, slot=1, e0=3)
    plen = wire.udp_payload_len(32)
    ulen, ilen = wire.UDP_HLEN + plen, wire.IPV4_HLEN + wire.UDP_HLEN + plen
    junk = frame(0, _vals(rng, 32, 10**6, 10**7), slot=1, e0=40)  # would show in the sum
    ours_short = relength(
        junk, ip_len=wire.IPV4_HLEN + 18, udp_len=18, cut=ilen - wire.IPV4_HLEN - 18
    )
    c.steps = [
        dropped("UDP length short", relength(junk, udp_len=18), Reason.DROP_BAD_LENGTH),
        dropped("UDP length long", relength(junk, udp_len=ulen + 4), Reason.DROP_BAD_LENGTH),
        dropped("IPv4 length short", relength(junk, ip_len=ilen - 4), Reason.DROP_BAD_LENGTH),
        dropped("IPv4 length long", relength(junk, ip_len=ilen + 4), Reason.DROP_BAD_LENGTH),
        dropped(
            "both lengths long",
            relength(junk, ip_len=ilen + 4, udp_len=ulen + 4),
            Reason.DROP_BAD_LENGTH,
        ),
        dropped(
            "UDP 18, IPv4 38, payload as an Ethernet trailer",
            relength(junk, ip_len=wire.IPV4_HLEN + 18, udp_len=18),
            Reason.DROP_BAD_LENGTH,
        ),
        dropped(
            "right lengths, bytes after them",
            relength(junk, trailer=b"\0" * 4),
            Reason.DROP_BAD_LENGTH,
        ),
        dropped(
            "lengths agree with a frame too short for the size code",
            ours_short,
            Reason.DROP_TRUNCATED,
        ),
        dropped("w0 still aggregates", good, Reason.AGGREGATED),
        dropped(
            "w1 lies at completion",
            relength(frame(1, b, slot=1), udp_len=18),
            Reason.DROP_BAD_LENGTH,
        ),
        completes("w1 completes with the exact sum", frame(1, b, slot=1, e0=-1), _wrap(a + b), 3),
        dropped(
            "w0 retransmission with a lying length",
            relength(good, ip_len=ilen + 4),
            Reason.DROP_BAD_LENGTH,
        ),
        answered("w0 retransmits", good, _wrap(a + b), 3, sender=0),
    ]
    return [c]


@case
def lying_frame_for_the_other_version(rng) -> list[Case]:
    ilen = wire.IPV4_HLEN + wire.UDP_HLEN + wire.udp_payload_len(32)
    # The defect's worst form: a lying frame for (slot, version 0) from a worker that waits on
    # version 1 must neither clear its bit of version 1 nor complete anything.
    c = Case("lying_frame_for_the_other_version", [job(n=2, base=0, count=4)], workers(0, 2))
    steps, _, _ = complete_round(rng, 2, 32, slot=2, version=0, tag="v0 ")
    a, b = _vals(rng, 32), _vals(rng, 32)
    c.steps = steps + [
        dropped("w0 on v1", frame(0, a, slot=2, version=1), Reason.AGGREGATED),
        dropped(
            "w0 lies on v0",
            relength(frame(0, b, slot=2, version=0), udp_len=18),
            Reason.DROP_BAD_LENGTH,
        ),
        dropped(
            "w0 lies on v1",
            relength(frame(0, b, slot=2, version=1), ip_len=ilen - 8),
            Reason.DROP_BAD_LENGTH,
        ),
        completes("w1 completes v1 exactly", frame(1, b, slot=2, version=1), _wrap(a + b), 0),
    ]
    return [c]


@case
def result_fields_are_the_aggregators(rng) -> list[Case]:
    # Results carry ToS 0, IP id 0, no DF and TTL 64 whatever the requests carried, as
    # p4app-switchML's sender writes them (check_result asserts it on every result
    # of the table; here the requests differ: a DSCP and ECN, DF as Linux's UDP sets it).
    c = Case("result_fields_are_the_aggregators", [job(n=2)], workers(0, 2))
    a, b = _vals(rng, 32), _vals(rng, 32)
    odd = [
        with_request_fields(frame(h, v, slot=0), ttl=1, ip_id=0x1234, tos=0xB9, df=True)
        for h, v in ((0, a), (1, b))
    ]
    c.steps = [
        dropped("w0 with TTL 1, id 0x1234, DSCP, DF", odd[0], Reason.AGGREGATED),
        completes("w1 likewise completes", odd[1], _wrap(a + b), 0),
        answered("w0 retransmits likewise", odd[0], _wrap(a + b), 0, sender=0),
    ]
    return [c]


@case
def udp_checksum_verified_k(rng) -> list[Case]:
    cases = []
    # A job that verifies UDP checksums: a wrong one is dropped before any state changes; a zero
    # checksum (none sent, legal for IPv4) is taken. Jobs without the option ignore checksums.
    for k in (32, 256):
        c = Case(
            f"udp_checksum_verified_k{k}", [job(n=3, elems=k, udp_checksum=True)], workers(0, 3)
        )
        a, b, d = (_vals(rng, k, -(2**31), 2**31 - 1) for _ in range(3))
        sums = [frame(h, v, slot=2, udp_checksum=True) for h, v in ((0, a), (1, b), (2, d))]
        bad = bytearray(sums[1])
        bad[wire.PAYLOAD_OFFSET + 5] ^= 0x40  # one bit flipped in the payload
        c.steps = [
            dropped("w0, right checksum", sums[0], Reason.AGGREGATED),
            dropped("w1, one payload bit flipped", bytes(bad), Reason.DROP_BAD_CHECKSUM),
            dropped("w1, right checksum", sums[1], Reason.AGGREGATED),
            completes("w2, no checksum (0)", frame(2, d, slot=2), _wrap(a + b + d), 0),
            answered("w1 retransmits, right checksum", sums[1], _wrap(a + b + d), 0, sender=1),
        ]
        cases.append(c)
    return cases


@case
def udp_checksum_ignored_by_default(rng) -> list[Case]:
    c = Case("udp_checksum_ignored_by_default", [job(n=1)], workers(0, 1))
    a = _vals(rng, 32)
    bad = bytearray(frame(0, a, slot=0, udp_checksum=True))
    bad[wire.PAYLOAD_OFFSET] ^= 1
    a[0] = np.frombuffer(bytes(bad[wire.PAYLOAD_OFFSET : wire.PAYLOAD_OFFSET + 4]), ">i4")[0]
    c.steps = [completes("wrong checksum, job without the option", bytes(bad), _wrap(a), 0)]
    return [c]


@case
def not_ours_passes_untouched(rng) -> list[Case]:
    c = Case("not_ours_passes_untouched", [job(n=2)], workers(0, 2))
    eth = Ether(src=worker_mac(0), dst=AGG_MAC)
    c.steps = [
        Step(
            "ARP",
            bytes(
                Ether(src=worker_mac(0), dst="ff:ff:ff:ff:ff:ff")
                / ARP(psrc=worker_ip(0), pdst=AGG_IP)
            ),
            Action.PASS,
            Reason.PASS,
        ),
        Step(
            "ICMP echo",
            bytes(eth / IP(src=worker_ip(0), dst=AGG_IP) / ICMP() / (b"x" * 32)),
            Action.PASS,
            Reason.PASS,
        ),
        Step(
            "other UDP",
            bytes(eth / IP(src=worker_ip(0), dst=AGG_IP) / UDP(sport=5000, dport=53) / (b"q" * 40)),
            Action.PASS,
            Reason.PASS,
        ),
        Step(
            "UDP from our port to another",
            bytes(
                eth
                / IP(src=worker_ip(0), dst=AGG_IP)
                / UDP(sport=wire.UDP_PORT, dport=0xBEF0)
                / (b"q" * 40)
            ),
            Action.PASS,
            Reason.PASS,
        ),
        Step(
            "TCP to our port",
            bytes(
                eth
                / IP(src=worker_ip(0), dst=AGG_IP)
                / TCP(sport=40000, dport=wire.UDP_PORT)
                / (b"t" * 40)
            ),
            Action.PASS,
            Reason.PASS,
        ),
        Step(
            "IPv6 UDP to our port",
            bytes(
                eth
                / IPv6(src="2001:db8::10", dst="2001:db8::1")
                / UDP(sport=wire.UDP_PORT, dport=wire.UDP_PORT)
                / (b"6" * 64)
            ),
            Action.PASS,
            Reason.PASS,
        ),
    ]
    return [c]


@case
def malformed_ipv4_to_our_port(rng) -> list[Case]:
    c = Case("malformed_ipv4_to_our_port", [job(n=2)], workers(0, 2))
    a = _vals(rng, 32)
    opt = Ether(frame(0, a))
    opt[IP].options = [b"\x01\x01\x01\x00"]  # NOP NOP NOP EOL: one option word
    del opt[IP].ihl, opt[IP].len, opt[IP].chksum
    frag = Ether(frame(0, a))
    frag[IP].flags = "MF"
    del frag[IP].chksum
    later = Ether(frame(0, a))  # bytes where a UDP header would be look like ours: not a header
    later[IP].frag = 185
    del later[IP].chksum
    later_opt = Ether(bytes(opt))
    later_opt[IP].frag = 185
    del later_opt[IP].chksum
    short_ihl = bytearray(frame(0, a))
    short_ihl[wire.ETH_HLEN] = 0x44  # version 4, ihl 4: no valid IPv4 header
    c.steps = [
        dropped("IPv4 options", bytes(opt), Reason.DROP_MALFORMED),
        dropped("first fragment", bytes(frag), Reason.DROP_MALFORMED),
        Step("later fragment", bytes(later), Action.PASS, Reason.PASS),
        Step("later fragment with options", bytes(later_opt), Action.PASS, Reason.PASS),
        Step("ihl below 5", bytes(short_ihl), Action.PASS, Reason.PASS),
        dropped("still aggregates", frame(0, a), Reason.AGGREGATED),
    ]
    return [c]


@case
def second_exponent_is_a_max_too(rng) -> list[Case]:
    c = Case("second_exponent_is_a_max_too", [job(n=3)], workers(0, 3))
    a, b, d = (_vals(rng, 32) for _ in range(3))
    c.steps = [
        dropped("w0", frame(0, a, slot=6, e0=-2, e1=5), Reason.AGGREGATED),
        dropped("w1", frame(1, b, slot=6, e0=7, e1=-9), Reason.AGGREGATED),
        completes("w2 completes", frame(2, d, slot=6, e0=1, e1=11), _wrap(a + b + d), 7, e1=11),
        answered(
            "w1 retransmits", frame(1, b, slot=6, e0=7, e1=-9), _wrap(a + b + d), 7, sender=1, e1=11
        ),
    ]
    return [c]


@case
def retransmission_answer_k64(rng) -> list[Case]:
    c = Case("retransmission_answer_k64", [job(n=2, elems=64)], workers(0, 2))
    a, b = _vals(rng, 64, -(2**31), 2**31 - 1), _vals(rng, 64, -(2**31), 2**31 - 1)
    c.steps = [
        dropped("w0", frame(0, a, slot=2), Reason.AGGREGATED),
        completes("w1 completes", frame(1, b, slot=2), _wrap(a + b), 0),
        answered("w0 retransmits", frame(0, a, slot=2), _wrap(a + b), 0, sender=0),
    ]
    return [c]


@case
def switch_mode_broadcasts(rng) -> list[Case]:
    c = Case("switch_mode_broadcasts", [job(n=2, delivery=Delivery.BROADCAST)], workers(0, 2))
    c.steps, _, _ = complete_round(rng, 2, 32, slot=4)
    return [c]


@case
def switch_results_to_request_source_port(rng) -> list[Case]:
    """Switch topology: every copy of a result goes to the completing request's source port,
    not to the port the worker registered, as p4app-switchML's switch answers
    (dev_root/p4/udp_receiver.p4 lines 70-71, udp_sender.p4 lines 37 and 80 at b5c74a0): its host's
    thread t sends from worker_port + t and owns its own slots, so each thread gets its own
    slots' results. Two threads' rounds here, from ports 4000 and 4001 (p4app's default
    worker_port and the next); the workers registered 0xBEE0. The XDP program's devmap egress
    (which BPF_PROG_TEST_RUN cannot run) is checked in the testbed by
    tests/root/test_switchml_grpc_netns.py, the soft aggregator (the model behind sockets) by
    tests/unit/test_switchml_grpc.py; bmv2's runner checks every copy's ports."""
    c = Case(
        "switch_results_to_request_source_port",
        [job(n=2, delivery=Delivery.BROADCAST)],
        workers(0, 2),
    )
    for t, slot in ((0, 1), (1, 9)):
        steps, _, _ = complete_round(rng, 2, 32, slot=slot, sport=4000 + t, tag=f"thread {t} ")
        c.steps += steps
    return [c]


@case
def unicast_results_redirected_to_copies(rng) -> list[Case]:
    """One-arm unicast delivery (hosts that join no group, docs/protocol.md 3.5): a result
    leaves addressed as for the group, by a devmap broadcast to the job's n copies, where the
    copy program (tests/root/test_unicast.py) gives copy k worker k's MAC and address. Rounds from
    two lanes' ports, and a retransmission answered to its sender alone (XDP_TX)."""
    c = Case(
        "unicast_results_redirected_to_copies",
        [job(n=3, delivery=Delivery.UNICAST)],
        workers(0, 3),
    )
    for t, slot in ((0, 2), (1, 10)):
        steps, _, _ = complete_round(rng, 3, 32, slot=slot, sport=WORKER_PORT + t, tag=f"{t} ")
        c.steps += steps
    c.steps.append(
        answered("w0 retransmits", steps[0].frame, steps[-1].values, steps[-1].e0, sender=0)
    )
    return [c]


@case
def worker_moves_on_before_the_round_completes(rng) -> list[Case]:
    """A faulty worker: w0 contributes to (slot 3, version 0), then to version 1 without
    waiting for version 0's result, which clears its bit in version 0's bitmap (every target, as
    p4app-switchML's bitmap_checker.p4 lines 84-98 do). w1's version-0 contribution then still
    joins the round w0 opened: ours starts a new round when the previous one is complete or has
    no contribution (count 0), so the sum is w0's + w1's. p4app-switchML's switch starts one
    when the version's bitmap is empty (processor.p4 lines 97-102: its first packet writes
    instead of adding), so it would overwrite w0's values and, its worker count then at the last
    packet (workers_counter.p4 lines 27-38), send w1's values alone as the sum. We keep ours
    (docs/protocol.md 7.2): no result may leave without a contribution the aggregator counted."""
    c = Case("worker_moves_on_before_the_round_completes", [job(n=2)], workers(0, 2))
    a0, a1, b0, b1 = (_vals(rng, 32) for _ in range(4))
    c.steps = [
        Step("w0 v0", frame(0, a0, slot=3, version=0, e0=1), Action.DROP, Reason.AGGREGATED),
        Step(
            "w0 v1, moves on", frame(0, a1, slot=3, version=1, e0=2), Action.DROP, Reason.AGGREGATED
        ),
        Step(
            "w1 v0 completes w0's round",
            frame(1, b0, slot=3, version=0, e0=-1),
            Action.TO_ALL,
            Reason.COMPLETED,
            _wrap(a0 + b0),
            1,
        ),
        Step(
            "w1 v1 completes version 1",
            frame(1, b1, slot=3, version=1, e0=3),
            Action.TO_ALL,
            Reason.COMPLETED,
            _wrap(a1 + b1),
            3,
        ),
    ]
    return [c]


@case
def mac_cases(rng) -> list[Case]:
    """A worker's source MAC is matched with its address and port (as p4app-switchML's switch
    matches it), where the control plane knows it; an all-zero MAC matches any."""
    stranger = "02:00:00:00:ee:01"  # another host using a worker's address and port
    c = Case("worker_mac_matched", [job(n=2)], workers(0, 2))
    a, b = _vals(rng, 32), _vals(rng, 32)
    c.steps = [
        dropped(
            "w0's address, another MAC", frame(0, b, src_mac=stranger), Reason.DROP_UNKNOWN_SOURCE
        ),
        dropped("w0", frame(0, a), Reason.AGGREGATED),
        dropped(
            "w1's address, another MAC", frame(1, a, src_mac=stranger), Reason.DROP_UNKNOWN_SOURCE
        ),
        completes("w1 completes", frame(1, b), _wrap(a + b), 0),
    ]
    unknown = [
        WorkerSpec(w.job_id, w.index, w.ip, w.port, w.agg_port, "00:00:00:00:00:00")
        for w in workers(0, 2)
    ]
    d = Case("worker_mac_unknown_matches_any", [job(n=2)], unknown)
    d.steps = [
        dropped("w0 from any MAC", frame(0, a, src_mac=stranger), Reason.AGGREGATED),
        completes("w1 completes", frame(1, b), _wrap(a + b), 0),
    ]
    return [c, d]


def _p4app_check(what: str, req: bytes, k: int, values, exponent: int) -> Callable[[bytes], None]:
    """A check of a result as p4app-switchML's receive path reads it (tests/harness/p4app_host.py):
    its pkt_id and short job id echoed, the max exponent, the sum."""
    sent = p4app_host.read_result(req, k)

    def check(out: bytes) -> None:
        got = p4app_host.read_result(out, k)
        assert (got.short_job_id, got.pkt_id) == (sent.short_job_id, sent.pkt_id), what
        assert got.exponent == exponent, f"{what}: the exponent p4app's host reads"
        np.testing.assert_array_equal(got.entries, values, err_msg=f"{what}: p4app's entries")

    return check


def p4app_round(
    name: str, spec: JobSpec, vals, exps, *, pidx: int, job_id: int, pkt_id: int, extra=None
) -> Case:
    """One round of a slot from p4app-switchML hosts 0..n-1 (n = len(vals)): requests built by
    p4app_host.build_packet, n-1 partials, the last completes, worker 0 retransmits; both results
    read as p4app's receive path reads them too."""
    n, k = len(vals), spec.elems
    extra = extra if extra is not None else [0] * n
    switch = p4app_host.Endpoint(AGG_MAC, AGG_IP, p4app_host.SWITCH_PORT)
    reqs = [
        p4app_host.build_packet(
            worker=p4app_host.Endpoint(worker_mac(i), worker_ip(i), WORKER_PORT),
            switch=switch,
            job_id=job_id,
            pkt_id=pkt_id + i,
            pool_index=pidx,
            values=vals[i],
            exponent=exps[i],
            extra_byte=extra[i],
        )
        for i in range(n)
    ]
    total = _wrap(sum(np.asarray(v, dtype=np.int64) for v in vals))
    e1 = max(b - 256 if b >= 128 else b for b in extra)  # the second byte, signed on our side
    c = Case(name, [spec], workers(0, n))
    c.steps = [dropped(f"p4app w{i} partial", reqs[i], Reason.AGGREGATED) for i in range(n - 1)]
    for i, what, action, reason in (
        (n - 1, f"p4app w{n - 1} completes", Action.TO_ALL, Reason.COMPLETED),
        (0, "p4app w0 retransmits", Action.TO_SENDER, Reason.RETX_ANSWERED),
    ):
        c.steps.append(
            Step(
                what,
                reqs[i],
                action,
                reason,
                total,
                max(exps),
                e1=e1,
                sender=i if action == Action.TO_SENDER else None,
                pool_index=pidx,
                raw_check=_p4app_check(what, reqs[i], k, total, max(exps)),
            )
        )
    return c


@case
def p4app_host_cases(rng) -> list[Case]:
    """Requests built byte for byte as p4app-switchML's DPDK host builds them (BuildPacket at
    b5c74a0: tests/harness/p4app_host.py cites the lines), 64 int32 per packet as its default packet
    size; the results checked at the offsets its receive path reads. With and without our UDP
    checksum verification (the host's checksum is offloaded, so right on the wire)."""
    out = []
    for verify in (False, True):
        vals = [np.arange(1, 65)] + [_vals(rng, 64, -(2**31), 2**31 - 1) for _ in range(2)]
        out.append(
            p4app_round(
                "p4app_host_buildpacket" + ("_udp_checksum" if verify else ""),
                job(n=3, elems=64, udp_checksum=verify),
                vals,
                [-4, -9, -6],
                extra=[3, 0x81, 7],  # the second byte, which the switch maxes as e1
                pidx=0x8000 | 5,  # version 1, slot 5
                job_id=0x1234,  # the host sends the job id's low 8 bits
                pkt_id=0x01020304,
            )
        )
    return out


def parent_pool_index(g: int, v: int) -> int:
    """The parent's pool index for our slot g, version v, in the tree cases (g - 4 + 100)."""
    return int(wire.pool_index(g - 4 + PARENT_SLOT_BASE, v))


def tree_forward_and_down(rng, k: int) -> Case:
    """A rack job's round of k elements through two levels: up, again up, down, a stale copy of
    the parent's result, and a retransmission answered with it."""
    pidx, up = wire.pool_index, parent_pool_index
    c = Case(
        f"tree_forward_and_down_k{k}",
        [job(n=3, elems=k, base=4, count=8, tree=True)],
        workers(0, 3),
    )
    vals = [_vals(rng, k) for _ in range(3)]
    exps = [3, -5, 9]
    fr = [frame(h, vals[h], slot=6, tsi=50, e0=exps[h], job_number=7) for h in range(3)]
    part = _wrap(sum(vals))
    other = _vals(rng, k, -(10**6), 10**6)  # the other racks' sum, as the parent adds it
    total = _wrap(sum(vals) + other)
    down = parent_frame(total, slot=6 - 4 + PARENT_SLOT_BASE, tsi=50, e0=12, job_number=7)
    c.steps = [
        dropped("w0", fr[0], Reason.AGGREGATED),
        dropped("w1", fr[1], Reason.AGGREGATED),
        Step(
            "w2 completes here: the partial goes up",
            fr[2],
            Action.TO_PARENT,
            Reason.FORWARDED_UP,
            part,
            9,
            pool_index=up(6, 0),
        ),
        Step(
            "w0 retransmits before the parent answered: the partial again",
            fr[0],
            Action.TO_PARENT,
            Reason.RESENT_UP,
            part,
            9,
            pool_index=up(6, 0),
        ),
        Step(
            "the parent's result comes down to every worker",
            down,
            Action.TO_ALL,
            Reason.PARENT_RESULT,
            total,
            12,
            pool_index=int(pidx(6, 0)),
        ),
        dropped("the parent's result again (a copy)", down, Reason.STALE_PARENT_RESULT),
        answered(
            "w1 retransmits after the parent answered: the parent's result",
            fr[1],
            total,
            12,
            sender=1,
        ),
    ]
    return c


@case
def tree_cases(rng) -> list[Case]:
    """Two levels (docs/protocol.md section 3.7): a rack job (base 4, 8 slots) whose parent job's
    slots start at PARENT_SLOT_BASE. Our slot g is the parent's g - 4 + 100."""
    cases = []
    pidx, up = wire.pool_index, parent_pool_index
    for k in (32, 256):
        cases.append(tree_forward_and_down(rng, k))

    c = Case("tree_versions_alternate", [job(n=2, base=4, count=8, tree=True)], workers(0, 2))
    for r in range(3):  # v0, v1, v0 on slot 5: each round up, then down
        v = r % 2
        a, b = _vals(rng, 32), _vals(rng, 32)
        tsi = 5 + 8 * r
        total = _wrap(a + b + 1000 * (r + 1))
        c.steps += [
            dropped(f"round {r} w0", frame(0, a, slot=5, version=v, tsi=tsi), Reason.AGGREGATED),
            Step(
                f"round {r} w1 completes, up",
                frame(1, b, slot=5, version=v, tsi=tsi),
                Action.TO_PARENT,
                Reason.FORWARDED_UP,
                _wrap(a + b),
                0,
                pool_index=up(5, v),
            ),
            Step(
                f"round {r} the parent's result",
                parent_frame(total, slot=101, version=v, tsi=tsi),
                Action.TO_ALL,
                Reason.PARENT_RESULT,
                total,
                0,
                pool_index=int(pidx(5, v)),
            ),
        ]
    cases.append(c)

    c = Case("tree_stale_parent_results", [job(n=2, base=4, count=8, tree=True)], workers(0, 2))
    a, b = _vals(rng, 32), _vals(rng, 32)
    total = _wrap(a + b + 7)
    c.steps = [
        dropped(
            "a parent result before anything went up",
            parent_frame(total, slot=102, tsi=9),
            Reason.STALE_PARENT_RESULT,
        ),
        dropped("w0", frame(0, a, slot=6, tsi=9), Reason.AGGREGATED),
        dropped(
            "a parent result while the slot is still incomplete here",
            parent_frame(total, slot=102, tsi=9),
            Reason.STALE_PARENT_RESULT,
        ),
        Step(
            "w1 completes, up",
            frame(1, b, slot=6, tsi=9),
            Action.TO_PARENT,
            Reason.FORWARDED_UP,
            _wrap(a + b),
            0,
            pool_index=up(6, 0),
        ),
        dropped(
            "the parent's result for the other version",
            parent_frame(total, slot=102, version=1, tsi=9),
            Reason.STALE_PARENT_RESULT,
        ),
        dropped(
            "a parent result of another packet (tsi)",
            parent_frame(total, slot=102, tsi=1),
            Reason.STALE_PARENT_RESULT,
        ),
        dropped(
            "a result from another address than the parent's",
            parent_frame(total, slot=102, tsi=9, src_ip="198.18.1.2"),
            Reason.DROP_UNKNOWN_SOURCE,
        ),
        dropped(
            "a parent result for a slot outside the parent job's",
            parent_frame(total, slot=99, tsi=9),
            Reason.DROP_SLOT_RANGE,
        ),
        Step(
            "the parent's result, finally",
            parent_frame(total, slot=102, tsi=9),
            Action.TO_ALL,
            Reason.PARENT_RESULT,
            total,
            0,
            pool_index=int(pidx(6, 0)),
        ),
    ]
    cases.append(c)
    return cases


def length_lies(full: bytes, k: int, fewer: int) -> tuple[list[Step], list[Step]]:
    """Steps of a valid frame of k elements made to lie, all dropped before any state changes:
    (too short: its payload cut, or its lengths agreeing with `fewer` elements less), and
    (lengths that lie: UDP length long, IPv4 length short, bytes after the payload)."""
    plen = wire.udp_payload_len(k)
    ulen, ilen = wire.UDP_HLEN + plen, wire.IPV4_HLEN + wire.UDP_HLEN + plen
    cut = 4 * fewer
    short = [
        dropped("payload truncated", full[:-4], Reason.DROP_TRUNCATED),
        dropped(
            f"lengths agree with a frame of {k - fewer} elements",
            relength(full, ip_len=ilen - cut, udp_len=ulen - cut, cut=cut),
            Reason.DROP_TRUNCATED,
        ),
    ]
    lies = [
        dropped("UDP length long", relength(full, udp_len=ulen + 4), Reason.DROP_BAD_LENGTH),
        dropped("IPv4 length short", relength(full, ip_len=ilen - 4), Reason.DROP_BAD_LENGTH),
        dropped(
            "bytes after the payload", relength(full, trailer=b"\0" * 4), Reason.DROP_BAD_LENGTH
        ),
    ]
    return short, lies


@case
def folded_cases(rng) -> list[Case]:
    """256 elements per packet (size code 3, p4app-switchML's 1024-byte payload), which the P4
    programs aggregate in four passes of 64 (p4app's folded pipe; bmv2 recirculates): every
    verdict of the state machine on them, rounds that overwrite each pass's registers, the
    checks before any state changes, and a request built as p4app's host builds it."""
    k = 256
    cases = []
    c = Case("folded_k256_rounds_and_answers", [job(n=2, elems=k, base=0, count=4)], workers(0, 2))
    a, b = _vals(rng, k, -(2**31), 2**31 - 1), _vals(rng, k, -(2**31), 2**31 - 1)
    c.steps = [
        dropped("w0", frame(0, a, slot=1, e0=5, e1=-2), Reason.AGGREGATED),
        dropped("w0 again", frame(0, a, slot=1, e0=5, e1=-2), Reason.DUP_PENDING),
        completes("w1 completes", frame(1, b, slot=1, e0=-7, e1=9), _wrap(a + b), 5, e1=9),
        answered(
            "w1 retransmits", frame(1, b, slot=1, e0=-7, e1=9), _wrap(a + b), 5, e1=9, sender=1
        ),
    ]
    for r in range(3):  # v1, v0, v1 on slot 1: each first contribution overwrites all passes
        steps, _, _ = complete_round(rng, 2, k, slot=1, version=(r + 1) % 2, tag=f"round {r} ")
        c.steps += steps
    c.steps.append(
        Step(
            "w0 retransmits v0 after it moved on",  # its bit in v0 was cleared by v1's round
            frame(0, a, slot=1, version=0),
            Action.DROP,
            Reason.AGGREGATED,
        )
    )
    cases.append(c)

    c = Case("folded_k256_checks", [job(n=2, elems=k, base=4, count=4)], workers(0, 2))
    a, b = _vals(rng, k), _vals(rng, k)
    full = frame(0, a, slot=5)
    short, lies = length_lies(full, k, 4)
    c.steps = [
        *short,
        dropped("64 elements to a 256 job", frame(0, a[:64], slot=5), Reason.DROP_BAD_SIZE),
        dropped("128 elements (XDP only)", frame(0, a[:128], slot=5), Reason.DROP_BAD_SIZE),
        *lies,
        dropped("slot above range", frame(0, a, slot=8), Reason.DROP_SLOT_RANGE),
        dropped("w0 after all that", full, Reason.AGGREGATED),
        completes("w1 completes", frame(1, b, slot=5), _wrap(a + b), 0),
    ]
    cases.append(c)

    c = Case(
        "folded_k256_size_mismatch_both_ways",
        [
            job(0, n=1, elems=64, base=0, count=4),
            job(1, n=1, elems=k, base=4, count=4, port=wire.UDP_PORT + 1),
        ],
        workers(0, 1) + workers(1, 1, first=1, port=wire.UDP_PORT + 1),
    )
    a, b = _vals(rng, k), _vals(rng, 64)
    c.steps = [
        dropped("256 elements to a 64 job", frame(0, a, slot=0), Reason.DROP_BAD_SIZE),
        completes("64 elements to its job", frame(0, b, slot=0), _wrap(b), 0),
        completes(
            "256 elements to their job", frame(1, a, slot=4, port=wire.UDP_PORT + 1), _wrap(a), 0
        ),
    ]
    cases.append(c)

    vals = [_vals(rng, k, -(2**31), 2**31 - 1) for _ in range(2)]
    c = p4app_round(
        "p4app_host_buildpacket_k256",
        job(n=2, elems=k),
        vals,
        [-3, 6],
        pidx=3,  # version 0, slot 3
        job_id=7,
        pkt_id=0x0A0B0C00,
    )
    cases.append(c)
    return cases


def with_size_code(f: bytes, code: int) -> bytes:
    """A frame with another size code in its SwitchML header (payload and lengths unchanged)."""
    b = bytearray(f)
    b[wire.SWITCHML_OFFSET] = (b[wire.SWITCHML_OFFSET] & ~7) | code
    return bytes(b)


@case
def jumbo_cases(rng) -> list[Case]:
    """The jumbo size codes, 1024 and 2048 int32 (4148- and 8244-byte frames, more than a page:
    the XDP program takes them as a multi-buffer (frags) program only, through
    bpf_xdp_load_bytes/store_bytes). Every verdict of the state machine on them, the length and
    checksum checks (a flipped bit past the first buffer), two levels; and the jumbo codes
    carried to a job of another size, which every target, bmv2 included, drops as a bad size.
    Registered last, so that the cases before keep their values."""
    cases = []
    for k in (1024, 2048):
        c = Case(f"jumbo_complete_n3_k{k}", [job(n=3, elems=k)], workers(0, 3))
        c.steps, vals, exps = complete_round(rng, 3, k, slot=2)
        again = frame(1, vals[1], slot=2, e0=exps[1], tsi=1001)
        c.steps.append(answered("w1 retransmits", again, _wrap(sum(vals)), max(exps), sender=1))
        cases.append(c)

    k = 2048
    c = Case("jumbo_k2048_checks", [job(n=2, elems=k, base=4, count=4)], workers(0, 2))
    a, b = _vals(rng, k, -(2**31), 2**31 - 1), _vals(rng, k, -(2**31), 2**31 - 1)
    full = frame(0, a, slot=5)
    short, lies = length_lies(full, k, 8)
    c.steps = [
        *short,
        dropped("1024 elements to a 2048 job", frame(0, a[:1024], slot=5), Reason.DROP_BAD_SIZE),
        *lies,
        dropped("w0", full, Reason.AGGREGATED),
        dropped("w0 again", full, Reason.DUP_PENDING),
        completes("w1 completes", frame(1, b, slot=5), _wrap(a + b), 0),
    ]
    cases.append(c)

    c = Case("jumbo_udp_checksum_k2048", [job(n=2, elems=k, udp_checksum=True)], workers(0, 2))
    a, b = _vals(rng, k, -(2**31), 2**31 - 1), _vals(rng, k, -(2**31), 2**31 - 1)
    sums = [frame(h, v, slot=3, udp_checksum=True) for h, v in ((0, a), (1, b))]
    bad = bytearray(sums[1])
    bad[wire.PAYLOAD_OFFSET + 4 * 1900 + 1] ^= 0x10  # past the first buffer (3520 bytes)
    c.steps = [
        dropped("w0, right checksum", sums[0], Reason.AGGREGATED),
        dropped("w1, a bit flipped late", bytes(bad), Reason.DROP_BAD_CHECKSUM),
        completes("w1 completes", sums[1], _wrap(a + b), 0),
    ]
    cases.append(c)
    cases.append(tree_forward_and_down(rng, k))
    cases[-1].name = "jumbo_tree_forward_and_down_k2048"

    c = Case("jumbo_size_codes_to_a_32_job", [job(n=1, elems=32)], workers(0, 1))
    a = _vals(rng, 32)
    c.steps = [
        dropped(
            f"size code {code} ({wire.elems_for(code)}) on a 32-element frame",
            with_size_code(frame(0, a, slot=1), code),
            Reason.DROP_BAD_SIZE,
        )
        for code in wire.JUMBO_SIZE_CODES
    ]
    c.steps.append(completes("the frame itself", frame(0, a, slot=1), _wrap(a), 0))
    cases.append(c)
    return cases


# --- sparse jobs (docs/protocol.md section 8) ----------------------------------------------------
BLOCKS = 40  # the tensor's blocks in the sparse cases


def sframe(
    w: int, block: int, nxt: int, values=None, *, blocks=BLOCKS, k=32, padded=False, **kw
) -> bytes:
    """A sparse contribution of worker host `w` about `block`, naming its next non-zero block
    `nxt`: with `values` (msg_type 2), or empty (3) when they are None: header only, or
    `padded` with k zero int32 (room for a result, docs/protocol.md section 8.1)."""
    vals = () if values is None else values
    if padded:
        vals, kw["msg_type"] = np.zeros(k, dtype=np.int64), wire.MSG_TYPE_SPARSE_EMPTY
    sp = wire.Sparse(block, nxt, blocks)
    return frame(w, vals, size=wire.size_code_for(k), sparse=sp, **kw)


def sresult(what: str, f: bytes, total, block: int, nxt: int, e0=0, *, blocks=BLOCKS, **kw):
    """The step whose sparse contribution completes its round: `total` (None: an empty result),
    the round's block, the smallest next `nxt` and its exponent `e0`, to every worker."""
    return Step(
        what, f, Action.TO_ALL, Reason.COMPLETED, total, e0, sparse=wire.Sparse(block, nxt, blocks)
    )


def sanswer(what: str, f: bytes, total, block: int, nxt: int, e0=0, *, blocks=BLOCKS, **kw):
    """The step whose sparse retransmission is answered with the stored result, to its sender."""
    sp = wire.Sparse(block, nxt, blocks)
    return Step(what, f, Action.TO_SENDER, Reason.RETX_ANSWERED, total, e0, sparse=sp, **kw)


def sparse_job(job_id=0, **kw) -> JobSpec:
    return job(job_id, sparse=True, **kw)


@case
def sparse_rounds(rng) -> list[Case]:
    """A block present on one worker only, on all, on none; next indices that differ (the
    exponent is the maximum over the contributions naming the smallest next); int32 wraps."""
    c = Case("sparse_rounds_n3", [sparse_job(n=3)], workers(0, 3))
    a, b, d = _vals(rng, 32), _vals(rng, 32), _vals(rng, 32)
    big = np.full(32, 2**31 - 1, dtype=np.int64)
    c.steps = [
        # round 1 on slot 2 (block 2): only w1 has data; w0 next 10 (e 5), w1 6 (e 3), w2 6 (e 4)
        dropped("w0 empty", sframe(0, 2, 10, slot=2, e0=5), Reason.AGGREGATED),
        dropped("w1 data", sframe(1, 2, 6, a, slot=2, e0=3), Reason.AGGREGATED),
        sresult("w2 empty completes", sframe(2, 2, 6, slot=2, e0=4), _wrap(a), 2, 6, 4),
        # round 2 (block 6, version 1): every worker has data
        dropped("w0 data", sframe(0, 6, 10, a, slot=2, version=1, e0=-1), Reason.AGGREGATED),
        dropped("w1 data", sframe(1, 6, 14, b, slot=2, version=1, e0=9), Reason.AGGREGATED),
        sresult(
            "w2 data completes",
            sframe(2, 6, 10, d, slot=2, version=1, e0=2),
            _wrap(a + b + d),
            6,
            10,
            2,
        ),
        # round 3 (block 10, version 0): nobody has data there any more (w0 said 10 and changed
        # its mind? no: w0 has data; here all three are empty, as after a block that cancelled)
        dropped("w0 empty", sframe(0, 10, BLOCKS, slot=2, e0=-128), Reason.AGGREGATED),
        dropped("w1 empty", sframe(1, 10, 14, slot=2, e0=7), Reason.AGGREGATED),
        sresult("w2 empty: empty result", sframe(2, 10, 18, slot=2, e0=1), None, 10, 14, 7),
        # round 4 (block 14, version 1): two workers wrap int32; then the column ends
        dropped("w0 wraps", sframe(0, 14, BLOCKS, big, slot=2, version=1), Reason.AGGREGATED),
        dropped("w1 wraps", sframe(1, 14, BLOCKS, big, slot=2, version=1), Reason.AGGREGATED),
        sresult(
            "w2 ends: next = blocks",
            sframe(2, 14, BLOCKS, slot=2, version=1),
            _wrap(2 * big),
            14,
            BLOCKS,
            0,
        ),
    ]
    one = Case("sparse_one_worker", [sparse_job(n=1)], workers(0, 1))
    one.steps = [
        sresult("announce: empty, next = block", sframe(0, 3, 3, slot=3, e0=6), None, 3, 3, 6),
        sresult("its data", sframe(0, 3, 7, a, slot=3, version=1, e0=2), _wrap(a), 3, 7, 2),
    ]
    return [c, one]


@case
def sparse_loss_and_duplication(rng) -> list[Case]:
    """Each kind of packet duplicated or retransmitted, before and after completion; a result
    lost and re-requested by an empty contribution (the answer carries the data)."""
    c = Case("sparse_loss_and_duplication", [sparse_job(n=2)], workers(0, 2))
    a, b = _vals(rng, 32), _vals(rng, 32)
    data, empty = sframe(0, 1, 5, a, slot=1, tsi=3, e0=2), sframe(1, 1, 9, slot=1, tsi=3, e0=8)
    c.steps = [
        dropped("w0 data", data, Reason.AGGREGATED),
        dropped("w0 data again", data, Reason.DUP_PENDING),
        dropped("w0 data again (3rd)", data, Reason.DUP_PENDING),
        sresult("w1 empty completes", empty, _wrap(a), 1, 5, 2),
        sanswer("w1's result lost: it retransmits", empty, _wrap(a), 1, 5, 2, sender=1),
        sanswer("w0's result lost: it retransmits", data, _wrap(a), 1, 5, 2, sender=0),
    ]
    e0f, e1f = sframe(0, 5, 9, slot=1, version=1), sframe(1, 5, 9, b, slot=1, version=1)
    c.steps += [
        dropped("w0 empty", e0f, Reason.AGGREGATED),
        dropped("w0 empty again", e0f, Reason.DUP_PENDING),
        sresult("w1 data completes", e1f, _wrap(b), 5, 9, 0),
        sanswer("w0 re-requests with its empty", e0f, _wrap(b), 5, 9, 0, sender=0),
    ]
    n0, n1 = sframe(0, 9, BLOCKS, slot=1), sframe(1, 9, BLOCKS, slot=1)
    c.steps += [
        dropped("w0 empty", n0, Reason.AGGREGATED),
        sresult("w1 empty: nobody had data", n1, None, 9, BLOCKS, 0),
        sanswer("w0 re-requests: the empty result", n0, None, 9, BLOCKS, 0, sender=0),
        # a retransmission whose next disagrees with its first copy: the first counted stands
        sanswer(
            "w1 retransmits with another next",
            sframe(1, 9, 13, slot=1),
            None,
            9,
            BLOCKS,
            0,
            sender=1,
        ),
    ]
    return [c]


@case
def sparse_bad_input(rng) -> list[Case]:
    """Bad sparse contributions are dropped under their own reasons and change nothing: the
    round still completes with the right sum after each of them."""
    c = Case(
        "sparse_bad_input",
        [sparse_job(0, n=2, base=0, count=8), job(1, n=1, base=8, count=8, port=wire.UDP_PORT + 1)],
        workers(0, 2) + workers(1, 1, first=2, port=wire.UDP_PORT + 1),
    )
    a, b = _vals(rng, 32), _vals(rng, 32)
    good0 = sframe(0, 4, 8, a, slot=4)
    full = bytes(sframe(1, 4, 8, b, slot=4))
    c.steps = [
        dropped("block = blocks", sframe(0, BLOCKS, BLOCKS, a, slot=4), Reason.DROP_SPARSE_RANGE),
        dropped("next > blocks", sframe(0, 4, BLOCKS + 1, a, slot=4), Reason.DROP_SPARSE_RANGE),
        dropped("blocks = 0", sframe(0, 0, 0, slot=4, blocks=0), Reason.DROP_SPARSE_RANGE),
        dropped("next < block", sframe(0, 4, 3, a, slot=4), Reason.DROP_SPARSE_BACKWARDS),
        dropped("data, next = block", sframe(0, 4, 4, a, slot=4), Reason.DROP_SPARSE_BACKWARDS),
        dropped("empty, next < block", sframe(0, 4, 0, slot=4), Reason.DROP_SPARSE_BACKWARDS),
        dropped("w0 good", good0, Reason.AGGREGATED),
        dropped("w1 another block", sframe(1, 12, 16, b, slot=4), Reason.DROP_SPARSE_MISMATCH),
        dropped(
            "w1 another tensor", sframe(1, 4, 8, b, slot=4, blocks=50), Reason.DROP_SPARSE_MISMATCH
        ),
        dropped("w1 dense to a sparse round", frame(1, b, slot=4), Reason.DROP_SPARSE_MISMATCH),
        dropped("w0 dup, other block", sframe(0, 12, 16, a, slot=4), Reason.DROP_SPARSE_MISMATCH),
        dropped("w1 truncated", full[:-4], Reason.DROP_TRUNCATED),
        dropped(
            "sparse to a dense job",
            sframe(2, 0, 4, b, slot=8, port=wire.UDP_PORT + 1),
            Reason.DROP_BAD_TYPE,
        ),
        sresult("w1 good completes", full, _wrap(a + b), 4, 8, 0),
        dropped(
            "retransmission, other block",
            sframe(1, 8, 12, b, slot=4),
            Reason.DROP_SPARSE_MISMATCH,
        ),
    ]
    # a dense round in progress on a sparse job: a sparse contribution mismatches it
    d0 = frame(0, a, slot=5)
    c.steps += [
        dropped("w0 dense", d0, Reason.AGGREGATED),
        dropped(
            "w1 sparse to a dense round", sframe(1, 5, 9, b, slot=5), Reason.DROP_SPARSE_MISMATCH
        ),
        completes("w1 dense completes", frame(1, b, slot=5), _wrap(a + b), 0),
    ]
    return [c]


@case
def sparse_lengths(rng) -> list[Case]:
    """A sparse packet's length follows its kind: 22 bytes for an empty one (or 22 + 4k,
    padded: sparse_padded_empties), 22 + 4k for one with data; anything else is dropped as a
    dense packet's would be."""
    c = Case("sparse_lengths", [sparse_job(n=2, base=0, count=4)], workers(0, 2))
    _, b = _vals(rng, 32), _vals(rng, 32)  # the first keeps the later cases' draws
    empty = sframe(0, 1, 5, slot=1)
    # the type says empty, the frame carries 4 bytes more: neither header-only nor padded
    ip, udp = wire.IPV4_HLEN + wire.UDP_HLEN, wire.UDP_HLEN
    as_empty = relength(empty + bytes(4), ip_len=ip + 26, udp_len=udp + 26)
    as_data = bytearray(empty)  # the type says data, the frame ends after the sparse header
    as_data[wire.SWITCHML_OFFSET] = (wire.MSG_TYPE_SPARSE << 4) | 0
    c.steps = [
        dropped("empty type, 4 bytes more", as_empty, Reason.DROP_BAD_LENGTH),
        dropped("data type, header only", bytes(as_data), Reason.DROP_TRUNCATED),
        dropped("header cut", empty[:-2], Reason.DROP_TRUNCATED),
        dropped("w0 empty", empty, Reason.AGGREGATED),
        sresult("w1 data completes", sframe(1, 1, 9, b, slot=1), _wrap(b), 1, 5, 0),
    ]
    return [c]


@case
def sparse_udp_checksum(rng) -> list[Case]:
    """A sparse job that verifies UDP checksums: over the sparse header and the block (none for
    an empty contribution); a wrong one is dropped before the sparse checks (row 10 before 11)."""
    c = Case("sparse_udp_checksum", [sparse_job(n=3, udp_checksum=True)], workers(0, 3))
    a, d = _vals(rng, 32), _vals(rng, 32)
    w0 = sframe(0, 6, 10, a, slot=6, e0=3, udp_checksum=True)
    w1 = sframe(1, 6, 8, slot=6, e0=5, udp_checksum=True)
    w2 = sframe(2, 6, 12, d, slot=6, udp_checksum=True)
    bad_next = bytearray(w1)  # next 8 -> 8 + 2^31: outside the tensor, and the checksum wrong
    bad_next[wire.SWITCHML_OFFSET + wire.SPARSE_AT + 4] ^= 0x80
    bad_block = bytearray(w2)
    bad_block[wire.SWITCHML_OFFSET + wire.SPARSE_VALUES_AT + 3] ^= 0x01
    no_sum = bytearray(w2)
    no_sum[wire.SWITCHML_OFFSET - 2 : wire.SWITCHML_OFFSET] = b"\0\0"  # none sent: taken
    c.steps = [
        dropped("w0 data, right checksum", w0, Reason.AGGREGATED),
        dropped("w1 empty, a bit of next flipped", bytes(bad_next), Reason.DROP_BAD_CHECKSUM),
        dropped("w1 empty, right checksum", w1, Reason.AGGREGATED),
        dropped("w2 data, a bit of the block flipped", bytes(bad_block), Reason.DROP_BAD_CHECKSUM),
        sresult("w2 data, no checksum (0)", bytes(no_sum), _wrap(a + d), 6, 8, 5),
        sanswer("w1 retransmits its empty", w1, _wrap(a + d), 6, 8, 5, sender=1),
    ]
    return [c]


@case
def sparse_sizes(rng) -> list[Case]:
    """Sparse rounds at 256 elements (p4app's size, folded in P4), with 40 workers, and at a
    jumbo size (multi-buffer in XDP)."""
    cases = []
    for name, k, n in (("sparse_k256", 256, 3), ("sparse_many_workers_40", 64, 40)):
        c = Case(name, [sparse_job(n=n, elems=k)], workers(0, n))
        vals = {i: _vals(rng, k) for i in range(0, n, 3)}  # every third worker has data
        for i in range(n):
            f = sframe(i, 7, 11 + i % 5, vals.get(i), k=k, slot=7, e0=i % 9)
            if i < n - 1:
                c.steps.append(dropped(f"w{i}", f, Reason.AGGREGATED))
            else:
                total = _wrap(sum(vals.values()))
                e0 = max(j % 9 for j in range(n) if j % 5 == 0)
                c.steps.append(sresult(f"w{i} completes", f, total, 7, 11, e0))
        cases.append(c)
    k = 1024
    c = Case("sparse_jumbo_k1024", [sparse_job(n=2, elems=k)], workers(0, 2))
    a = _vals(rng, k)
    c.steps = [
        dropped("w0 empty", sframe(0, 2, 6, k=k, slot=2), Reason.AGGREGATED),
        sresult("w1 data", sframe(1, 2, 10, a, k=k, slot=2), _wrap(a), 2, 6, 0),
        sanswer("w0 re-requests", sframe(0, 2, 6, k=k, slot=2), _wrap(a), 2, 6, 0, sender=0),
    ]
    cases.append(c)
    return cases


@case
def sparse_padded_empties(rng) -> list[Case]:
    """Empty contributions padded to a block's length (docs/protocol.md 8.1: room for a result
    with data, which XDP writes in place): their payload is not added, they complete a round
    and are answered like header-only ones, the result as long as its kind says; any other
    length of an empty contribution is a bad length."""
    cases = []
    for k in (32, 256, 768):
        c = Case(f"sparse_padded_empties_k{k}", [sparse_job(n=3, elems=k)], workers(0, 3))
        a = _vals(rng, k)
        p0 = sframe(0, 2, 6, k=k, slot=2, padded=True, e0=4)
        p2 = sframe(2, 2, 10, k=k, slot=2, padded=True, e0=9)
        ones = bytearray(p2)  # padding that is not zero: still not added
        ones[-4 * k :] = b"\x01" * (4 * k)
        c.steps = [
            dropped("w0 padded empty", p0, Reason.AGGREGATED),
            dropped("w1 data", sframe(1, 2, 6, a, k=k, slot=2, e0=-2), Reason.AGGREGATED),
            sresult("w2 padded empty completes", bytes(ones), _wrap(a), 2, 6, 4),
            sanswer("w0 retransmits its padded empty", p0, _wrap(a), 2, 6, 4, sender=0),
            dropped(
                "w0 padded, 4 bytes short",
                sframe(0, 6, 10, k=k, slot=2, version=1, padded=True)[:-4],
                Reason.DROP_TRUNCATED,
            ),
            dropped(
                "w0 padded empty",
                sframe(0, 6, 10, k=k, slot=2, version=1, padded=True),
                Reason.AGGREGATED,
            ),  # fmt: skip
            dropped(
                "w1 header-only empty", sframe(1, 6, 8, k=k, slot=2, version=1), Reason.AGGREGATED
            ),  # fmt: skip
            sresult(
                "w2 padded empty: an empty result",
                sframe(2, 6, 10, k=k, slot=2, version=1, padded=True),
                None,
                6,
                8,
                0,
            ),
        ]
        cases.append(c)
    return cases


def _refilled(f: bytes, fill: bytes) -> bytes:
    """`f`, a padded empty contribution, with `fill` as its padding (its last bytes) and its UDP
    checksum made right over it."""
    pkt = Ether(f[: len(f) - len(fill)] + fill)
    del pkt[UDP].chksum
    return bytes(pkt)


@case
def sparse_padded_checksum(rng) -> list[Case]:
    """A sparse job that verifies UDP checksums: a padded empty contribution's checksum covers
    its padding, as any UDP checksum covers the datagram (docs/protocol.md 8.1); the padding is
    still not added, and the result is written in place, checksum included."""
    c = Case("sparse_padded_checksum", [sparse_job(n=2, udp_checksum=True)], workers(0, 2))
    a = _vals(rng, 32)
    p0 = sframe(0, 3, 9, k=32, slot=3, padded=True, udp_checksum=True, e0=2)
    p0 = _refilled(p0, bytes(range(1, 129)))
    flipped = bytearray(p0)
    flipped[-1] ^= 0x01
    c.steps = [
        dropped(
            "w0 padded empty, a bit of its padding flipped",
            bytes(flipped),
            Reason.DROP_BAD_CHECKSUM,
        ),
        dropped("w0 padded empty, padding not zero", p0, Reason.AGGREGATED),
        sresult(
            "w1 data completes",
            sframe(1, 3, 9, a, slot=3, udp_checksum=True, e0=1),
            _wrap(a),
            3,
            9,
            2,
        ),
        sanswer("w0 retransmits its padded empty", p0, _wrap(a), 3, 9, 2, sender=0),
    ]
    return [c]


# --- 16-bit jobs (docs/protocol.md section 5.6) ---------------------------------------------------
# A 16-bit job's packet carries 2k elements as k int32 words a * 2^16 + b; every aggregator sums
# the words as int32 and checks only the width bit. The expected sums are computed here on the
# elements and packed (wire.pack_pairs), never by summing words as the aggregator does.


def _pairs(rng, n: int, k: int) -> list[np.ndarray]:
    """n workers' 2k elements each, within the headroom of n workers (wire.pair_range)."""
    m = wire.pair_range(n)
    return [rng.integers(-m, m + 1, size=2 * k, dtype=np.int64) for _ in range(n)]


def _packed(elements) -> np.ndarray:
    """The words of a 16-bit packet holding `elements` (2k of them)."""
    return wire.pack_pairs(np.asarray(elements, dtype=np.int64))


def wframe(w: int, elements, **kw) -> bytes:
    """A 16-bit contribution of worker host `w`: its elements packed in pairs, the width bit set."""
    return frame(w, _packed(elements), wire_bits=16, **kw)


def wire16_job(job_id=0, **kw) -> JobSpec:
    return job(job_id, wire_bits=16, **kw)


def wire16_round(rng, n: int, k: int, tag: str = "", **kw) -> list[Step]:
    """One round of a 16-bit job: n - 1 contributions aggregated, the n-th completes with the
    packed sum of the elements (kw: the frames' slot, version, ...)."""
    elems = _pairs(rng, n, k)
    total = _packed(sum(elems))
    steps = [
        dropped(f"{tag}w{i}", wframe(i, e, **kw), Reason.AGGREGATED) for i, e in enumerate(elems)
    ]
    steps[-1] = completes(f"{tag}w{n - 1} completes", wframe(n - 1, elems[-1], **kw), total, 0)
    return steps


@case
def wire16_complete(rng) -> list[Case]:
    """Rounds of 16-bit jobs at several sizes: the unpacked result is the elements' exact sum."""
    cases = []
    for k in (32, 256, 768):
        c = Case(f"wire16_complete_n3_k{k}", [wire16_job(n=3, elems=k)], workers(0, 3))
        c.steps = wire16_round(rng, 3, k, slot=2) + wire16_round(
            rng, 3, k, "v1 ", slot=2, version=1
        )
        cases.append(c)
    return cases


@case
def wire16_headroom_edge(rng) -> list[Case]:
    """Every worker at the edge of its headroom, n = 1 and the largest n (wire.pair_range): both
    halves of every word sum to +-(2^15 - 1) at most, and come back exactly. One past the edge,
    the word sum stays the exact int32 sum (the aggregator is the same adder), but its low half
    carries into the high one: the hosts never send past the range (hostlib.scaling)."""
    cases = []
    for n in (1, MAX_WORKERS):
        m = wire.pair_range(n)
        edge = np.tile([m, -m, -m, m], 16)  # 64 elements (32 words): both signs in both halves
        c = Case(f"wire16_headroom_edge_n{n}", [wire16_job(n=n)], workers(0, n))
        steps = [
            dropped(f"w{i} at the edge", wframe(i, edge, slot=1), Reason.AGGREGATED)
            for i in range(n)
        ]
        steps[-1] = completes(
            "the last completes", wframe(n - 1, edge, slot=1), _packed(n * edge), 0
        )
        assert np.abs(n * edge).max() <= 2**15 - 1
        c.steps = steps
        cases.append(c)
    n, m = 2, wire.pair_range(2)
    past = np.full(64, m + 1, dtype=np.int64)  # 2 (m + 1) = 2^15: one past the halves' range
    c = Case("wire16_past_the_headroom_n2", [wire16_job(n=n)], workers(0, n))
    c.steps = [
        dropped("w0 past the edge", wframe(0, past, slot=0), Reason.AGGREGATED),
        completes("w1 past the edge", wframe(1, past, slot=0), _wrap(2 * _packed(past)), 0),
    ]
    assert not np.array_equal(wire.unpack_pairs(c.steps[-1].values), 2 * past)
    cases.append(c)
    return cases


@case
def wire16_loss_and_duplication(rng) -> list[Case]:
    """A duplicate of a 16-bit contribution is not counted twice; a retransmission after the
    round completed is answered with the stored 16-bit result, width bit set."""
    c = Case("wire16_loss_and_duplication", [wire16_job(n=2)], workers(0, 2))
    a, b = _pairs(rng, 2, 32)
    total = _packed(a + b)
    c.steps = [
        dropped("w0", wframe(0, a, slot=3, tsi=5, e0=3), Reason.AGGREGATED),
        dropped("w0 again", wframe(0, a, slot=3, tsi=5, e0=3), Reason.DUP_PENDING),
        completes("w1 completes", wframe(1, b, slot=3, tsi=5, e0=-2), total, 3),
        answered("w0 lost the result", wframe(0, a, slot=3, tsi=5, e0=3), total, 3, sender=0),
        answered("w1 lost it too", wframe(1, b, slot=3, tsi=5, e0=-2), total, 3, sender=1),
    ]
    return [c]


@case
def wire16_width_mismatch(rng) -> list[Case]:
    """A 32-bit packet in a 16-bit job and a 16-bit one in a 32-bit job: dropped as
    drop_bad_width before they touch a round, in a round in progress and after it completed."""
    c = Case(
        "wire16_width_mismatch",
        [wire16_job(0, n=2, base=0, count=8), job(1, n=2, base=8, count=8, port=wire.UDP_PORT + 1)],
        workers(0, 2) + workers(1, 2, first=2, port=wire.UDP_PORT + 1),
    )
    a, b = _pairs(rng, 2, 32)
    x, y = _vals(rng, 32), _vals(rng, 32)
    p1 = dict(port=wire.UDP_PORT + 1)
    c.steps = [
        dropped("32-bit to the 16-bit job", frame(0, _packed(a), slot=2), Reason.DROP_BAD_WIDTH),
        dropped("w0 16-bit", wframe(0, a, slot=2), Reason.AGGREGATED),
        dropped("w1 32-bit mid-round", frame(1, _packed(b), slot=2), Reason.DROP_BAD_WIDTH),
        completes("w1 16-bit completes", wframe(1, b, slot=2), _packed(a + b), 0),
        dropped("w0 32-bit resend", frame(0, _packed(a), slot=2), Reason.DROP_BAD_WIDTH),
        dropped(
            "16-bit to the 32-bit job",
            frame(2, x, slot=9, wire_bits=16, **p1),
            Reason.DROP_BAD_WIDTH,
        ),
        dropped("job1 w0", frame(2, x, slot=9, **p1), Reason.AGGREGATED),
        dropped("job1 w1 16-bit", frame(3, y, slot=9, wire_bits=16, **p1), Reason.DROP_BAD_WIDTH),
        completes("job1 w1 completes", frame(3, y, slot=9, **p1), _wrap(x + y), 0),
        dropped(
            "a width bit flipped alone",
            with_width_bit(wframe(0, a, slot=3), 0),
            Reason.DROP_BAD_WIDTH,
        ),
    ]
    return [c]


@case
def wire16_sparse(rng) -> list[Case]:
    """A sparse 16-bit job: a block one worker has, a block both have, and a sparse packet of
    the other width dropped as drop_bad_width (the width is checked before the sparse rows)."""
    c = Case("wire16_sparse_n2", [sparse_job(n=2, wire_bits=16)], workers(0, 2))
    a, b = _pairs(rng, 2, 32)
    w16 = dict(wire_bits=16)
    c.steps = [
        dropped("w0 empty", sframe(0, 2, 6, slot=2, e0=1, **w16), Reason.AGGREGATED),
        dropped("w1 32-bit", sframe(1, 2, 6, _packed(b), slot=2), Reason.DROP_BAD_WIDTH),
        sresult(
            "w1 data completes",
            sframe(1, 2, 6, _packed(b), slot=2, e0=4, **w16),
            _packed(b),
            2,
            6,
            4,
        ),
        dropped(
            "w0 data", sframe(0, 6, 10, _packed(a), slot=2, version=1, **w16), Reason.AGGREGATED
        ),
        sresult(
            "w1 data completes",
            sframe(1, 6, 12, _packed(b), slot=2, version=1, **w16),
            _packed(a + b),
            6,
            10,
        ),
        sanswer(
            "w0 retransmits",
            sframe(0, 6, 10, _packed(a), slot=2, version=1, **w16),
            _packed(a + b),
            6,
            10,
            sender=0,
        ),
    ]
    return [c]


@case
def wire16_jumbo_and_tree(rng) -> list[Case]:
    """A 16-bit jumbo round (2048 words: 4096 elements, MTU 9000, the frags program), and a
    16-bit rack job of two levels: its partial goes up and the parent's result comes down with
    the width bit; a parent result of the other width is dropped as drop_bad_width."""
    c = Case("wire16_jumbo_complete_n2_k2048", [wire16_job(n=2, elems=2048)], workers(0, 2))
    c.steps = wire16_round(rng, 2, 2048, slot=1)
    up, pidx = parent_pool_index, wire.pool_index
    rack = wire16_job(n=2, base=4, count=8, tree=True)
    t = Case("wire16_tree_forward_and_down", [rack], workers(0, 2))
    a, b, other = _pairs(rng, 4, 32)[:3]  # scaled for the 4 workers under the root
    fr = [wframe(h, v, slot=6, tsi=9, e0=2) for h, v in ((0, a), (1, b))]
    total = _packed(a + b + other)
    slot = 6 - 4 + PARENT_SLOT_BASE
    down = parent_frame(total, slot=slot, tsi=9, e0=5, wire_bits=16)
    t.steps = [
        dropped("w0", fr[0], Reason.AGGREGATED),
        Step(
            "w1 completes here: the 16-bit partial goes up",
            fr[1],
            Action.TO_PARENT,
            Reason.FORWARDED_UP,
            _packed(a + b),
            2,
            pool_index=up(6, 0),
        ),
        dropped(
            "the parent's result at 32 bits",
            parent_frame(total, slot=slot, tsi=9, e0=5),
            Reason.DROP_BAD_WIDTH,
        ),
        Step(
            "the parent's 16-bit result comes down",
            down,
            Action.TO_ALL,
            Reason.PARENT_RESULT,
            total,
            5,
            pool_index=int(pidx(6, 0)),
        ),
        answered("w0 retransmits: the parent's result", fr[0], total, 5, sender=0),
    ]
    return [c, t]


def build_cases() -> list[Case]:
    """The table: every registered case function's cases, in order. Deterministic (seeded)."""
    rng = np.random.default_rng(2021)
    return [c for fn in CASE_FUNCTIONS for c in fn(rng)]


CASES = build_cases()
