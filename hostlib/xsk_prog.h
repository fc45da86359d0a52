/*
 * The worker's XDP program of the AF_XDP data path (hostlib/_xsk.c) and its XSKMAP: a
 * hand-written instruction array loaded and attached with bpf(2) alone (no libbpf: pip builds
 * the extension from source). It sends the job's results on this receive queue to the lane's
 * AF_XDP socket and passes everything else to the kernel.
 */
#ifndef HOSTLIB_XSK_PROG_H
#define HOSTLIB_XSK_PROG_H

#include <linux/bpf.h>
#include <stddef.h>
#include <stdint.h>

long xsk_sys_bpf(int cmd, union bpf_attr *attr);

/* The XSKMAP of `lanes` sockets (key: the lane); its fd, or -1 with errno. */
int xsk_map_create(int lanes);

/* Lane `lane`'s socket fd into the map, or out of it when fd < 0. 0, or -1 with errno. */
int xsk_map_set(int map_fd, int lane, int fd);

/* Load the program for `lanes` lanes on the UDP ports base_port .. base_port + lanes - 1 of
 * receive queue `queue`, redirecting to the XSKMAP map_fd keyed by lane; `no_socket`: the action
 * where the lane has no socket in the map (XDP_PASS: its kernel UDP socket takes the frame; a
 * test run gives another to tell the two apart). Returns its fd, or -1 with errno (and the
 * verifier's log in log, when log_len). */
int xsk_prog_load(int map_fd, uint16_t base_port, int lanes, int queue, int no_socket, char *log,
                  size_t log_len);

/* Attach prog_fd to ifindex by a bpf_link, in driver mode, else generic (skb) mode (prog_flags:
 * XDP_FLAGS_DRV_MODE or XDP_FLAGS_SKB_MODE to allow only that one, 0 for both). Returns the
 * link's fd with *mode "drv" or "skb", or -1 with the reason in why. */
int xsk_prog_attach(int prog_fd, int ifindex, int prog_flags, const char **mode, char *why,
                    size_t why_len);

#endif
