/* Sparse jobs (docs/protocol.md section 8): the state machine of aggregate.h for a job that takes
 * sparse contributions (msg_type 2, a block of data; 3, the empty-contribution marker) as well as
 * dense ones. Each round's first contribution decides its kind, block and blocks; every
 * contribution names its sender's next non-zero block, and the result carries the sum of the
 * blocks sent (or none), the smallest next and the e0 of the contributions that named it.
 *
 * Concurrency design, on top of aggregate.h's (the same seen, arrivals, added and published
 * counters, per-CPU partials gathered by the completing CPU):
 *  - the round's key (kind, block and blocks in one u64, sparse_key) is shared: `round_key` of
 *    the slot's version, installed by the round's first contribution with a compare-and-swap
 *    from 0, before its seen bit is set. Of two first contributions on two CPUs at once one
 *    installs its key and the other compares with it, as the second in the serial order would;
 *    a contribution whose key differs is dropped (drop_sparse_mismatch) having changed nothing;
 *  - the completing CPU stores the key in the result, clears round_key (fetch_and: a full
 *    barrier), then bumps `published`. The version's next round starts only after this result
 *    has gone out (docs/protocol.md 3.3), so its first contribution finds round_key 0;
 *  - a duplicate (its sender's bit set) compares its key with round_key while the round is open
 *    and with the result's once it is published; round_key found 0 after `published` said open
 *    means the round completed in between, and its key is in the result already;
 *  - each CPU's partial keeps its contributions' smallest next, the max e0 of those naming it and
 *    whether any carried data (aggregate.h fold_sparse); the completing CPU folds them in too
 *    (gather_exponents) and writes the result from the stored state, whose length need not be
 *    the request's: the frame is resized (bpf_xdp_adjust_tail) unless the request was as long
 *    (a padded empty contribution, docs/protocol.md 8.1, has a block's room for it). */
#ifndef XDP_AGG_SPARSE_H
#define XDP_AGG_SPARSE_H

#define AGG_DENSE_KEY	(~0ULL) /* a dense round's key: block = blocks, which no sparse key has */
#define AGG_SPARSE_HDRS (SML_HLEN + SML_EXP_HLEN + SML_SPARSE_HLEN) /* UDP payload before a block */

/* The K int32 of a sparse job's packet at frame offset `off`, copied into this CPU's scratch
 * (NULL: the frame does not hold them). verifier: every kind of packet of a sparse job has its
 * payload in the same map value, so that the state machine after read_contrib is verified
 * once for all kinds, not once per kind with the packet's offsets (aggregate.h reads a dense
 * job's payload in place). */
static __always_inline __be32 *scratch_payload(struct xdp_md *ctx, u32 off, const u32 K)
{
	struct agg_scratch *s;
	u32 zero = 0;

	s = bpf_map_lookup_elem(&scratch, &zero);
	/* verifier: K * 4 is a constant no larger than the scratch value (AGG_MAX_ELEMS) */
	if (!s || bpf_xdp_load_bytes(ctx, off, s->data, K * 4))
		return NULL;
	return s->data;
}

/* A sparse packet's fields into c and the reason to drop it before it changes anything (rows 11
 * and 12 of docs/protocol.md 8.3: outside the tensor, backwards), else 0. The key is
 * block << 32 | blocks: block < blocks here, so never 0 nor AGG_DENSE_KEY. */
static __always_inline u32 read_sparse(struct sparse_hdr *sh, bool data, struct agg_contrib *c)
{
	u32 block = agg_ntohl(sh->block), next = agg_ntohl(sh->next),
	    blocks = agg_ntohl(sh->blocks);

	if (block >= blocks || next > blocks)
		return AGG_DROP_SPARSE_RANGE;
	if (next < block || (next == block && data))
		return AGG_DROP_SPARSE_BACKWARDS;
	c->key = ((u64)block << 32) | blocks;
	c->next = next;
	return 0;
}

/* The UDP checksum of a sparse job's packet is right (aggregate.h checksum_ok): its headers (a
 * sparse packet's 30 bytes from the UDP header on, a dense packet's 18) and its payload in
 * scratch (pl; NULL: none). verifier: one payload loop for every kind of packet. */
static __always_inline bool contrib_checksum_ok(struct agg_pkt *pk, bool sparse, __be32 *pl,
						const u32 K)
{
	u16 *h = (u16 *)pk->udp;
	u64 sum = csum_start(pk, sizeof(struct udphdr) + SML_HLEN + SML_EXP_HLEN);

	if (sparse) {
#pragma unroll
		for (int i = (sizeof(struct udphdr) + SML_HLEN + SML_EXP_HLEN) / 2;
		     i < (sizeof(struct udphdr) + AGG_SPARSE_HDRS) / 2; i++)
			sum += h[i];
	}
	if (pl && csum_add_payload(&sum, pl, AGG_IN_MAP, K))
		return false; /* the loop stopped short: failed as a wrong checksum (checksum_ok) */
	return csum_folds_to_ok(sum);
}

/* What a sparse job's packet contributes (c: a dense packet's key is AGG_DENSE_KEY, its next 0),
 * where its payload is (*pl, in scratch; NULL: an empty contribution), and the reason to drop
 * it before it changes anything, else 0: rows 7 and 10-12 of docs/protocol.md 8.3 (its payload
 * where it must be, its UDP checksum, read_sparse: in this order, though read_sparse looks
 * first). A padded empty contribution's padding (8.1) is read only for its checksum, which
 * covers it, and never added. */
static __always_inline u32 read_contrib(struct xdp_md *ctx, struct agg_pkt *pk, struct agg_job *job,
					struct agg_contrib *c, __be32 **pl, const u32 K)
{
	bool csum = (job->flags & AGG_JOB_VERIFY_UDP_CSUM) && pk->udp->check;
	u32 type = SML_MSG_TYPE(pk->sml);
	u32 off = type == SML_MSG_TYPE_DATA ? SML_PAYLOAD_OFFSET : SML_SPARSE_PAYLOAD_OFFSET;
	struct sparse_hdr *sh = (void *)(pk->exp + 1);

	/* verifier: a constant-size range check on the packet pointer, which also covers the 30
	 * header bytes the checksum sums (a dense packet is longer than a sparse header) */
	if ((void *)(sh + 1) > pk->data_end)
		return AGG_DROP_TRUNCATED;
	c->e0 = pk->exp->e0;
	c->e1 = pk->exp->e1;
	c->key = type == SML_MSG_TYPE_DATA ? AGG_DENSE_KEY : 0; /* a sparse one's: read_sparse */
	c->next = 0;
	c->empty = type == SML_MSG_TYPE_SPARSE_EMPTY;
	*pl = NULL;
	/* the ingress checked the lengths: an empty one longer than its headers is padded */
	if (type != SML_MSG_TYPE_SPARSE_EMPTY ||
	    (csum && agg_ntohs(pk->udp->len) != sizeof(struct udphdr) + AGG_SPARSE_HDRS)) {
		*pl = scratch_payload(ctx, off, K);
		if (!*pl)
			return AGG_DROP_TRUNCATED;
	}
	/* verifier: the kind is read back from the map value from here on, which keeps the
	 * packet's type out of the verifier's state where it walks the payload loop */
	if (csum && !contrib_checksum_ok(pk, c->key != AGG_DENSE_KEY, *pl, K))
		return AGG_DROP_BAD_CHECKSUM;
	if (c->key == AGG_DENSE_KEY)
		return 0;
	if (c->empty)
		*pl = NULL; /* a padded one's padding: summed by the checksum, never added */
	return read_sparse(sh, *pl != NULL, c);
}

/* Row 13 for a new contribution (its sender's bit clear): true when the round of the slot's
 * version vi in progress has the contribution's key, or none is in progress and the
 * contribution's key becomes the round's (compare-and-swap from 0: exactly one of several
 * first contributions at once installs its key, the others compare with it). */
static __always_inline bool claim_round(struct agg_slot *st, u32 vi, u64 key)
{
	u64 had = __sync_val_compare_and_swap(&st->round_key[vi], 0, key);

	return had == 0 || had == key;
}

/* One block of a finished sum (lane order) stored big-endian into the result. */
static __always_inline void store_block(agg_lanes *r, const agg_lanes *sum)
{
#pragma unroll
	for (int i = 0; i < AGG_BLOCK_WORDS; i++)
		r[i] = agg_lanes_to_wire(sum[i]);
}

/* Store a sparse job's finished round in its result (docs/protocol.md 8.3): the sum big-endian
 * when any contribution carried data (all of it in r->data, lane order, when the gather ran and
 * found data: rs->others; else own's), the exponents, the smallest next, the key and whether it
 * has data. -1: the loop stopped short. */
static __always_inline int store_round(struct agg_result *r, struct agg_partial *own,
				       struct agg_round *rs, u64 key, const u32 K)
{
	agg_lanes *rw = (agg_lanes *)r->data;
	agg_lanes *src = rs->others ? rw : (agg_lanes *)own->sum;
	u32 data = rs->others || own->has_data;

	if (data && AGG_SUMS_LOOP(store_block, rw, src, AGG_IN_MAP, K))
		return -1;
	r->e0 = rs->e0;
	r->e1 = rs->e1;
	r->next = rs->next;
	r->has_data = data;
	r->key = key;
	return 0;
}

/* Write a sparse round's stored result into the packet, whatever kind of packet it is: resized
 * to the result's length (a padded empty request answered with data keeps its length, a
 * header-only one grows; a data or padded request with an empty result shrinks), its IPv4 and
 * UDP lengths, kind, exponents, sparse header and payload; the SwitchML header's other fields
 * stay the request's. -1: the frame's buffer cannot hold the result (bpf_xdp_adjust_tail grows a
 * frame within its buffer only, on veth not at all: why hosts pad, docs/protocol.md 8.1). */
static __always_inline int write_sparse(struct xdp_md *ctx, struct agg_pkt *pk,
					struct agg_result *r, const u32 K)
{
	u32 len = AGG_SPARSE_HDRS + (r->has_data ? K * 4 : 0); /* UDP payload */
	u32 type = r->has_data ? SML_MSG_TYPE_SPARSE : SML_MSG_TYPE_SPARSE_EMPTY;
	int delta = (int)(SML_OFFSET + len) - (int)frame_len(ctx);
	struct sparse_hdr *sh;

	if (delta && bpf_xdp_adjust_tail(ctx, delta))
		return -1;
	if (!repoint(ctx, pk))
		return -1;
	sh = (void *)(pk->exp + 1);
	/* verifier: a constant-size range check on the packet pointer */
	if ((void *)(sh + 1) > pk->data_end)
		return -1;
	pk->ip->tot_len = bpf_htons(sizeof(struct iphdr) + sizeof(struct udphdr) + len);
	pk->udp->len = bpf_htons(sizeof(struct udphdr) + len);
	/* the kind; the width bit and the size code (the low nibble) stay the request's */
	pk->sml->msg_type_size = (type << 4) | (pk->sml->msg_type_size & 0x0f);
	pk->exp->e0 = r->e0;
	pk->exp->e1 = r->e1;
	sh->block = bpf_htonl(r->key >> 32);
	sh->next = bpf_htonl(r->next);
	sh->blocks = bpf_htonl((u32)r->key);
	/* one helper call, whatever the size (verifier: no loop to walk per path) */
	if (r->has_data && bpf_xdp_store_bytes(ctx, SML_SPARSE_PAYLOAD_OFFSET, r->data, K * 4))
		return -1;
	return 0;
}

/* Write the stored result of a sparse job's round into the packet: a dense round's sum and
 * exponents in place (the packet is dense too: its key matched), a sparse round's by
 * write_sparse. -1: it could not be written. */
static __always_inline int write_result(struct xdp_md *ctx, struct agg_pkt *pk,
					struct agg_result *r, const u32 K)
{
	if (r->key != AGG_DENSE_KEY)
		return write_sparse(ctx, pk, r, K);
	if (bpf_xdp_store_bytes(ctx, SML_PAYLOAD_OFFSET, r->data, K * 4))
		return -1;
	pk->exp->e0 = r->e0;
	pk->exp->e1 = r->e1;
	return 0;
}

/* A sparse job's retransmission or duplicate (its sender's bit set): dropped when its key is not
 * its round's (row 13), else answered with the stored result if the round is published, as
 * aggregate.h answer_duplicate does. */
static __always_inline int sparse_duplicate(struct xdp_md *ctx, struct agg_pkt *pk,
					    struct agg_job *job, struct agg_worker *w,
					    struct agg_slot *st, u32 vi, u32 rkey, u64 key,
					    const u32 K)
{
	u64 arrivals = st->arrivals[vi];
	/* fetch_add(0) is a full barrier: the result read below is the one published. */
	u64 published = __sync_fetch_and_add(&st->published[vi], 0);
	bool open = published * job->num_workers != arrivals;
	struct agg_result *r = bpf_map_lookup_elem(&results, &rkey);
	u64 have;

	if (!r)
		return XDP_ABORTED;
	have = open ? __sync_fetch_and_add(&st->round_key[vi], 0) : r->key;
	if (!have)
		have = r->key; /* completed since `published` was read: the key is stored */
	if (have != key)
		return drop(w, AGG_DROP_SPARSE_MISMATCH);
	count_worker(w, duplicates);
	if (open) {
		count(w->job, AGG_DUP_PENDING);
		return XDP_DROP;
	}
	if (write_result(ctx, pk, r, K))
		return XDP_ABORTED;
	return send_answer(ctx, pk, w);
}

/* The last addition of a sparse job's round: this CPU alone completes it (aggregate.h). The
 * gathered round is stored with its key; round_key is cleared after the store and before the
 * round reads as published (fetch_and and fetch_add: full barriers), and the result goes out
 * from the stored state. */
static __always_inline int sparse_complete(struct xdp_md *ctx, struct agg_pkt *pk,
					   struct agg_job *job, struct agg_worker *w,
					   struct agg_slot *st, u32 vi, u32 pkey, u64 tag,
					   struct agg_partial *own, u64 key, const u32 K)
{
	struct agg_result *r = bpf_map_lookup_elem(&results, &pkey);
	struct agg_round rs;

	if (!r || gather_round(pkey, tag, own, job->num_workers, true, &rs, K) ||
	    store_round(r, own, &rs, key, K))
		return XDP_ABORTED;
	__sync_fetch_and_and(&st->round_key[vi], 0);
	__sync_fetch_and_add(&st->published[vi], 1);
	if (write_result(ctx, pk, r, K))
		return XDP_ABORTED;
	count(w->job, AGG_COMPLETED);
	return send_result(ctx, pk, job, w);
}

/* A packet of a sparse job (dense, sparse data or empty: the ingress checked its type and
 * lengths) with K elements from worker w for slot g, version vi: aggregate()'s state machine,
 * after the checks of docs/protocol.md 8.3, which a dropped packet passes having changed
 * nothing. */
static __always_inline int sparse_aggregate(struct xdp_md *ctx, struct agg_pkt *pk,
					    struct agg_job *job, struct agg_worker *w, u32 g,
					    u32 vi, const u32 K)
{
	u32 pkey = AGG_POOL_ENTRY(g, vi), why, zero = 0;
	u64 bit, tag;
	int last;
	struct agg_contrib *c = bpf_map_lookup_elem(&contrib, &zero);
	struct agg_partial *own;
	struct agg_slot *st;
	__be32 *pl;

	if (!c)
		return XDP_ABORTED;
	why = read_contrib(ctx, pk, job, c, &pl, K);
	if (why)
		return drop(w, why);
	st = bpf_map_lookup_elem(&slots, &g);
	if (!st || !repoint(ctx, pk))
		return XDP_ABORTED;
	bit = 1ULL << w->index; /* a worker's index is < AGG_MAX_WORKERS here (ingress checked) */
	/* a worker's packets are processed in order (one queue per flow): its bit stays as read */
	if (st->seen[vi] & bit)
		return sparse_duplicate(ctx, pk, job, w, st, vi, pkey, c->key, K);
	if (!claim_round(st, vi, c->key))
		return drop(w, AGG_DROP_SPARSE_MISMATCH);
	if (__sync_fetch_and_or(&st->seen[vi], bit) & bit) /* a copy won on another CPU */
		return sparse_duplicate(ctx, pk, job, w, st, vi, pkey, c->key, K);
	last = arrive(pk, job, w, st, vi, pkey, bit, (agg_lanes *)pl, c, &tag, &own, K);
	if (last <= 0)
		return last ? XDP_ABORTED : XDP_DROP;
	return sparse_complete(ctx, pk, job, w, st, vi, pkey, tag, own, c->key, K);
}

/* A sparse job's packet of K int32 from worker w for slot and version pkey (AGG_POOL_ENTRY):
 * sparse_aggregate, one subprogram for every packet size. verifier: a global function (not
 * static), which the verifier checks once, by itself, instead of once per packet size and
 * path into it. Its arguments are what their types say (the context; a job's and a worker's
 * bytes, which may be NULL; two numbers, K bounded here); no packet pointer crosses into it, so
 * it finds the frame's headers again (repoint: the ingress parsed them). */
__noinline int agg_sparse(struct xdp_md *ctx, struct agg_job *job, struct agg_worker *w, u32 pkey,
			  u32 K)
{
	struct agg_pkt pk;

	if (!job || !w || K > AGG_MAX_ELEMS || !repoint(ctx, &pk))
		return XDP_ABORTED;
	/* verifier: K checked one bound at a time (clang would make the two one compare of K - 32,
	 * which bounds that, not K), and what is made of it made after the checks (K * 4 bounded) */
	barrier_var(K);
	if (K < 2 * AGG_BLOCK_WORDS)
		return XDP_ABORTED;
	barrier_var(K);
	return sparse_aggregate(ctx, &pk, job, w, pkey >> 1, pkey & 1, K);
}

#endif
