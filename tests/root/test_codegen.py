"""One wire format: the generated C and P4 headers match the Python definitions, and the
compiled program's BTF has the sizes and offsets that wire.py and abi.py say."""

import ctypes as ct
import json
import shutil
import subprocess

import numpy as np
import pytest

from xdp_agg.codegen import abi
from xdp_agg.codegen import generate as codegen
from xdp_agg.proto import wire


def test_generated_files_are_current():
    assert codegen.drift() == [], "run `python -m xdp_agg.codegen` and commit the result"


def test_codegen_check_mode_reports_drift(tmp_path, monkeypatch):
    monkeypatch.setattr(codegen, "ROOT", tmp_path)
    assert codegen.main(["--check"]) == 1
    assert codegen.main([]) == 0
    assert codegen.main(["--check"]) == 0


def test_header_members_are_byte_aligned_and_sized():
    sml = wire.members(wire.SWITCHML)
    assert [(m.name, m.offset, m.nbytes) for m in sml] == [
        ("msg_type_size", 0, 1),
        ("job_number", 1, 1),
        ("tsi", 2, 4),
        ("pool_index", 6, 2),
    ]
    assert (
        wire.SML_DTYPE.itemsize == wire.SWITCHML_HLEN and wire.EXP_DTYPE.itemsize == wire.EXP_HLEN
    )


def test_scapy_layer_matches_numpy_packing():
    from xdp_agg.proto.scapy_layer import Exponents, SwitchML

    vals = np.arange(-16, 16)
    ours = wire.build_payloads(
        job_number=3,
        size_code=0,
        tsi=0xDEADBEEF,
        slot=0x1234,
        version=1,
        values=vals[None],
        e0=-5,
        e1=7,
    )[0]
    theirs = bytes(
        SwitchML(msg_type=1, size=0, job_number=3, tsi=0xDEADBEEF, pool_index=0x9234)
        / Exponents(e0=-5, e1=7, values=list(vals))
    )
    assert ours.tobytes() == theirs
    msg = wire.Message.from_bytes(theirs)
    assert (
        msg.msg_type,
        msg.size,
        msg.job_number,
        msg.tsi,
        msg.slot,
        msg.version,
        msg.e0,
        msg.e1,
    ) == (1, 0, 3, 0xDEADBEEF, 0x1234, 1, -5, 7)
    np.testing.assert_array_equal(msg.values, vals)


def test_p4_header_lists_every_field():
    text = codegen.wire_p4()
    for h in wire.HEADERS:
        for f in h.fields:
            assert f"bit<{f.bits}> {f.name};" in text


@pytest.mark.root
@pytest.mark.bpf
def test_btf_layout_matches_python(agg_prog):
    """Sizes and member offsets in the loaded program's BTF equal wire.py's and abi.py's."""
    _check_btf_layout(agg_prog[0])


def _check_btf_layout(prog) -> None:
    from xdp_agg import bpfsys

    if not shutil.which("bpftool"):
        pytest.fail("bpftool is missing: run `make deps`")
    # the maps carry the object's BTF (clang's), with every type the program uses
    btf_id = bpfsys.map_info(prog.maps["jobs"]).btf_id
    dump = json.loads(
        subprocess.run(
            ["bpftool", "-j", "btf", "dump", "id", str(btf_id)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    structs = {t["name"]: t for t in dump["types"] if t.get("kind") == "STRUCT"}

    for h in wire.HEADERS:
        t = structs[f"{h.name}_hdr"]
        assert t["size"] == h.length
        assert [(m["name"], m["bits_offset"] // 8) for m in t["members"]] == [
            (m.name, m.offset) for m in wire.members(h)
        ]
    anchor = structs["agg_btf_anchor"]
    assert [m["bits_offset"] // 8 for m in anchor["members"]][:3] == [
        0,
        wire.SWITCHML_HLEN,
        wire.SPARSE_AT,
    ]

    for s in abi.STRUCTS:
        t = structs[s.name]
        cls = s.ctypes()
        assert t["size"] == ct.sizeof(cls), s.name
        assert [(m["name"], m["bits_offset"] // 8) for m in t["members"]] == [
            (f, getattr(cls, f).offset) for f, _ in cls._fields_
        ], s.name


def test_key_formulas_agree_between_python_and_the_generated_c():
    """xdp_agg.proto.keys is compiled for Python and written into abi.h: both from one
    expression."""
    from xdp_agg.proto import keys, limits, reasons

    text = (codegen.ROOT / "bpf/generated/abi.h").read_text()
    for k in keys.KEYS:
        assert f"#define AGG_{k.name.upper()}({', '.join(k.args)}) ({k.expr})" in text
    assert keys.pool_entry(5, 1) == 11
    assert (
        keys.counter_key(limits.NO_JOB, reasons.Reason.PASS) == limits.NO_JOB * reasons.NUM_REASONS
    )
    assert keys.worker_key(2, 3) == 2 * limits.MAX_WORKERS + 3
