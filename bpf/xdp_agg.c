/* xdp_agg.c: SwitchML-protocol gradient aggregation in XDP (docs/protocol.md sections 2-3).
 *
 * xdp_agg_ingress runs on every interface workers reach us through: it finds the job and worker
 * of a packet from its (source address, destination port), sums its int32 payload into the slot,
 * and sends the finished sum to every worker; anything that is not IPv4 UDP to ports
 * 0xBEE0-0xBEEF passes untouched. xdp_agg_egress is the devmap egress program of switch mode: it
 * addresses each broadcast copy of a result to the job's worker behind that port, and prunes
 * flooded multicast copies IGMP snooping says nobody wants there (snoop.h). xdp_agg_copy is
 * the devmap egress program of unicast delivery (one-arm): it addresses copy k of a result to
 * the job's worker k. A sparse job's packets (docs/protocol.md section 8) go through sparse.h.
 * Built once per flavour by clang (xdp_switch/bpfbuild.py) and loaded by libbpf (platform.h).
 * With -DAGG_FRAGS the programs are multi-buffer (frags) programs, which see frames larger than
 * a page: the jumbo size codes (1024 and 2048 int32) are copied through a per-CPU
 * scratch map with bpf_xdp_load_bytes/store_bytes, the others read in place (bpf/consts.h).
 * With -DAGG_CPUMAP xdp_agg_steer (slot_cpus.h) is what the interfaces run, and xdp_agg_ingress
 * runs on the cpumap's CPUs, the one that owns each slot. A frame that is not ours is forwarded
 * between the ports in the switch topology (forward.h), else passed to the kernel. */
#include "platform.h"
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/in.h>
#include <linux/udp.h>

#include "generated/wire.h"
#include "generated/abi.h"
#include "consts.h"
#include "maps.h"
#include "parse.h"
#include "helpers.h"
#include "forward.h"
#include "slot_cpus.h"
#include "aggregate.h"
#include "sparse.h"

/* One case of the size-code switch in xdp_agg_ingress: a sparse job's packets (of any kind) to
 * sparse.h, a dense job's to aggregate.h (the jumbo sizes' through agg_jumbo). */
#define AGG_SIZE_CASE(code, elems)                                                    \
	case code:                                                                    \
		if (sparse)                                                           \
			return agg_sparse(ctx, job, w, AGG_POOL_ENTRY(g, vi), elems); \
		if (!AGG_DIRECT(elems))                                               \
			return agg_jumbo(ctx, job, w, AGG_POOL_ENTRY(g, vi), elems);  \
		return aggregate(ctx, &pk, job, w, g, vi, elems);

/* Why a packet of a known worker is dropped for its type, width or lengths (rows 5-8 of
 * docs/protocol.md 2.2, and of 8.3 for a sparse job), else 0. The frame must hold the packet's
 * UDP payload (the SwitchML and exponent headers, a sparse packet's sparse header, and k int32
 * unless it is an empty sparse contribution, which carries them only as padding: 8.1), and the
 * IPv4 total length and the UDP length must say exactly that much and match the frame: a lying
 * length would otherwise be summed, and echoed in the result, whose receivers would take it at
 * its word. */
static __always_inline u32 type_and_lengths(struct xdp_md *ctx, struct agg_pkt *pk,
					    struct agg_job *job, bool sparse)
{
	u32 type = SML_MSG_TYPE(pk->sml), len, need = SML_HLEN + SML_EXP_HLEN;

	/* a sparse job takes msg_type 2 and 3 too (docs/protocol.md 8.1); a dense job only 1 */
	if (type != SML_MSG_TYPE_DATA &&
	    !(sparse && (type == SML_MSG_TYPE_SPARSE || type == SML_MSG_TYPE_SPARSE_EMPTY)))
		return AGG_DROP_BAD_TYPE;
	if (SML_SIZE(pk->sml) != job->size_code)
		return AGG_DROP_BAD_SIZE;
	/* the element width (docs/protocol.md 5.6): the sum is the same int32 sum either way, so
	 * only a packet of the other width is refused, before it is added to a round */
	if (SML_WIRE16(pk->sml) != !!(job->flags & AGG_JOB_WIRE16))
		return AGG_DROP_BAD_WIDTH;
	if (type != SML_MSG_TYPE_DATA)
		need += SML_SPARSE_HLEN;
	/* an empty contribution is header-only or padded to a block's room for the result, which
	 * XDP writes in place (a frame cannot grow past its buffer): its UDP length says which */
	if (type != SML_MSG_TYPE_SPARSE_EMPTY ||
	    agg_ntohs(pk->udp->len) == sizeof(struct udphdr) + need + job->elems * 4)
		need += job->elems * 4;
	len = frame_len(ctx);
	if (len < SML_OFFSET + need)
		return AGG_DROP_TRUNCATED;
	if (agg_ntohs(pk->udp->len) != sizeof(struct udphdr) + need ||
	    agg_ntohs(pk->ip->tot_len) != sizeof(struct iphdr) + sizeof(struct udphdr) + need ||
	    len != SML_OFFSET + need)
		return AGG_DROP_BAD_LENGTH;
	return 0;
}

/* The aggregator: what the interfaces run (--slot-cpus rss), or the cpumap's CPUs
 * (xdp_agg_cpumap). */
static __always_inline int ingress(struct xdp_md *ctx)
{
	struct agg_worker_key wk = {};
	struct agg_worker *w;
	struct agg_job *job;
	struct agg_pkt pk;
	u32 pidx, g, vi, why;
	bool from_parent, sparse;
	switch (parse(ctx, &pk)) {
	case AGG_PARSE_OK:
		break;
	case AGG_PARSE_MALFORMED:
		count(AGG_NO_JOB, AGG_DROP_MALFORMED);
		return XDP_DROP;
	case AGG_PARSE_TRUNCATED:
		count(AGG_NO_JOB, AGG_DROP_TRUNCATED);
		return XDP_DROP;
	default:
		return not_ours(ctx); /* forward.h: the switch topology forwards it */
	}
	wk.addr = pk.ip->saddr;
	wk.port = pk.udp->dest;
	w = bpf_map_lookup_elem(&workers, &wk);
	/* the source MAC too, where the control plane knows it (an on-link worker), as
	 * p4app-switchML's switch matches it: another host's frames with a worker's address and
	 * port are from a source we do not know */
	if (!w || (w->match_mac && !same_mac(pk.eth->h_source, w->mac))) {
		count(AGG_NO_JOB, AGG_DROP_UNKNOWN_SOURCE);
		return XDP_DROP;
	}
	job = bpf_map_lookup_elem(&jobs, &w->job);
	/* A tree job's parent is registered as its worker AGG_PARENT_INDEX (docs/protocol.md 3.7) */
	from_parent = w->index == AGG_PARENT_INDEX;
	if (!job || !job->active ||
	    (from_parent ? !(job->flags & AGG_JOB_TREE)
			 : w->index >= job->num_workers || w->index >= AGG_MAX_WORKERS)) {
		count(w->job < AGG_MAX_JOBS ? w->job : AGG_NO_JOB, AGG_DROP_NO_JOB);
		return XDP_DROP;
	}
	count_worker(w, packets);
	sparse = (job->flags & AGG_JOB_SPARSE) && !from_parent; /* a sparse job has no parent */
	why = type_and_lengths(ctx, &pk, job, sparse);
	if (why)
		return drop(w, why);
	pidx = agg_ntohs(pk.sml->pool_index);
	/* the reserved bit set puts g out of every range */
	g = pidx & (SML_POOL_SLOT_MASK | SML_POOL_RESERVED_BIT);
	vi = pidx >> 15;
	if (from_parent) { /* the parent's slots map onto ours one to one */
		if (g < job->parent_slot_base || g >= job->parent_slot_base + job->slot_count)
			return drop(w, AGG_DROP_SLOT_RANGE);
		g = g - job->parent_slot_base + job->slot_base;
	}
	if (g < job->slot_base || g >= job->slot_base + job->slot_count || g >= agg_pool_slots)
		return drop(w, AGG_DROP_SLOT_RANGE);

	/* One copy of the dense state machine per packet size read in place (the size codes of
	 * the wire module, generated), so that every packet access has a constant bound the
	 * verifier can check; the jumbo sizes and a sparse job take K at run time (agg_jumbo,
	 * agg_sparse: no packet access of theirs depends on it). */
	switch (job->size_code) {
		SML_FOR_EACH_SIZE(AGG_SIZE_CASE)
	}
	return drop(w, AGG_DROP_BAD_SIZE);
}

AGG_PROG(AGG_SEC_XDP) int xdp_agg_ingress(struct xdp_md *ctx)
{
	return ingress(ctx);
}

#ifdef AGG_CPUMAP
/* The aggregator as the cpumap's entries run it (expected attach type BPF_XDP_CPUMAP). */
AGG_PROG(AGG_SEC_CPUMAP) int xdp_agg_cpumap(struct xdp_md *ctx)
{
	return ingress(ctx);
}
#endif

AGG_PROG(AGG_SEC_DEVMAP) int xdp_agg_egress(struct xdp_md *ctx)
{
	struct agg_port_key pkey = {};
	struct agg_port_worker *pw;
	struct agg_pkt pk;
	u32 g, *owner;

	if (parse(ctx, &pk) != AGG_PARSE_OK)
		return fwd_prune(ctx); /* not a result: forwarded, or an answer (slot_cpus.h) */
	g = agg_ntohs(pk.sml->pool_index) & SML_POOL_SLOT_MASK;
	owner = bpf_map_lookup_elem(&slot_owner, &g);
	if (!owner || *owner == 0 || *owner > AGG_MAX_JOBS)
		return XDP_DROP;
	pkey.ifindex = ctx->egress_ifindex;
	pkey.job = *owner - 1;
	pw = bpf_map_lookup_elem(&port_workers, &pkey);
	if (!pw) {
		count(pkey.job, AGG_EGRESS_NO_WORKER); /* a port without a worker of this job */
		return XDP_DROP;
	}
	if (pk.ip->saddr == pw->agg_ip)
		return XDP_PASS; /* from us: an answer to its sender, addressed (slot_cpus.h AGG_TX) */
	address_to_worker(&pk, pw);
	count(pkey.job, AGG_EGRESS_SENT);
	return XDP_PASS; /* in a devmap program, PASS transmits */
}

AGG_PROG(AGG_SEC_DEVMAP) int xdp_agg_copy(struct xdp_md *ctx)
{
	struct agg_copy_cursor *cur;
	struct agg_port_worker *to;
	struct agg_job *job;
	struct agg_pkt pk;
	u32 zero = 0, g, jid, key, *owner;
	u64 id;

	if (!parse_result(ctx, &pk))
		return XDP_PASS; /* not a result: another frame sent out of this port (slot_cpus.h) */
	g = agg_ntohs(pk.sml->pool_index) & SML_POOL_SLOT_MASK;
	owner = bpf_map_lookup_elem(&slot_owner, &g);
	if (!owner || *owner == 0 || *owner > AGG_MAX_JOBS)
		return XDP_PASS;
	jid = *owner - 1;
	job = bpf_map_lookup_elem(&jobs, &jid);
	cur = bpf_map_lookup_elem(&copy_cursor, &zero);
	if (!job || !cur)
		return XDP_ABORTED;
	if (job->delivery != AGG_DELIVERY_UNICAST || pk.ip->daddr != job->group_ip)
		return XDP_PASS; /* addressed already: an answer, a group's result (slot_cpus.h) */
	id = copy_identity(&pk);
	if (cur->result != id || cur->job != jid) { /* the first copy of another result */
		cur->result = id;
		cur->job = jid;
		cur->k = 0;
	} else if (++cur->k >= job->num_workers) {
		cur->k = 0; /* the same result broadcast once more: its first copy again */
	}
	if (cur->k >= AGG_MAX_WORKERS)
		return XDP_ABORTED; /* verifier: bounds the key below; num_workers <= AGG_MAX_WORKERS */
	key = AGG_WORKER_KEY(jid, cur->k);
	to = bpf_map_lookup_elem(&copy_dests, &key);
	if (!to || !to->ip) {
		count(jid, AGG_EGRESS_NO_WORKER); /* worker k has not registered (yet) */
		return XDP_DROP;
	}
	address_copy(&pk, to);
	count(jid, AGG_EGRESS_SENT);
	return XDP_PASS; /* in a devmap program, PASS transmits */
}

char LICENSE[] SEC("license") = "GPL"; /* bpf_loop and the percpu lookup are GPL-only */
