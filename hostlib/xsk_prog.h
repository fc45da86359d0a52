/*
 * The worker's XDP program of the AF_XDP data path (hostlib/_xsk.c) and its two maps: a
 * hand-written instruction array loaded and attached with bpf(2) alone (no libbpf: pip builds
 * the extension from source). It sends the results on this receive queue to the AF_XDP socket of
 * their UDP port (every lane of every job of this process on the queue: a job's and its 16-bit
 * companion's) and passes everything else to the kernel.
 */
#ifndef HOSTLIB_XSK_PROG_H
#define HOSTLIB_XSK_PROG_H

#include <linux/bpf.h>
#include <stddef.h>
#include <stdint.h>

long xsk_sys_bpf(int cmd, union bpf_attr *attr);

/* The XSKMAP of `slots` sockets (key: the socket's slot); its fd, or -1 with errno. */
int xsk_map_create(int slots);

/* The ports map of `slots` entries (a hash: a UDP port, host order, to the slot of the socket
 * that takes its results); its fd, or -1 with errno. */
int xsk_ports_create(int slots);

/* key -> value into either map (a socket's fd into the XSKMAP, a slot into the ports map), or
 * the key out of it when value < 0. 0, or -1 with errno. */
int xsk_map_set(int map_fd, uint32_t key, int value);

/* Load the program for receive queue `queue`: a UDP port in the ports map ports_fd goes to the
 * XSKMAP map_fd at its slot; `no_socket`: the action where that slot has no socket (XDP_PASS:
 * its kernel UDP socket takes the frame; a test run gives another to tell the two apart). Returns
 * its fd, or -1 with errno (and the verifier's log in log, when log_len). */
int xsk_prog_load(int map_fd, int ports_fd, int queue, int no_socket, char *log, size_t log_len);

/* Attach prog_fd to ifindex by a bpf_link, in driver mode, else generic (skb) mode (prog_flags:
 * XDP_FLAGS_DRV_MODE or XDP_FLAGS_SKB_MODE to allow only that one, 0 for both). Returns the
 * link's fd with *mode "drv" or "skb", or -1 with the reason in why. */
int xsk_prog_attach(int prog_fd, int ifindex, int prog_flags, const char **mode, char *why,
                    size_t why_len);

#endif
