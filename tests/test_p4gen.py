"""The generated P4 parts (aggcodegen/p4.py) say what the Python side says (drift: test_codegen)."""

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
    tna = p4gen.elements_tna()
    for i in range(32):
        assert tna.count(f"value{i:02d}.apply(hdr.d0.d{i:02d}, md);") == 1
    payload = p4gen.payload_p4()
    assert sum(1 for ln in payload.splitlines() if ln.strip().startswith("bit<32> d")) == 32
