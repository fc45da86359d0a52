"""BPF instructions, written in Python under the kernel's names: the opcode fields of
include/uapi/linux/bpf_common.h and bpf.h, and builders named and shaped like the macros of the
kernel's include/linux/filter.h (hostlib/bpf_insn.h is the C twin). Every place in the project
that writes instructions by hand uses these; tests/unit/test_bpf_insn.py checks each constant
against the kernel's header.

An instruction is one 64-bit integer as the kernel reads it on a little-endian machine (code,
dst_reg | src_reg << 4, off, imm), the form :func:`xdp_agg.bpfsys.prog_load` takes; BPF_LD_IMM64
and BPF_LD_MAP_FD give two. A jump's ``off`` may be a label's name instead of a number:
:func:`assemble` counts it, given the program as instructions and label names.

    assemble([BPF_JMP_IMM(BPF_JNE, BPF_REG_1, 0, "out"), BPF_MOV64_IMM(BPF_REG_0, 1),
              BPF_EXIT_INSN(), "out", BPF_MOV64_IMM(BPF_REG_0, 2), BPF_EXIT_INSN()])
"""

from __future__ import annotations

from dataclasses import dataclass

# instruction classes (bpf_common.h; BPF_JMP32 and BPF_ALU64 from bpf.h)
BPF_LD, BPF_LDX, BPF_ST, BPF_STX = 0x00, 0x01, 0x02, 0x03
BPF_ALU, BPF_JMP, BPF_JMP32, BPF_ALU64 = 0x04, 0x05, 0x06, 0x07
# load and store sizes and modes
BPF_W, BPF_H, BPF_B, BPF_DW = 0x00, 0x08, 0x10, 0x18
BPF_IMM, BPF_ABS, BPF_IND, BPF_MEM, BPF_ATOMIC = 0x00, 0x20, 0x40, 0x60, 0xC0
# the source operand: the immediate or src_reg
BPF_K, BPF_X = 0x00, 0x08
# ALU operations
BPF_ADD, BPF_SUB, BPF_MUL, BPF_DIV, BPF_OR, BPF_AND = 0x00, 0x10, 0x20, 0x30, 0x40, 0x50
BPF_LSH, BPF_RSH, BPF_NEG, BPF_MOD, BPF_XOR = 0x60, 0x70, 0x80, 0x90, 0xA0
BPF_MOV, BPF_ARSH, BPF_END = 0xB0, 0xC0, 0xD0
BPF_TO_LE, BPF_TO_BE = 0x00, 0x08
# jump operations
BPF_JA, BPF_JEQ, BPF_JGT, BPF_JGE, BPF_JSET, BPF_JNE = 0x00, 0x10, 0x20, 0x30, 0x40, 0x50
BPF_JSGT, BPF_JSGE, BPF_CALL, BPF_EXIT = 0x60, 0x70, 0x80, 0x90
BPF_JLT, BPF_JLE, BPF_JSLT, BPF_JSLE = 0xA0, 0xB0, 0xC0, 0xD0
# src_reg of BPF_LD | BPF_IMM | BPF_DW and of BPF_CALL
BPF_PSEUDO_MAP_FD, BPF_PSEUDO_MAP_VALUE, BPF_PSEUDO_FUNC = 1, 2, 4
BPF_PSEUDO_CALL = 1
# registers
BPF_REG_0, BPF_REG_1, BPF_REG_2, BPF_REG_3, BPF_REG_4, BPF_REG_5 = range(6)
BPF_REG_6, BPF_REG_7, BPF_REG_8, BPF_REG_9, BPF_REG_10 = range(6, 11)
BPF_REG_FP = BPF_REG_10


@dataclass(frozen=True)
class Jump:
    """A jump whose offset is a label's, counted by :func:`assemble`."""

    code: int
    dst: int
    src: int
    label: str
    imm: int


def BPF_RAW_INSN(code: int, dst: int, src: int, off: int, imm: int) -> int:  # noqa: N802
    """One instruction as its 64-bit little-endian integer."""
    return code | dst << 8 | src << 12 | (off & 0xFFFF) << 16 | (imm & 0xFFFFFFFF) << 32


def _jump(code: int, dst: int, src: int, off: int | str, imm: int) -> int | Jump:
    if isinstance(off, str):
        return Jump(code, dst, src, off, imm)
    return BPF_RAW_INSN(code, dst, src, off, imm)


# The builders, as include/linux/filter.h names them (upper case, so that a program reads as
# the kernel's and hostlib/bpf_insn.h's do).
# ruff: noqa: N802


def BPF_MOV64_REG(dst: int, src: int) -> int:
    return BPF_RAW_INSN(BPF_ALU64 | BPF_MOV | BPF_X, dst, src, 0, 0)


def BPF_MOV64_IMM(dst: int, imm: int) -> int:
    return BPF_RAW_INSN(BPF_ALU64 | BPF_MOV | BPF_K, dst, 0, 0, imm)


def BPF_MOV32_IMM(dst: int, imm: int) -> int:
    return BPF_RAW_INSN(BPF_ALU | BPF_MOV | BPF_K, dst, 0, 0, imm)


def BPF_ALU64_IMM(op: int, dst: int, imm: int) -> int:
    return BPF_RAW_INSN(BPF_ALU64 | op | BPF_K, dst, 0, 0, imm)


def BPF_ALU64_REG(op: int, dst: int, src: int) -> int:
    return BPF_RAW_INSN(BPF_ALU64 | op | BPF_X, dst, src, 0, 0)


def BPF_ALU32_IMM(op: int, dst: int, imm: int) -> int:
    return BPF_RAW_INSN(BPF_ALU | op | BPF_K, dst, 0, 0, imm)


def BPF_ENDIAN(type_: int, dst: int, length: int) -> int:
    """Byte swap to (BPF_TO_BE) or from network order: `length` is 16, 32 or 64 bits."""
    return BPF_RAW_INSN(BPF_ALU | BPF_END | type_, dst, 0, 0, length)


def BPF_LDX_MEM(size: int, dst: int, src: int, off: int) -> int:
    return BPF_RAW_INSN(BPF_LDX | size | BPF_MEM, dst, src, off, 0)


def BPF_STX_MEM(size: int, dst: int, src: int, off: int) -> int:
    return BPF_RAW_INSN(BPF_STX | size | BPF_MEM, dst, src, off, 0)


def BPF_ST_MEM(size: int, dst: int, off: int, imm: int) -> int:
    return BPF_RAW_INSN(BPF_ST | size | BPF_MEM, dst, 0, off, imm)


def BPF_LD_IMM64_RAW(dst: int, src: int, imm: int) -> list[int]:
    """The two-slot 64-bit immediate load."""
    return [
        BPF_RAW_INSN(BPF_LD | BPF_DW | BPF_IMM, dst, src, 0, imm & 0xFFFFFFFF),
        BPF_RAW_INSN(0, 0, 0, 0, (imm >> 32) & 0xFFFFFFFF),
    ]


def BPF_LD_IMM64(dst: int, imm: int) -> list[int]:
    return BPF_LD_IMM64_RAW(dst, 0, imm)


def BPF_LD_MAP_FD(dst: int, map_fd: int) -> list[int]:
    """dst = the map of `map_fd` (the kernel turns the fd into the map at load)."""
    return BPF_LD_IMM64_RAW(dst, BPF_PSEUDO_MAP_FD, map_fd)


def BPF_JMP_IMM(op: int, dst: int, imm: int, off: int | str) -> int | Jump:
    return _jump(BPF_JMP | op | BPF_K, dst, 0, off, imm)


def BPF_JMP_REG(op: int, dst: int, src: int, off: int | str) -> int | Jump:
    return _jump(BPF_JMP | op | BPF_X, dst, src, off, 0)


def BPF_JMP32_IMM(op: int, dst: int, imm: int, off: int | str) -> int | Jump:
    """A compare of the lower 32 bits: the immediate is not sign-extended to 64."""
    return _jump(BPF_JMP32 | op | BPF_K, dst, 0, off, imm)


def BPF_JMP32_REG(op: int, dst: int, src: int, off: int | str) -> int | Jump:
    return _jump(BPF_JMP32 | op | BPF_X, dst, src, off, 0)


def BPF_JMP_A(off: int | str) -> int | Jump:
    return _jump(BPF_JMP | BPF_JA, 0, 0, off, 0)


def BPF_EMIT_CALL(func: int) -> int:
    """Call helper number `func` (enum bpf_func_id)."""
    return BPF_RAW_INSN(BPF_JMP | BPF_CALL, 0, 0, 0, func)


def BPF_EXIT_INSN() -> int:
    return BPF_RAW_INSN(BPF_JMP | BPF_EXIT, 0, 0, 0, 0)


def assemble(body: list) -> list[int]:
    """A program's instructions from `body`: instructions, lists of them (BPF_LD_IMM64), label
    names (where the next instruction is) and jumps to labels, whose offsets are counted here."""
    flat: list = []
    for x in body:
        flat.extend(x if isinstance(x, list) else [x])
    labels, at = {}, 0
    for x in flat:
        if isinstance(x, str):
            labels[x] = at
        else:
            at += 1
    code: list[int] = []
    for x in flat:
        if isinstance(x, str):
            continue
        if isinstance(x, Jump):
            x = BPF_RAW_INSN(x.code, x.dst, x.src, labels[x.label] - len(code) - 1, x.imm)
        code.append(x)
    return code


def to_bytes(insns: list[int]) -> bytes:
    """The instructions as the kernel reads them (struct bpf_insn, little-endian)."""
    return b"".join(i.to_bytes(8, "little") for i in insns)
