/*
 * The worker's XDP program of the AF_XDP data path, written as instructions (hostlib/xsk_prog.h).
 *
 * A frame that is IPv4 without options, unfragmented UDP to a port in the ports map and arrived
 * on the sockets' receive queue goes to the AF_XDP socket at that port's slot of the XSKMAP;
 * anything else (ARP, ICMP, the control TCP, other ports, other queues) is passed to the kernel.
 * bpf_redirect_map's flags give XDP_PASS for a slot whose socket is not (or no longer) in the
 * map: the kernel UDP socket on the same port takes the result then. Packet loads read the raw
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
#include "bpf_insn.h"

long xsk_sys_bpf(int cmd, union bpf_attr *attr)
{
    return syscall(__NR_bpf, cmd, attr, sizeof *attr);
}

static int map_create(uint32_t type, int entries, const char *name)
{
    union bpf_attr a;
    memset(&a, 0, sizeof a);
    a.map_type = type;
    a.key_size = a.value_size = 4;
    a.max_entries = (uint32_t)entries;
    snprintf(a.map_name, sizeof a.map_name, "%s", name);
    return (int)xsk_sys_bpf(BPF_MAP_CREATE, &a);
}

int xsk_map_create(int slots)
{
    return map_create(BPF_MAP_TYPE_XSKMAP, slots, "xdp_agg_xsks");
}

int xsk_ports_create(int slots)
{
    return map_create(BPF_MAP_TYPE_HASH, slots, "xdp_agg_ports");
}

int xsk_map_set(int map_fd, uint32_t key, int value)
{
    uint32_t val = (uint32_t)value;
    union bpf_attr a;
    memset(&a, 0, sizeof a);
    a.map_fd = (uint32_t)map_fd;
    a.key = (uint64_t)(uintptr_t)&key;
    a.value = (uint64_t)(uintptr_t)&val;
    return (int)xsk_sys_bpf(value >= 0 ? BPF_MAP_UPDATE_ELEM : BPF_MAP_DELETE_ELEM, &a);
}

enum { PASS }; /* the labels of the program */

int xsk_prog_load(int map_fd, int ports_fd, int queue, int no_socket, char *log, size_t log_len)
{
    struct bpf_insn p[] = {
        BPF_MOV64_REG(BPF_REG_6, BPF_REG_1),            /* r6 = ctx */
        BPF_LDX_MEM(BPF_W, BPF_REG_2, BPF_REG_6, 0),    /* r2 = data */
        BPF_LDX_MEM(BPF_W, BPF_REG_3, BPF_REG_6, 4),    /* r3 = data_end */
        BPF_MOV64_REG(BPF_REG_4, BPF_REG_2),            /* */
        BPF_ALU64_IMM(BPF_ADD, BPF_REG_4, XSK_HDR_LEN), /* r4 = data + 42 */
        /* a short frame (verifier: proves the loads below within data_end) */
        BPF_JMP_REG(BPF_JGT, BPF_REG_4, BPF_REG_3, BPF_LABEL(PASS)),
        BPF_LDX_MEM(BPF_H, BPF_REG_5, BPF_REG_2, 12), /* ethertype */
        BPF_JMP_IMM(BPF_JNE, BPF_REG_5, htons(0x0800), BPF_LABEL(PASS)),
        BPF_LDX_MEM(BPF_B, BPF_REG_5, BPF_REG_2, 14), /* version, IHL */
        BPF_JMP_IMM(BPF_JNE, BPF_REG_5, 0x45, BPF_LABEL(PASS)),
        BPF_LDX_MEM(BPF_B, BPF_REG_5, BPF_REG_2, 23), /* protocol */
        BPF_JMP_IMM(BPF_JNE, BPF_REG_5, IPPROTO_UDP, BPF_LABEL(PASS)),
        BPF_LDX_MEM(BPF_H, BPF_REG_5, BPF_REG_2, 20),        /* flags, fragment offset */
        BPF_ALU64_IMM(BPF_AND, BPF_REG_5, htons(0x3FFF)),    /* MF and the offset */
        BPF_JMP_IMM(BPF_JNE, BPF_REG_5, 0, BPF_LABEL(PASS)), /* a fragment */
        BPF_LDX_MEM(BPF_W, BPF_REG_4, BPF_REG_6, 16),        /* r4 = rx_queue_index */
        /* the sockets' queue only (the kernel checks it too) */
        BPF_JMP_IMM(BPF_JNE, BPF_REG_4, queue, BPF_LABEL(PASS)),
        BPF_LDX_MEM(BPF_H, BPF_REG_5, BPF_REG_2, 36),        /* UDP destination port */
        BPF_ENDIAN(BPF_TO_BE, BPF_REG_5, 16),                /* in host order */
        BPF_STX_MEM(BPF_W, BPF_REG_10, BPF_REG_5, -4),       /* the key, on the stack */
        BPF_MOV64_REG(BPF_REG_2, BPF_REG_10),                /* */
        BPF_ALU64_IMM(BPF_ADD, BPF_REG_2, -4),               /* r2 = &key */
        BPF_LD_MAP_FD(BPF_REG_1, ports_fd),                  /* r1 = the ports map */
        BPF_EMIT_CALL(BPF_FUNC_map_lookup_elem),             /* r0 = &slot, or NULL */
        BPF_JMP_IMM(BPF_JEQ, BPF_REG_0, 0, BPF_LABEL(PASS)), /* not a port of ours */
        BPF_LDX_MEM(BPF_W, BPF_REG_2, BPF_REG_0, 0),         /* key: the slot */
        BPF_LD_MAP_FD(BPF_REG_1, map_fd),                    /* r1 = the XSKMAP */
        BPF_MOV64_IMM(BPF_REG_3, no_socket),                 /* no socket there: this action */
        BPF_EMIT_CALL(BPF_FUNC_redirect_map),
        BPF_EXIT_INSN(),
        /* PASS: */
        BPF_MOV64_IMM(BPF_REG_0, XDP_PASS),
        BPF_EXIT_INSN(),
    };
    size_t n = sizeof p / sizeof p[0];
    bpf_fix_label(p, n, PASS, n - 2);
    union bpf_attr a;
    memset(&a, 0, sizeof a);
    a.prog_type = BPF_PROG_TYPE_XDP;
    a.insns = (uint64_t)(uintptr_t)p;
    a.insn_cnt = (uint32_t)n;
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
