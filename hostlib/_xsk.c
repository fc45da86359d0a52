/*
 * The AF_XDP data path of hostlib._fastpath, with plain system calls only:
 * socket(AF_XDP), setsockopt XDP_UMEM_REG and the ring sizes, mmap of the rings, bind
 * (zero-copy where the driver has it, copy mode otherwise: veth has only copy mode), and bpf(2)
 * for the XSKMAP and the redirect program (hostlib/xsk_prog.c) with a bpf_link that attaches it
 * to the interface. The link lives as long as its fd: when the process ends, however it ends,
 * the kernel detaches the program, so nothing is left on the interface.
 *
 * No libbpf/libxdp: the extension is built by pip from source, where neither may be installed;
 * the uapi headers <linux/if_xdp.h> and <linux/bpf.h> are all it needs. The ring protocol is the
 * one of the kernel's Documentation/networking/af_xdp.rst: the producer index is published with
 * a release store after the descriptors are written, the peer's index read with an acquire load.
 *
 * Lanes and jobs: every lane of a job has its own socket, with its own RX and TX rings, on the
 * one interface queue the results arrive on (veth cannot steer frames to a queue per lane), and
 * so has every lane of the job's 16-bit companion job (hostlib.communicator), on ports of its
 * own. The kernel lets sockets share a queue only through one UMEM (XDP_SHARED_UMEM), and then
 * they share its fill and completion rings too (af_xdp.rst, "XDP_SHARED_UMEM bind flag"). So the
 * first socket to open on an interface queue makes a group: the UMEM, the fill and completion
 * rings, the free transmit frames and the redirect program with its maps (a socket's UDP port to
 * its slot, the slot to the socket); every other socket of this process on that queue, of any
 * job, joins it with a free slot. The group lives until its last socket closes, in any order (the
 * socket that registered the UMEM stays open with it). The group's lock guards what the sockets'
 * threads share: filling, reaping completions and the free stack, a few times per batch of
 * frames; each socket's RX and TX rings are its thread's own.
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
#include "fp_wire.h"

#include <arpa/inet.h>
#include <errno.h>
#include <linux/bpf.h>
#include <linux/if_xdp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fp_util.h"
#include "xsk_prog.h"

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
#define XSK_SLOTS  (4 * FP_MAX_LANES) /* a group's sockets: a job's lanes, its companion's, room */
#define RX_BATCH   256                /* frames taken off an RX ring per receive */

struct ring {
    uint32_t *producer, *consumer;
    void *desc;
    uint32_t mask;
    void *map;
    size_t map_len;
};

/* The ring operations, as libxdp's xsk.h names them (xsk_ring_cons__peek, __release,
 * xsk_ring_prod__submit, xsk_prod_nb_free): the side that owns an index reads it plainly and
 * publishes it with release; the other side's index is read with acquire. Every ring holds
 * XSK_RING entries. */
static inline uint32_t ring_cons_peek(const struct ring *r, uint32_t max, uint32_t *idx)
{
    uint32_t cons = *r->consumer;
    uint32_t avail = __atomic_load_n(r->producer, __ATOMIC_ACQUIRE) - cons;
    *idx = cons;
    return avail < max ? avail : max;
}

static inline void ring_cons_release(struct ring *r, uint32_t n)
{
    __atomic_store_n(r->consumer, *r->consumer + n, __ATOMIC_RELEASE);
}

static inline uint32_t ring_prod_free(const struct ring *r)
{
    return XSK_RING - (*r->producer - __atomic_load_n(r->consumer, __ATOMIC_ACQUIRE));
}

static inline void ring_prod_submit(struct ring *r, uint32_t n)
{
    __atomic_store_n(r->producer, *r->producer + n, __ATOMIC_RELEASE);
}

/* What the sockets on one interface queue share: the UMEM, its fill and completion rings, the
 * free transmit frames and the program with its maps. */
typedef struct Group {
    struct Group *next;       /* the registry's list (groups, under groups_lock) */
    int ifindex, queue;       /* the key */
    int nopen;                /* sockets open in it */
    uint16_t port[XSK_SLOTS]; /* slot s: the UDP port of its socket; 0: a free slot */
    int fd;                   /* the socket that registered the UMEM (the first one's) */
    int map_fd, ports_fd, prog_fd, link_fd; /* the XSKMAP, the ports map, the program, its link */
    int zerocopy;
    const char *mode; /* the XDP attach mode: "drv" or "skb" */
    uint8_t *umem;
    pthread_mutex_t lock; /* fill, comp, free_tx and nfree: every socket's thread uses them */
    struct ring fill, comp;
    uint64_t free_tx[XSK_FRAMES / 2];
    unsigned nfree;
} Group;

struct Xsk {
    Group *g;
    int fd;   /* the lane's socket (the group's own for the socket that made the group) */
    int slot; /* its key in the XSKMAP */
    struct ring rx, tx;
    XskConfig cfg;
    uint8_t hdr[XSK_HDR_LEN]; /* every frame's headers, but the IP id, checksum, lengths */
    uint16_t ip_id;
};

static Group *groups; /* the open groups of this process */
static pthread_mutex_t groups_lock = PTHREAD_MUTEX_INITIALIZER;

/* --- the rings ---------------------------------------------------------------------------- */
static int map_ring(int fd, struct ring *r, const struct xdp_ring_offset *o, size_t desc_size,
                    off_t pgoff)
{
    r->map_len = o->desc + XSK_RING * desc_size;
    r->map = mmap(NULL, r->map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, pgoff);
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

static void unmap_ring(struct ring *r)
{
    if (r->map)
        munmap(r->map, r->map_len);
    r->map = NULL;
}

/* A socket with RX and TX rings; with the UMEM's registration and its fill and completion rings
 * when umem is not NULL (the group's first socket: a shared one may not have its own). */
static int new_socket(uint8_t *umem, char *why, size_t why_len)
{
    int fd = socket(AF_XDP, SOCK_RAW | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        snprintf(why, why_len, "socket(AF_XDP): %s", strerror(errno));
        return -1;
    }
    struct xdp_umem_reg reg = {.addr = (uint64_t)(uintptr_t)umem,
                               .len = (uint64_t)XSK_FRAMES * XSK_FRAME,
                               .chunk_size = XSK_FRAME};
    unsigned ring = XSK_RING;
    if ((umem && (setsockopt(fd, SOL_XDP, XDP_UMEM_REG, &reg, sizeof reg) < 0 ||
                  setsockopt(fd, SOL_XDP, XDP_UMEM_FILL_RING, &ring, sizeof ring) < 0 ||
                  setsockopt(fd, SOL_XDP, XDP_UMEM_COMPLETION_RING, &ring, sizeof ring) < 0)) ||
        setsockopt(fd, SOL_XDP, XDP_RX_RING, &ring, sizeof ring) < 0 ||
        setsockopt(fd, SOL_XDP, XDP_TX_RING, &ring, sizeof ring) < 0) {
        snprintf(why, why_len, "AF_XDP UMEM and rings: %s", strerror(errno));
        int err = errno;
        close(fd);
        errno = err;
        return -1;
    }
    return fd;
}

/* mmap the RX and TX rings of fd into rx and tx, and the fill and completion rings too when
 * fill is not NULL. */
static int map_rings(int fd, struct ring *rx, struct ring *tx, struct ring *fill, struct ring *comp,
                     char *why, size_t why_len)
{
    struct xdp_mmap_offsets off;
    socklen_t optlen = sizeof off;
    if (getsockopt(fd, SOL_XDP, XDP_MMAP_OFFSETS, &off, &optlen) < 0 ||
        (fill &&
         (map_ring(fd, fill, &off.fr, sizeof(uint64_t), XDP_UMEM_PGOFF_FILL_RING) < 0 ||
          map_ring(fd, comp, &off.cr, sizeof(uint64_t), XDP_UMEM_PGOFF_COMPLETION_RING) < 0)) ||
        map_ring(fd, rx, &off.rx, sizeof(struct xdp_desc), XDP_PGOFF_RX_RING) < 0 ||
        map_ring(fd, tx, &off.tx, sizeof(struct xdp_desc), XDP_PGOFF_TX_RING) < 0) {
        snprintf(why, why_len, "AF_XDP ring mmap: %s", strerror(errno));
        return -1;
    }
    return 0;
}

/* Bind fd to the interface queue: the group's socket zero-copy first where asked (EOPNOTSUPP
 * there, on veth and generic XDP, means copy mode, which every driver has); a socket joining a
 * group with XDP_SHARED_UMEM and no other flag (the kernel refuses any: the group's mode holds).
 * *zerocopy (the group's socket only; NULL for one joining) says whether it bound zero-copy. */
static int bind_socket(int fd, const XskConfig *c, const Group *shared, int *zerocopy, char *why,
                       size_t why_len)
{
    struct sockaddr_xdp sa = {.sxdp_family = AF_XDP,
                              .sxdp_ifindex = (uint32_t)c->ifindex,
                              .sxdp_queue_id = (uint32_t)c->queue};
    if (shared) {
        sa.sxdp_flags = XDP_SHARED_UMEM;
        sa.sxdp_shared_umem_fd = (uint32_t)shared->fd;
    } else if (c->zerocopy) {
        sa.sxdp_flags = XDP_ZEROCOPY;
        if (bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0) {
            *zerocopy = 1;
            return 0;
        }
    }
    if (!shared)
        sa.sxdp_flags = XDP_COPY;
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0)
        return 0;
    snprintf(why, why_len, "bind(AF_XDP, queue %d%s): %s", c->queue,
             shared ? ", sharing the queue's UMEM" : "", strerror(errno));
    return -1;
}

/* --- the group ---------------------------------------------------------------------------- */
static void group_free(Group *g)
{
    int fds[] = {g->link_fd, g->prog_fd, g->map_fd, g->ports_fd};
    for (size_t i = 0; i < 4; i++) /* the link first: it detaches the program */
        if (fds[i] >= 0)
            close(fds[i]);
    unmap_ring(&g->fill);
    unmap_ring(&g->comp);
    if (g->fd >= 0)
        close(g->fd);
    if (g->umem)
        munmap(g->umem, (size_t)XSK_FRAMES * XSK_FRAME);
    pthread_mutex_destroy(&g->lock);
    free(g);
}

/* The XSKMAP, the ports map and the program for the group's sockets, attached to its
 * interface. */
static int group_program(Group *g, const XskConfig *c, char *why, size_t why_len)
{
    g->map_fd = xsk_map_create(XSK_SLOTS);
    g->ports_fd = g->map_fd < 0 ? -1 : xsk_ports_create(XSK_SLOTS);
    if (g->ports_fd < 0) {
        snprintf(why, why_len, "bpf(XSKMAP and ports map): %s", strerror(errno));
        return -1;
    }
    char log[1024] = "";
    /* no log unless it fails: a successful verification's log can overflow the buffer (ENOSPC) */
    g->prog_fd = xsk_prog_load(g->map_fd, g->ports_fd, g->queue, XDP_PASS, NULL, 0);
    if (g->prog_fd < 0 && errno != EPERM)
        g->prog_fd = xsk_prog_load(g->map_fd, g->ports_fd, g->queue, XDP_PASS, log, sizeof log);
    if (g->prog_fd < 0) {
        snprintf(why, why_len, "loading the XDP program: %s %.200s", strerror(errno), log);
        return -1;
    }
    g->link_fd = xsk_prog_attach(g->prog_fd, c->ifindex, c->prog_flags, &g->mode, why, why_len);
    return g->link_fd < 0 ? -1 : 0;
}

/* A new group for c's interface queue, with its first socket (x's, in slot 0), UMEM, the rings
 * of both and the program. NULL with the reason in why. */
static Group *group_open(Xsk *x, const XskConfig *c, char *why, size_t why_len)
{
    Group *g = calloc(1, sizeof *g);
    if (!g) {
        snprintf(why, why_len, "out of memory");
        return NULL;
    }
    *g = (Group){.ifindex = c->ifindex,
                 .queue = c->queue,
                 .fd = -1,
                 .map_fd = -1,
                 .ports_fd = -1,
                 .prog_fd = -1,
                 .link_fd = -1};
    x->slot = 0;
    pthread_mutex_init(&g->lock, NULL);
    g->umem = mmap(NULL, (size_t)XSK_FRAMES * XSK_FRAME, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (g->umem == MAP_FAILED) {
        g->umem = NULL;
        snprintf(why, why_len, "UMEM mmap: %s", strerror(errno));
        goto fail;
    }
    g->fd = x->fd = new_socket(g->umem, why, why_len);
    if (g->fd < 0 || map_rings(g->fd, &x->rx, &x->tx, &g->fill, &g->comp, why, why_len) < 0 ||
        bind_socket(g->fd, c, NULL, &g->zerocopy, why, why_len) < 0 ||
        group_program(g, c, why, why_len) < 0)
        goto fail;
    /* lend the first half of the frames to the kernel for receiving */
    uint64_t *fq = g->fill.desc;
    for (uint32_t i = 0; i < XSK_RING; i++)
        fq[i] = (uint64_t)i * XSK_FRAME;
    ring_prod_submit(&g->fill, XSK_RING);
    for (g->nfree = 0; g->nfree < XSK_FRAMES / 2; g->nfree++)
        g->free_tx[g->nfree] = (uint64_t)(XSK_RING + g->nfree) * XSK_FRAME;
    return g;
fail : {
    int err = errno;
    unmap_ring(&x->rx);
    unmap_ring(&x->tx);
    x->fd = -1; /* g->fd: closed with the group */
    group_free(g);
    errno = err;
    return NULL;
}
}

/* The open group of c's interface queue, or NULL (under groups_lock). */
static Group *group_find(const XskConfig *c)
{
    for (Group *g = groups; g; g = g->next)
        if (g->ifindex == c->ifindex && g->queue == c->queue)
            return g;
    return NULL;
}

/* A free slot of g for a socket on `port`, or -1 with the reason (under groups_lock). */
static int free_slot(const Group *g, uint16_t port, char *why, size_t why_len)
{
    int slot = -1;
    for (int s = 0; s < XSK_SLOTS; s++) {
        if (g->port[s] == port) {
            snprintf(why, why_len, "port %u has an AF_XDP socket already", port);
            errno = EBUSY;
            return -1;
        }
        if (!g->port[s] && slot < 0)
            slot = s;
    }
    if (slot < 0) {
        snprintf(why, why_len, "the queue has %d AF_XDP sockets, the most it takes", XSK_SLOTS);
        errno = ENOSPC;
    }
    return slot;
}

/* x's socket into group g: a free slot, its own socket on g's UMEM, its rings (under
 * groups_lock). */
static int group_join(Group *g, Xsk *x, const XskConfig *c, char *why, size_t why_len)
{
    x->slot = free_slot(g, c->src_port, why, why_len);
    if (x->slot < 0)
        return -1;
    x->fd = new_socket(NULL, why, why_len);
    if (x->fd < 0 || map_rings(x->fd, &x->rx, &x->tx, NULL, NULL, why, why_len) < 0 ||
        bind_socket(x->fd, c, g, NULL, why, why_len) < 0)
        return -1;
    return 0;
}

/* x's socket into the program's maps: from now its port's results come to it. */
static int map_socket(Group *g, const Xsk *x, char *why, size_t why_len)
{
    if (xsk_map_set(g->map_fd, (uint32_t)x->slot, x->fd) == 0 &&
        xsk_map_set(g->ports_fd, x->cfg.src_port, x->slot) == 0)
        return 0;
    snprintf(why, why_len, "XSKMAP or ports map update: %s", strerror(errno));
    return -1;
}

/* x's socket out of them: from now its port's results go to the kernel socket. */
static void unmap_socket(Group *g, const Xsk *x)
{
    xsk_map_set(g->ports_fd, x->cfg.src_port, -1); /* ENOENT if it never got there */
    xsk_map_set(g->map_fd, (uint32_t)x->slot, -1);
}

static void build_header(Xsk *x)
{
    const XskConfig *c = &x->cfg;
    uint8_t *h = x->hdr;
    memcpy(h, c->dst_mac, 6);
    memcpy(h + 6, c->src_mac, 6);
    store_be16(h + 12, 0x0800);
    h[14] = 0x45;
    h[15] = (uint8_t)c->tos;
    store_be16(h + 16, (uint16_t)(20 + 8 + c->plen));
    store_be16(h + 20, 0x4000); /* DF, as the kernel sends UDP with path MTU discovery */
    h[22] = (uint8_t)c->ttl;
    h[23] = IPPROTO_UDP;
    store_be32(h + 26, c->src_ip);
    store_be32(h + 30, c->dst_ip);
    store_be16(h + 34, c->src_port);
    store_be16(h + 36, c->dst_port);
    store_be16(h + 38, (uint16_t)(8 + c->plen));
    store_be16(h + 40, 0); /* no UDP checksum (RFC 768 allows it over IPv4) */
}

/* why the lane's configuration cannot be, or NULL */
static const char *bad_config(const XskConfig *c)
{
    /* XDP_PACKET_HEADROOM; a sparse packet has 12 more header bytes than a dense one */
    if (c->plen + FP_SPARSE_HLEN + XSK_HDR_LEN > (int)XSK_FRAME - 256)
        return "the packet does not fit a UMEM frame";
    if (c->lanes < 1 || c->lanes > FP_MAX_LANES || c->lane < 0 || c->lane >= c->lanes)
        return "lanes must be 1 to 64, and lane one of them";
    if (c->src_port == 0)
        return "src_port is not a port";
    return NULL;
}

static void ignore_frame(void *ctx, const uint8_t *payload, size_t len)
{
    (void)ctx, (void)payload, (void)len;
}

/* Close x's socket and rings (under groups_lock); its group's when it is the last socket,
 * whichever job's. */
static void lane_close(Xsk *x)
{
    Group *g = x->g;
    uint64_t dropped = 0;
    if (g) {
        unmap_socket(g, x); /* from now the kernel socket's */
        while (xsk_receive(x, RX_BATCH, ignore_frame, NULL, &dropped) > 0)
            ; /* frames left on the RX ring: back to the fill ring */
    }
    unmap_ring(&x->rx);
    unmap_ring(&x->tx);
    if (x->fd >= 0 && (!g || x->fd != g->fd))
        close(x->fd);
    if (!g)
        return;
    g->port[x->slot] = 0;
    if (--g->nopen)
        return;
    for (Group **p = &groups; *p; p = &(*p)->next)
        if (*p == g) {
            *p = g->next;
            break;
        }
    group_free(g);
}

Xsk *xsk_open(const XskConfig *cfg, char *why, size_t why_len)
{
    const char *bad = bad_config(cfg);
    if (bad) {
        snprintf(why, why_len, "%s", bad);
        errno = EINVAL;
        return NULL;
    }
    Xsk *x = calloc(1, sizeof *x);
    if (!x) {
        snprintf(why, why_len, "out of memory");
        return NULL;
    }
    x->fd = -1;
    x->slot = -1;
    x->cfg = *cfg;
    int err = 0;
    pthread_mutex_lock(&groups_lock);
    Group *g = group_find(cfg);
    if (g ? group_join(g, x, cfg, why, why_len) < 0 : !(g = group_open(x, cfg, why, why_len)))
        goto fail;
    if (!g->nopen) { /* a new group: into the registry */
        g->next = groups;
        groups = g;
    }
    x->g = g;
    g->nopen++;
    g->port[x->slot] = cfg->src_port;
    if (map_socket(g, x, why, why_len) < 0)
        goto fail;
    pthread_mutex_unlock(&groups_lock);
    build_header(x);
    return x;
fail:
    err = errno;
    lane_close(x);
    pthread_mutex_unlock(&groups_lock);
    free(x);
    errno = err;
    return NULL;
}

void xsk_close(Xsk *x)
{
    if (!x)
        return;
    pthread_mutex_lock(&groups_lock);
    lane_close(x);
    pthread_mutex_unlock(&groups_lock);
    free(x);
}

int xsk_fd(const Xsk *x)
{
    return x->fd;
}

int xsk_zerocopy(const Xsk *x)
{
    return x->g->zerocopy;
}

const char *xsk_attach_mode(const Xsk *x)
{
    return x->g->mode;
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

/* completed transmit frames back onto the free stack (under g->lock) */
static void reap(Group *g)
{
    uint32_t cons, n = ring_cons_peek(&g->comp, XSK_RING, &cons);
    const uint64_t *cq = g->comp.desc;
    for (uint32_t i = 0; i < n; i++)
        g->free_tx[g->nfree++] = cq[(cons + i) & g->comp.mask];
    ring_cons_release(&g->comp, n);
}

/* sendto() makes the kernel transmit what the TX ring holds; copy mode does at most 32 frames
 * per call and says EAGAIN while more wait. Zero-copy only wakes the driver, which then
 * consumes the ring by itself: one call. Returns 0 or -errno (not transient). */
static int kick(Xsk *x, uint64_t *calls)
{
    for (int i = 0; i < (x->g->zerocopy ? 1 : KICK_TRIES); i++) {
        if (ring_prod_free(&x->tx) == XSK_RING)
            return 0; /* the kernel took every frame */
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

int xsk_send(Xsk *x, const uint8_t *const *rows, const int *lens, int n, uint64_t *calls)
{
    Group *g = x->g;
    uint32_t prod = *x->tx.producer;
    uint32_t room = ring_prod_free(&x->tx);
    int q = n;
    if ((uint32_t)q > room)
        q = (int)room;
    struct xdp_desc *d = x->tx.desc;
    pthread_mutex_lock(&g->lock); /* the group's free frames: take q at once */
    reap(g);
    if ((unsigned)q > g->nfree)
        q = (int)g->nfree;
    for (int i = 0; i < q; i++)
        d[(prod + (uint32_t)i) & x->tx.mask].addr = g->free_tx[--g->nfree];
    pthread_mutex_unlock(&g->lock);
    for (int i = 0; i < q; i++, prod++) { /* prod: the frame's entry, submitted below */
        struct xdp_desc *e = &d[prod & x->tx.mask];
        uint8_t *f = g->umem + e->addr;
        size_t plen = (size_t)(lens ? lens[i] : x->cfg.plen);
        memcpy(f, x->hdr, XSK_HDR_LEN);
        if (lens) { /* a sparse packet's own lengths (the template has a dense one's) */
            store_be16(f + 16, (uint16_t)(20 + 8 + plen));
            store_be16(f + 38, (uint16_t)(8 + plen));
        }
        store_be16(f + 18, x->ip_id++);
        store_be16(f + 24, csum_fold(csum_add(0, f + 14, 20)));
        memcpy(f + XSK_HDR_LEN, rows[i], plen);
        e->len = (uint32_t)(XSK_HDR_LEN + plen);
    }
    ring_prod_submit(&x->tx, (uint32_t)q);
    int rc = kick(x, calls);
    if (pthread_mutex_trylock(&g->lock) == 0) { /* copy mode completed them in the kick */
        reap(g);
        pthread_mutex_unlock(&g->lock);
    }
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

/* Frames taken off an RX ring back into the group's fill ring: it has room for all of them
 * (it holds as many entries as there are receive frames). */
static void return_frames(Group *g, const uint64_t *addrs, uint32_t n)
{
    pthread_mutex_lock(&g->lock);
    uint64_t *fq = g->fill.desc;
    uint32_t fprod = *g->fill.producer;
    for (uint32_t i = 0; i < n; i++)
        fq[(fprod + i) & g->fill.mask] = addrs[i];
    ring_prod_submit(&g->fill, n);
    pthread_mutex_unlock(&g->lock);
}

int xsk_receive(Xsk *x, int budget, xsk_datagram_fn fn, void *ctx, uint64_t *malformed)
{
    uint32_t cons, n;
    n = ring_cons_peek(&x->rx, (uint32_t)budget < RX_BATCH ? (uint32_t)budget : RX_BATCH, &cons);
    if (n == 0)
        return 0;
    const struct xdp_desc *d = x->rx.desc;
    uint64_t addrs[RX_BATCH];
    for (uint32_t i = 0; i < n; i++) {
        struct xdp_desc rd = d[(cons + i) & x->rx.mask];
        size_t plen;
        const uint8_t *p = udp_payload(x, x->g->umem + rd.addr, rd.len, &plen);
        if (p)
            fn(ctx, p, plen);
        else
            (*malformed)++;
        addrs[i] = rd.addr & ~(uint64_t)(XSK_FRAME - 1); /* ours again */
    }
    ring_cons_release(&x->rx, n);
    return_frames(x->g, addrs, n);
    return (int)n;
}
