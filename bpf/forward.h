/* forward.h: the switch topology forwards what is not aggregation traffic (issue 53,
 * docs/design.md "Forwarding ordinary traffic").
 *
 * A frame the parser calls not ours goes to forward(), which does what fwd_config says:
 *  - off (one-arm): XDP_PASS, as before;
 *  - routed (each port its own subnet): bpf_fib_lookup in the kernel's tables and a redirect
 *    through the devmap hash fwd_ports to the attached egress port, TTL or hop limit
 *    decremented, MACs from the lookup; what XDP must not touch (no neighbour yet, a local
 *    destination, TTL 1, an egress port not attached) passes to the kernel, which forwards it,
 *    resolves the neighbour or answers ICMP. The model is the kernel's samples/bpf/xdp_fwd_kern.c
 *    (torvalds/linux 30c0923, xdp_fwd_flags, lines 43-141) and xdp-tools' xdp-forward
 *    (xdp-project/xdp-tools f0b4ac2, xdp-forward/xdp_forward.bpf.c lines 32-127);
 *  - switched (the ports share one segment): the source MAC is learned into fwd_macs (an LRU
 *    hash: bounded, the least recently used entry goes first), a learned destination behind
 *    another port gets a redirect there, an unknown, aged, broadcast or multicast one is
 *    flooded by a devmap broadcast through tx_ports to every other port (BPF_F_EXCLUDE_INGRESS:
 *    no hairpin); frames to the box itself (its MACs, an ARP request for its address) pass;
 *    IGMP is snooped and flooded multicast pruned at egress as the Linux bridge does
 *    (bpf/snoop.h).
 * Both modes drop a frame whose source is one of the box's own ports (fwd_own_macs,
 * fwd_own_ips): it can only have looped back. Every outcome is counted in fwd_stats.
 *
 * Every frame sent out of a port carries the port's egress program (tx_ports and fwd_ports
 * entries both have it): a CPU's redirected frames to one device share one bulk queue, which
 * runs its first frame's program on all (kernel 6.18 kernel/bpf/devmap.c bq_enqueue), so a
 * forwarded frame without one ahead of a result's copy would send the copy unaddressed. The
 * egress programs pass a frame that is not a result unchanged. */
#ifndef XDP_AGG_FORWARD_H
#define XDP_AGG_FORWARD_H

#include <linux/ipv6.h>

#define AGG_AF_INET	    2		 /* bpf_fib_lookup family: IPv4 */
#define AGG_AF_INET6	    10		 /* bpf_fib_lookup family: IPv6 */
#define AGG_IPV6_FLOW_MASK  0x0fffffff	 /* IPv6 flow label and traffic class */
#define AGG_FWD_MACS	    4096	 /* learned MACs the switched mode holds (LRU) */
#define AGG_FWD_OWN_IPS	    256		 /* IPv4 addresses of the box's ports */
#define AGG_FWD_REFRESH_NS  250000000ULL /* a learned entry's time is rewritten this often */
#define AGG_FWD_FLOOD_FLAGS (BPF_F_BROADCAST | BPF_F_EXCLUDE_INGRESS) /* to the other ports */

/* What fwd_config's mode says the switch topology does with a frame that is not ours. */
enum agg_fwd_mode {
	AGG_FWD_OFF = 0,      /* pass it to the kernel (one-arm) */
	AGG_FWD_ROUTED = 1,   /* route it: fib lookup, redirect */
	AGG_FWD_SWITCHED = 2, /* switch it: learned MACs, flooding */
};

/* Counters of fwd_stats (per-CPU), one per outcome or table event. */
enum agg_fwd_counter {
	AGG_FWD_C_ROUTED = 0,	  /* routed out of another port */
	AGG_FWD_C_SWITCHED = 1,	  /* switched to the port its destination was learned on */
	AGG_FWD_C_FLOODED = 2,	  /* flooded to the other ports */
	AGG_FWD_C_PASSED = 3,	  /* passed to the kernel (to us, no neighbour, not IP, ...) */
	AGG_FWD_C_TTL = 4,	  /* TTL or hop limit 1: passed, the kernel says time exceeded */
	AGG_FWD_C_OWN_SOURCE = 5, /* dropped: the source is one of the box's own ports */
	AGG_FWD_C_LOOP = 6,	  /* dropped: its source MAC came in on another port just now */
	AGG_FWD_C_SAME_PORT = 7,  /* dropped: destination learned behind the ingress port */
	AGG_FWD_C_BAD_SOURCE = 8, /* dropped: multicast source MAC */
	AGG_FWD_C_LEARNED = 9,	  /* event: a new MAC learned */
	AGG_FWD_C_MOVED = 10,	  /* event: a learned MAC relearned on another port */
	AGG_FWD_C_AGED = 11,	  /* event: a learned MAC forgotten for age */
	AGG_FWD_C_IGMP = 12,	  /* event: an IGMP message snooped (bpf/snoop.h) */
	AGG_FWD_C_PRUNED = 13,	  /* a flooded multicast copy not sent: no member there */
	AGG_FWD_NUM_COUNTERS = 14,
};

/* How the switch topology forwards: written by attach, read by every frame that is not ours. */
struct agg_fwd_config {
	u32 mode;	/* enum agg_fwd_mode */
	u32 pad;	/* zero */
	u64 age_ns;	/* switched: a MAC not seen for this long is forgotten */
	u64 hold_ns;	/* switched: a MAC seen on another port sooner than this is a loop */
	u64 member_ns;	/* switched: a port's group membership lasts this long after a report */
	u64 querier_ns; /* switched: a querier is present this long after its query */
	u64 leave_ns;	/* switched: a membership lasts this long after a leave */
};

/* A MAC address as a hash key (padded to 8 bytes, the pad zero). */
struct agg_fwd_mac {
	u8 addr[ETH_ALEN]; /* the address */
	u16 pad;	   /* zero */
};

/* Where a MAC was learned. */
struct agg_fwd_learned {
	u32 ifindex; /* the port */
	u32 pad;     /* zero */
	u64 seen_ns; /* bpf_ktime_get_ns of its last frame (refreshed every AGG_FWD_REFRESH_NS) */
};

/* clang-format off */
AGG_ARRAY(fwd_config, struct agg_fwd_config, 1);                                /* 0 -> mode, ageing */
AGG_DEVMAP_HASH(fwd_ports, AGG_MAX_PORTS);                                      /* ifindex -> attached port, its egress program */
AGG_BTF_MAP(BPF_MAP_TYPE_LRU_HASH, fwd_macs, struct agg_fwd_mac, struct agg_fwd_learned, AGG_FWD_MACS); /* MAC -> port */
AGG_HASH(fwd_own_macs, struct agg_fwd_mac, u32, AGG_MAX_PORTS);                 /* our port's MAC -> its ifindex */
AGG_HASH(fwd_own_ips, __be32, u32, AGG_FWD_OWN_IPS);                            /* our port's IPv4 -> its ifindex */
AGG_PERCPU_ARRAY(fwd_stats, u64, AGG_FWD_NUM_COUNTERS);                         /* counter -> frames */
/* clang-format on */

/* Count one frame (or table event) in fwd_stats. Per-CPU: no atomics. */
static __always_inline void fwd_count(u32 what)
{
	u64 *c = bpf_map_lookup_elem(&fwd_stats, &what);

	if (c)
		*c += 1;
}

/* Count an outcome and return its XDP action. */
static __always_inline int fwd_verdict(u32 what, int action)
{
	fwd_count(what);
	return action;
}

#include "snoop.h"

/* Whether a MAC is one of the box's ports'. */
static __always_inline bool fwd_is_own_mac(const u8 *mac)
{
	struct agg_fwd_mac k = {};

	__builtin_memcpy(k.addr, mac, ETH_ALEN);
	return bpf_map_lookup_elem(&fwd_own_macs, &k) != NULL;
}

/* IPv4 TTL minus one, the header checksum updated incrementally (RFC 1624), as the kernel's
 * ip_decrease_ttl does. */
static __always_inline void fwd_ttl_down(struct iphdr *ip)
{
	u32 sum = (u32)ip->check + (u32)bpf_htons(0x0100);

	ip->check = (u16)(sum + (sum >> 16));
	ip->ttl--;
}

/* Fill the lookup's IPv4 or IPv6 part from the header; the TTL verdict (0: go on). */
static __always_inline int fwd_fib_params(struct bpf_fib_lookup *fib, void *l3, void *data_end,
					  __be16 proto)
{
	if (proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = l3;

		if ((void *)(ip + 1) > data_end || ip->version != 4)
			return fwd_verdict(AGG_FWD_C_PASSED, XDP_PASS);
		if (ip->ttl <= 1)
			return fwd_verdict(AGG_FWD_C_TTL, XDP_PASS);
		fib->family = AGG_AF_INET;
		fib->tos = ip->tos;
		fib->l4_protocol = ip->protocol;
		fib->tot_len = agg_ntohs(ip->tot_len);
		fib->ipv4_src = ip->saddr;
		fib->ipv4_dst = ip->daddr;
		return 0;
	}
	if (proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = l3;

		if ((void *)(ip6 + 1) > data_end)
			return fwd_verdict(AGG_FWD_C_PASSED, XDP_PASS);
		if (ip6->hop_limit <= 1)
			return fwd_verdict(AGG_FWD_C_TTL, XDP_PASS);
		fib->family = AGG_AF_INET6;
		fib->flowinfo = *(__be32 *)ip6 & bpf_htonl(AGG_IPV6_FLOW_MASK);
		fib->l4_protocol = ip6->nexthdr;
		fib->tot_len = agg_ntohs(ip6->payload_len);
		__builtin_memcpy(fib->ipv6_src, &ip6->saddr, sizeof(ip6->saddr));
		__builtin_memcpy(fib->ipv6_dst, &ip6->daddr, sizeof(ip6->daddr));
		return 0;
	}
	return fwd_verdict(AGG_FWD_C_PASSED, XDP_PASS); /* ARP and the rest: the kernel's */
}

/* Routed: the kernel's FIB says where; only frames addressed to us are routed.
 * verifier: a subprogram of its own (noinline), so that its stack (the 64-byte lookup) is not
 * added to the aggregator's frame and its branches are verified once. */
static __noinline int fwd_route(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct bpf_fib_lookup fib = {};
	struct ethhdr *eth = data;
	int rc;

	if ((void *)(eth + 1) > data_end || !fwd_is_own_mac(eth->h_dest))
		return fwd_verdict(AGG_FWD_C_PASSED, XDP_PASS); /* broadcast, another host's */
	rc = fwd_fib_params(&fib, eth + 1, data_end, eth->h_proto);
	if (rc)
		return rc;
	fib.ifindex = ctx->ingress_ifindex;
	rc = bpf_fib_lookup(ctx, &fib, sizeof(fib), 0);
	/* no neighbour yet, a local destination, forwarding off, back out of the same port (the
	 * kernel sends a redirect), a port not attached: the kernel's forwarding does it */
	if (rc != BPF_FIB_LKUP_RET_SUCCESS || fib.ifindex == ctx->ingress_ifindex ||
	    !bpf_map_lookup_elem(&fwd_ports, &fib.ifindex))
		return fwd_verdict(AGG_FWD_C_PASSED, XDP_PASS);
	data = (void *)(long)ctx->data; /* verifier: a helper call invalidates packet pointers */
	data_end = (void *)(long)ctx->data_end;
	eth = data;
	if ((void *)(eth + 1) > data_end)
		return XDP_ABORTED;
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);

		if ((void *)(ip + 1) > data_end)
			return XDP_ABORTED; /* verifier: checked before the lookup, lost in it */
		fwd_ttl_down(ip);
	} else {
		struct ipv6hdr *ip6 = (void *)(eth + 1);

		if ((void *)(ip6 + 1) > data_end)
			return XDP_ABORTED; /* verifier: as above */
		ip6->hop_limit--;
	}
	__builtin_memcpy(eth->h_dest, fib.dmac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, fib.smac, ETH_ALEN);
	fwd_count(AGG_FWD_C_ROUTED);
	return bpf_redirect_map(&fwd_ports, fib.ifindex, XDP_PASS);
}

/* Switched: learn where the source is. False: a loop, to be dropped. */
static __always_inline bool fwd_learn(struct agg_fwd_config *cfg, const u8 *src, u32 in, u64 now)
{
	struct agg_fwd_learned *l, fresh = {.ifindex = in, .seen_ns = now};
	struct agg_fwd_mac k = {};

	__builtin_memcpy(k.addr, src, ETH_ALEN);
	l = bpf_map_lookup_elem(&fwd_macs, &k);
	if (!l) {
		fwd_count(AGG_FWD_C_LEARNED);
		bpf_map_update_elem(&fwd_macs, &k, &fresh, BPF_ANY); /* LRU: evicts when full */
		return true;
	}
	if (l->ifindex != in) {
		/* the same source on two ports within the hold: a frame looping back through
		 * another port (not relearned, so that the loop does not move it back and forth) */
		if (now - l->seen_ns < cfg->hold_ns)
			return false;
		fwd_count(AGG_FWD_C_MOVED);
		l->ifindex = in;
		l->seen_ns = now;
	} else if (now - l->seen_ns > AGG_FWD_REFRESH_NS) {
		l->seen_ns = now; /* not on every frame: the entry's cache line stays shared */
	}
	return true;
}

/* Whether an ARP request asks for one of the box's addresses (the kernel answers it). */
static __always_inline bool fwd_arp_for_us(struct ethhdr *eth, void *data_end)
{
	u8 *arp = (void *)(eth + 1);
	__be32 tip;

	/* verifier: the 28-byte IPv4-over-Ethernet ARP body must be in the frame */
	if (eth->h_proto != bpf_htons(ETH_P_ARP) || (void *)(arp + 28) > data_end)
		return false;
	__builtin_memcpy(&tip, arp + 24, sizeof(tip)); /* target protocol address, RFC 826 */
	return bpf_map_lookup_elem(&fwd_own_ips, &tip) != NULL;
}

/* Switched: learned destination, flood, or the box itself.
 * verifier: a subprogram of its own (noinline), as fwd_route. */
static __noinline int fwd_switch(struct xdp_md *ctx, struct agg_fwd_config *cfg)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct agg_fwd_learned *l;
	struct agg_fwd_mac k = {};
	struct ethhdr *eth = data;
	u32 in = ctx->ingress_ifindex;
	u64 now = bpf_ktime_get_ns();

	if ((void *)(eth + 1) > data_end)
		return fwd_verdict(AGG_FWD_C_PASSED, XDP_PASS);
	if (eth->h_source[0] & 1)
		return fwd_verdict(AGG_FWD_C_BAD_SOURCE, XDP_DROP);
	if (!fwd_learn(cfg, eth->h_source, in, now))
		return fwd_verdict(AGG_FWD_C_LOOP, XDP_DROP);
	if (eth->h_dest[0] & 1) {
		fwd_snoop(ctx, cfg, in, now);
		data = (void *)(long)ctx->data; /* verifier: packet pointers again after a call */
		data_end = (void *)(long)ctx->data_end;
		eth = data;
		if ((void *)(eth + 1) > data_end)
			return XDP_ABORTED;
	}
	if (fwd_is_own_mac(eth->h_dest) || fwd_arp_for_us(eth, data_end))
		return fwd_verdict(AGG_FWD_C_PASSED, XDP_PASS);
	if (!(eth->h_dest[0] & 1)) {
		__builtin_memcpy(k.addr, eth->h_dest, ETH_ALEN);
		l = bpf_map_lookup_elem(&fwd_macs, &k);
		if (l && now - l->seen_ns > cfg->age_ns) {
			fwd_count(AGG_FWD_C_AGED);
			bpf_map_delete_elem(&fwd_macs, &k);
			l = NULL;
		}
		if (l && l->ifindex == in)
			return fwd_verdict(AGG_FWD_C_SAME_PORT, XDP_DROP); /* no hairpin */
		if (l) {
			fwd_count(AGG_FWD_C_SWITCHED);
			return bpf_redirect_map(&fwd_ports, l->ifindex, XDP_DROP);
		}
	}
	fwd_count(AGG_FWD_C_FLOODED);
	return bpf_redirect_map(&tx_ports, 0, AGG_FWD_FLOOD_FLAGS);
}

/* A source the box's own ports have: a frame of ours come back, or a spoofed one. */
static __always_inline bool fwd_own_source(struct xdp_md *ctx)
{
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = (void *)(long)ctx->data;
	struct iphdr *ip = (void *)(eth + 1);

	if ((void *)(ip + 1) > data_end)
		return (void *)(eth + 1) <= data_end && fwd_is_own_mac(eth->h_source);
	if (fwd_is_own_mac(eth->h_source))
		return true;
	return eth->h_proto == bpf_htons(ETH_P_IP) &&
	       bpf_map_lookup_elem(&fwd_own_ips, &ip->saddr) != NULL;
}

/* A frame that is not aggregation traffic, as fwd_config says (see the top of this file). */
static __always_inline int forward(struct xdp_md *ctx)
{
	u32 zero = 0;
	struct agg_fwd_config *cfg = bpf_map_lookup_elem(&fwd_config, &zero);

	if (!cfg || cfg->mode == AGG_FWD_OFF)
		return XDP_PASS;
#ifdef AGG_FRAGS
	/* a frame larger than its first buffer: the kernel's (a devmap redirect of a multi-buffer
	 * frame is not relied on, docs/protocol.md 3.5) */
	if (frame_len(ctx) != (u32)(ctx->data_end - ctx->data))
		return fwd_verdict(AGG_FWD_C_PASSED, XDP_PASS);
#endif
	if (fwd_own_source(ctx))
		return fwd_verdict(AGG_FWD_C_OWN_SOURCE, XDP_DROP);
	if (cfg->mode == AGG_FWD_ROUTED)
		return fwd_route(ctx);
	return fwd_switch(ctx, cfg);
}

/* A frame that is not ours: forwarded, or passed to the kernel (counted as AGG_PASS then). */
static __always_inline int not_ours(struct xdp_md *ctx)
{
	int action = forward(ctx);

	if (action == XDP_PASS)
		count(AGG_NO_JOB, AGG_PASS);
	return action;
}

#endif
