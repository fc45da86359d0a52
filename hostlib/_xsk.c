/*
 * The AF_XDP data path of hostlib._fastpath, with plain system calls only:
 * socket(AF_XDP), setsockopt XDP_UMEM_REG and the ring sizes, mmap of the four rings, bind
 * (zero-copy where the driver has it, copy mode otherwise: veth has only copy mode), and bpf(2)
 * for the XSKMAP, the redirect program (a hand-written instruction array below) and a bpf_link
 * that attaches it to the interface. The link lives as long as its fd: when the process ends,
 * however it ends, the kernel detaches the program, so nothing is left on the interface.
 *
 * No libbpf/libxdp: the extension is built by pip from source, where neither may be installed;
 * the uapi headers <linux/if_xdp.h> and <linux/bpf.h> are all it needs. The ring protocol is the
 * one of the kernel's Documentation/networking/af_xdp.rst: the producer index is published with
 * a release store after the descriptors are written, the peer's index read with an acquire load.
 *
 * Frames: one UMEM of XSK_FRAMES chunks of XSK_FRAME bytes; the first half is lent to the kernel
 * through the fill ring for receiving, the second half is a stack of free transmit frames that
 * the completion ring returns. Every transmit frame is built here: Ethernet + IPv4 (DF, TTL and
 * TOS as the kernel sends them, an incrementing id) + UDP (checksum 0: none, as the aggregator
 * writes its results) + the packet's row, copied (a row is kept for resends while a frame may
 * still be in the kernel's hands).
 */
#define _GNU_SOURCE
#include "_xsk.h"

#include <arpa/inet.h>
#include <errno.h>
#include <linux/bpf.h>
#include <linux/if_link.h>
#include <linux/if_xdp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef AF_XDP
#define AF_XDP 44
#endif
#ifndef SOL_XDP
#define SOL_XDP 283
#endif

#define XSK_FRAME  4096u /* a chunk: holds any packet of elems <= 768 with its headers */
#define XSK_FRAMES 4096u /* 16 MiB of UMEM: half for receiving, half for sending */
#define XSK_RING   2048u /* every ring holds half the frames */
#define KICK_TRIES 64    /* copy mode sends at most 32 frames per kick (TX_BATCH_SIZE) */

struct ring {
    uint32_t *producer, *consumer;
    void *desc;
    uint32_t mask;
    void *map;
    size_t map_len;
};

struct Xsk {
    int fd, map_fd, prog_fd, link_fd;
    uint8_t *umem;
    struct ring fill, comp, rx, tx;
    uint64_t free_tx[XSK_FRAMES / 2];
    unsigned nfree;
    XskConfig cfg;
    uint8_t hdr[XSK_HDR_LEN]; /* the headers of every frame sent, but the IP id and checksum */
    uint16_t ip_id;
    int zerocopy;
    const char *mode; /* the XDP attach mode: "drv" or "skb" */
};

static long sys_bpf(int cmd, union bpf_attr *attr)
{
    return syscall(__NR_bpf, cmd, attr, sizeof *attr);
}

/* --- the redirect program ----------------------------------------------------------------- */
#define INSN(c, d, s, o, i) \
    ((struct bpf_insn){.code = (c), .dst_reg = (d), .src_reg = (s), .off = (o), .imm = (i)})
#define LDX(size, d, s, o) INSN(BPF_LDX | (size) | BPF_MEM, d, s, o, 0)
#define MOVR(d, s)         INSN(BPF_ALU64 | BPF_MOV | BPF_X, d, s, 0, 0)
#define MOVI(d, i)         INSN(BPF_ALU64 | BPF_MOV | BPF_K, d, 0, 0, i)
#define ALUI(op, d, i)     INSN(BPF_ALU64 | (op) | BPF_K, d, 0, 0, i)
#define JNEI(d, i, o)      INSN(BPF_JMP | BPF_JNE | BPF_K, d, 0, o, i)
#define PASS_AT            23 /* the index of the XDP_PASS exit below */
#define TO_PASS(at)        (PASS_AT - (at)-1)

/* The worker's program: a frame that is IPv4 without options, unfragmented UDP to the worker's
 * data port goes to the XSK of its receive queue (bpf_redirect_map's flags give XDP_PASS when
 * that queue has none); anything else (ARP, ICMP, the control TCP, other ports) is passed to the
 * kernel. Packet loads read the raw bytes, so constants are compared in network order. */
static int load_program(int map_fd, uint16_t port, char *log, size_t log_len)
{
    struct bpf_insn p[] = {
        MOVR(6, 1),                                           /* 0: r6 = ctx */
        LDX(BPF_W, 2, 6, 0),                                  /* 1: r2 = data */
        LDX(BPF_W, 3, 6, 4),                                  /* 2: r3 = data_end */
        MOVR(4, 2),                                           /* 3 */
        ALUI(BPF_ADD, 4, XSK_HDR_LEN),                        /* 4: r4 = data + 42 */
        INSN(BPF_JMP | BPF_JGT | BPF_X, 4, 3, TO_PASS(5), 0), /* 5: short frame */
        LDX(BPF_H, 5, 2, 12),                                 /* 6: ethertype */
        JNEI(5, htons(0x0800), TO_PASS(7)),                   /* 7 */
        LDX(BPF_B, 5, 2, 14),                                 /* 8: version, IHL */
        JNEI(5, 0x45, TO_PASS(9)),                            /* 9 */
        LDX(BPF_B, 5, 2, 23),                                 /* 10: protocol */
        JNEI(5, IPPROTO_UDP, TO_PASS(11)),                    /* 11 */
        LDX(BPF_H, 5, 2, 20),                                 /* 12: flags, fragment offset */
        ALUI(BPF_AND, 5, htons(0x3FFF)),                      /* 13: MF and the offset */
        JNEI(5, 0, TO_PASS(14)),                              /* 14: a fragment */
        LDX(BPF_H, 5, 2, 36),                                 /* 15: UDP destination port */
        JNEI(5, htons(port), TO_PASS(16)),                    /* 16 */
        INSN(BPF_LD | BPF_DW | BPF_IMM, 1, BPF_PSEUDO_MAP_FD, 0, map_fd), /* 17-18: r1 = map */
        INSN(0, 0, 0, 0, 0),
        LDX(BPF_W, 2, 6, 16),                                     /* 19: r2 = rx_queue_index */
        MOVI(3, XDP_PASS),                                        /* 20: no XSK there: pass */
        INSN(BPF_JMP | BPF_CALL, 0, 0, 0, BPF_FUNC_redirect_map), /* 21 */
        INSN(BPF_JMP | BPF_EXIT, 0, 0, 0, 0),                     /* 22 */
        MOVI(0, XDP_PASS),                                        /* 23: PASS_AT */
        INSN(BPF_JMP | BPF_EXIT, 0, 0, 0, 0),                     /* 24 */
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
    return (int)sys_bpf(BPF_PROG_LOAD, &a);
}

/* Attach with a bpf_link in driver mode, else generic (skb) mode. EBUSY: the interface has a
 * program already (attached by netlink, or another worker's link), which we leave alone. */
static int attach_program(Xsk *x, char *why, size_t why_len)
{
    static const struct {
        int flags;
        const char *name;
    } modes[] = {{XDP_FLAGS_DRV_MODE, "drv"}, {XDP_FLAGS_SKB_MODE, "skb"}};
    for (size_t i = 0; i < 2; i++) {
        if (x->cfg.prog_flags && x->cfg.prog_flags != modes[i].flags)
            continue;
        union bpf_attr a;
        memset(&a, 0, sizeof a);
        a.link_create.prog_fd = (uint32_t)x->prog_fd;
        a.link_create.target_ifindex = (uint32_t)x->cfg.ifindex;
        a.link_create.attach_type = BPF_XDP;
        a.link_create.flags = (uint32_t)modes[i].flags;
        x->link_fd = (int)sys_bpf(BPF_LINK_CREATE, &a);
        if (x->link_fd >= 0) {
            x->mode = modes[i].name;
            return 0;
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

/* --- the socket and its rings ------------------------------------------------------------- */
static int map_ring(Xsk *x, struct ring *r, const struct xdp_ring_offset *o, size_t desc_size,
                    off_t pgoff)
{
    r->map_len = o->desc + XSK_RING * desc_size;
    r->map =
        mmap(NULL, r->map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, x->fd, pgoff);
    if (r->map == MAP_FAILED) {
        r->map = NULL;
        return -1;
    }
    r->producer = (uint32_t *)((uint8_t *)r->map + o->producer);
    r->consumer = (uint32_t *)((uint8_t *)r->map + o->consumer);
    r->desc = (uint8_t *)r->map + o->desc;
    r->mask = XSK_RING - 1;
    return 0;
}

static int setup_socket(Xsk *x, char *why, size_t why_len)
{
    x->fd = socket(AF_XDP, SOCK_RAW | SOCK_CLOEXEC, 0);
    if (x->fd < 0) {
        snprintf(why, why_len, "socket(AF_XDP): %s", strerror(errno));
        return -1;
    }
    x->umem = mmap(NULL, (size_t)XSK_FRAMES * XSK_FRAME, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (x->umem == MAP_FAILED) {
        x->umem = NULL;
        snprintf(why, why_len, "UMEM mmap: %s", strerror(errno));
        return -1;
    }
    struct xdp_umem_reg reg = {.addr = (uint64_t)(uintptr_t)x->umem,
                               .len = (uint64_t)XSK_FRAMES * XSK_FRAME,
                               .chunk_size = XSK_FRAME};
    unsigned ring = XSK_RING;
    if (setsockopt(x->fd, SOL_XDP, XDP_UMEM_REG, &reg, sizeof reg) < 0 ||
        setsockopt(x->fd, SOL_XDP, XDP_UMEM_FILL_RING, &ring, sizeof ring) < 0 ||
        setsockopt(x->fd, SOL_XDP, XDP_UMEM_COMPLETION_RING, &ring, sizeof ring) < 0 ||
        setsockopt(x->fd, SOL_XDP, XDP_RX_RING, &ring, sizeof ring) < 0 ||
        setsockopt(x->fd, SOL_XDP, XDP_TX_RING, &ring, sizeof ring) < 0) {
        snprintf(why, why_len, "AF_XDP UMEM and rings: %s", strerror(errno));
        return -1;
    }
    struct xdp_mmap_offsets off;
    socklen_t optlen = sizeof off;
    if (getsockopt(x->fd, SOL_XDP, XDP_MMAP_OFFSETS, &off, &optlen) < 0 ||
        map_ring(x, &x->fill, &off.fr, sizeof(uint64_t), XDP_UMEM_PGOFF_FILL_RING) < 0 ||
        map_ring(x, &x->comp, &off.cr, sizeof(uint64_t), XDP_UMEM_PGOFF_COMPLETION_RING) < 0 ||
        map_ring(x, &x->rx, &off.rx, sizeof(struct xdp_desc), XDP_PGOFF_RX_RING) < 0 ||
        map_ring(x, &x->tx, &off.tx, sizeof(struct xdp_desc), XDP_PGOFF_TX_RING) < 0) {
        snprintf(why, why_len, "AF_XDP ring mmap: %s", strerror(errno));
        return -1;
    }
    /* lend the first half of the frames to the kernel for receiving */
    uint64_t *fq = x->fill.desc;
    for (uint32_t i = 0; i < XSK_RING; i++)
        fq[i] = (uint64_t)i * XSK_FRAME;
    __atomic_store_n(x->fill.producer, XSK_RING, __ATOMIC_RELEASE);
    for (x->nfree = 0; x->nfree < XSK_FRAMES / 2; x->nfree++)
        x->free_tx[x->nfree] = (uint64_t)(XSK_RING + x->nfree) * XSK_FRAME;
    return 0;
}

/* Bind to the interface queue, zero-copy first where asked: EOPNOTSUPP there (veth, generic
 * XDP) means copy mode, which every driver has. */
static int bind_socket(Xsk *x, char *why, size_t why_len)
{
    struct sockaddr_xdp sa = {.sxdp_family = AF_XDP,
                              .sxdp_ifindex = (uint32_t)x->cfg.ifindex,
                              .sxdp_queue_id = (uint32_t)x->cfg.queue};
    if (x->cfg.zerocopy) {
        sa.sxdp_flags = XDP_ZEROCOPY;
        if (bind(x->fd, (struct sockaddr *)&sa, sizeof sa) == 0) {
            x->zerocopy = 1;
            return 0;
        }
    }
    sa.sxdp_flags = XDP_COPY;
    if (bind(x->fd, (struct sockaddr *)&sa, sizeof sa) == 0)
        return 0;
    snprintf(why, why_len, "bind(AF_XDP, queue %d): %s", x->cfg.queue, strerror(errno));
    return -1;
}

static void put_be16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)(v >> 8);
    p[1] = (uint8_t)v;
}

static void put_be32(uint8_t *p, uint32_t v)
{
    put_be16(p, (uint16_t)(v >> 16));
    put_be16(p + 2, (uint16_t)v);
}

static void build_header(Xsk *x)
{
    const XskConfig *c = &x->cfg;
    uint8_t *h = x->hdr;
    memcpy(h, c->dst_mac, 6);
    memcpy(h + 6, c->src_mac, 6);
    put_be16(h + 12, 0x0800);
    h[14] = 0x45;
    h[15] = (uint8_t)c->tos;
    put_be16(h + 16, (uint16_t)(20 + 8 + c->plen));
    put_be16(h + 20, 0x4000); /* DF, as the kernel sends UDP with path MTU discovery */
    h[22] = (uint8_t)c->ttl;
    h[23] = IPPROTO_UDP;
    put_be32(h + 26, c->src_ip);
    put_be32(h + 30, c->dst_ip);
    put_be16(h + 34, c->src_port);
    put_be16(h + 36, c->dst_port);
    put_be16(h + 38, (uint16_t)(8 + c->plen));
    put_be16(h + 40, 0); /* no UDP checksum (RFC 768 allows it over IPv4) */
}

Xsk *xsk_open(const XskConfig *cfg, char *why, size_t why_len)
{
    if (cfg->plen + XSK_HDR_LEN > (int)XSK_FRAME - 256) { /* XDP_PACKET_HEADROOM */
        snprintf(why, why_len, "a %d-byte packet does not fit a %u-byte UMEM frame", cfg->plen,
                 XSK_FRAME);
        errno = EMSGSIZE;
        return NULL;
    }
    Xsk *x = calloc(1, sizeof *x);
    if (!x) {
        snprintf(why, why_len, "out of memory");
        return NULL;
    }
    x->fd = x->map_fd = x->prog_fd = x->link_fd = -1;
    x->cfg = *cfg;
    char log[1024] = "";
    int err = 0;
    if (setup_socket(x, why, why_len) < 0 || bind_socket(x, why, why_len) < 0)
        goto fail;
    union bpf_attr a;
    memset(&a, 0, sizeof a);
    a.map_type = BPF_MAP_TYPE_XSKMAP;
    a.key_size = a.value_size = 4;
    a.max_entries = 64; /* receive queues */
    memcpy(a.map_name, "xdp_agg_xsks", sizeof "xdp_agg_xsks");
    x->map_fd = (int)sys_bpf(BPF_MAP_CREATE, &a);
    if (x->map_fd < 0) {
        snprintf(why, why_len, "bpf(XSKMAP): %s", strerror(errno));
        goto fail;
    }
    uint32_t key = (uint32_t)cfg->queue, val = (uint32_t)x->fd;
    memset(&a, 0, sizeof a);
    a.map_fd = (uint32_t)x->map_fd;
    a.key = (uint64_t)(uintptr_t)&key;
    a.value = (uint64_t)(uintptr_t)&val;
    if (sys_bpf(BPF_MAP_UPDATE_ELEM, &a) < 0) {
        snprintf(why, why_len, "XSKMAP update: %s", strerror(errno));
        goto fail;
    }
    /* no log unless it fails: a successful verification's log can overflow the buffer (ENOSPC) */
    x->prog_fd = load_program(x->map_fd, cfg->src_port, NULL, 0);
    if (x->prog_fd < 0 && errno != EPERM)
        x->prog_fd = load_program(x->map_fd, cfg->src_port, log, sizeof log);
    if (x->prog_fd < 0) {
        snprintf(why, why_len, "loading the XDP program: %s %.200s", strerror(errno), log);
        goto fail;
    }
    if (attach_program(x, why, why_len) < 0)
        goto fail;
    build_header(x);
    return x;
fail:
    err = errno;
    xsk_close(x);
    errno = err;
    return NULL;
}

void xsk_close(Xsk *x)
{
    if (!x)
        return;
    int fds[] = {x->link_fd, x->prog_fd, x->map_fd};
    for (size_t i = 0; i < 3; i++) /* the link first: it detaches the program */
        if (fds[i] >= 0)
            close(fds[i]);
    struct ring *rings[] = {&x->fill, &x->comp, &x->rx, &x->tx};
    for (size_t i = 0; i < 4; i++)
        if (rings[i]->map)
            munmap(rings[i]->map, rings[i]->map_len);
    if (x->fd >= 0)
        close(x->fd);
    if (x->umem)
        munmap(x->umem, (size_t)XSK_FRAMES * XSK_FRAME);
    free(x);
}

int xsk_fd(const Xsk *x)
{
    return x->fd;
}

int xsk_zerocopy(const Xsk *x)
{
    return x->zerocopy;
}

const char *xsk_attach_mode(const Xsk *x)
{
    return x->mode;
}

/* --- sending ------------------------------------------------------------------------------ */
static uint16_t csum_fold(uint32_t s)
{
    while (s >> 16)
        s = (s & 0xFFFF) + (s >> 16);
    return (uint16_t)~s;
}

/* the one's complement sum of n bytes (n even) */
static uint32_t csum_add(uint32_t s, const uint8_t *p, size_t n)
{
    for (size_t i = 0; i + 1 < n; i += 2)
        s += (uint32_t)p[i] << 8 | p[i + 1];
    if (n & 1)
        s += (uint32_t)p[n - 1] << 8;
    return s;
}

/* completed transmit frames back onto the free stack */
static void reap(Xsk *x)
{
    uint32_t cons = *x->comp.consumer;
    uint32_t prod = __atomic_load_n(x->comp.producer, __ATOMIC_ACQUIRE);
    const uint64_t *cq = x->comp.desc;
    for (; cons != prod; cons++)
        x->free_tx[x->nfree++] = cq[cons & x->comp.mask];
    __atomic_store_n(x->comp.consumer, cons, __ATOMIC_RELEASE);
}

/* sendto() makes the kernel transmit what the TX ring holds; copy mode does at most 32 frames
 * per call and says EAGAIN while more wait. Zero-copy only wakes the driver, which then
 * consumes the ring by itself: one call. Returns 0 or -errno (not transient). */
static int kick(Xsk *x, uint64_t *calls)
{
    for (int i = 0; i < (x->zerocopy ? 1 : KICK_TRIES); i++) {
        if (__atomic_load_n(x->tx.consumer, __ATOMIC_ACQUIRE) == *x->tx.producer)
            return 0;
        (*calls)++;
        if (sendto(x->fd, NULL, 0, MSG_DONTWAIT, NULL, 0) >= 0)
            continue;
        if (errno == EAGAIN || errno == EBUSY || errno == EINTR)
            continue;
        if (errno == ENOBUFS || errno == ENETDOWN || errno == ENXIO)
            return 0; /* dropped or left in the ring: the timers resend */
        return -errno;
    }
    return 0;
}

int xsk_send(Xsk *x, const uint8_t *const *rows, int n, uint64_t *calls)
{
    reap(x);
    uint32_t prod = *x->tx.producer;
    uint32_t room = XSK_RING - (prod - __atomic_load_n(x->tx.consumer, __ATOMIC_ACQUIRE));
    int q = n;
    if ((uint32_t)q > room)
        q = (int)room;
    if ((unsigned)q > x->nfree)
        q = (int)x->nfree;
    struct xdp_desc *d = x->tx.desc;
    size_t plen = (size_t)x->cfg.plen;
    for (int i = 0; i < q; i++, prod++) {
        uint64_t addr = x->free_tx[--x->nfree];
        uint8_t *f = x->umem + addr;
        memcpy(f, x->hdr, XSK_HDR_LEN);
        put_be16(f + 18, x->ip_id++);
        put_be16(f + 24, csum_fold(csum_add(0, f + 14, 20)));
        memcpy(f + XSK_HDR_LEN, rows[i], plen);
        d[prod & x->tx.mask] =
            (struct xdp_desc){.addr = addr, .len = (uint32_t)(XSK_HDR_LEN + plen)};
    }
    __atomic_store_n(x->tx.producer, prod, __ATOMIC_RELEASE);
    int rc = kick(x, calls);
    reap(x);
    return rc < 0 ? rc : q;
}

/* --- receiving ---------------------------------------------------------------------------- */
/* The UDP payload of a result frame, or NULL: the checks the kernel's receive path makes of
 * the lengths and the IPv4 header checksum. */
static const uint8_t *udp_payload(const Xsk *x, const uint8_t *f, size_t len, size_t *plen)
{
    if (len < XSK_HDR_LEN || f[12] != 0x08 || f[13] != 0x00 || f[14] != 0x45 ||
        f[23] != IPPROTO_UDP)
        return NULL;
    size_t tot = (size_t)f[16] << 8 | f[17], ulen = (size_t)f[38] << 8 | f[39];
    if (tot < 28 || tot > len - 14 || ulen < 8 || ulen > tot - 20 ||
        ((size_t)f[36] << 8 | f[37]) != x->cfg.src_port)
        return NULL;
    if (csum_fold(csum_add(0, f + 14, 20)) != 0)
        return NULL;
    /* The UDP checksum is not checked: the aggregator sends none (0), and a frame a veth peer's
     * kernel sent carries a partial one (CHECKSUM_PARTIAL: the pseudo header's sum only, which
     * the kernel's receive path trusts for veth). The NIC checked the Ethernet FCS. */
    *plen = ulen - 8;
    return f + XSK_HDR_LEN;
}

int xsk_receive(Xsk *x, int budget, xsk_datagram_fn fn, void *ctx, uint64_t *malformed)
{
    uint32_t cons = *x->rx.consumer;
    uint32_t avail = __atomic_load_n(x->rx.producer, __ATOMIC_ACQUIRE) - cons;
    uint32_t n = avail < (uint32_t)budget ? avail : (uint32_t)budget;
    if (n == 0)
        return 0;
    const struct xdp_desc *d = x->rx.desc;
    uint64_t *fq = x->fill.desc;
    uint32_t fprod = *x->fill.producer;
    for (uint32_t i = 0; i < n; i++) {
        struct xdp_desc rd = d[(cons + i) & x->rx.mask];
        size_t plen;
        const uint8_t *p = udp_payload(x, x->umem + rd.addr, rd.len, &plen);
        if (p)
            fn(ctx, p, plen);
        else
            (*malformed)++;
        /* the frames are ours again: back into the fill ring (it has room for all of them) */
        fq[fprod++ & x->fill.mask] = rd.addr & ~(uint64_t)(XSK_FRAME - 1);
    }
    __atomic_store_n(x->rx.consumer, cons + n, __ATOMIC_RELEASE);
    __atomic_store_n(x->fill.producer, fprod, __ATOMIC_RELEASE);
    return (int)n;
}
