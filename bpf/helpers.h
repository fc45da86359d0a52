/* Small helpers of the XDP aggregator: counters, checksums, address rewrites. */
#ifndef XDP_AGG_HELPERS_H
#define XDP_AGG_HELPERS_H

#define agg_ntohl(x) bpf_htonl(x) /* a byte swap is its own inverse */
#define agg_ntohs(x) bpf_htons(x)

/* The frame's length: in a multi-buffer (frags) program data_end ends the first buffer only. */
static __always_inline u32 frame_len(struct xdp_md *ctx)
{
#ifdef AGG_FRAGS
	return (u32)bpf_xdp_get_buff_len(ctx);
#else
	return (u32)(ctx->data_end - ctx->data);
#endif
}

/* Count one packet for a job (AGG_NO_JOB for none) and a reason. Per-CPU: no atomics. */
static __always_inline void count(u32 job, u32 reason)
{
	u32 key = AGG_COUNTER_KEY(job, reason);
	u64 *c = bpf_map_lookup_elem(&stats, &key);

	if (c)
		*c += 1;
}

/* A worker's counter row (per-CPU); none for a tree job's parent (index AGG_PARENT_INDEX). */
static __always_inline struct agg_worker_stats *worker_counters(struct agg_worker *w)
{
	u32 key = AGG_WORKER_KEY(w->job, w->index);

	if (w->index >= AGG_MAX_WORKERS)
		return NULL;

	return bpf_map_lookup_elem(&worker_stats, &key);
}

/* Count one packet in a per-worker counter; `field` is a member of struct agg_worker_stats. */
#define count_worker(w, field)                                    \
	do {                                                      \
		struct agg_worker_stats *_s = worker_counters(w); \
		if (_s)                                           \
			_s->field += 1;                           \
	} while (0)

/* A dropped packet of a known worker: count it for the job and the worker. */
static __always_inline int drop(struct agg_worker *w, u32 reason)
{
	count(w->job, reason);
	count_worker(w, dropped);
	return XDP_DROP;
}

/* Recompute the IPv4 header checksum (20 bytes, no options: the parser guarantees it). */
static __always_inline void ipv4_csum(struct iphdr *ip)
{
	u16 *p = (u16 *)ip;
	u32 sum = 0;

	ip->check = 0;
#pragma unroll
	for (int i = 0; i < 10; i++)
		sum += p[i];
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	ip->check = ~sum;
}

/* The fields every result leaves with, whatever the request carried, as p4app-switchML's sender
 * writes them: ToS 0, IP id 0, flags 0 (no DF), TTL 64, UDP checksum 0 (legal for IPv4). The
 * SwitchML header's width bit (p4app-switchML's `unused`, 0 in its results) stays the request's,
 * which is the job's (docs/protocol.md 5.6): 0 in every 32-bit job's result. The fragment offset is 0 already: fragments are not ours.
 * The caller recomputes the IPv4 checksum. */
static __always_inline void result_fields(struct agg_pkt *pk)
{
	pk->ip->tos = SML_RESULT_TOS;
	pk->ip->frag_off = bpf_htons(SML_RESULT_IP_FLAGS << 13);
	pk->ip->ttl = SML_RESULT_TTL;
	pk->ip->id = bpf_htons(SML_RESULT_IP_ID);
	pk->udp->check = 0;
}

/* Two MACs are equal: one 32-bit and one 16-bit compare (the verifier allows these unaligned
 * loads from packet and map memory alike on x86-64, where the programs run). */
static __always_inline bool same_mac(const u8 *a, const u8 *b)
{
	return *(const u32 *)a == *(const u32 *)b && *(const u16 *)(a + 4) == *(const u16 *)(b + 4);
}

/* Turn a request around to its sender: swap MACs, addresses and ports. */
static __always_inline void reply_to_sender(struct agg_pkt *pk)
{
	u8 tmp[ETH_ALEN];
	__be32 a = pk->ip->saddr;
	__be16 p = pk->udp->source;

	__builtin_memcpy(tmp, pk->eth->h_source, ETH_ALEN);
	__builtin_memcpy(pk->eth->h_source, pk->eth->h_dest, ETH_ALEN);
	__builtin_memcpy(pk->eth->h_dest, tmp, ETH_ALEN);
	pk->ip->saddr = pk->ip->daddr;
	pk->ip->daddr = a;
	pk->udp->source = pk->udp->dest;
	pk->udp->dest = p;
	result_fields(pk);
	ipv4_csum(pk->ip);
}

/* Address the packet: both MACs, both IPv4 addresses and both UDP ports (network order). */
static __always_inline void set_addresses(struct agg_pkt *pk, const u8 *dst_mac, const u8 *src_mac,
					  __be32 saddr, __be32 daddr, __be16 sport, __be16 dport)
{
	__builtin_memcpy(pk->eth->h_dest, dst_mac, ETH_ALEN);
	__builtin_memcpy(pk->eth->h_source, src_mac, ETH_ALEN);
	pk->ip->saddr = saddr;
	pk->ip->daddr = daddr;
	pk->udp->source = sport;
	pk->udp->dest = dport;
}

/* Address a result to the job's group (one-arm mode): from our port to the workers' port. */
static __always_inline void address_to_group(struct agg_pkt *pk, struct agg_job *job)
{
	set_addresses(pk, job->group_mac, job->agg_mac, job->agg_ip, job->group_ip, pk->udp->dest,
		      pk->udp->source);
	result_fields(pk);
	ipv4_csum(pk->ip);
}

/* Tree jobs: address a partial sum of our slot g, version vi to the parent aggregator, as a
 * contribution from us (our address and uplink port) to the parent's slot for g. */
static __always_inline void address_up(struct agg_pkt *pk, struct agg_job *job, u32 g, u32 vi)
{
	u32 pg = g - job->slot_base + job->parent_slot_base;

	set_addresses(pk, job->parent_mac, job->agg_mac, job->agg_ip, job->parent_ip,
		      job->uplink_port, job->parent_port);
	pk->sml->pool_index = bpf_htons((pg & SML_POOL_SLOT_MASK) | (vi << 15));
	result_fields(pk);
	ipv4_csum(pk->ip);
}

/* Tree jobs: address the parent's result for our slot g, version vi to our workers' group,
 * from our aggregator port to theirs. */
static __always_inline void address_down(struct agg_pkt *pk, struct agg_job *job, u32 g, u32 vi)
{
	set_addresses(pk, job->group_mac, job->agg_mac, job->agg_ip, job->group_ip,
		      bpf_htons((u16)job->agg_port), job->down_port);
	pk->sml->pool_index = bpf_htons((g & SML_POOL_SLOT_MASK) | (vi << 15));
	result_fields(pk);
	ipv4_csum(pk->ip);
}

/* Tree jobs: what names a round between the levels, the job_number and tsi of the packet sent
 * up, which the parent's result echoes. */
static __always_inline u64 round_key(struct agg_pkt *pk)
{
	return ((u64)pk->sml->tsi << 8) | pk->sml->job_number;
}

/* Address a result copy to one worker behind an egress port (switch mode): to its MAC and
 * address from ours there, and to the completing request's source port, still in the copy, as
 * p4app-switchML's switch answers (dev_root/p4/udp_sender.p4): a host's threads (or lanes)
 * send from ports of their own, one per range of slots, and each gets its slots' results. */
static __always_inline void address_to_worker(struct agg_pkt *pk, struct agg_port_worker *w)
{
	/* the completing request's source port, as set_addresses' argument, before it is replaced */
	set_addresses(pk, w->mac, w->agg_mac, w->agg_ip, w->ip, w->agg_port, pk->udp->source);
	ipv4_csum(pk->ip); /* the ingress program set the result's other fields */
}

/* Address a unicast copy of a result (one-arm, unicast delivery) to one worker: its MAC (or
 * its next hop's) and its IPv4 address. The ingress program addressed the result as for the
 * job's group: our MAC and address, both UDP ports, the result fields. */
static __always_inline void address_copy(struct agg_pkt *pk, struct agg_port_worker *to)
{
	__builtin_memcpy(pk->eth->h_dest, to->mac, ETH_ALEN);
	pk->ip->daddr = to->ip;
	ipv4_csum(pk->ip);
}

/* What tells one result from the next in a run of copies: its pool index (slot and version),
 * job_number and tsi, which the result echoes from the request that completed it. */
static __always_inline u64 copy_identity(struct agg_pkt *pk)
{
	return ((u64)pk->sml->pool_index << 48) | ((u64)pk->sml->job_number << 32) | pk->sml->tsi;
}

#endif
