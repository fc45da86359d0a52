/*
 * The worker's XDP program of the AF_XDP data path, written as instructions (hostlib/xsk_prog.h).
 *
 * A frame that is IPv4 without options, unfragmented UDP to one of the lanes' ports and arrived
 * on the sockets' receive queue goes to that lane's AF_XDP socket (XSKMAP key: port - base_port);
 * anything else (ARP, ICMP, the control TCP, other ports, other queues) is passed to the kernel.
 * bpf_redirect_map's flags give XDP_PASS for a lane whose socket is not (or no longer) in the
 * map: its kernel UDP socket on the same port takes the result then. Packet loads read the raw
 * bytes, so the header constants are compared in network order.
 */
#include "xsk_prog.h"

#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_link.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "_xsk.h"

long xsk_sys_bpf(int cmd, union bpf_attr *attr)
{
    return syscall(__NR_bpf, cmd, attr, sizeof *attr);
}

int xsk_map_create(int lanes)
{
    union bpf_attr a;
    memset(&a, 0, sizeof a);
    a.map_type = BPF_MAP_TYPE_XSKMAP;
    a.key_size = a.value_size = 4;
    a.max_entries = (uint32_t)lanes;
    memcpy(a.map_name, "xdp_agg_xsks", sizeof "xdp_agg_xsks");
    return (int)xsk_sys_bpf(BPF_MAP_CREATE, &a);
}

int xsk_map_set(int map_fd, int lane, int fd)
{
    uint32_t key = (uint32_t)lane, val = (uint32_t)fd;
    union bpf_attr a;
    memset(&a, 0, sizeof a);
    a.map_fd = (uint32_t)map_fd;
    a.key = (uint64_t)(uintptr_t)&key;
    a.value = (uint64_t)(uintptr_t)&val;
    return (int)xsk_sys_bpf(fd >= 0 ? BPF_MAP_UPDATE_ELEM : BPF_MAP_DELETE_ELEM, &a);
}

#define INSN(c, d, s, o, i) \
    ((struct bpf_insn){.code = (c), .dst_reg = (d), .src_reg = (s), .off = (o), .imm = (i)})
#define LDX(size, d, s, o) INSN(BPF_LDX | (size) | BPF_MEM, d, s, o, 0)
#define MOVR(d, s)         INSN(BPF_ALU64 | BPF_MOV | BPF_X, d, s, 0, 0)
#define MOVI(d, i)         INSN(BPF_ALU64 | BPF_MOV | BPF_K, d, 0, 0, i)
#define ALUI(op, d, i)     INSN(BPF_ALU64 | (op) | BPF_K, d, 0, 0, i)
#define JNEI(d, i, o)      INSN(BPF_JMP | BPF_JNE | BPF_K, d, 0, o, i)
#define PASS_AT            27 /* the index of the XDP_PASS exit below */
#define TO_PASS(at)        (PASS_AT - (at)-1)

int xsk_prog_load(int map_fd, uint16_t base_port, int lanes, int queue, char *log, size_t log_len)
{
    struct bpf_insn p[] = {
        MOVR(6, 1),                    /* 0: r6 = ctx */
        LDX(BPF_W, 2, 6, 0),           /* 1: r2 = data */
        LDX(BPF_W, 3, 6, 4),           /* 2: r3 = data_end */
        MOVR(4, 2),                    /* 3 */
        ALUI(BPF_ADD, 4, XSK_HDR_LEN), /* 4: r4 = data + 42 */
        /* 5: a short frame (verifier: proves the loads below within data_end) */
        INSN(BPF_JMP | BPF_JGT | BPF_X, 4, 3, TO_PASS(5), 0),
        LDX(BPF_H, 5, 2, 12),                             /* 6: ethertype */
        JNEI(5, htons(0x0800), TO_PASS(7)),               /* 7 */
        LDX(BPF_B, 5, 2, 14),                             /* 8: version, IHL */
        JNEI(5, 0x45, TO_PASS(9)),                        /* 9 */
        LDX(BPF_B, 5, 2, 23),                             /* 10: protocol */
        JNEI(5, IPPROTO_UDP, TO_PASS(11)),                /* 11 */
        LDX(BPF_H, 5, 2, 20),                             /* 12: flags, fragment offset */
        ALUI(BPF_AND, 5, htons(0x3FFF)),                  /* 13: MF and the offset */
        JNEI(5, 0, TO_PASS(14)),                          /* 14: a fragment */
        LDX(BPF_H, 5, 2, 36),                             /* 15: UDP destination port */
        INSN(BPF_ALU | BPF_END | BPF_TO_BE, 5, 0, 0, 16), /* 16: in host order */
        ALUI(BPF_SUB, 5, base_port),                      /* 17: r5 = the lane */
        /* 18: unsigned: a port below base_port wrapped round to a huge lane */
        INSN(BPF_JMP | BPF_JGE | BPF_K, 5, 0, TO_PASS(18), lanes),
        LDX(BPF_W, 4, 6, 16),        /* 19: r4 = rx_queue_index */
        JNEI(4, queue, TO_PASS(20)), /* 20: the sockets' queue only (the kernel checks it too) */
        INSN(BPF_LD | BPF_DW | BPF_IMM, 1, BPF_PSEUDO_MAP_FD, 0,
             map_fd),                                             /* 21: r1 = map, 2 slots */
        INSN(0, 0, 0, 0, 0),                                      /* 22: the map's upper half */
        MOVR(2, 5),                                               /* 23: key: the lane */
        MOVI(3, XDP_PASS),                                        /* 24: no socket there: pass */
        INSN(BPF_JMP | BPF_CALL, 0, 0, 0, BPF_FUNC_redirect_map), /* 25 */
        INSN(BPF_JMP | BPF_EXIT, 0, 0, 0, 0),                     /* 26 */
        MOVI(0, XDP_PASS),                                        /* 27: PASS_AT */
        INSN(BPF_JMP | BPF_EXIT, 0, 0, 0, 0),                     /* 28 */
    };
    union bpf_attr a;
    memset(&a, 0, sizeof a);
    a.prog_type = BPF_PROG_TYPE_XDP;
    a.insns = (uint64_t)(uintptr_t)p;
    a.insn_cnt = sizeof p / sizeof p[0];
    a.license = (uint64_t)(uintptr_t) "GPL";
    a.log_buf = (uint64_t)(uintptr_t)log;
    a.log_size = (uint32_t)log_len;
    a.log_level = log_len ? 1 : 0;
    memcpy(a.prog_name, "xdp_agg_xsk", sizeof "xdp_agg_xsk");
    return (int)xsk_sys_bpf(BPF_PROG_LOAD, &a);
}

/* EBUSY: the interface has a program already (attached by netlink, or another worker's link),
 * which we leave alone. */
int xsk_prog_attach(int prog_fd, int ifindex, int prog_flags, const char **mode, char *why,
                    size_t why_len)
{
    static const struct {
        int flags;
        const char *name;
    } modes[] = {{XDP_FLAGS_DRV_MODE, "drv"}, {XDP_FLAGS_SKB_MODE, "skb"}};
    for (size_t i = 0; i < 2; i++) {
        if (prog_flags && prog_flags != modes[i].flags)
            continue;
        union bpf_attr a;
        memset(&a, 0, sizeof a);
        a.link_create.prog_fd = (uint32_t)prog_fd;
        a.link_create.target_ifindex = (uint32_t)ifindex;
        a.link_create.attach_type = BPF_XDP;
        a.link_create.flags = (uint32_t)modes[i].flags;
        int fd = (int)xsk_sys_bpf(BPF_LINK_CREATE, &a);
        if (fd >= 0) {
            *mode = modes[i].name;
            return fd;
        }
        if (errno == EBUSY || errno == EEXIST) {
            snprintf(why, why_len, "the interface has an XDP program already (%s)",
                     strerror(errno));
            return -1;
        }
    }
    snprintf(why, why_len, "attaching the XDP program failed: %s", strerror(errno));
    return -1;
}
