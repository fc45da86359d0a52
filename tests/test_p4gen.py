"""The generated P4 parts (aggcodegen/p4.py) say what the Python side says (drift: test_codegen)."""

import re

from aggcodegen import p4 as p4gen
from aggproto import limits, reasons


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
    for i in range(32):
        assert tna.count(f"value{i:02d}.apply(hdr.d0.d{i:02d}, md);") == 1
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
