/*
 * The AF_XDP data path of hostlib._fastpath: one AF_XDP socket on the worker's
 * interface queue, its UMEM and rings, and the worker's XDP program that redirects this job's
 * results (UDP to the worker's data port) to the socket and passes everything else. See
 * hostlib/_xsk.c; hostlib/afxdp.py finds the addresses.
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
    uint16_t src_port, dst_port;
    int ttl, tos;   /* of the IPv4 header: what the kernel would send (hostlib/afxdp.py) */
    int plen;       /* UDP payload length of every frame sent */
    int zerocopy;   /* 1: try XDP_ZEROCOPY first (falls back to copy mode) */
    int prog_flags; /* XDP attach mode: XDP_FLAGS_DRV_MODE or XDP_FLAGS_SKB_MODE, 0: try both */
} XskConfig;

typedef struct Xsk Xsk;

/* Called for each result datagram (its UDP payload) by xsk_receive. */
typedef void (*xsk_datagram_fn)(void *ctx, const uint8_t *payload, size_t len);

/* Open the socket, register the UMEM, attach the redirect program. Returns NULL with the reason
 * in why (and errno set) when AF_XDP cannot run here; the caller keeps the kernel socket. */
Xsk *xsk_open(const XskConfig *cfg, char *why, size_t why_len);
void xsk_close(Xsk *x);
int xsk_fd(const Xsk *x);
int xsk_zerocopy(const Xsk *x);
const char *xsk_attach_mode(const Xsk *x);

/* Queue n frames with the payloads rows[i] (cfg.plen bytes each) and kick the kernel.
 * Returns the frames queued (the rest found no free frame or ring entry: lost, as datagrams a
 * full socket buffer refused), or -errno on an error that is not transient. *calls counts the
 * system calls made. */
int xsk_send(Xsk *x, const uint8_t *const *rows, int n, uint64_t *calls);

/* Take up to `budget` received frames off the RX ring; fn gets each valid result's payload.
 * Returns the frames taken (valid or not); *malformed counts those that were not results. */
int xsk_receive(Xsk *x, int budget, xsk_datagram_fn fn, void *ctx, uint64_t *malformed);

#endif
