/*
 * The I/O of the C fast path behind one interface, a Transport: the kernel's UDP socket
 * (sendmmsg with UDP GSO, recvmmsg with UDP GRO) or an AF_XDP socket (hostlib/_xsk.c) with
 * the kernel socket beside it for the results that arrive there. The stream loop
 * (hostlib/fp_loop.c) sends rows, takes batches of results and waits through the ops only.
 * A Transport belongs to one loop: several loops, each with its own, can run in threads.
 */
#ifndef HOSTLIB_FP_IO_H
#define HOSTLIB_FP_IO_H

#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>

#include "_xsk.h"
#include "fp_counters.h"

/* Called for each message received: n bytes at buf, cut into datagrams of seg bytes (n for
 * one datagram; a GRO buffer holds several), received at `now` (monotonic seconds). */
typedef void (*fp_message_fn)(void *ctx, const uint8_t *buf, size_t n, size_t seg, double now);

typedef struct Transport Transport;

typedef struct {
    /* Send the n rows, lens[i] bytes each (lens NULL: plen each; a sparse all-reduce mixes
     * header-only packets with full ones). Returns 0 (rows the kernel or the rings refused are
     * lost and counted in send_errors: the timers resend them), or -errno on an error that is
     * neither transient nor a GSO refusal. */
    int (*send)(Transport *t, const uint8_t *const *rows, const int *lens, int n, Counters *c);
    /* Take one batch of received messages (fn for each). Returns the messages taken (0: none
     * waiting) or -errno. */
    int (*receive)(Transport *t, fp_message_fn fn, void *ctx, Counters *c);
    /* Wait up to `seconds` for something to receive. Returns > 0 readable, 0 timed out, or
     * -errno (-EINTR: a signal came). */
    int (*wait)(Transport *t, double seconds);
    /* "udp", or "afxdp-copy-drv" etc. into buf */
    void (*describe)(const Transport *t, char *buf, size_t len);
    void (*close)(Transport *t);
} TransportOps;

struct Transport {
    const TransportOps *ops;
    int plen;        /* UDP payload bytes of a dense datagram (the longest: plen + 12) */
    int gso;         /* sends still use UDP GSO (a refusal turns it off for good) */
    int gso_refused; /* set when GSO was refused: the caller reads and clears it */
    int last_errno;  /* of the last refused send, 0 if none yet */
};

/* The kernel socket `fd` (non-blocking UDP) sending to dst, up to max_rows rows per send.
 * NULL when out of memory. */
Transport *fp_udp_open(int fd, const struct sockaddr_in *dst, int plen, int max_rows, int gso,
                       int gro);
/* An AF_XDP socket as cfg says, with the kernel transport `udp` beside it (taken over: closed
 * with it). NULL with the reason in why when AF_XDP cannot run here (udp stays the caller's),
 * or when out of memory (why says so). */
Transport *fp_xsk_open(Transport *udp, const XskConfig *cfg, int max_rows, char *why,
                       size_t why_len);

#endif
