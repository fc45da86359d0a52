"""The aggregator's state machine, serial and in plain Python (docs/protocol.md sections 2-3).

This is the reference the XDP program (and the P4 program) are checked against: the table-driven
PROG_TEST_RUN tests and the concurrency test compare the kernel's verdicts and bytes with what
this model says, packet for packet. It is also small enough to read as the specification.

The model works on UDP payloads (our two headers and the int32 payload); addressing is given
as (source address, destination port), which is how the aggregator identifies job and worker.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from . import wire
from .jobs import mac_bytes
from .limits import PARENT_INDEX
from .reasons import Reason

# Frame offsets the parse needs (the wire module has ours; these are IPv4's and UDP's).
_IP_END = wire.ETH_HLEN + wire.IPV4_HLEN
_IPPROTO_UDP = 17
_IP_MF, _IP_OFFSET_MASK = 0x2000, 0x1FFF  # IPv4 more-fragments flag, fragment offset


def _offset(name: str) -> int:
    """Where the header field `name` starts in our UDP payload (wire.HDR_DTYPE's layout)."""
    fields = wire.HDR_DTYPE.fields
    assert fields is not None  # a structured dtype has them
    return int(fields[name][1])


# Offsets inside our UDP payload, from the wire module's header layout.
_TYPE_SIZE = _offset("msg_type_size")
_POOL_INDEX = _offset("pool_index")
_E0 = _offset("e0")  # the exponent header follows the SwitchML header
_JOB_NUMBER = _offset("job_number")
_TSI = _offset("tsi")


def _udp_checksum_ok(frame: bytes) -> bool:
    """The UDP checksum of an IPv4 frame without options is right, or zero (none sent)."""
    udp = frame[_IP_END:]
    if udp[6:8] == b"\0\0":
        return True
    ulen = int.from_bytes(udp[4:6], "big")
    data = frame[26:34] + bytes((0, _IPPROTO_UDP)) + udp[4:6] + udp[:ulen]  # pseudo-header first
    if len(data) % 2:
        data += b"\0"
    total = sum(np.frombuffer(data, ">u2").tolist())
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total == 0xFFFF


class Action(Enum):
    """What the aggregator does with a packet."""

    PASS = "pass"  # not ours: to the kernel untouched
    DROP = "drop"  # consumed (aggregated, or dropped with a reason)
    TO_ALL = "to_all"  # the result, to every worker of the job
    TO_SENDER = "to_sender"  # the stored result, to the sender alone
    TO_PARENT = "to_parent"  # a rack job's partial sum, to its parent aggregator


@dataclass
class Verdict:
    """The model's answer for one packet."""

    action: Action
    reason: Reason
    payload: bytes | None = None  # the rewritten UDP payload, for TO_ALL and TO_SENDER
    job_id: int | None = None
    worker: int | None = None


@dataclass
class _Slot:
    seen: list = field(default_factory=lambda: [0, 0])
    count: list = field(default_factory=lambda: [0, 0])  # contributions in the current round
    complete: list = field(default_factory=lambda: [False, False])
    acc: list = field(default_factory=lambda: [None, None])
    e0: list = field(default_factory=lambda: [0, 0])
    e1: list = field(default_factory=lambda: [0, 0])
    # tree jobs: the (job_number, tsi) forwarded up, and whether the parent's result is stored
    up_hdr: list = field(default_factory=lambda: [None, None])
    parent_done: list = field(default_factory=lambda: [False, False])
    # sparse jobs (docs/protocol.md section 8): the round's kind and block, set by its first
    # contribution (None: dense), the smallest next over its contributions and the exponent
    # maximum over those naming it, and whether any contribution carried data
    sparse: list = field(default_factory=lambda: [None, None])
    next_min: list = field(default_factory=lambda: [0, 0])
    has_data: list = field(default_factory=lambda: [False, False])


@dataclass
class ModelParent:
    """A rack job's link to its parent aggregator (the JobSpec parent_* fields)."""

    ip: str  # the parent's address: its results come from there
    uplink_port: int  # our port toward it: its results come to there
    slot_base: int  # the parent job's first slot


@dataclass
class ModelJob:
    """A job as the control plane configures it."""

    job_id: int
    num_workers: int
    elems: int
    slot_base: int
    slot_count: int
    udp_checksum: bool = False  # verify contributions' (nonzero) UDP checksums
    parent: ModelParent | None = None  # a rack job of a two-level tree
    sparse: bool = False  # takes sparse contributions as well (docs/protocol.md section 8)
    wire_bits: int = 32  # the element width its packets must say (docs/protocol.md section 5.6)

    @property
    def size_code(self) -> int:
        return wire.size_code_for(self.elems)


class ReferenceAggregator:
    """Serial reference implementation of the aggregator (one packet at a time)."""

    def __init__(self) -> None:
        self.jobs: dict[int, ModelJob] = {}
        self.workers: dict[tuple[str, int], tuple[int, int]] = {}
        self.macs: dict[tuple[str, int], bytes] = {}  # (addr, port) -> MAC its frames come from
        self.slots: dict[tuple[int, int], _Slot] = {}

    def create_job(
        self,
        job_id,
        num_workers,
        elems,
        slot_base,
        slot_count,
        udp_checksum: bool = False,
        parent: ModelParent | None = None,
        sparse: bool = False,
        wire_bits: int = 32,
    ) -> ModelJob:
        """Create (or re-create) a job; its slot state starts cleared. With `parent`, a rack
        job: its parent is registered as the job's worker PARENT_INDEX. With `sparse`, a job that
        takes sparse contributions too; `wire_bits` 16, a job of 16-bit elements."""
        job = ModelJob(
            job_id,
            num_workers,
            elems,
            slot_base,
            slot_count,
            udp_checksum,
            parent,
            sparse,
            wire.check_wire_bits(wire_bits),
        )
        self.jobs[job_id] = job
        for g in range(slot_base, slot_base + slot_count):
            self.slots[(job_id, g)] = _Slot()
        if parent is not None:
            self.workers[(parent.ip, parent.uplink_port)] = (job_id, PARENT_INDEX)
        return job

    def create_job_spec(self, spec) -> ModelJob:
        """create_job from an xdp_agg.proto.jobs.JobSpec (its parent link too)."""
        parent = None
        if spec.has_parent:
            parent = ModelParent(spec.parent_ip, spec.uplink_port, spec.parent_slot_base)
        return self.create_job(
            spec.job_id,
            spec.num_workers,
            spec.elems,
            spec.slot_base,
            spec.slot_count,
            spec.udp_checksum,
            parent,
            spec.sparse,
            spec.wire_bits,
        )

    def delete_job(self, job_id: int) -> None:
        self.jobs.pop(job_id, None)
        self.workers = {k: v for k, v in self.workers.items() if v[0] != job_id}

    def add_worker(
        self, job_id: int, index: int, addr: str, port: int = wire.UDP_PORT, mac: str | None = None
    ) -> None:
        """Register worker `index` of a job: packets from `addr` to aggregator port `port`, and
        whole frames (process_frame) from source MAC `mac` too, unless it is None or all zeros
        (not known: any MAC), as the XDP program and p4app-switchML's switch match them."""
        self.workers[(addr, port)] = (job_id, index)
        raw = mac_bytes(mac) if mac else bytes(6)
        if any(raw):
            self.macs[(addr, port)] = raw
        else:
            self.macs.pop((addr, port), None)

    def remove_worker(self, job_id: int, index: int) -> None:
        """Unregister worker `index` of a job (a no-op if it is not registered): its packets are
        then from an unknown source. The slot state stays, as in the XDP program."""
        self.workers = {k: v for k, v in self.workers.items() if v != (job_id, index)}
        self.macs = {k: v for k, v in self.macs.items() if k in self.workers}

    def process_frame(self, frame: bytes) -> Verdict:
        """Run one whole Ethernet frame through the aggregator, as the XDP program sees it.

        The parse follows bpf/xdp_agg.c: only IPv4 UDP to the aggregator's ports is ours (a
        later fragment, whose bytes at the UDP offset are no header, and an IPv4 header with
        ihl < 5 are not); ours with IPv4 options or as a first fragment is malformed; the
        IPv4 total length and the UDP length are checked against the frame and the size code.
        """
        b = bytes(frame)
        if len(b) < _IP_END or b[12:14] != b"\x08\x00":
            return Verdict(Action.PASS, Reason.PASS)
        ip = b[wire.ETH_HLEN :]
        ihl, frag = ip[0] & 0xF, int.from_bytes(ip[6:8], "big")
        if ip[0] >> 4 != 4 or ip[9] != _IPPROTO_UDP or ihl < 5 or frag & _IP_OFFSET_MASK:
            return Verdict(Action.PASS, Reason.PASS)
        udp = wire.ETH_HLEN + 4 * ihl
        if len(b) < udp + wire.UDP_HLEN:
            return Verdict(Action.PASS, Reason.PASS)
        dport = int.from_bytes(b[udp + 2 : udp + 4], "big")
        if (dport & wire.UDP_PORT_MASK) != wire.UDP_PORT:
            return Verdict(Action.PASS, Reason.PASS)
        if ihl != 5 or frag & _IP_MF:
            return Verdict(Action.DROP, Reason.DROP_MALFORMED)
        src = ".".join(str(x) for x in ip[12:16])
        lengths = (int.from_bytes(ip[2:4], "big"), int.from_bytes(b[udp + 4 : udp + 6], "big"))
        return self._classify(
            src,
            dport,
            b[wire.SWITCHML_OFFSET :],
            len(b),
            *lengths,
            checksum_ok=lambda: _udp_checksum_ok(b),
            src_mac=b[6:12],
        )

    def process(self, src_addr: str, dst_port: int, payload: bytes) -> Verdict:
        """Run one UDP payload sent from src_addr to dst_port through the state machine.

        For a datagram as a socket receives it: the kernel has checked its lengths, so the IPv4
        and UDP lengths are the ones the payload implies.
        """
        udp_len = wire.UDP_HLEN + len(payload)
        frame_len = wire.SWITCHML_OFFSET + len(payload)
        return self._classify(
            src_addr, dst_port, payload, frame_len, wire.IPV4_HLEN + udp_len, udp_len
        )

    def _classify(
        self,
        src_addr,
        dst_port,
        payload,
        frame_len,
        ip_len,
        udp_len,
        checksum_ok=None,
        src_mac=None,
    ) -> Verdict:
        """The checks of docs/protocol.md section 2 in the XDP program's order, then the state
        machine. `payload` is everything after the UDP header up to the end of the frame;
        `checksum_ok()` says whether its UDP checksum is right (None: the kernel checked it);
        `src_mac` is the frame's source MAC (None: a datagram, no MAC to match)."""
        if (dst_port & wire.UDP_PORT_MASK) != wire.UDP_PORT:
            return Verdict(Action.PASS, Reason.PASS)
        if len(payload) < wire.UDP_HDRS_LEN:  # both headers, before any lookup
            return Verdict(Action.DROP, Reason.DROP_TRUNCATED)
        who = self.workers.get((src_addr, dst_port))
        mac = self.macs.get((src_addr, dst_port))
        if who is None or (src_mac is not None and mac is not None and src_mac != mac):
            return Verdict(Action.DROP, Reason.DROP_UNKNOWN_SOURCE)
        job_id, w = who
        job = self.jobs.get(job_id)
        up = w == PARENT_INDEX
        if job is None or (job.parent is None if up else w >= job.num_workers):
            return Verdict(Action.DROP, Reason.DROP_NO_JOB, job_id=job_id, worker=w)
        ts = payload[_TYPE_SIZE]
        sparse = job.sparse and ts >> 4 in wire.SPARSE_TYPES
        if ts >> 4 != wire.MSG_TYPE_DATA and not sparse:
            return Verdict(Action.DROP, Reason.DROP_BAD_TYPE, job_id=job_id, worker=w)
        if ts & 7 != job.size_code:
            return Verdict(Action.DROP, Reason.DROP_BAD_SIZE, job_id=job_id, worker=w)
        if bool(ts & wire.TYPE_SIZE_WIRE16_MASK) != (job.wire_bits == 16):
            return Verdict(Action.DROP, Reason.DROP_BAD_WIDTH, job_id=job_id, worker=w)
        need = wire.udp_payload_len(job.elems)
        if sparse:
            need = wire.sparse_payload_len(job.elems, ts >> 4 == wire.MSG_TYPE_SPARSE_EMPTY)
            if udp_len == wire.UDP_HLEN + wire.sparse_payload_len(job.elems, False):
                need = udp_len - wire.UDP_HLEN  # an empty one padded to a block's room (8.1)
        if len(payload) < need:
            return Verdict(Action.DROP, Reason.DROP_TRUNCATED, job_id=job_id, worker=w)
        want_udp = wire.UDP_HLEN + need
        if (udp_len, ip_len, frame_len) != (
            want_udp,
            wire.IPV4_HLEN + want_udp,
            wire.SWITCHML_OFFSET + need,
        ):
            return Verdict(Action.DROP, Reason.DROP_BAD_LENGTH, job_id=job_id, worker=w)
        pidx = int.from_bytes(payload[_POOL_INDEX : _POOL_INDEX + 2], "big")
        # the reserved bit set puts g out of every range
        g = pidx & (wire.POOL_SLOT_MASK | wire.POOL_RESERVED_BIT)
        v = int(bool(pidx & wire.POOL_VERSION_BIT))
        if up:  # the parent's slots map onto ours one to one
            parent = job.parent
            assert parent is not None  # a packet from the parent of a job without one: dropped
            if not parent.slot_base <= g < parent.slot_base + job.slot_count:
                return Verdict(Action.DROP, Reason.DROP_SLOT_RANGE, job_id=job_id, worker=w)
            g = g - parent.slot_base + job.slot_base
        if not job.slot_base <= g < job.slot_base + job.slot_count:
            return Verdict(Action.DROP, Reason.DROP_SLOT_RANGE, job_id=job_id, worker=w)
        if job.udp_checksum and checksum_ok is not None and not checksum_ok():
            return Verdict(Action.DROP, Reason.DROP_BAD_CHECKSUM, job_id=job_id, worker=w)
        msg = wire.Message.from_bytes(payload[:need])
        st = self.slots[(job_id, g)]
        if up:
            return self._from_parent(job, payload[:need], msg, st, g, v)
        if job.sparse:
            bad = _sparse_check(msg, st, v, 1 << w)
            if bad is not None:
                return Verdict(Action.DROP, bad, job_id=job_id, worker=w)
        if msg.sparse is not None:
            return self._sparse(job, msg, st, v, w)
        return self._dense(job, payload, msg, st, g, v, w)

    def _dense(self, job: ModelJob, payload, msg: wire.Message, st: _Slot, g, v, w) -> Verdict:
        """A dense contribution that passed every check (docs/protocol.md section 3.2)."""
        job_id = job.job_id
        bit = 1 << w
        if not st.seen[v] & bit:
            st.seen[v] |= bit
            st.seen[1 - v] &= ~bit
            if st.count[v] == 0 or st.complete[v]:  # first contribution of a new round
                st.count[v] = 0
                st.complete[v] = False
                st.sparse[v] = None
                st.acc[v] = msg.values.astype(np.int64)
                st.e0[v], st.e1[v] = msg.e0, msg.e1
            else:
                st.acc[v] = st.acc[v] + msg.values
                st.e0[v], st.e1[v] = max(st.e0[v], msg.e0), max(st.e1[v], msg.e1)
            st.count[v] += 1
            if st.count[v] < job.num_workers:
                return Verdict(Action.DROP, Reason.AGGREGATED, job_id=job_id, worker=w)
            st.complete[v] = True
            if job.parent is not None:  # complete here: the partial sum goes up
                st.up_hdr[v] = _round_key(payload)
                st.parent_done[v] = False
                return Verdict(
                    Action.TO_PARENT,
                    Reason.FORWARDED_UP,
                    self._up(job, payload, st, g, v),
                    job_id,
                    w,
                )
            return Verdict(Action.TO_ALL, Reason.COMPLETED, self._result(payload, st, v), job_id, w)
        if st.complete[v] and job.parent is not None and not st.parent_done[v]:
            # complete here, no parent result yet: the partial went up and may have been lost
            return Verdict(
                Action.TO_PARENT, Reason.RESENT_UP, self._up(job, payload, st, g, v), job_id, w
            )
        if st.complete[v]:
            return Verdict(
                Action.TO_SENDER, Reason.RETX_ANSWERED, self._result(payload, st, v), job_id, w
            )
        return Verdict(Action.DROP, Reason.DUP_PENDING, job_id=job_id, worker=w)

    def _sparse(self, job: ModelJob, msg: wire.Message, st: _Slot, v: int, w: int) -> Verdict:
        """A sparse contribution that passed every check (docs/protocol.md section 8.3)."""
        bit, sp = 1 << w, msg.sparse
        assert sp is not None
        if st.seen[v] & bit:  # a duplicate: as for dense, the first copy counted stands
            if st.complete[v]:
                result = _sparse_result(msg, st, v)
                return Verdict(Action.TO_SENDER, Reason.RETX_ANSWERED, result, job.job_id, w)
            return Verdict(Action.DROP, Reason.DUP_PENDING, job_id=job.job_id, worker=w)
        st.seen[v] |= bit
        st.seen[1 - v] &= ~bit
        if st.count[v] == 0 or st.complete[v]:  # first contribution of a new round
            st.count[v], st.complete[v] = 0, False
            st.sparse[v] = wire.Sparse(sp.block, 0, sp.blocks)
            st.acc[v] = np.zeros(job.elems, dtype=np.int64)
            st.has_data[v], st.next_min[v], st.e0[v], st.e1[v] = False, sp.next, msg.e0, msg.e1
        if msg.msg_type == wire.MSG_TYPE_SPARSE:
            st.acc[v] = st.acc[v] + msg.values
            st.has_data[v] = True
        if sp.next < st.next_min[v]:  # the exponent travels with the smallest next (8.4)
            st.next_min[v], st.e0[v] = sp.next, msg.e0
        elif sp.next == st.next_min[v]:
            st.e0[v] = max(st.e0[v], msg.e0)
        st.e1[v] = max(st.e1[v], msg.e1)
        st.count[v] += 1
        if st.count[v] < job.num_workers:
            return Verdict(Action.DROP, Reason.AGGREGATED, job_id=job.job_id, worker=w)
        st.complete[v] = True
        return Verdict(Action.TO_ALL, Reason.COMPLETED, _sparse_result(msg, st, v), job.job_id, w)

    def _from_parent(self, job, payload, msg, st: _Slot, g: int, v: int) -> Verdict:
        """A result from a rack job's parent for our slot g, version v: stored and sent to every
        worker when that round is complete here and waits on it (the same job_number and tsi
        as the partial sent up); anything else is stale."""
        waiting = st.complete[v] and not st.parent_done[v]
        if not waiting or _round_key(payload) != st.up_hdr[v]:
            return Verdict(Action.DROP, Reason.STALE_PARENT_RESULT, job_id=job.job_id)
        st.acc[v] = msg.values.astype(np.int64)
        st.e0[v], st.e1[v] = msg.e0, msg.e1
        st.parent_done[v] = True
        out = bytearray(self._result(payload, st, v))
        out[_POOL_INDEX : _POOL_INDEX + 2] = int(wire.pool_index(g, v)).to_bytes(2, "big")
        return Verdict(Action.TO_ALL, Reason.PARENT_RESULT, bytes(out), job.job_id, PARENT_INDEX)

    def _up(self, job: ModelJob, request: bytes, st: _Slot, g: int, v: int) -> bytes:
        """The partial sum of slot g as a contribution to the parent: the request's headers,
        the parent's slot for ours."""
        out = bytearray(self._result(request, st, v))
        assert job.parent is not None  # only a rack job's partial sums go up
        pg = g - job.slot_base + job.parent.slot_base
        out[_POOL_INDEX : _POOL_INDEX + 2] = int(wire.pool_index(pg, v)).to_bytes(2, "big")
        return bytes(out)

    @staticmethod
    def _result(request: bytes, st: _Slot, v: int) -> bytes:
        """The request's headers with the stored sum and max exponents (wrapping int32); the
        width bit is the request's, which is the job's."""
        n = len(st.acc[v])
        out = bytearray(request)  # exactly the job's payload: the lengths were checked
        out[_E0] = st.e0[v] & 0xFF
        out[_E0 + 1] = st.e1[v] & 0xFF
        wrapped = (st.acc[v] & 0xFFFFFFFF).astype(np.uint32).astype(">u4").tobytes()
        out[wire.VALUES_AT : wire.VALUES_AT + n * wire.ELEM_BYTES] = wrapped
        return bytes(out)


def _sparse_check(msg: wire.Message, st: _Slot, v: int, bit: int) -> Reason | None:
    """Why a sparse job drops this contribution before it changes anything (docs/protocol.md
    section 8.3), or None: the sparse fields inside the tensor and not going backwards, and
    a contribution to a round in progress (or a duplicate) of the round's kind and block."""
    sp = msg.sparse
    if sp is not None:
        if sp.block >= sp.blocks or sp.next > sp.blocks:
            return Reason.DROP_SPARSE_RANGE
        if sp.next < sp.block or (sp.next == sp.block and msg.msg_type == wire.MSG_TYPE_SPARSE):
            return Reason.DROP_SPARSE_BACKWARDS
    in_round = st.seen[v] & bit or (st.count[v] and not st.complete[v])
    if not in_round:
        return None
    have = st.sparse[v]
    if (have is None) != (sp is None):
        return Reason.DROP_SPARSE_MISMATCH
    if have is not None and sp is not None and (have.block, have.blocks) != (sp.block, sp.blocks):
        return Reason.DROP_SPARSE_MISMATCH
    return None


def _sparse_result(request: wire.Message, st: _Slot, v: int) -> bytes:
    """A sparse round's result: the request's job number, tsi, size and pool index; the round's
    block and blocks, the smallest next and its exponent; the sum, or nothing when no
    contribution carried data."""
    sp, data = st.sparse[v], st.has_data[v]
    result = dataclasses.replace(
        request,
        msg_type=wire.MSG_TYPE_SPARSE if data else wire.MSG_TYPE_SPARSE_EMPTY,
        e0=st.e0[v],
        e1=st.e1[v],
        values=(st.acc[v] & 0xFFFFFFFF).astype(np.uint32) if data else np.zeros(0, np.int32),
        sparse=wire.Sparse(sp.block, st.next_min[v], sp.blocks),
    )
    return result.to_bytes()


def _round_key(payload: bytes) -> bytes:
    """What names a round between the levels: the job_number and tsi of the packet sent up,
    which the parent's result echoes."""
    return bytes(payload[_JOB_NUMBER : _JOB_NUMBER + 1]) + bytes(payload[_TSI : _TSI + 4])
