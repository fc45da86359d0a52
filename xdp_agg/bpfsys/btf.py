"""The smallest BTF a program with subprograms needs: one FUNC per subprogram.

The kernel refuses a bpf_loop() callback (a BPF_PSEUDO_FUNC reference) unless the program
carries BTF func_info, and wants the callback's FUNC to have static linkage
(kernel/bpf/verifier.c, check_ld_imm: "missing btf func_info", "callback function not static").
bcc builds BTF for what it loads itself, but xdp_switch.loader links the callbacks into the
program and loads it here, so it describes the functions itself: their names, linkage and
argument count, every argument and return value a plain 64-bit integer (the verifier takes
the argument types of static functions from the call, not from BTF).
"""

from __future__ import annotations

import ctypes as ct
import struct
from dataclasses import dataclass

from . import _U8, _U32, _U64, _fields

BTF_MAGIC = 0xEB9F
BTF_KIND_INT, BTF_KIND_FUNC, BTF_KIND_FUNC_PROTO = 1, 12, 13
BTF_FUNC_STATIC, BTF_FUNC_GLOBAL = 0, 1
_HDR = struct.Struct("<HBBIIIII")  # struct btf_header
_TYPE = struct.Struct("<III")  # struct btf_type: name_off, info, size or type
_PARAM = struct.Struct("<II")  # struct btf_param: name_off, type
FUNC_INFO_REC = struct.Struct("<II")  # struct bpf_func_info: insn_off, type_id


@dataclass(frozen=True)
class Func:
    """A subprogram: its name, whether it is the program's entry (global linkage) or a static
    function (a callback), and how many arguments it takes."""

    name: str
    entry: bool
    args: int


def _info(kind: int, vlen: int = 0) -> int:
    return (kind << 24) | vlen


def encode(funcs: list[Func]) -> tuple[bytes, list[int]]:
    """The BTF blob describing `funcs`, and the type id of each one's FUNC (for func_info)."""
    strings = bytearray(b"\0")

    def name(s: str) -> int:
        off = len(strings)
        strings.extend(s.encode() + b"\0")
        return off

    types = bytearray()
    # type 1: a 64-bit integer, every argument's and return value's type
    types += _TYPE.pack(name("u64"), _info(BTF_KIND_INT), 8) + struct.pack("<I", 64)
    next_id, func_ids = 2, []
    for f in funcs:
        types += _TYPE.pack(0, _info(BTF_KIND_FUNC_PROTO, f.args), 1)
        for i in range(f.args):
            types += _PARAM.pack(name(f"a{i}"), 1)
        linkage = BTF_FUNC_GLOBAL if f.entry else BTF_FUNC_STATIC
        types += _TYPE.pack(name(f.name), _info(BTF_KIND_FUNC, linkage), next_id)
        func_ids.append(next_id + 1)
        next_id += 2
    header = _HDR.pack(BTF_MAGIC, 1, 0, _HDR.size, 0, len(types), len(types), len(strings))
    return header + bytes(types) + bytes(strings), func_ids


class _BtfLoad(ct.Structure):
    _fields_ = _fields(
        (_U64, "btf btf_log_buf"), (_U32, "btf_size btf_log_size btf_log_level"), (_U8 * 36, "pad")
    )


def load(blob: bytes) -> int:
    """Load a BTF blob; returns its fd. A refusal raises BpfError with the kernel's BTF log."""
    from . import BTF_LOAD, BpfError, _bpf

    data = ct.create_string_buffer(blob, len(blob))
    log = ct.create_string_buffer(1 << 16)
    attr = _BtfLoad(ct.addressof(data), ct.addressof(log), len(blob), len(log), 1)
    try:
        return _bpf(BTF_LOAD, attr)
    except BpfError as e:
        raise BpfError(e.errno, f"{e}: {log.value.decode(errors='replace').strip()}") from e
