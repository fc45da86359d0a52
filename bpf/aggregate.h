/* The aggregation state machine of docs/protocol.md section 3, for one packet of K elements.
 *
 * Concurrency design (several CPUs may process packets of the same slot at once):
 *  - each CPU adds into its own copy of the slot's partial sum (per-CPU map `partials`), tagged
 *    with the job epoch and round it belongs to, so the first contribution of a round on a CPU
 *    overwrites instead of needing a separate reset;
 *  - the shared per-slot state only holds counters changed with atomic read-modify-writes:
 *    `seen` (fetch_or: exactly one CPU wins a worker's bit), `arrivals` (fetch_add: the round a
 *    contribution belongs to), `added` (fetch_add after the addition: the CPU that brings it to
 *    (round + 1) * n is the only one that completes the slot, and sees every addition finished);
 *  - the completing CPU gathers all CPUs' partials of that round, stores the big-endian result,
 *    then bumps `published`: a retransmission only reads a result published for its round.
 * Test-only builds (tests/test_xdp_concurrency.py) may define AGG_TEST_RACE_DELAY (see
 * race_window()) and AGG_TEST_MUTANT_COMPLETE_ON_ARRIVAL (a racy completion); production
 * never does.
 * With -DAGG_SPINLOCK (the baseline the design asks to measure against) the per-CPU partials are
 * replaced by one shared partial per (slot, version) under a bpf_spin_lock; the rest is the same.
 * A worker's own packets are processed in order (one queue per flow), which is what makes the
 * stored result stable while it is read; see docs/protocol.md section 3.3 for why two versions suffice.
 *
 * Tree jobs (a rack job with a parent aggregator, docs/protocol.md section 3.7): the completing
 * CPU stores the partial sum in the result as usual, records the round's key (tsi, job_number)
 * in `up_round`, and bumps `up` instead of `published` (fetch_add: a full barrier, so whoever
 * reads `up` with a fetch_add sees the partial and the key); the packet goes to the parent as
 * our contribution. A retransmission of a round complete here (up * n == arrivals) but not yet
 * answered (published * n != arrivals) re-sends the stored partial up. The parent's result is
 * taken once per round: it must match a round waiting on it (up == published + 1, the same
 * key), and then claim the parent bit of `seen` (fetch_or: exactly one CPU wins when copies
 * arrive at once; the completing CPU cleared it before bumping `up`). The winner overwrites
 * the stored partial with the parent's sum and only then bumps `published`, so a
 * retransmission answered from a published round reads the parent's sum. A re-send racing
 * with that overwrite may carry a torn sum up: harmless, since a parent result exists only
 * once the parent holds our contribution, so it takes the re-send for a duplicate and
 * ignores its payload. */
#ifndef XDP_AGG_AGGREGATE_H
#define XDP_AGG_AGGREGATE_H

static __always_inline s32 max_s32(s32 a, s32 b)
{
	return a > b ? a : b;
}

/* Copy a stored sum (network order) and its exponents into the packet. */
static __always_inline int copy_result(struct xdp_md *ctx, struct agg_pkt *pk, struct agg_result *r,
				       const u32 K)
{
	void *data_end = (void *)(long)ctx->data_end;
	__be32 *pl = (__be32 *)(pk->exp + 1);

	if ((void *)(pl + K) > data_end) /* verifier: the caller checked the length already */
		return -1;
	AGG_NO_UNROLL
	for (u32 j = 0; j < K; j++)
		pl[j] = r->data[j];
	pk->exp->e0 = r->e0;
	pk->exp->e1 = r->e1;
	return 0;
}

/* Tree jobs: a retransmission of a round complete here that the parent has not answered: the
 * stored partial goes up again (the first may have been lost between the levels). */
static __always_inline int resend_up(struct xdp_md *ctx, struct agg_pkt *pk, struct agg_job *job,
				     struct agg_worker *w, u32 vi, u32 rkey, const u32 K)
{
	struct agg_result *r = results.lookup(&rkey);

	if (!r)
		return XDP_ABORTED;
	if (copy_result(ctx, pk, r, K))
		return XDP_DROP;
	address_up(pk, job, rkey >> 1, vi);
	count(w->job, AGG_RESENT_UP);
	return XDP_TX;
}

/* A retransmission or duplicate: answer the stored result if the round is published. */
static __always_inline int answer_duplicate(struct xdp_md *ctx, struct agg_pkt *pk,
					    struct agg_job *job, struct agg_worker *w,
					    struct agg_slot *st, u32 vi, u32 rkey, const u32 K)
{
	void *data_end = (void *)(long)ctx->data_end;
	__be32 *pl = (__be32 *)(pk->exp + 1);
	u64 arrivals = st->arrivals[vi];
	/* fetch_add(0) is a full barrier: the result read below is the one published. */
	u64 published = __sync_fetch_and_add(&st->published[vi], 0);
	struct agg_result *r;

	count_worker(w, duplicates);
	/* The worker's bit is set, so it is in the latest round of (slot, version); that round is
	 * complete when every arrival so far belongs to a published round. */
	if (published * job->num_workers != arrivals) {
		/* tree: complete here but the parent has not answered: send the partial up again
		 * (fetch_add(0): the partial stored before `up` was bumped is the one read) */
		if ((job->flags & AGG_JOB_TREE) &&
		    __sync_fetch_and_add(&st->up[vi], 0) * job->num_workers == arrivals)
			return resend_up(ctx, pk, job, w, vi, rkey, K);
		count(w->job, AGG_DUP_PENDING);
		return XDP_DROP;
	}
	r = results.lookup(&rkey);
	if (!r)
		return XDP_ABORTED;
	if ((void *)(pl + K) > data_end) /* verifier: the caller checked the length already */
		return XDP_DROP;
	AGG_NO_UNROLL
	for (u32 j = 0; j < K; j++)
		pl[j] = r->data[j];
	pk->exp->e0 = r->e0;
	pk->exp->e1 = r->e1;
	reply_to_sender(pk);
	count(w->job, AGG_RETX_ANSWERED);
	count_worker(w, answered);
	return XDP_TX;
}

/* Fold one contribution into a partial sum: overwrite when the partial belongs to an earlier
 * round (no separate reset is needed), add otherwise. */
static __always_inline void fold(struct agg_partial *p, u64 tag, struct agg_pkt *pk, __be32 *pl,
				 const u32 K)
{
	if (p->tag != tag) {
		AGG_NO_UNROLL
		for (u32 j = 0; j < K; j++)
			p->sum[j] = agg_ntohl(pl[j]);
		p->e0 = pk->exp->e0;
		p->e1 = pk->exp->e1;
		p->tag = tag;
	} else {
		AGG_NO_UNROLL
		for (u32 j = 0; j < K; j++)
			p->sum[j] += agg_ntohl(pl[j]);
		p->e0 = max_s32(p->e0, pk->exp->e0);
		p->e1 = max_s32(p->e1, pk->exp->e1);
	}
}

/* Write a finished sum (host order in r->data) big-endian into the result and the packet. */
static __always_inline void publish_result(struct agg_pkt *pk, __be32 *pl, struct agg_result *r,
					   s32 e0, s32 e1, const u32 K)
{
	AGG_NO_UNROLL
	for (u32 j = 0; j < K; j++) {
		__be32 be = agg_ntohl(r->data[j]);

		r->data[j] = be;
		pl[j] = be;
	}
	r->e0 = e0;
	r->e1 = e1;
	pk->exp->e0 = e0;
	pk->exp->e1 = e1;
}

#ifndef AGG_SPINLOCK
/* Per-CPU variant (the default): each CPU folds into its own partial of the slot. */
static __always_inline int accumulate(u32 pkey, u64 tag, struct agg_pkt *pk, __be32 *pl,
				      const u32 K)
{
	struct agg_partial *p = bpf_map_lookup_elem(partials, &pkey);

	if (!p)
		return -1;
	fold(p, tag, pk, pl, K);
	return 0;
}

/* Sum the partials of round `tag` over all CPUs into the packet and the stored result. */
static __always_inline void complete_slot(struct agg_pkt *pk, __be32 *pl, struct agg_result *r,
					  u32 pkey, u64 tag, const u32 K)
{
	s32 e0 = AGG_EXP_NONE, e1 = AGG_EXP_NONE;
	bool first = true;

	/* Bounded by the possible CPUs known at load time: the verifier walks each iteration. */
	AGG_NO_UNROLL
	for (u32 cpu = 0; cpu < AGG_NR_CPUS; cpu++) {
		struct agg_partial *q = lookup_percpu_elem(partials, &pkey, cpu);

		if (!q || q->tag != tag)
			continue; /* this CPU saw no contribution of this round */
		e0 = max_s32(e0, q->e0);
		e1 = max_s32(e1, q->e1);
		if (first) {
			AGG_NO_UNROLL
			for (u32 j = 0; j < K; j++)
				r->data[j] = q->sum[j];
		} else {
			AGG_NO_UNROLL
			for (u32 j = 0; j < K; j++)
				r->data[j] += q->sum[j];
		}
		first = false;
	}
	publish_result(pk, pl, r, e0, e1, K);
}
#else
/* Spin-lock variant (build option, the baseline to measure against): one shared partial per
 * (slot, version), folded into under its bpf_spin_lock. */
static __always_inline int accumulate(u32 pkey, u64 tag, struct agg_pkt *pk, __be32 *pl,
				      const u32 K)
{
	struct agg_locked_partial *lp = locked_partials.lookup(&pkey);

	if (!lp)
		return -1;
	/* verifier: no helper calls between lock and unlock; fold() makes none */
	bpf_spin_lock(&lp->lock);
	fold(&lp->p, tag, pk, pl, K);
	bpf_spin_unlock(&lp->lock);
	return 0;
}

/* Every addition of the round is finished (the `added` count says so) and no new round can
 * start before this result is sent, so the shared partial is read without the lock. */
static __always_inline void complete_slot(struct agg_pkt *pk, __be32 *pl, struct agg_result *r,
					  u32 pkey, u64 tag, const u32 K)
{
	struct agg_locked_partial *lp = locked_partials.lookup(&pkey);

	if (!lp)
		return;
	AGG_NO_UNROLL
	for (u32 j = 0; j < K; j++)
		r->data[j] = lp->p.sum[j];
	publish_result(pk, pl, r, lp->p.e0, lp->p.e1, K);
}
#endif

#ifdef AGG_TEST_RACE_DELAY
/* Test-only (tests/test_xdp_concurrency.py; never in a production build): widen the window
 * between a contribution's arrival count and the end of its addition by spinning a pseudo-random
 * 0..AGG_TEST_RACE_DELAY ns. The jitter is what matters: a contribution that arrived first can
 * then finish its addition after one that arrived later, which is the interleaving a completion
 * decided on the arrival count gets wrong (a fixed delay would keep arrival order). */
#define AGG_TEST_RACE_SPINS 2048 /* ktime reads, each tens of ns: covers the delays the test uses */
static __always_inline void race_window(void)
{
	u64 end = bpf_ktime_get_ns() + bpf_get_prandom_u32() % (AGG_TEST_RACE_DELAY + 1);

	/* verifier: a constant bound on the iterations (it walks each one); the clock ends the
	 * loop earlier */
	AGG_NO_UNROLL
	for (u32 i = 0; i < AGG_TEST_RACE_SPINS; i++)
		if (bpf_ktime_get_ns() >= end)
			break;
}
#else
#define race_window() \
	do {          \
	} while (0)
#endif

/* True when the UDP checksum of a packet of K elements is right (the caller skips a zero
 * checksum: none was sent). One's complement sum of the pseudo-header, the UDP header, the
 * SwitchML and exponent headers and the payload; the sum of 16-bit words does not depend on
 * their byte order (RFC 1071), so the words are added as they lie in memory, the payload 32
 * bits at a time. */
static __always_inline bool udp_checksum_ok(struct agg_pkt *pk, __be32 *pl, const u32 K)
{
	u16 *h = (u16 *)pk->udp;
	u64 sum = (u64)pk->ip->saddr + pk->ip->daddr + bpf_htons(IPPROTO_UDP) + pk->udp->len;

	/* UDP, SwitchML and exponent headers: 18 bytes, bounds-checked by the parser */
#pragma unroll
	for (int i = 0; i < (sizeof(struct udphdr) + SML_HLEN + SML_EXP_HLEN) / 2; i++)
		sum += h[i];
	AGG_NO_UNROLL
	for (u32 j = 0; j < K; j++)
		sum += pl[j];
	sum = (sum & 0xffffffff) + (sum >> 32);
	sum = (sum & 0xffffffff) + (sum >> 32);
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return sum == 0xffff;
}

/* Tree jobs: the parent's result for our slot g, version vi (docs/protocol.md section 3.7). */
static __always_inline int from_parent(struct xdp_md *ctx, struct agg_pkt *pk, struct agg_job *job,
				       struct agg_worker *w, struct agg_slot *st, u32 g, u32 vi,
				       u32 rkey, const u32 K)
{
	void *data_end = (void *)(long)ctx->data_end;
	__be32 *pl = (__be32 *)(pk->exp + 1);
	/* fetch_add(0) is a full barrier: up_round below is the one of the round sent up */
	u64 up = __sync_fetch_and_add(&st->up[vi], 0);
	struct agg_result *r;
	u64 old;

	if (up != st->published[vi] + 1 || st->up_round[vi] != round_key(pk)) {
		count(w->job, AGG_STALE_PARENT_RESULT); /* no round waits on it: old or another's */
		return XDP_DROP;
	}
	old = __sync_fetch_and_or(&st->seen[vi], AGG_PARENT_BIT);
	if (old & AGG_PARENT_BIT) {
		count(w->job, AGG_STALE_PARENT_RESULT); /* a copy already taken on another CPU */
		return XDP_DROP;
	}
	r = results.lookup(&rkey);
	if (!r)
		return XDP_ABORTED;
	if ((void *)(pl + K) > data_end) /* verifier: the caller checked the length already */
		return XDP_DROP;
	AGG_NO_UNROLL
	for (u32 j = 0; j < K; j++)
		r->data[j] = pl[j];
	r->e0 = pk->exp->e0;
	r->e1 = pk->exp->e1;
	/* the parent's sum is stored before the round reads as published */
	__sync_fetch_and_add(&st->published[vi], 1);
	count(w->job, AGG_PARENT_RESULT);
	address_down(pk, job, g, vi);
	return XDP_TX;
}

/* A packet of ours with K elements from worker w for slot g, version vi. */
static __always_inline int aggregate(struct xdp_md *ctx, struct agg_pkt *pk, struct agg_job *job,
				     struct agg_worker *w, u32 g, u32 vi, const u32 K)
{
	void *data_end = (void *)(long)ctx->data_end;
	__be32 *pl = (__be32 *)(pk->exp + 1);
	u32 pkey = AGG_POOL_ENTRY(g, vi);
	u64 n = job->num_workers;
	struct agg_result *r;
	struct agg_slot *st;
	u64 old, a, round, tag, done, bit;

	/* verifier: a constant-size range check on the packet pointer (the length was checked) */
	if ((void *)(pl + K) > data_end)
		return XDP_DROP;
	if ((job->flags & AGG_JOB_VERIFY_UDP_CSUM) && pk->udp->check &&
	    !udp_checksum_ok(pk, pl, K)) {
		count(w->job, AGG_DROP_BAD_CHECKSUM); /* before any state changes */
		count_worker(w, dropped);
		return XDP_DROP;
	}
	st = slots.lookup(&g);
	if (!st)
		return XDP_ABORTED;
	if (w->index == AGG_PARENT_INDEX)
		return from_parent(ctx, pk, job, w, st, g, vi, pkey, K);
	bit = 1ULL << w->index; /* a worker's index is < AGG_MAX_WORKERS here (ingress checked) */
	old = __sync_fetch_and_or(&st->seen[vi], bit);
	if (old & bit)
		return answer_duplicate(ctx, pk, job, w, st, vi, pkey, K);
	__sync_fetch_and_and(&st->seen[vi ^ 1], ~bit); /* w has moved on from the other version */
	a = __sync_fetch_and_add(&st->arrivals[vi], 1);
	round = a / n;
	tag = ((u64)job->epoch << 32) | (u32)round;
	count_worker(w, contributions);

	race_window(); /* nothing unless a test build asks for it */
	if (accumulate(pkey, tag, pk, pl, K))
		return XDP_ABORTED;
	done = __sync_fetch_and_add(&st->added[vi], 1) + 1;
#ifdef AGG_TEST_MUTANT_COMPLETE_ON_ARRIVAL
	/* Test-only, deliberately wrong (the mutant tests/test_xdp_concurrency.py must catch): the
	 * n-th arrival completes the slot, though another CPU's addition may not have finished. */
	done = a + 1;
#endif
	if (done != (round + 1) * n) {
		count(w->job, AGG_AGGREGATED);
		return XDP_DROP;
	}

	/* The last addition of the round: this CPU alone completes the slot. */
	r = results.lookup(&pkey);
	if (!r)
		return XDP_ABORTED;
	complete_slot(pk, pl, r, pkey, tag, K);
	if (job->flags & AGG_JOB_TREE) {
		/* the partial is stored; the parent's result for this round is still to be taken */
		__sync_fetch_and_and(&st->seen[vi], ~AGG_PARENT_BIT);
		st->up_round[vi] = round_key(pk);
		__sync_fetch_and_add(&st->up[vi], 1); /* barrier: partial and key before `up` */
		count(w->job, AGG_FORWARDED_UP);
		address_up(pk, job, g, vi);
		return XDP_TX;
	}
	__sync_fetch_and_add(&st->published[vi], 1);
	count(w->job, AGG_COMPLETED);
	if (job->delivery == AGG_DELIVERY_BROADCAST) {
		/* every copy carries the result's fields; the egress program only addresses it */
		result_fields(pk);
		ipv4_csum(pk->ip);
		return tx_ports.redirect_map(0, BPF_F_BROADCAST);
	}
	address_to_group(pk, job);
	return XDP_TX;
}

#endif
