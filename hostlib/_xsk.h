/*
 * The AF_XDP data path of hostlib._fastpath: an AF_XDP socket per lane on the worker's
 * interface queue, the UMEM all the sockets there share (every lane of every job of this
 * process) and its fill and completion rings, and the worker's XDP program
 * (hostlib/xsk_prog.c) that redirects the results (UDP to a lane's data port) to that lane's
 * socket and passes everything else. See hostlib/_xsk.c; hostlib/afxdp.py finds the addresses.
 */
#ifndef HOSTLIB_XSK_H
#define HOSTLIB_XSK_H

#include <stddef.h>
#include <stdint.h>

#include "fp_wire.h"

#define XSK_HDR_LEN FP_FRAME_HLEN /* Ethernet (14) + IPv4 without options (20) + UDP (8) */

/* Where the frames go and come from (addresses and ports in host order). */
typedef struct {
    int ifindex, queue;
    uint8_t src_mac[6], dst_mac[6];
    uint32_t src_ip, dst_ip;
    uint16_t src_port, dst_port; /* src_port: this lane's, the lanes' base port + lane */
    int lane, lanes;             /* this socket's lane of the job's lanes (0 of 1 without lanes) */
    int ttl, tos;   /* of the IPv4 header: what the kernel would send (hostlib/afxdp.py) */
    int plen;       /* UDP payload length of a dense frame (a sparse one: 22 or plen + 12) */
    int zerocopy;   /* 1: try XDP_ZEROCOPY first (falls back to copy mode) */
    int prog_flags; /* XDP attach mode: XDP_FLAGS_DRV_MODE or XDP_FLAGS_SKB_MODE, 0: try both */
} XskConfig;

typedef struct Xsk Xsk;

/* Called for each result datagram (its UDP payload) by xsk_receive. */
typedef void (*xsk_datagram_fn)(void *ctx, const uint8_t *payload, size_t len);

/* Open the lane's socket. The first socket of this process to open on an interface queue
 * registers the UMEM and attaches the redirect program for every socket there; the others, of
 * this job's lanes or another job's (a 16-bit companion's), bind to its UMEM (XDP_SHARED_UMEM)
 * and enter their ports in the program's maps. Thread-safe; each lane's socket is then used by
 * one thread. Returns NULL with the reason in why (and errno set) when AF_XDP cannot run here;
 * the caller keeps the kernel socket. */
Xsk *xsk_open(const XskConfig *cfg, char *why, size_t why_len);
/* Close the lane's socket (its results go to the kernel socket from then); the others on the
 * queue go on, and the last one's close, whichever job's, detaches the program and frees the
 * UMEM. */
void xsk_close(Xsk *x);
int xsk_fd(const Xsk *x);
int xsk_zerocopy(const Xsk *x);
const char *xsk_attach_mode(const Xsk *x);

/* Queue n frames with the payloads rows[i] (lens[i] bytes each, at most cfg.plen + 12; lens
 * NULL: cfg.plen each) and kick the kernel.
 * Returns the frames queued (the rest found no free frame or ring entry: lost, as datagrams a
 * full socket buffer refused), or -errno on an error that is not transient. *calls counts the
 * system calls made. */
int xsk_send(Xsk *x, const uint8_t *const *rows, const int *lens, int n, uint64_t *calls);

/* Take up to `budget` received frames off the RX ring; fn gets each valid result's payload.
 * Returns the frames taken (valid or not); *malformed counts those that were not results. */
int xsk_receive(Xsk *x, int budget, xsk_datagram_fn fn, void *ctx, uint64_t *malformed);

#endif
