"""The one Python vocabulary of BPF instructions (xdp_agg/bpfsys/insn.py): each opcode field
has the kernel's value under the kernel's name, and the builders encode as the kernel's
include/linux/filter.h macros do. No root."""

import re
from pathlib import Path

import pytest

from xdp_agg.bpfsys import insn
from xdp_agg.bpfsys.insn import (
    BPF_ALU64_IMM,
    BPF_DW,
    BPF_EXIT_INSN,
    BPF_JMP32_IMM,
    BPF_JMP_A,
    BPF_JMP_IMM,
    BPF_JNE,
    BPF_LD_IMM64,
    BPF_LD_MAP_FD,
    BPF_LDX_MEM,
    BPF_MOV64_IMM,
    BPF_RSH,
    assemble,
    to_bytes,
)

HEADERS = [Path("/usr/include/linux/bpf_common.h"), Path("/usr/include/linux/bpf.h")]


def _kernel_defines() -> dict[str, int]:
    found = {}
    for h in HEADERS:
        for name, value in re.findall(
            r"#define\s+(BPF_\w+)\s+(0x[0-9a-fA-F]+|\d+)\b", h.read_text()
        ):
            found.setdefault(name, int(value, 0))
    return found


@pytest.mark.skipif(not all(h.exists() for h in HEADERS), reason="no linux uapi headers")
def test_every_opcode_field_is_the_kernels():
    kernel = _kernel_defines()
    ours = {
        n: v
        for n, v in vars(insn).items()
        if n.startswith("BPF_") and isinstance(v, int) and not n.startswith("BPF_REG_")
    }
    assert len(ours) > 50
    assert {n: v for n, v in ours.items() if kernel.get(n) != v} == {}


def test_the_builders_encode_as_the_kernels_macros():
    # code | dst << 8 | src << 12 | off << 16 | imm << 32 (struct bpf_insn, little-endian)
    assert BPF_MOV64_IMM(0, 2) == 0xB7 | 2 << 32
    assert BPF_EXIT_INSN() == 0x95
    assert to_bytes([BPF_LDX_MEM(BPF_DW, 0, 1, 4000)]) == bytes(
        [0x79, 0x10, 0xA0, 0x0F, 0, 0, 0, 0]
    )
    assert BPF_ALU64_IMM(BPF_RSH, 3, -1) == 0x77 | 3 << 8 | 0xFFFFFFFF << 32
    assert BPF_JMP_IMM(BPF_JNE, 5, 0x45, -2) == 0x55 | 5 << 8 | 0xFFFE << 16 | 0x45 << 32
    assert BPF_LD_IMM64(1, 1 << 32 | 7) == [0x18 | 1 << 8 | 7 << 32, 1 << 32]
    assert BPF_LD_MAP_FD(2, 9) == [0x18 | 2 << 8 | 1 << 12 | 9 << 32, 0]


def test_assemble_counts_the_labels():
    prog = assemble(
        [
            BPF_JMP32_IMM(BPF_JNE, 1, 0, "out"),
            BPF_LD_IMM64(0, 5),  # two slots
            BPF_JMP_A("out"),
            BPF_MOV64_IMM(0, 1),
            "out",
            BPF_EXIT_INSN(),
        ]
    )
    assert len(prog) == 6
    assert (prog[0] >> 16) & 0xFFFF == 4 and prog[0] & 0xFF == 0x56  # over 4 to the exit
    assert (prog[3] >> 16) & 0xFFFF == 1 and prog[3] & 0xFF == 0x05
