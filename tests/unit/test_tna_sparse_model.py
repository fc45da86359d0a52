"""The TNA variant's sparse rounds (p4/tna/sparse_round.p4, Tofino 2), register for register,
through the packet table's sparse cases.

No Tofino model runs here (p4/README.md), and bf-p4c only says whether the program fits. What can
be checked is the design: TnaSlots below keeps the state the P4 program keeps, in the P4
program's registers and with its actions (SparseRound's claim and close, BitmapChecker's update
of both versions, WorkersCounter's count-down, SparseState, the accumulators' overwrite, add and
read, ExponentMax), and each step of tests/harness/packet_cases.py's sparse cases of 32 and 64
elements goes through it. The reason, and a result's kind, values, exponents and sparse header,
must be the table's (the reference model's, which bmv2 and XDP pass too). Rows 0-12 of
docs/protocol.md 8.3 are UDPReceiver's gateways, not modelled here: a step the table drops
there changes no state, as the program's checks make sure.

The claim this checks above all: the round key closes when the other version's round completes
(not its own), so that every retransmission finds its round's key open and every new round's
first contribution finds it closed."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pytest
from harness.packet_cases import CASES, Case, Step

import xdp_agg.targets.bmv2 as bm
from xdp_agg.proto import wire
from xdp_agg.proto.model import Action
from xdp_agg.proto.reasons import Reason

TNA = bm.P4_DIR / "tna"
TNA_MAX_WORKERS = 32  # p4/tna/configuration.p4
TNA_SPARSE_ELEMS = (32, 64)  # packets of 256 elements are never sparse on Tofino
DENSE_KEY = 0x7FFFFFFF  # p4/tna/types.p4
ROUND_OPEN = 0x80000000
# Reasons the state machine decides (the counter's and SparseRound's); any other is a row 0-12
# drop of UDPReceiver, which changes nothing.
STATE_REASONS = {
    Reason.AGGREGATED,
    Reason.COMPLETED,
    Reason.RETX_ANSWERED,
    Reason.DUP_PENDING,
    Reason.DROP_SPARSE_MISMATCH,
}


@dataclass
class Out:
    """What the program's last pass sends (or drops), as a packet-table step says it."""

    reason: Reason
    msg_type: int = 0
    values: np.ndarray | None = None
    e0: int = 0
    e1: int = 0
    sparse: wire.Sparse | None = None


@dataclass
class TnaSlots:
    """The registers of one job's slots, indexed as the P4 program indexes them: (slot,
    version) for round_key, remaining, the exponents and the sparse state; slot for the
    bitmap pair."""

    n: int
    k: int
    round_key: dict = field(default_factory=dict)  # (g, v) -> (lo, hi); absent: 0, 0 (closed)
    seen: dict = field(default_factory=dict)  # g -> [bitmap v0, bitmap v1]
    remaining: dict = field(default_factory=dict)
    acc: dict = field(default_factory=dict)
    e0: dict = field(default_factory=dict)  # ExponentMax e0 (dense rounds' result)
    e1: dict = field(default_factory=dict)
    next_e0: dict = field(default_factory=dict)  # (smallest next, its e0 biased): one pair
    has_data: dict = field(default_factory=dict)

    def claim(self, g: int, v: int, lo: int, hi: int) -> str:
        """SparseRound's `claim`: closed -> the packet's key, open; open -> compared ("other"
        is RK_OTHER; the P4 program's verdict does not tell "claimed" from "same")."""
        slo, shi = self.round_key.get((g, v), (0, 0))
        if shi & ROUND_OPEN == 0:
            self.round_key[g, v] = (lo, hi | ROUND_OPEN)
            return "claimed"
        return "same" if (slo, shi & ~ROUND_OPEN) == (lo, hi) else "other"

    def close(self, g: int, v: int) -> None:
        """SparseRound's `close`, in a completing packet's last pass: the other version's key."""
        self.round_key[g, 1 - v] = (0, 0)

    def count(self, g: int, v: int, bit: int) -> tuple[bool, int]:
        """BitmapChecker (this version's bit set, the other's cleared, one ALU) and
        WorkersCounter (count-down; a retransmission only reads): (is_new, count_before)."""
        bitmaps = self.seen.setdefault(g, [0, 0])
        is_new = not bitmaps[v] & bit
        bitmaps[v] |= bit
        bitmaps[1 - v] &= ~bit
        before = self.remaining.get((g, v), 0)
        if is_new:
            self.remaining[g, v] = self.n - 1 if before == 0 else before - 1
        return is_new, before


def _reason(n: int, is_new: bool, before: int) -> Reason:
    """WorkersCounter's apply block."""
    if is_new:
        return Reason.COMPLETED if before == 1 or (before == 0 and n == 1) else Reason.AGGREGATED
    return Reason.RETX_ANSWERED if before == 0 else Reason.DUP_PENDING


def _table_op(is_new: bool, before: int) -> str | None:
    """The accumulators', exponents' and SparseState's tables: first, update, read, nothing."""
    if is_new:
        return "first" if before == 0 else "update"
    return "read" if before == 0 else None


def _payload(msg: wire.Message, k: int) -> np.ndarray:
    """The payload headers the Processors add: an empty contribution's zeroed by UDPReceiver."""
    if msg.msg_type == wire.MSG_TYPE_SPARSE_EMPTY:
        return np.zeros(k, dtype=np.int64)
    return msg.values.astype(np.int64)


def _accumulate(st: TnaSlots, key, op: str, msg: wire.Message) -> None:
    """Processor.sum and ExponentMax (e0 and e1) for one pass of 32 or 64 elements."""
    vals = _payload(msg, st.k)
    if op == "first":
        st.acc[key], st.e0[key], st.e1[key] = vals % 2**32, msg.e0, msg.e1
    elif op == "update":
        st.acc[key] = (st.acc[key] + vals) % 2**32
        st.e0[key], st.e1[key] = max(st.e0[key], msg.e0), max(st.e1[key], msg.e1)


def _sparse_state(st: TnaSlots, key, op: str, msg: wire.Message) -> None:
    """SparseState's two registers: the (next, e0) pair, whose ALU returns both words, with e0
    biased (e0 ^ 0x80) so that an unsigned max is the signed one and travelling with the
    smallest next; and has_data."""
    if msg.sparse is None or op == "read":
        return
    nxt, e0b = msg.sparse.next, (msg.e0 & 0xFF) ^ 0x80
    data = msg.msg_type != wire.MSG_TYPE_SPARSE_EMPTY
    if op == "first":
        st.next_e0[key], st.has_data[key] = (nxt, e0b), int(data)
        return
    have, he0 = st.next_e0[key]
    if nxt < have:
        st.next_e0[key] = (nxt, e0b)
    elif nxt == have:
        st.next_e0[key] = (have, max(he0, e0b))
    st.has_data[key] |= int(data)


def _result(st: TnaSlots, key, msg: wire.Message, reason: Reason) -> Out:
    """SparseResult (or the dense path's request headers), with the stored sums read back."""
    vals = st.acc[key].astype(np.uint32).astype(np.int64)
    if msg.sparse is None:
        return Out(reason, msg.msg_type, vals, st.e0[key], st.e1[key])
    e0 = np.int8(np.uint8(st.next_e0[key][1] ^ 0x80)).item()
    sp = wire.Sparse(msg.sparse.block, st.next_e0[key][0], msg.sparse.blocks)
    if not st.has_data[key]:
        return Out(reason, wire.MSG_TYPE_SPARSE_EMPTY, None, e0, st.e1[key], sp)
    return Out(reason, wire.MSG_TYPE_SPARSE, vals, e0, st.e1[key], sp)


def tna_pass(st: TnaSlots, w: int, msg: wire.Message) -> Out:
    """One contribution that passed UDPReceiver, through Ingress's order: SparseRound, then
    (unless another round's key is open) the bitmap and counter, SparseState, the accumulators
    and exponents, SparseResult; a completion's last pass closes the other version's key."""
    g, v = msg.slot, msg.version
    sp = msg.sparse
    lo, hi = (sp.block, sp.blocks) if sp is not None else (DENSE_KEY, DENSE_KEY)
    if st.claim(g, v, lo, hi) == "other":
        return Out(Reason.DROP_SPARSE_MISMATCH)
    is_new, before = st.count(g, v, 1 << w)
    reason, op = _reason(st.n, is_new, before), _table_op(is_new, before)
    if op is not None:
        _sparse_state(st, (g, v), op, msg)
        _accumulate(st, (g, v), op, msg)
    if reason not in (Reason.COMPLETED, Reason.RETX_ANSWERED):
        return Out(reason)
    if reason == Reason.COMPLETED:
        st.close(g, v)  # harvest 7: the close pass (32 elements) or the harvest (64)
    return _result(st, (g, v), msg, reason)


def _expected(step: Step) -> Out:
    """The step's reason and result as an Out."""
    if step.action not in (Action.TO_ALL, Action.TO_SENDER):
        return Out(step.reason)
    msg = wire.Message.from_bytes(step.frame[wire.SWITCHML_OFFSET :])
    if step.sparse is not None and step.values is None:
        mt = wire.MSG_TYPE_SPARSE_EMPTY
    else:
        mt = wire.MSG_TYPE_SPARSE if step.sparse is not None else wire.MSG_TYPE_DATA
    vals = None if step.values is None else np.asarray(step.values).astype(np.int64) % 2**32
    return Out(step.reason, mt, vals, msg.e0 if step.e0 is None else step.e0, step.e1, step.sparse)


def _sender(case: Case, frame: bytes) -> tuple[int, int]:
    """(job id, worker index) of a frame's source address and aggregator port."""
    ip = ".".join(str(b) for b in frame[wire.ETH_HLEN + 12 : wire.ETH_HLEN + 16])
    dport = int.from_bytes(frame[wire.ETH_HLEN + 22 : wire.ETH_HLEN + 24], "big")
    for ws in case.workers:
        if ws.ip == ip and ws.agg_port == dport:
            return ws.job_id, ws.index
    raise AssertionError(f"no worker at {ip}:{dport:#x}")


def _tna_cases() -> list[Case]:
    """The sparse cases Tofino 2 would run: jobs of 32 or 64 elements, at most 32 workers, no
    UDP checksums (the TNA variant verifies none)."""
    return [
        c
        for c in CASES
        if c.sparse
        and all(
            j.elems in TNA_SPARSE_ELEMS and j.num_workers <= TNA_MAX_WORKERS and not j.udp_checksum
            for j in c.jobs
        )
    ]


def _same(got: Out, want: Out, what: str) -> None:
    assert got.reason == want.reason, what
    if want.msg_type == 0:
        return
    assert (got.msg_type, got.sparse) == (want.msg_type, want.sparse), what
    assert (got.e0, got.e1) == (want.e0, want.e1), what
    if want.values is None:
        assert got.values is None, what
    else:
        np.testing.assert_array_equal(got.values, want.values, err_msg=what)


@pytest.mark.parametrize("case", _tna_cases(), ids=lambda c: c.name)
def test_tna_sparse_rounds_pass_the_packet_table(case):
    slots = {j.job_id: TnaSlots(j.num_workers, j.elems) for j in case.jobs}
    for i, step in enumerate(case.steps):
        what = f"{case.name} step {i}: {step.what}"
        if step.reason not in STATE_REASONS:
            continue  # a row 0-12 drop (UDPReceiver): no state changes
        job_id, w = _sender(case, step.frame)
        msg = wire.Message.from_bytes(step.frame[wire.SWITCHML_OFFSET :])
        _same(tna_pass(slots[job_id], w, msg), _expected(step), what)


def test_the_table_has_the_cases_this_needs():
    """Rounds of both versions in turn, loss and duplication, mismatches, an empty result."""
    names = {c.name for c in _tna_cases()}
    assert {"sparse_rounds_n3", "sparse_loss_and_duplication", "sparse_bad_input"} <= names


def test_round_table_claims_in_the_first_pass_and_closes_in_harvest_7():
    """The model's two uses of round_key are SparseRound.round's two entries."""
    text = (TNA / "sparse_round.p4").read_text()
    entries = re.findall(r"^\s*\((\d), (\d), (STEP_\w+), (\w+)\): (\w+)\(\);", text, re.M)
    assert entries == [
        ("1", "1", "STEP_CONSUME0", "_", "claim_action"),
        ("1", "1", "STEP_HARVEST7", "AGG_COMPLETED", "close_action"),
    ]
    switchml = (TNA / "switchml.p4").read_text()
    # the close pass indexes the other version's entry
    assert "ig_md.sml.slot ++ ~ig_md.sml.version" in switchml


def test_a_stale_key_would_be_refused_before_the_bitmap():
    """A new contribution naming another block than the open round's changes nothing: its
    worker's later good contribution still counts, and the round completes with it."""
    st = TnaSlots(2, 32)
    a, b = np.arange(32), np.arange(32) * 3

    def msg(block, vals, nxt=9):
        return wire.Message(2, 1, 0, 0, 4, 0, 0, 0, vals, sparse=wire.Sparse(block, nxt, 40))

    assert tna_pass(st, 0, msg(4, a)).reason == Reason.AGGREGATED
    assert tna_pass(st, 1, msg(12, b, 16)).reason == Reason.DROP_SPARSE_MISMATCH
    out = tna_pass(st, 1, msg(4, b))
    assert out.reason == Reason.COMPLETED
    np.testing.assert_array_equal(out.values, a + b)
