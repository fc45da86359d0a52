"""Link the program's bpf_loop() callbacks into it, load it with their BTF, and say why the
verifier refused it when it did.

bcc compiles every non-static function of bpf/xdp_agg.c on its own and cannot emit a reference
to a function's address, which bpf_loop() takes. So the program names a callback by a 64-bit
constant (bpf/consts.h, AGG_CALLBACK: CALLBACK_MAGIC in the upper half, the callback's id in the
lower), and `link` appends the callback's compiled code after the program and rewrites the
constant's ld_imm64 into the kernel's reference to it (src_reg BPF_PSEUDO_FUNC, imm the offset
from the next instruction to the callback, include/uapi/linux/bpf.h). The kernel takes a
callback only with BTF func_info that gives it static linkage, which `load` supplies
(bpfsys.btf). Every program the loader loads goes through here, callbacks or not, so that a
refusal reads the same everywhere (`explain`).
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass

from xdp_agg import bpfsys
from xdp_agg.bpfsys import btf

CALLBACK_MAGIC = 0x58414743  # "XAGC": passed to the C as -DAGG_CALLBACK_MAGIC
CALLBACK_NAME = "agg_gather_{}"  # the function of callback id K (bpf/aggregate.h)
# callbacks of other ids (bpf/consts.h): the test builds' race-window spin
CALLBACK_NAMES = {1: "agg_race_spin"}
_INSN = struct.Struct("<BBhi")  # struct bpf_insn: code, dst/src registers, off, imm
LD_IMM64 = 0x18  # BPF_LD | BPF_IMM | BPF_DW: two instruction slots
BPF_PSEUDO_FUNC = 4  # ld_imm64 src_reg: imm is a subprogram's offset
VERIFIER_LIMIT = 1_000_000  # BPF_COMPLEXITY_LIMIT_INSNS, kernel/bpf/verifier.c


class LinkError(ValueError):
    """A callback reference the loader cannot resolve (a bug in the program, not the machine)."""


@dataclass
class Linked:
    """A program with its callbacks appended: the instructions, and (name, first instruction)
    of each function, the entry first."""

    code: bytes
    funcs: list[tuple[str, int]]


def _callbacks(code: bytes):
    """(slot, callback id) of every ld_imm64 that carries the callback magic."""
    i, n = 0, len(code) // 8
    while i < n:
        op, _, _, lo = _INSN.unpack_from(code, 8 * i)
        if op == LD_IMM64:
            hi = _INSN.unpack_from(code, 8 * (i + 1))[3] & 0xFFFFFFFF
            if hi == CALLBACK_MAGIC:
                yield i, lo & 0xFFFFFFFF
            i += 2
        else:
            i += 1


def link(b, name: str) -> Linked:
    """bcc's compiled `name` with every callback it references appended once and linked."""
    code = bytearray(b.dump_func(name.encode()))
    funcs = [(name, 0)]
    start: dict[int, int] = {}
    for slot, cb in list(_callbacks(bytes(code))):
        if cb not in start:
            cb_name = CALLBACK_NAMES.get(cb) or CALLBACK_NAME.format(cb)
            try:
                cb_code = b.dump_func(cb_name.encode())
            except Exception as e:  # bcc: "Unknown program"
                raise LinkError(f"{name} calls back {cb_name}, which was not compiled") from e
            if any(True for _ in _callbacks(cb_code)):
                raise LinkError(f"{cb_name} references a callback itself: not supported")
            start[cb] = len(code) // 8
            funcs.append((cb_name, start[cb]))
            code += cb_code
        _, regs, off, _ = _INSN.unpack_from(code, 8 * slot)
        regs = (regs & 0x0F) | (BPF_PSEUDO_FUNC << 4)
        _INSN.pack_into(code, 8 * slot, LD_IMM64, regs, off, start[cb] - (slot + 1))
        _INSN.pack_into(code, 8 * (slot + 1), 0, 0, 0, 0)
    return Linked(bytes(code), funcs)


def explain(log: str) -> str:
    """The real cause of a verifier refusal, from its log: the processed-instruction limit, or
    the instruction it stopped at and what it said of it."""
    lines = [line for line in log.strip().splitlines() if line.strip()]
    m = re.search(r"BPF program is too large\. Processed (\d+) insn", log)
    if m:
        return (
            f"the verifier gave up after {int(m.group(1)):,} processed instructions, its limit "
            f"of {VERIFIER_LIMIT:,} (the program's verification grew too large)"
        )
    insns = [i for i, line in enumerate(lines) if re.match(r"\d+: \(", line)]
    if not insns:
        return lines[-1] if lines else "no verifier log"
    at = insns[-1]
    said = [line for line in lines[at + 1 :] if not line.startswith("processed ")]
    reason = said[0] if said else "(no message)"
    insn = lines[at].split(";")[0].strip()  # without the register states of a verbose log
    return f"at instruction {insn.split(':')[0]} ({insn}): {reason}"


def load(b, name: str, as_name: str, prog_flags: int, attach_type: int) -> tuple[int, int]:
    """Link and load bcc's compiled `name` as an XDP program called `as_name`; returns (fd,
    instructions the verifier processed). Raises bpfsys.ProgLoadError (its log's tail kept)."""
    linked = link(b, name)
    funcs = [btf.Func(as_name if i == 0 else f, i == 0, 1) for i, (f, _) in enumerate(linked.funcs)]
    blob, type_ids = btf.encode(funcs)
    btf_fd = btf.load(blob)
    try:
        fd = bpfsys.prog_load(
            bpfsys.PROG_TYPE_XDP,
            linked.code,
            as_name,
            prog_flags=prog_flags,
            expected_attach_type=attach_type,
            btf_fd=btf_fd,
            func_info=tuple((off, t) for (_, off), t in zip(linked.funcs, type_ids)),
        )
    finally:
        os.close(btf_fd)  # the program holds its own reference
    return fd, bpfsys.prog_info(fd).verified_insns
