/*
 * The transports of the C fast path (hostlib/fp_io.h): the kernel's UDP socket and AF_XDP.
 */
#define _GNU_SOURCE
#include "fp_io.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "fp_util.h"

#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif

#define MAX_GSO_SEGMENTS 64 /* UDP_MAX_SEGMENTS of older kernels */
#define MAX_GSO_BYTES    (65507 - 8)
#define RECV_SLOT        (65536 + 4096) /* one GRO buffer: at most one 64 KiB datagram */
#define RECV_MSGS_GRO    32
#define RECV_MSGS_PLAIN  256
#define SEG_CMSG_SPACE   CMSG_SPACE(sizeof(uint16_t))
#define GRO_CMSG_SPACE   CMSG_SPACE(sizeof(int))

/* --- the kernel socket -------------------------------------------------------------------- */
typedef struct {
    Transport base;
    int fd, gro;
    struct sockaddr_in dst;
    struct iovec *siov;
    struct mmsghdr *smsg;
    char *sctrl;
    uint8_t *rbuf;
    struct iovec *riov;
    struct mmsghdr *rmsg;
    char *rctrl;
    int rcount, rslot;
} Udp;

/* The arrays of a Udp: X(member, count, size of one), `rows` the most rows of a send. Allocated
 * together by fp_udp_open (after rcount and rslot), freed together by udp_close. */
#define UDP_ARRAYS(X)                                  \
    X(siov, rows, sizeof(struct iovec))                \
    X(smsg, rows, sizeof(struct mmsghdr))              \
    X(sctrl, rows, SEG_CMSG_SPACE)                     \
    X(rbuf, (size_t)u->rcount, (size_t)u->rslot)       \
    X(riov, (size_t)u->rcount, sizeof(struct iovec))   \
    X(rmsg, (size_t)u->rcount, sizeof(struct mmsghdr)) \
    X(rctrl, (size_t)u->rcount, GRO_CMSG_SPACE)

static int gso_refused_errno(int err)
{
    return err == EINVAL || err == EIO || err == ENOPROTOOPT || err == EOPNOTSUPP ||
           err == EMSGSIZE;
}

/* errors after which the datagrams are simply lost: the timers recover them (as udp_io) */
static int transient_errno(int err)
{
    return err == EAGAIN || err == EWOULDBLOCK || err == ENOBUFS || err == ENETUNREACH ||
           err == EHOSTUNREACH || err == ECONNREFUSED || err == EPERM;
}

/* Group iovecs [first_iov, first_iov + n) into messages: with GSO, runs of datagrams of one
 * length, up to per_call of them (the kernel cuts a GSO buffer at its segment size, and only
 * the last segment may be shorter: a shorter datagram ends a run); else one datagram each.
 * Returns the number of messages. */
static int build_msgs(Udp *u, int first_iov, int n)
{
    int m = 0, end = first_iov + n;
    for (int i = first_iov; i < end; m++) {
        size_t seg = u->siov[i].iov_len;
        int segs = 1;
        if (u->base.gso) {
            int per_call = MAX_GSO_BYTES / (int)seg;
            per_call =
                per_call > MAX_GSO_SEGMENTS ? MAX_GSO_SEGMENTS : (per_call < 1 ? 1 : per_call);
            while (segs < per_call && i + segs < end && u->siov[i + segs].iov_len <= seg)
                if (u->siov[i + segs++].iov_len < seg)
                    break;
        }
        struct msghdr *h = &u->smsg[m].msg_hdr;
        memset(h, 0, sizeof *h);
        h->msg_name = &u->dst;
        h->msg_namelen = sizeof u->dst;
        h->msg_iov = &u->siov[i];
        h->msg_iovlen = (size_t)segs;
        i += segs;
        if (segs > 1) { /* one buffer of segs datagrams, cut by the kernel at seg */
            char *ctl = u->sctrl + (size_t)m * SEG_CMSG_SPACE;
            memset(ctl, 0, SEG_CMSG_SPACE);
            h->msg_control = ctl;
            h->msg_controllen = SEG_CMSG_SPACE;
            struct cmsghdr *cm = CMSG_FIRSTHDR(h);
            cm->cmsg_level = SOL_UDP;
            cm->cmsg_type = UDP_SEGMENT;
            cm->cmsg_len = CMSG_LEN(sizeof(uint16_t));
            uint16_t gso_size = (uint16_t)seg;
            memcpy(CMSG_DATA(cm), &gso_size, sizeof gso_size);
        }
    }
    return m;
}

static int udp_send(Transport *t, const uint8_t *const *rows, const int *lens, int niov,
                    Counters *c)
{
    Udp *u = (Udp *)t;
    for (int i = 0; i < niov; i++) {
        u->siov[i].iov_base = (void *)rows[i];
        u->siov[i].iov_len = (size_t)(lens ? lens[i] : t->plen);
    }
    int nmsg = build_msgs(u, 0, niov), i = 0, waited = 0;
    while (i < nmsg) {
        c->send_calls++;
        int got = sendmmsg(u->fd, &u->smsg[i], (unsigned)(nmsg - i), 0);
        if (got > 0) {
            i += got;
            waited = 0;
            continue;
        }
        int err = got < 0 ? errno : EAGAIN;
        if (err == EINTR)
            continue;
        if ((err == EAGAIN || err == EWOULDBLOCK) && !waited) {
            struct pollfd pfd = {.fd = u->fd, .events = POLLOUT};
            waited = 1;
            if (poll(&pfd, 1, 20) > 0) /* once, like udp_io: a full buffer may drain */
                continue;
        }
        if (t->gso && u->smsg[i].msg_hdr.msg_iovlen > 1 && gso_refused_errno(err)) {
            /* the path or the kernel cannot do GSO: plain datagrams from here on, for good */
            t->gso = 0;
            t->gso_refused = 1;
            int first = (int)(u->smsg[i].msg_hdr.msg_iov - u->siov);
            nmsg = build_msgs(u, first, niov - first);
            i = 0;
            continue;
        }
        if (transient_errno(err)) {
            c->send_errors++;
            t->last_errno = err;
            i++; /* these datagrams are lost; their timers resend them */
            waited = 0;
            continue;
        }
        return -err;
    }
    return 0;
}

/* The GRO segment size of a received message (n when it holds one datagram). */
static size_t gro_segment(const struct msghdr *h, size_t n)
{
    size_t seg = n;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(h); cm; cm = CMSG_NXTHDR((struct msghdr *)h, cm)) {
        if (cm->cmsg_level == SOL_UDP && cm->cmsg_type == UDP_GRO &&
            cm->cmsg_len >= CMSG_LEN(sizeof(int))) {
            int gs;
            memcpy(&gs, CMSG_DATA(cm), sizeof gs);
            seg = gs > 0 ? (size_t)gs : n;
        }
    }
    return seg;
}

/* One recvmmsg. */
static int udp_receive(Transport *t, fp_message_fn fn, void *ctx, Counters *c)
{
    Udp *u = (Udp *)t;
    for (int i = 0; i < u->rcount; i++) {
        struct msghdr *h = &u->rmsg[i].msg_hdr;
        h->msg_name = NULL;
        h->msg_namelen = 0;
        h->msg_flags = 0;
        h->msg_control = u->gro ? u->rctrl + (size_t)i * GRO_CMSG_SPACE : NULL;
        h->msg_controllen = u->gro ? GRO_CMSG_SPACE : 0;
    }
    c->recv_calls++;
    int m = recvmmsg(u->fd, u->rmsg, (unsigned)u->rcount, MSG_DONTWAIT, NULL);
    if (m < 0) {
        int err = errno;
        if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR || transient_errno(err))
            return 0; /* nothing, or an ICMP error queued on the socket: not data */
        return -err;
    }
    double now = now_s();
    for (int i = 0; i < m; i++) {
        struct msghdr *h = &u->rmsg[i].msg_hdr;
        size_t n = u->rmsg[i].msg_len;
        if (h->msg_flags & MSG_TRUNC) {
            c->bytes_received += n;
            c->malformed++;
            continue;
        }
        size_t seg = u->gro && h->msg_controllen ? gro_segment(h, n) : n;
        fn(ctx, (const uint8_t *)u->riov[i].iov_base, n, seg, now);
    }
    return m;
}

static struct timespec timespec_of(double seconds)
{
    seconds = seconds < 0 ? 0 : seconds;
    return (struct timespec){(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
}

static int udp_wait(Transport *t, double seconds)
{
    struct timespec ts = timespec_of(seconds);
    struct pollfd pfd = {.fd = ((Udp *)t)->fd, .events = POLLIN};
    int rc = ppoll(&pfd, 1, &ts, NULL);
    return rc < 0 ? -errno : rc;
}

static void udp_describe(const Transport *t, char *buf, size_t len)
{
    (void)t;
    snprintf(buf, len, "udp");
}

static void udp_close(Transport *t)
{
    Udp *u = (Udp *)t;
    if (!u)
        return;
#define UDP_FREE(member, count, size) free(u->member);
    UDP_ARRAYS(UDP_FREE)
#undef UDP_FREE
    free(u);
}

static const TransportOps UDP_OPS = {udp_send, udp_receive, udp_wait, udp_describe, udp_close};

Transport *fp_udp_open(int fd, const struct sockaddr_in *dst, int plen, int max_rows, int gso,
                       int gro)
{
    Udp *u = calloc(1, sizeof *u);
    if (!u)
        return NULL;
    u->base = (Transport){.ops = &UDP_OPS, .plen = plen, .gso = gso};
    u->fd = fd;
    u->gro = gro;
    u->dst = *dst;
    size_t rows = (size_t)max_rows;
    /* longer datagrams show as MSG_TRUNC; a sparse result is 12 bytes over plen */
    u->rslot = gro ? RECV_SLOT : plen + 64;
    u->rcount = gro ? RECV_MSGS_GRO : RECV_MSGS_PLAIN;
    int ok = 1;
#define UDP_ALLOC(member, count, size) ok &= (u->member = calloc(count, size)) != NULL;
    UDP_ARRAYS(UDP_ALLOC)
#undef UDP_ALLOC
    if (!ok) {
        udp_close(&u->base);
        return NULL;
    }
    for (int i = 0; i < u->rcount; i++) {
        u->riov[i].iov_base = u->rbuf + (size_t)i * (size_t)u->rslot;
        u->riov[i].iov_len = (size_t)u->rslot;
        u->rmsg[i].msg_hdr.msg_iov = &u->riov[i];
        u->rmsg[i].msg_hdr.msg_iovlen = 1;
    }
    return &u->base;
}

/* --- AF_XDP, with the kernel socket beside it --------------------------------------------- */
typedef struct {
    Transport base;
    Transport *udp; /* results on another queue, or before the program was attached */
    Xsk *xsk;
    int kernel_ready; /* the last wait saw the kernel socket readable */
    fp_message_fn fn; /* of the receive in progress */
    void *ctx;
    double rx_now; /* when the frames being taken arrived */
} XdpSock;

static int xsk_t_send(Transport *t, const uint8_t *const *rows, const int *lens, int n, Counters *c)
{
    XdpSock *x = (XdpSock *)t;
    uint64_t calls = 0;
    int q = xsk_send(x->xsk, rows, lens, n, &calls);
    c->send_calls += calls;
    if (q < 0)
        return q;
    if (q < n) { /* frames the rings had no room for are lost, as a full socket buffer's */
        c->send_errors += (uint64_t)(n - q);
        t->last_errno = ENOBUFS;
    }
    return 0;
}

static void on_frame(void *ctx, const uint8_t *payload, size_t len)
{
    XdpSock *x = ctx;
    x->fn(x->ctx, payload, len, len, x->rx_now); /* one datagram per frame: no GRO */
}

/* The RX ring, and the kernel socket when the last wait saw it readable. */
static int xsk_t_receive(Transport *t, fp_message_fn fn, void *ctx, Counters *c)
{
    XdpSock *x = (XdpSock *)t;
    x->fn = fn;
    x->ctx = ctx;
    x->rx_now = now_s();
    int m = xsk_receive(x->xsk, RECV_MSGS_PLAIN, on_frame, x, &c->malformed);
    if (x->kernel_ready) {
        x->kernel_ready = 0;
        int k = x->udp->ops->receive(x->udp, fn, ctx, c);
        if (k < 0)
            return k;
        m += k;
    }
    return m;
}

static int xsk_t_wait(Transport *t, double seconds)
{
    XdpSock *x = (XdpSock *)t;
    struct timespec ts = timespec_of(seconds);
    struct pollfd pfd[2] = {{.fd = ((Udp *)x->udp)->fd, .events = POLLIN},
                            {.fd = xsk_fd(x->xsk), .events = POLLIN}};
    int rc = ppoll(pfd, 2, &ts, NULL);
    /* POLLERR too: a queued ICMP error is taken off by a receive, else ppoll would not wait */
    if (rc > 0 && (pfd[0].revents & (POLLIN | POLLERR)))
        x->kernel_ready = 1;
    return rc < 0 ? -errno : rc;
}

static void xsk_t_describe(const Transport *t, char *buf, size_t len)
{
    const XdpSock *x = (const XdpSock *)t;
    snprintf(buf, len, "afxdp-%s-%s", xsk_zerocopy(x->xsk) ? "zerocopy" : "copy",
             xsk_attach_mode(x->xsk));
}

static void xsk_t_close(Transport *t)
{
    XdpSock *x = (XdpSock *)t;
    xsk_close(x->xsk);
    x->udp->ops->close(x->udp);
    free(x);
}

static const TransportOps XSK_OPS = {xsk_t_send, xsk_t_receive, xsk_t_wait, xsk_t_describe,
                                     xsk_t_close};

Transport *fp_xsk_open(Transport *udp, const XskConfig *cfg, int max_rows, char *why,
                       size_t why_len)
{
    (void)max_rows; /* the rows are the loop's: nothing to copy them into */
    XdpSock *x = calloc(1, sizeof *x);
    if (!x) {
        snprintf(why, why_len, "out of memory");
        return NULL;
    }
    x->xsk = xsk_open(cfg, why, why_len);
    if (!x->xsk) {
        free(x);
        return NULL;
    }
    x->base = (Transport){.ops = &XSK_OPS, .plen = udp->plen, .gso = udp->gso};
    x->udp = udp;
    return &x->base;
}
