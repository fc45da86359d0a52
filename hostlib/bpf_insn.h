/*
 * BPF instructions as C initialisers, under the names the kernel gives them
 * (include/linux/filter.h; xdp-tools' lib/libxdp/bpf_instr.h carries the same set for user
 * space), written here because the uapi headers do not ship them; and jumps to labels, whose
 * offsets bpf_fix_label counts once the program is written.
 */
#ifndef HOSTLIB_BPF_INSN_H
#define HOSTLIB_BPF_INSN_H

#include <linux/bpf.h>
#include <stddef.h>

#define BPF_INSN(CODE, DST, SRC, OFF, IMM) \
    ((struct bpf_insn){                    \
        .code = (CODE), .dst_reg = (DST), .src_reg = (SRC), .off = (OFF), .imm = (IMM)})

#define BPF_MOV64_REG(DST, SRC)     BPF_INSN(BPF_ALU64 | BPF_MOV | BPF_X, DST, SRC, 0, 0)
#define BPF_MOV64_IMM(DST, IMM)     BPF_INSN(BPF_ALU64 | BPF_MOV | BPF_K, DST, 0, 0, IMM)
#define BPF_ALU64_IMM(OP, DST, IMM) BPF_INSN(BPF_ALU64 | BPF_OP(OP) | BPF_K, DST, 0, 0, IMM)
#define BPF_ENDIAN(TYPE, DST, LEN)  BPF_INSN(BPF_ALU | BPF_END | BPF_SRC(TYPE), DST, 0, 0, LEN)
#define BPF_LDX_MEM(SIZE, DST, SRC, OFF) \
    BPF_INSN(BPF_LDX | BPF_SIZE(SIZE) | BPF_MEM, DST, SRC, OFF, 0)
#define BPF_STX_MEM(SIZE, DST, SRC, OFF) \
    BPF_INSN(BPF_STX | BPF_SIZE(SIZE) | BPF_MEM, DST, SRC, OFF, 0)
#define BPF_JMP_REG(OP, DST, SRC, OFF) BPF_INSN(BPF_JMP | BPF_OP(OP) | BPF_X, DST, SRC, OFF, 0)
#define BPF_JMP_IMM(OP, DST, IMM, OFF) BPF_INSN(BPF_JMP | BPF_OP(OP) | BPF_K, DST, 0, OFF, IMM)
#define BPF_EMIT_CALL(FUNC)            BPF_INSN(BPF_JMP | BPF_CALL, 0, 0, 0, FUNC)
#define BPF_EXIT_INSN()                BPF_INSN(BPF_JMP | BPF_EXIT, 0, 0, 0, 0)
/* two instructions: the 64-bit immediate is a map's fd, which the kernel turns into the map */
#define BPF_LD_MAP_FD(DST, MAP_FD) \
    BPF_INSN(BPF_LD | BPF_DW | BPF_IMM, DST, BPF_PSEUDO_MAP_FD, 0, MAP_FD), BPF_INSN(0, 0, 0, 0, 0)

/* A jump's offset that names label L (small, negative: no real jump of ours goes backwards). */
#define BPF_LABEL(L) (-1000 - (L))

/* Point every jump to label `label` at instruction `at`. */
static inline void bpf_fix_label(struct bpf_insn *p, size_t n, int label, size_t at)
{
    for (size_t i = 0; i < n; i++)
        if (BPF_CLASS(p[i].code) == BPF_JMP && p[i].off == BPF_LABEL(label))
            p[i].off = (short)((long)at - (long)i - 1);
}

#endif
