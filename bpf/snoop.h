/* snoop.h: IGMP snooping of the switched mode (bpf/forward.h; issue 53, docs/design.md
 * "Multicast in the switched mode").
 *
 * The rules are the Linux bridge's with snooping on (net/bridge/br_multicast.c and
 * br_input.c, torvalds/linux 30c0923): IGMP messages arriving on a port are snooped at ingress
 * (fwd_snoop) and every frame is still flooded as before; the devmap egress program then
 * prunes each flooded copy (fwd_prune):
 *  - a query makes its port a multicast router port and says a querier is present; with no
 *    query seen for querier_ns, nothing is pruned (the bridge floods without a querier:
 *    without one, hosts do not refresh their reports and memberships would lapse);
 *  - a report (IGMP v1, v2, or a v3 record that joins) makes its port a member of the group
 *    for member_ns; a leave (v2, or a v3 record of include mode with no source) shortens that
 *    port's membership to leave_ns (the querier's group-specific queries then refresh the
 *    ports that still have members);
 *  - with a querier present, a group with members goes to its member ports and the router
 *    ports only; reports and leaves go to the router ports only (so that one host's report
 *    does not suppress another's, IGMPv2 section 3); queries, 224.0.0.0/24 (link-local
 *    control) and groups without members are flooded.
 * MLD (IPv6) is not snooped: IPv6 multicast is flooded. */
#ifndef XDP_AGG_SNOOP_H
#define XDP_AGG_SNOOP_H

#define AGG_FWD_GROUPS	     4096	/* (group, port) memberships held (LRU) */
#define AGG_IGMP_PROTO	     2		/* IPPROTO_IGMP */
#define AGG_IGMP_QUERY	     0x11	/* membership query */
#define AGG_IGMP_V1_REPORT   0x12	/* IGMPv1 membership report */
#define AGG_IGMP_V2_REPORT   0x16	/* IGMPv2 membership report */
#define AGG_IGMP_V2_LEAVE    0x17	/* IGMPv2 leave group */
#define AGG_IGMP_V3_REPORT   0x22	/* IGMPv3 membership report (RFC 3376 4.2) */
#define AGG_IGMP_V3_MAX_OFF  9000	/* verifier: a record starts this far in, at most */
#define AGG_IGMP_MODE_IS_IN  1		/* v3 record: MODE_IS_INCLUDE */
#define AGG_IGMP_TO_IN	     3		/* v3 record: CHANGE_TO_INCLUDE_MODE */
#define AGG_IGMP_BLOCK_OLD   6		/* v3 record: BLOCK_OLD_SOURCES */
#define AGG_MCAST_NET	     0xe0000000 /* 224.0.0.0/4, host order: a group address */
#define AGG_MCAST_MASK	     0xf0000000 /* the mask of 224.0.0.0/4 */
#define AGG_MCAST_LOCAL_MASK 0xffffff00 /* the mask of 224.0.0.0/24: always flooded */

/* A membership of fwd_groups: a group behind a port. */
struct agg_fwd_group {
	__be32 group; /* the group address */
	u32 ifindex;  /* the port a report came in on */
};

/* clang-format off */
AGG_BTF_MAP(BPF_MAP_TYPE_LRU_HASH, fwd_groups, struct agg_fwd_group, u64, AGG_FWD_GROUPS); /* (group, port) -> when it lapses */
AGG_BTF_MAP(BPF_MAP_TYPE_LRU_HASH, fwd_group_any, __be32, u64, AGG_FWD_GROUPS);           /* group -> when its last membership lapses */
AGG_HASH(fwd_mrouters, u32, u64, AGG_MAX_PORTS);                                          /* port a query came in on -> when it lapses */
AGG_ARRAY(fwd_querier, u64, 1);                                                           /* 0 -> when the querier's presence lapses */
/* clang-format on */

/* The IPv4 header of a frame, or NULL. */
static __always_inline struct iphdr *snoop_ip(struct ethhdr *eth, void *data_end)
{
	struct iphdr *ip = (void *)(eth + 1);

	if ((void *)(ip + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP) || ip->version != 4)
		return NULL;
	return ip;
}

/* The IGMP message after the IPv4 header (IGMP carries the router alert option), or NULL. */
static __always_inline u8 *snoop_igmp(struct iphdr *ip, void *data_end)
{
	/* verifier: ihl is 4 bits, so the offset is at most 60 */
	u8 *igmp = (u8 *)ip + (ip->ihl & 0xf) * 4;

	if (ip->protocol != AGG_IGMP_PROTO || ip->ihl < 5 || (void *)(igmp + 8) > data_end)
		return NULL;
	return igmp;
}

/* Whether a group is one snooping may prune: not 224.0.0.0/24. */
static __always_inline bool snoop_prunable(__be32 group)
{
	u32 g = agg_ntohl(group);

	return (g & AGG_MCAST_MASK) == AGG_MCAST_NET && (g & AGG_MCAST_LOCAL_MASK) != AGG_MCAST_NET;
}

/* A report for group on port `in`: a member until now + member_ns. */
static __always_inline void snoop_join(struct agg_fwd_config *cfg, __be32 group, u32 in, u64 now)
{
	struct agg_fwd_group k = {.group = group, .ifindex = in};
	u64 until = now + cfg->member_ns;

	if (!snoop_prunable(group))
		return;
	bpf_map_update_elem(&fwd_groups, &k, &until, BPF_ANY);
	bpf_map_update_elem(&fwd_group_any, &group, &until, BPF_ANY);
}

/* A leave of group on port `in`: its membership lapses within leave_ns. */
static __always_inline void snoop_leave(struct agg_fwd_config *cfg, __be32 group, u32 in, u64 now)
{
	struct agg_fwd_group k = {.group = group, .ifindex = in};
	u64 *until = bpf_map_lookup_elem(&fwd_groups, &k);

	if (until && *until > now + cfg->leave_ns)
		*until = now + cfg->leave_ns;
}

/* Where an IGMPv3 report's walk over its records is (snoop_v3_record's bpf_loop context). */
struct agg_snoop_walk {
	struct xdp_md *ctx;	    /* the frame */
	struct agg_fwd_config *cfg; /* fwd_config's entry */
	u64 now;		    /* bpf_ktime_get_ns */
	u32 off;		    /* the next record, from the frame's start */
	u32 in;			    /* the port it came in on */
};

/* One group record of an IGMPv3 report (RFC 3376 4.2.4): a record of include mode with no
 * source leaves, BLOCK_OLD_SOURCES changes nothing, every other record joins. 1 (stop) past
 * the frame's end.
 * verifier: a bpf_loop callback, verified once whatever the number of records. */
static long snoop_v3_record(u64 i, void *arg)
{
	struct agg_snoop_walk *w = arg;
	void *data = (void *)(long)w->ctx->data;
	void *data_end = (void *)(long)w->ctx->data_end;
	u32 off = w->off, nsrc;
	__be32 group;
	u8 *rec;

	/* verifier: a bounded offset, then the record's 8 bytes checked against the end */
	if (off > AGG_IGMP_V3_MAX_OFF)
		return 1;
	rec = data + off;
	if ((void *)(rec + 8) > data_end)
		return 1;
	nsrc = ((u32)rec[2] << 8) | rec[3];
	__builtin_memcpy(&group, rec + 4, sizeof(group));
	if ((rec[0] == AGG_IGMP_MODE_IS_IN || rec[0] == AGG_IGMP_TO_IN) && nsrc == 0)
		snoop_leave(w->cfg, group, w->in, w->now);
	else if (rec[0] != AGG_IGMP_BLOCK_OLD)
		snoop_join(w->cfg, group, w->in, w->now);
	w->off = off + 8 + 4 * nsrc + 4 * (u32)rec[1]; /* sources, aux data: 32-bit words */
	return 0;
}

/* Snoop an IGMP message that came in on port `in` (the frame is flooded afterwards).
 * verifier: a subprogram of its own (noinline), verified once. */
static __noinline void fwd_snoop(struct xdp_md *ctx, struct agg_fwd_config *cfg, u32 in, u64 now)
{
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = (void *)(long)ctx->data;
	struct iphdr *ip;
	u32 zero = 0;
	u64 until;
	__be32 group;
	u8 *igmp;

	if ((void *)(eth + 1) > data_end)
		return;
	ip = snoop_ip(eth, data_end);
	igmp = ip ? snoop_igmp(ip, data_end) : NULL;
	if (!igmp)
		return;
	fwd_count(AGG_FWD_C_IGMP);
	__builtin_memcpy(&group, igmp + 4, sizeof(group));
	switch (igmp[0]) {
	case AGG_IGMP_QUERY:
		until = now + cfg->querier_ns;
		bpf_map_update_elem(&fwd_mrouters, &in, &until, BPF_ANY);
		bpf_map_update_elem(&fwd_querier, &zero, &until, BPF_ANY);
		break;
	case AGG_IGMP_V1_REPORT:
	case AGG_IGMP_V2_REPORT:
		snoop_join(cfg, group, in, now);
		break;
	case AGG_IGMP_V2_LEAVE:
		snoop_leave(cfg, group, in, now);
		break;
	case AGG_IGMP_V3_REPORT: {
		struct agg_snoop_walk w = {ctx, cfg, now, (u32)(igmp + 8 - (u8 *)eth), in};

		bpf_loop(((u32)igmp[6] << 8) | igmp[7], snoop_v3_record, &w, 0);
		break;
	}
	}
}

/* Whether a map's "lapses at" entry for key is still in the future. */
static __always_inline bool snoop_live(void *map, const void *key, u64 now)
{
	u64 *until = bpf_map_lookup_elem(map, key);

	return until && *until > now;
}

/* Whether a flooded copy of an IPv4 multicast frame may leave by port `out` (see the top). */
static __always_inline bool snoop_lets_out(struct iphdr *ip, void *data_end, u32 out, u64 now)
{
	struct agg_fwd_group k = {.group = ip->daddr, .ifindex = out};
	u32 zero = 0;
	u8 *igmp;

	if (!snoop_live(&fwd_querier, &zero, now) || snoop_live(&fwd_mrouters, &out, now))
		return true;
	igmp = snoop_igmp(ip, data_end);
	if (igmp)
		return igmp[0] == AGG_IGMP_QUERY; /* reports and leaves: router ports only */
	if (!snoop_prunable(ip->daddr) || snoop_live(&fwd_groups, &k, now))
		return true;
	return !snoop_live(&fwd_group_any, &ip->daddr, now); /* no members: flooded */
}

/* The egress side of snooping, for a frame that is not a result: XDP_DROP for a flooded
 * multicast copy the port's members do not want, else XDP_PASS (in a devmap program, sent). */
static __always_inline int fwd_prune(struct xdp_md *ctx)
{
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = (void *)(long)ctx->data;
	struct agg_fwd_config *cfg;
	struct iphdr *ip;
	u32 zero = 0;

	/* verifier: the Ethernet header before its first byte is read */
	if ((void *)(eth + 1) > data_end || !(eth->h_dest[0] & 1))
		return XDP_PASS; /* unicast: switched or routed, never pruned */
	ip = snoop_ip(eth, data_end);
	if (!ip || (agg_ntohl(ip->daddr) & AGG_MCAST_MASK) != AGG_MCAST_NET)
		return XDP_PASS; /* not IPv4 multicast: broadcast, ARP, IPv6 */
	cfg = bpf_map_lookup_elem(&fwd_config, &zero);
	if (!cfg || cfg->mode != AGG_FWD_SWITCHED)
		return XDP_PASS;
	if (snoop_lets_out(ip, data_end, ctx->egress_ifindex, bpf_ktime_get_ns()))
		return XDP_PASS;
	fwd_count(AGG_FWD_C_PRUNED);
	return XDP_DROP;
}

#endif
