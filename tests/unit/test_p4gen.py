"""The generated P4 parts (xdp_agg/codegen/p4.py) say what the Python side says (drift:
test_codegen)."""

import re
from pathlib import Path

from xdp_agg.codegen import p4 as p4gen
from xdp_agg.proto import limits, reasons


def test_abi_p4_has_every_reason_with_its_value():
    text = p4gen.abi_p4()
    for r in reasons.Reason:
        assert f"const bit<8> AGG_{r.name} = {int(r)};" in text
    assert f"AGG_NUM_REASONS = {reasons.NUM_REASONS};" in text
    assert f"AGG_NO_JOB = {limits.NO_JOB};" in text


def test_every_element_is_summed_once_into_its_own_field():
    """Element i of a 64-element packet: Processor value<i> on field d<i // 32>.d<i % 32>."""
    text = p4gen.elements_v1model()
    for i in range(64):
        line = f"value{i:02d}.apply(hdr.d{i // 32}.d{i % 32:02d}, md);"
        assert text.count(line) == 1, line
        assert text.count(f"Processor() value{i:02d};") == 1
    assert "Processor() value64;" not in text
    tna = p4gen.elements_tna()
    for i in range(32):  # a register pair each: element i of d0 and of d1
        assert tna.count(f"value{i:02d}.apply(hdr.d0.d{i:02d}, hdr.d1.d{i:02d}, md);") == 1
    assert "Processor() value32;" not in tna
    payload = p4gen.payload_p4()
    assert sum(1 for ln in payload.splitlines() if ln.strip().startswith("bit<32> d")) == 32


def test_a_folded_packet_brings_each_element_to_its_processor_once():
    """The rotation of elements.p4, run on header names: in pass p the Processors see d0 and d1,
    which hold elements 64p..64p+63 of a 256-element packet; after the last pass every header is
    back where it was."""
    text = p4gen.elements_v1model()
    body = text[text.index("if (hdr.d7.isValid())") :]
    moves = re.findall(r"^\s+(?:payload_h )?(\w+(?:\.\w+)?) = (\w+(?:\.\w+)?);$", body, re.M)
    assert len(moves) == p4gen.PAYLOAD_HEADERS + p4gen.PASS_HEADERS
    where = {f"hdr.d{h}": h for h in range(p4gen.PAYLOAD_HEADERS)}  # field -> original header
    seen = []
    for _ in range(p4gen.PASSES):
        seen += [where["hdr.d0"], where["hdr.d1"]]
        new = dict(where)
        for dst, src in moves:
            new[dst] = new[src] if src.startswith("t") else where[src]
        where = {k: v for k, v in new.items() if k.startswith("hdr.")}
    assert seen == list(range(p4gen.PAYLOAD_HEADERS))
    assert where == {f"hdr.d{h}": h for h in range(p4gen.PAYLOAD_HEADERS)}
    assert f"SML_PASSES = {p4gen.PASSES};" in text and 256 in p4gen.P4_ELEMS


def test_tofino_counter_entries_tell_each_workers_retransmission():
    """WorkersCounter.count (p4/tna): one entry per worker index, matching exactly that worker's
    bit of bitmap_before, so a packet is a retransmission iff its worker's bit was set."""
    text = p4gen.worker_seen_entries_tna()
    entries = re.findall(
        r"^\((\d+), 32w(0x[0-9a-f]+) &&& 32w(0x[0-9a-f]+)\): (\w+)\(\);$", text, re.M
    )
    assert [int(w) for w, *_ in entries] == list(range(p4gen.TNA_MAX_WORKERS))
    for w, value, mask, action in entries:
        assert int(value, 16) == int(mask, 16) == 1 << int(w)
        assert action == "count_retransmission"


def _tna_step_entries() -> dict[tuple[str, int, str], tuple[str, list[int]]]:
    """next_step's entries: (size, step, reason) -> (action, its arguments)."""
    text = p4gen.next_step_entries_tna()
    found = re.findall(r"^\((SML_SIZE_\d+), (\d+), (AGG_\w+)\): (\w+)\(([\d, ]*)\);$", text, re.M)
    return {
        (size, int(step), r): (action, [int(a) for a in args.split(",") if a.strip()])
        for size, step, r, action, args in found
    }


def _tna_sum_action(step: int, is_new: int, count_before: int) -> str:
    """Processor.sum (p4/tna/processor.p4) for one pass: its const entries, first match wins."""
    text = (Path(__file__).resolve().parents[2] / "p4" / "tna" / "processor.p4").read_text()
    block = text[text.index("const entries") : text.index("const default_action")]
    for v, m, new, count, action in re.findall(
        r"\(1, (\d+) &&& (\d+), ([01_]), ([0-9_])\): (\w+)\(\);", block
    ):
        if (
            step & int(m) == int(v)
            and new in ("_", str(is_new))
            and count in ("_", str(count_before))
        ):
            return action
    return "NoAction"


# (is_new, count_before) the counter gives for a reason (workers_counter.p4)
TNA_COUNTER = {
    "AGG_COMPLETED": (1, 1),
    "AGG_AGGREGATED": (1, 2),
    "AGG_RETX_ANSWERED": (0, 0),
    "AGG_DUP_PENDING": (0, 2),
}


def _tna_parse(size: str, step: int, payload: list[int]):
    """The ingress parser's payload headers for a pass: (d0, d1, the rest); None: not parsed."""
    if size == "SML_SIZE_32":
        return None, payload[:32], payload[32:]  # in d1
    if step < 8 or size == "SML_SIZE_64":
        return payload[:32], payload[32:64], payload[64:]
    return None, None, payload  # a 256-element harvest pass parses no payload


def _run_tna_passes(
    size: str, reason: str, mine: list[int], stored: list[list[list[int]]], sparse_job=False
):
    """The Tofino program's passes for one packet of ours (its parser, Processor.sum and
    next_step on the payload headers): (its elements when it leaves, how it leaves, passes).
    `stored[q][i]` is the register pair of quarter q, element i, before the packet. A sparse
    job's 32-element completion takes the close pass (NextStepSelector's gateway)."""
    entries, (is_new, count) = dict(_tna_step_entries()), TNA_COUNTER[reason]
    if sparse_job:
        entries["SML_SIZE_32", 0, "AGG_COMPLETED"] = ("harvest_next", [15, 0])
    payload, step, quarter, passes = list(mine), 0, 0, 0
    while True:
        passes += 1
        d0, d1, payload = _tna_parse(size, step, payload)
        d0_valid = d0 is not None  # a read into an unparsed d0 leaves it invalid
        action, pair = _tna_sum_action(step, is_new, count), stored[quarter]
        if action in ("write_read1_action", "sum_read1_action"):  # count 1 or more: adds
            for i in range(32):
                pair[i] = [pair[i][0] + (d0[i] if d0 else 0), pair[i][1] + d1[i]]
        if action != "NoAction":
            half = [pair[i][0 if action == "read0_action" else 1] for i in range(32)]
            d0, d1 = (half, d1) if action == "read0_action" else (d0, half)
        name, args = entries.get((size, step, reason), ("drop", []))
        if name in ("result", "answer", "harvest_next") and not d0_valid:
            d0 = None  # these do not make d0 valid (a 32-element close pass reads into it)
        if name == "consume_next":
            d0 = d1 = None
        elif name == "harvest_d1_next":
            d0 = None
        elif name == "harvest_d0_next":
            d1 = None
        packet = (d0 or []) + (d1 or []) + payload  # the deparser: d0, d1, then the rest
        if not name.endswith("_next"):
            return packet, name, passes
        payload, (step, quarter) = packet, args


def _tna_store(size: str, elements: list[int]) -> list[list[list[int]]]:
    """The register pairs after one contribution: quarter q holds elements 64q..64q+63 (d0's
    half first); a 32-element packet's elements are second halves (it is parsed into d1)."""
    pairs = [[[0, 0] for _ in range(32)] for _ in range(4)]
    if size == "SML_SIZE_32":
        for i in range(32):
            pairs[0][i][1] = elements[i]
        return pairs
    for q in range(len(elements) // 64):
        for i in range(32):
            pairs[q][i] = [elements[64 * q + i], elements[64 * q + 32 + i]]
    return pairs


TNA_SIZES = (("SML_SIZE_32", 32), ("SML_SIZE_64", 64), ("SML_SIZE_256", 256))


def test_tofino_passes_put_every_element_of_a_result_back_in_order():
    """p4/tna's passes (next_step_entries.p4 with processor.p4's `sum`): the last worker's 32-,
    64- and 256-element packet leaves with the sum of element i at position i, after 1, 2 and 12
    passes; a retransmission for the completed slot gets the stored sums, in as many passes."""
    for (size, n), passes in zip(TNA_SIZES, (1, 2, 12)):
        other, mine = [7 * i + 3 for i in range(n)], [1000 + i for i in range(n)]
        packet, how, k = _run_tna_passes(size, "AGG_COMPLETED", mine, _tna_store(size, other))
        assert (how, k) == ("result_harvested" if n == 256 else "result", passes), size
        assert packet == [a + b for a, b in zip(other, mine)], size
        packet, how, k = _run_tna_passes(size, "AGG_RETX_ANSWERED", mine, _tna_store(size, other))
        assert how.startswith("answer") and k == passes and packet == other, size


def test_tofino_sparse_completion_of_32_elements_takes_the_close_pass():
    """A sparse job's 32-element completion goes round once more (harvest 7, where SparseRound
    closes the other version's round key, p4/tna/sparse_round.p4) and leaves with its 32 sums
    in place; its answers to retransmissions still leave from the first pass."""
    other, mine = [7 * i + 3 for i in range(32)], [1000 + i for i in range(32)]
    stored = _tna_store("SML_SIZE_32", other)
    packet, how, k = _run_tna_passes("SML_SIZE_32", "AGG_COMPLETED", mine, stored, True)
    assert (packet, how, k) == ([a + b for a, b in zip(other, mine)], "result", 2)
    stored = _tna_store("SML_SIZE_32", other)
    packet, how, k = _run_tna_passes("SML_SIZE_32", "AGG_RETX_ANSWERED", mine, stored, True)
    assert (packet, how, k) == (other, "answer", 1)
    gate = (
        Path(__file__).resolve().parents[2] / "p4" / "tna" / "next_step_selector.p4"
    ).read_text()
    assert "harvest_next(STEP_HARVEST7, 0); // the close pass" in gate


def test_tofino_passes_drop_what_does_not_complete():
    """An AGGREGATED packet stops after its last consume pass (4 for 256 elements), every other
    reason after its first: dropped by next_step's default action, counted then."""
    for (size, n), passes in zip(TNA_SIZES, (1, 1, 4)):
        mine, stored = list(range(n)), _tna_store(size, [0] * n)
        assert _run_tna_passes(size, "AGG_AGGREGATED", mine, stored)[1:] == ("drop", passes)
        assert _run_tna_passes(size, "AGG_DUP_PENDING", mine, stored)[1:] == ("drop", 1)
