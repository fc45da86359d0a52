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
 * A sparse job's packets (docs/protocol.md section 8) run the same machine through sparse.h,
 * which adds the round's key and reuses the fold, gather and delivery below.
 * Test-only builds (tests/root/test_xdp_concurrency.py) may define AGG_TEST_RACE_DELAY (see
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

/* Element loops (what the JIT makes of them: bench/xdp_compare.py):
 *  - A payload word, 8 bytes of two big-endian int32 x0, x1, byte-swapped as one u64 puts x0 in
 *    the high lane and x1 in the low one. Partial sums are kept so, in host order with each
 *    pair's two lanes swapped ("lane order"); one 64-bit swap of a lane-order word gives both
 *    sums big-endian in their places, which results and packets carry. So the first
 *    contribution of a round, the published result and every copy move 64-bit words (a load, a
 *    swap, a store per two elements). Only this file reads or writes partial sums (the control
 *    plane reads their tags alone).
 *  - Adding a contribution stays one int32 at a time (load, swap, load, add, store), into the
 *    lane-order position: two int32 lanes in one 64-bit add need their carries kept apart (six
 *    more ALU operations per word, add_lanes()), which measured slower here than the two adds
 *    they replace (601 and 657 ns against 550 per 768-element packet).
 *  - BPF has no indexed addressing: a loop over j recomputes base + j for every pointer it
 *    touches. The hot loops go a block of AGG_BLOCK_WORDS words at a time instead, the block
 *    unrolled with constant offsets from pointers bumped once per block; the verifier walks
 *    every block (a constant trip count) like any bounded loop.
 *  - Payload words start 4 bytes past an 8-byte boundary (the payload is at frame offset 52);
 *    the verifier allows such unaligned packet loads and stores on x86-64, where the programs
 *    run (it enforces alignment only with BPF_F_STRICT_ALIGNMENT or on architectures without
 *    efficient unaligned access). Map values' sums are 8-byte aligned (asserted below).
 *  - Words are reached through may_alias types: the same bytes are __be32 or __s32 elsewhere,
 *    and no alias analysis may reorder accesses across the two views. */
typedef u64 __attribute__((__may_alias__)) agg_lanes;
typedef u32 __attribute__((__may_alias__)) agg_word32;

#define AGG_LANE_LOW31	0x7fffffff7fffffffULL /* each lane without its top bit */
#define AGG_LANE_TOP	0x8000000080000000ULL /* each lane's top bit */
#define AGG_BLOCK_WORDS 16		      /* words per unrolled block: 32 int32 */
#define AGG_BLOCKS(K)	((K) / (2 * AGG_BLOCK_WORDS))
/* A block loop: the block is unrolled by hand, the loop itself must stay a loop (and not be
 * vectorised into an interleaved copy with a remainder loop). */
#define AGG_BLOCK_LOOP _Pragma("clang loop unroll(disable) vectorize(disable) interleave(disable)")

/* Loops that converge (every element loop but the hot path's, AGG_WALK_BLOCKS): the verifier
 * takes such a loop as verified once a step's state lies within the one before, instead of
 * walking every block of every packet size (most of what it processed). A step is a block, or
 * AGG_JUMBO_STEP blocks of a jumbo payload's (agg_payload_where). */
#define AGG_JUMBO_STEP 8 /* blocks per step of a jumbo payload's loops (256 int32) */

/* verifier: where every converging loop starts, 0, read from a global the program never writes
 * (.bss), whose value the verifier does not know: the loop's index is then a range to it, not a
 * constant, so that one step's state can lie within the one before. */
u32 agg_step0;

/* verifier: a may_goto instruction (kernel 6.9), spelled in bytes as the kernel's selftests
 * spell it for a clang that cannot name it, at which the verifier takes a loop as converged.
 * False only once the program has looped for a quarter of a second, which a packet's steps
 * never come near; each loop still checks that it ran to its end (agg_all_steps) and fails its
 * packet if not. */
#define agg_can_loop()                                                                    \
	({                                                                                \
		__label__ l_break, l_continue;                                            \
		bool ok = true;                                                           \
		asm volatile goto("1: .byte 0xe5; .byte 0;"                               \
				  ".long ((%l[l_break] - 1b - 8) / 8) & 0xffff; .short 0" \
				  :                                                       \
				  :                                                       \
				  :                                                       \
				  : l_break);                                             \
		goto l_continue;                                                          \
l_break:                                                                                  \
		ok = false;                                                               \
l_continue:                                                                               \
		ok;                                                                       \
	})

/* A converging loop, s (a u32) from agg_step0 over the steps of K int32 that lie `in` a map
 * value or the packet (struct agg_where, below). verifier: s is below the steps of the largest
 * packet too, which bounds it where K is not a constant (clang drops that compare where it is). */
#define AGG_EACH_STEP(s, in, K)               \
	AGG_BLOCK_LOOP                        \
	for (s = *(volatile u32 *)&agg_step0; \
	     s < AGG_STEPS(in, K) && s < AGG_STEPS(in, AGG_MAX_ELEMS) && agg_can_loop(); s++)

/* 0 when a converging loop over the steps of K int32 `in` ran to its end, -1 when it stopped
 * short. */
#define agg_all_steps(s, in, K) ((s) < AGG_STEPS(in, K) ? -1 : 0)

/* The blocks of a step of W words, i the word offset of each in the step (unrolled). */
#define AGG_STEP_BLOCK(i, W) _Pragma("unroll") for (u32 i = 0; i < (W); i += AGG_BLOCK_WORDS)

/* Where the words a converging loop reads or writes lie (in a map value, or in the packet), and
 * how many blocks it takes a step (a constant). */
struct agg_where {
	bool pkt;   /* in the packet, which ends at `end` */
	u32 blocks; /* blocks per step */
	void *end;  /* the packet's data_end */
};
/* A map value's words, a block a step; the same a jumbo step at a time; the packet's, up to e. */
#define AGG_IN_MAP	   ((struct agg_where){.pkt = false, .blocks = 1})
#define AGG_IN_MAP_WIDE	   ((struct agg_where){.pkt = false, .blocks = AGG_JUMBO_STEP})
#define agg_in_pkt(e)	   ((struct agg_where){.pkt = true, .blocks = 1, .end = (e)})
#define AGG_STEP_WORDS(in) ((in).blocks * AGG_BLOCK_WORDS) /* words per step */
#define AGG_STEPS(in, K)   (AGG_BLOCKS(K) / (in).blocks)   /* steps over K int32 */

/* Step s, of W words each, of the words at w. verifier: each step's address is made from its
 * index, opaque to clang, which would otherwise bump a pointer from step to step: the verifier
 * compares pointers' offsets exactly, and that loop would never converge. */
static __always_inline agg_lanes *step_at(agg_lanes *w, u32 s, const u32 W)
{
	u64 off = (u64)s * W * sizeof(*w);

	asm("" : "+r"(off));
	return (void *)w + off;
}

/* Whether step p, of W words that lie `in` a map value or the packet, ends past the packet's
 * end. verifier: a step in the packet is range-checked, its offset being a range; one in a map
 * value is bounded by the value's size. */
static __always_inline bool step_past_end(agg_lanes *p, struct agg_where in, const u32 W)
{
	return in.pkt && (void *)(p + W) > in.end;
}

/* Every packet size is whole blocks, a jumbo one whole jumbo steps. */
#define AGG_SIZE_IN_BLOCKS(code, elems)                                 \
	_Static_assert((elems) % (2 * AGG_BLOCK_WORDS) == 0, "blocks"); \
	_Static_assert(AGG_DIRECT(elems) || AGG_BLOCKS(elems) % AGG_JUMBO_STEP == 0, "steps");
SML_FOR_EACH_SIZE(AGG_SIZE_IN_BLOCKS)
_Static_assert(__builtin_offsetof(struct agg_partial, sum) % 8 == 0, "partial sums word-aligned");
_Static_assert(__builtin_offsetof(struct agg_result, data) % 8 == 0, "results word-aligned");

/* Lane-wise a + b mod 2^32: add the lanes without their top bits (no carry can leave a lane),
 * then put each lane's top bit back as the xor of the two top bits (and the carry into it). */
static __always_inline u64 add_lanes(u64 a, u64 b)
{
	return ((a & AGG_LANE_LOW31) + (b & AGG_LANE_LOW31)) ^ ((a ^ b) & AGG_LANE_TOP);
}

/* A payload word (two big-endian int32) in lane order, and back: one 64-bit swap each way. */
#define agg_wire_to_lanes(w) __builtin_bswap64(w)
#define agg_lanes_to_wire(w) __builtin_bswap64(w)

/* One block of a contribution into a partial, the first of its round on this CPU: s = p. */
static __always_inline void set_block(agg_lanes *s, const agg_lanes *p)
{
#pragma unroll
	for (int i = 0; i < AGG_BLOCK_WORDS; i++)
		s[i] = agg_wire_to_lanes(p[i]);
}

/* One block of a contribution added into a partial: s += p, element by element; the wire's
 * element 2i is lane-order position 2i + 1 and the other way round. */
static __always_inline void add_block(agg_lanes *s, const agg_lanes *p)
{
	agg_word32 *s4 = (agg_word32 *)s;
	const agg_word32 *p4 = (const agg_word32 *)p;

#pragma unroll
	for (int i = 0; i < AGG_BLOCK_WORDS; i++) {
		s4[2 * i + 1] += agg_ntohl(p4[2 * i]);
		s4[2 * i] += agg_ntohl(p4[2 * i + 1]);
	}
}

/* One block of a finished sum (lane order) published big-endian into the result and the packet. */
static __always_inline void publish_block(agg_lanes *r, agg_lanes *p, const agg_lanes *sum)
{
#pragma unroll
	for (int i = 0; i < AGG_BLOCK_WORDS; i++) {
		u64 be = agg_lanes_to_wire(sum[i]);

		r[i] = be;
		p[i] = be;
	}
}

/* One block of other CPUs' sums (lane order) plus own's published big-endian into the result,
 * where the others' are, and the packet. */
static __always_inline void publish_sum_block(agg_lanes *r, agg_lanes *p, const agg_lanes *own)
{
#pragma unroll
	for (int i = 0; i < AGG_BLOCK_WORDS; i++) {
		u64 be = agg_lanes_to_wire(add_lanes(r[i], own[i]));

		r[i] = be;
		p[i] = be;
	}
}

/* One block copied: d = s. */
static __always_inline void copy_block(agg_lanes *d, const agg_lanes *s)
{
#pragma unroll
	for (int i = 0; i < AGG_BLOCK_WORDS; i++)
		d[i] = s[i];
}

/* One block of sums (lane order) added into another, lane by lane: d += s. */
static __always_inline void add_lanes_block(agg_lanes *d, const agg_lanes *s)
{
#pragma unroll
	for (int i = 0; i < AGG_BLOCK_WORDS; i++)
		d[i] = add_lanes(d[i], s[i]);
}

static __always_inline s32 max_s32(s32 a, s32 b)
{
	return a > b ? a : b;
}

/* The words of K int32 at d = the words at s, each where it lies (din, sin; in steps of din's):
 * a converging loop. -1: the loop stopped short. */
static __always_inline int copy_words(agg_lanes *d, struct agg_where din, agg_lanes *s,
				      struct agg_where sin, const u32 K)
{
	agg_lanes *ds, *ss;
	u32 k;

	AGG_EACH_STEP(k, din, K) {
		ds = step_at(d, k, AGG_STEP_WORDS(din));
		if (step_past_end(ds, din, AGG_STEP_WORDS(din)))
			break;
		ss = step_at(s, k, AGG_STEP_WORDS(din));
		if (step_past_end(ss, sin, AGG_STEP_WORDS(din)))
			break;
		AGG_STEP_BLOCK(i, AGG_STEP_WORDS(din))
			copy_block(ds + i, ss + i);
	}
	return agg_all_steps(k, din, K);
}

/* Copy a stored sum (network order) and its exponents into the packet. */
static __always_inline int copy_result(struct xdp_md *ctx, struct agg_pkt *pk, struct agg_result *r,
				       const u32 K)
{
	void *data_end = pk->data_end;
	agg_lanes *pw = (agg_lanes *)(pk->exp + 1), *rw = (agg_lanes *)r->data;

	if (!AGG_DIRECT(K)) {
		/* a jumbo payload spans buffers: one helper call writes all of them */
		if (bpf_xdp_store_bytes(ctx, SML_PAYLOAD_OFFSET, r->data, K * 4))
			return -1;
	} else if (copy_words(pw, agg_in_pkt(data_end), rw, AGG_IN_MAP, K)) {
		return -1;
	}
	pk->exp->e0 = r->e0;
	pk->exp->e1 = r->e1;
	return 0;
}

/* Tree jobs: a retransmission of a round complete here that the parent has not answered: the
 * stored partial goes up again (the first may have been lost between the levels). */
static __always_inline int resend_up(struct xdp_md *ctx, struct agg_pkt *pk, struct agg_job *job,
				     struct agg_worker *w, u32 vi, u32 rkey, const u32 K)
{
	struct agg_result *r = bpf_map_lookup_elem(&results, &rkey);

	if (!r)
		return XDP_ABORTED;
	if (copy_result(ctx, pk, r, K))
		return XDP_DROP;
	address_up(pk, job, rkey >> 1, vi);
	count(w->job, AGG_RESENT_UP);
	return AGG_TX(ctx);
}

/* A retransmission answered: the stored result, now in the packet, back to its sender. */
static __always_inline int send_answer(struct xdp_md *ctx, struct agg_pkt *pk, struct agg_worker *w)
{
	reply_to_sender(pk);
	count(w->job, AGG_RETX_ANSWERED);
	count_worker(w, answered);
	return AGG_TX(ctx);
}

/* A retransmission or duplicate: answer the stored result if the round is published. */
static __always_inline int answer_duplicate(struct xdp_md *ctx, struct agg_pkt *pk,
					    struct agg_job *job, struct agg_worker *w,
					    struct agg_slot *st, u32 vi, u32 rkey, const u32 K)
{
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
	r = bpf_map_lookup_elem(&results, &rkey);
	if (!r)
		return XDP_ABORTED;
	if (copy_result(ctx, pk, r, K))
		return XDP_DROP;
	return send_answer(ctx, pk, w);
}

/* Where a dense payload of K elements lies (payload_at): in the packet where it is read in place,
 * in scratch (a map value, its loops a jumbo step at a time) where it was copied. */
#define agg_payload_where(pk, K) (AGG_DIRECT(K) ? agg_in_pkt((pk)->data_end) : AGG_IN_MAP_WIDE)

/* body (statements) run on each step of the words pw (lying `in` the packet or a map value) of K
 * int32: _k the step's index, _p its words (range-checked where in the packet); a converging
 * loop: 0, or -1 when the loop stopped short. */
#define AGG_PAYLOAD_STEPS(pw, in, K, body...)                          \
	({                                                             \
		agg_lanes *_p;                                         \
		u32 _k;                                                \
                                                                       \
		AGG_EACH_STEP(_k, in, K) {                             \
			_p = step_at(pw, _k, AGG_STEP_WORDS(in));      \
			if (step_past_end(_p, in, AGG_STEP_WORDS(in))) \
				break;                                 \
			body;                                          \
		}                                                      \
		agg_all_steps(_k, in, K);                              \
	})

/* op(s, p) over the blocks of sums sw (lane order, a map value) and words pw (lying `in` the
 * packet or a map value), a converging loop: 0, or -1 when the loop stopped short. */
#define AGG_SUMS_LOOP(op, sw, pw, in, K)                                                  \
	AGG_PAYLOAD_STEPS(pw, in, K, agg_lanes *_s = step_at(sw, _k, AGG_STEP_WORDS(in)); \
			  AGG_STEP_BLOCK(_i, AGG_STEP_WORDS(in)) op(_s + _i, _p + _i))

/* op(s, p) over the blocks of sums sw and a dense payload pw read in place, pointers bumped from
 * block to block: the hot path's loops (a contribution's fold, a result's publication).
 * verifier: a constant trip count, walked block by block (a payload in place is at most 768
 * int32). Converging, they cost a may_goto, an address made from the index and a range check
 * per block: up to 5% more per packet at 768 int32 (bench/xdp_compare.py, 21 passes), for
 * 17,800 fewer instructions verified but only 5 ms less of the load (0.13 s then). */
#define AGG_WALK_BLOCKS(op, sw, pw, K)                                                           \
	AGG_BLOCK_LOOP                                                                           \
	for (u32 _b = 0; _b < AGG_BLOCKS(K); _b++, sw += AGG_BLOCK_WORDS, pw += AGG_BLOCK_WORDS) \
	op(sw, pw)

/* A contribution's payload into a partial's sums, the first of its round there: s = p. */
static __always_inline int set_sums(agg_lanes *sw, agg_lanes *pw, struct agg_where in, const u32 K)
{
	if (!in.pkt)
		return AGG_SUMS_LOOP(set_block, sw, pw, in, K);
	AGG_WALK_BLOCKS(set_block, sw, pw, K);
	return 0;
}

/* A contribution's payload added into a partial's sums: s += p. */
static __always_inline int add_sums(agg_lanes *sw, agg_lanes *pw, struct agg_where in, const u32 K)
{
	if (!in.pkt)
		return AGG_SUMS_LOOP(add_block, sw, pw, in, K);
	AGG_WALK_BLOCKS(add_block, sw, pw, K);
	return 0;
}

/* Fold a sparse job's contribution into a partial (docs/protocol.md 8.3): the payload, where
 * there is one (pw, in scratch; NULL: an empty contribution), set or added as a dense one is,
 * the first payload of the round here being set (has_data); the smallest next with the maximum
 * e0 of the contributions naming it; e1 maxed. -1: the payload's loop stopped short. */
static __always_inline int fold_sparse(struct agg_partial *p, u64 tag, const struct agg_contrib *c,
				       agg_lanes *pw, const u32 K)
{
	bool fresh = p->tag != tag;

	/* verifier: the pointer itself says whether there is a payload (no flag beside it that
	 * the verifier could not tie to it) */
	if (pw && (fresh || !p->has_data ? set_sums((agg_lanes *)p->sum, pw, AGG_IN_MAP, K)
					 : add_sums((agg_lanes *)p->sum, pw, AGG_IN_MAP, K)))
		return -1;
	if (fresh) {
		p->next = c->next;
		p->e0 = c->e0;
		p->e1 = c->e1;
		p->count = 1;
		p->has_data = pw != NULL;
		p->tag = tag;
		return 0;
	}
	if (c->next < p->next) {
		p->next = c->next;
		p->e0 = c->e0;
	} else if (c->next == p->next) {
		p->e0 = max_s32(p->e0, c->e0);
	}
	p->e1 = max_s32(p->e1, c->e1);
	if (pw)
		p->has_data = 1;
	p->count += 1;
	return 0;
}

/* Fold one contribution into a partial sum (lane order): overwrite when the partial belongs to an
 * earlier round (no separate reset is needed), add otherwise. `c`: a sparse job's contribution
 * (fold_sparse), NULL for a dense job's (a constant: the dense code is what it was). -1: the
 * payload's loop stopped short. */
static __always_inline int fold(struct agg_partial *p, u64 tag, struct agg_pkt *pk, agg_lanes *pw,
				const struct agg_contrib *c, const u32 K)
{
	struct agg_where in = agg_payload_where(pk, K);

	if (c)
		return fold_sparse(p, tag, c, pw, K);
	if (p->tag != tag) {
		if (set_sums((agg_lanes *)p->sum, pw, in, K))
			return -1;
		p->e0 = pk->exp->e0;
		p->e1 = pk->exp->e1;
		p->count = 1;
		p->tag = tag;
		return 0;
	}
	if (add_sums((agg_lanes *)p->sum, pw, in, K))
		return -1;
	p->e0 = max_s32(p->e0, pk->exp->e0);
	p->e1 = max_s32(p->e1, pk->exp->e1);
	p->count += 1;
	return 0;
}

/* op(r, p, own) over the blocks of a result's words rw, a payload pw (lying `in` the packet or a
 * map value) and own's sums, a converging loop: 0, or -1 when the loop stopped short. */
#define AGG_PUBLISH_LOOP(op, rw, pw, in, own, K)                                          \
	AGG_PAYLOAD_STEPS(pw, in, K, agg_lanes *_r = step_at(rw, _k, AGG_STEP_WORDS(in)); \
			  agg_lanes *_o = step_at(own, _k, AGG_STEP_WORDS(in));           \
			  AGG_STEP_BLOCK(_i, AGG_STEP_WORDS(in)) op(_r + _i, _p + _i, _o + _i))

/* A finished sum, own's alone, published from a payload read in place: the hot path's loop, as
 * AGG_WALK_BLOCKS (verifier: walked block by block). */
static __always_inline void publish_in_place(agg_lanes *rw, agg_lanes *pw, agg_lanes *own,
					     const u32 K)
{
	AGG_BLOCK_LOOP
	for (u32 b = 0; b < AGG_BLOCKS(K); b++) {
		publish_block(rw, pw, own);
		rw += AGG_BLOCK_WORDS;
		pw += AGG_BLOCK_WORDS;
		own += AGG_BLOCK_WORDS;
	}
}

/* Write a finished sum big-endian into the result and the packet, in one pass: `own` (lane
 * order) plus, when `others`, what the other CPUs' partials summed to in r->data (lane order).
 * -1: the loop stopped short. */
static __always_inline int publish_result(struct agg_pkt *pk, agg_lanes *pw, struct agg_result *r,
					  agg_lanes *own, bool others, s32 e0, s32 e1, const u32 K)
{
	agg_lanes *rw = (agg_lanes *)r->data;
	struct agg_where in = agg_payload_where(pk, K);

	if (others) {
		if (AGG_PUBLISH_LOOP(publish_sum_block, rw, pw, in, own, K))
			return -1;
	} else if (in.pkt) {
		publish_in_place(rw, pw, own, K);
	} else if (AGG_PUBLISH_LOOP(publish_block, rw, pw, in, own, K)) {
		return -1;
	}
	r->e0 = e0;
	r->e1 = e1;
	pk->exp->e0 = e0;
	pk->exp->e1 = e1;
	return 0;
}

#define AGG_GATHER_ALL 0xffffffff /* gather: no CPU is left out (no CPU has this number) */

/* What a round's partials add up to besides the sum, as the completing CPU gathers them. */
struct agg_round {
	s32 e0, e1; /* the exponents: max e1; max e0 (sparse: of those naming the smallest next) */
	u32 next;   /* sparse: the smallest next */
	u32 others; /* whether r->data holds gathered sums (lane order; sparse: own's too) */
};

#ifndef AGG_SPINLOCK
/* Per-CPU variant (the default): each CPU folds into its own partial of the slot, which it
 * returns (NULL: no partial, a map error). `c`: as fold() takes it. */
static __always_inline struct agg_partial *accumulate(u32 pkey, u64 tag, struct agg_pkt *pk,
						      agg_lanes *pw, const struct agg_contrib *c,
						      const u32 K)
{
	struct agg_partial *p = bpf_map_lookup_elem(&partials, &pkey);

	if (!p || fold(p, tag, pk, pw, c, K))
		return NULL;
	return p;
}

/* Note where this CPU folded the contribution that arrived `pos`-th in its round (a mod n of
 * its arrival count a: the n arrivals of a round take the n positions once each, even when a
 * worker whose seen bit the other version cleared contributes twice). Before the `added` count
 * that publishes it: the completing CPU reads the entry after its own fetch_add on `added`. */
static __always_inline int note_cpu(u32 pkey, u32 pos)
{
	struct agg_contrib_cpus *c = bpf_map_lookup_elem(&contrib_cpus, &pkey);

	if (!c)
		return -1;
	/* verifier: the mask bounds the position (below n <= AGG_MAX_WORKERS) */
	c->cpu[pos & (AGG_MAX_WORKERS - 1)] = bpf_get_smp_processor_id();
	return 0;
}

/* One partial's exponents and next into the gather (a sparse round's e0 travels with the
 * smallest next, docs/protocol.md 8.3; a dense round's is the max over all). */
static __always_inline void gather_exponents(struct agg_gather *gs, struct agg_partial *q)
{
	if (!gs->sparse || q->next == gs->next) {
		gs->e0 = max_s32(gs->e0, q->e0);
	} else if (q->next < gs->next) {
		gs->next = q->next;
		gs->e0 = q->e0;
	}
	gs->e1 = max_s32(gs->e1, q->e1);
}

/* One step of the gather, for arrival position i of the round being completed on this CPU:
 * fold the partial of the CPU that took that contribution into r->data (lane order), unless
 * that CPU is this one (own is added last) or its partial was gathered already (for an earlier
 * position on the same CPU). Every addition of the round has finished (the `added` count) and no CPU can
 * fold into these partials before the result is published, so the completing CPU has them to
 * itself: it marks a gathered partial by zeroing its count, which the next round's first fold
 * resets. A sparse round's partial without data adds its exponents and next only. Returns 0
 * to go on, 1 to stop (a map lookup that cannot fail did, or a loop stopped short).
 * verifier: one callback for every packet size, K read from the gather (bounded below), its
 * loops converging; it is verified at each bpf_loop call, whatever the number of calls, so the
 * program's verification does not grow with the workers or the CPUs (a loop over CPUs walked
 * every iteration: built for 5 CPUs it passed the 1,000,000-instruction limit). */
AGG_CALLBACK_FN(agg_gather)
{
	u32 zero = 0, cpu, K;
	struct agg_gather *gs = bpf_map_lookup_elem(&gather, &zero);
	struct agg_contrib_cpus *c;
	struct agg_partial *q;
	struct agg_result *r;
	agg_lanes *rw, *qw;

	if (!gs)
		return 1;
	K = gs->elems;
	if (K > AGG_MAX_ELEMS)
		return 1;
	c = bpf_map_lookup_elem(&contrib_cpus, &gs->pkey);
	r = bpf_map_lookup_elem(&results, &gs->pkey);
	if (!c || !r)
		return 1;
	/* verifier: bpf_loop's index is unknown to it; the mask bounds it */
	cpu = c->cpu[i & (AGG_MAX_WORKERS - 1)];
	if (cpu == gs->me)
		return 0;
	q = bpf_map_lookup_percpu_elem(&partials, &gs->pkey, cpu);
	if (!q || q->tag != gs->tag || !q->count)
		return 0;
	rw = (agg_lanes *)r->data;
	qw = (agg_lanes *)q->sum;
	if (gs->sparse && !q->has_data) {
		/* nothing to add */
	} else if (!gs->others) {
		if (copy_words(rw, AGG_IN_MAP, qw, AGG_IN_MAP, K))
			return 1;
		gs->others = 1;
	} else if (AGG_SUMS_LOOP(add_lanes_block, rw, qw, AGG_IN_MAP, K)) {
		return 1;
	}
	gather_exponents(gs, q);
	q->count = 0;
	return 0;
}

/* Gather the round's partials other than `own` (this CPU's, which holds the round's last
 * addition) into r->data, and everything's exponents (and next, for a `sparse` job's round)
 * into `out`: the partials of the other CPUs that took contributions of the round
 * (contrib_cpus). XDP does not nest on a CPU, so own stays as folded. When own holds all n
 * contributions (its count, kept per CPU without atomics), no other CPU has any and none is
 * read. A sparse round gathers own too (AGG_GATHER_ALL): r->data then holds the whole sum and
 * its publication is one pass (sparse.h store_round). Returns -1 on a map error. */
static __always_inline int gather_round(u32 pkey, u64 tag, struct agg_partial *own, u64 n,
					bool sparse, struct agg_round *out, const u32 K)
{
	struct agg_gather *gs;
	u32 zero = 0;

	out->e0 = own->e0;
	out->e1 = own->e1;
	out->next = own->next;
	out->others = 0;
	if (own->count == n)
		return 0;
	gs = bpf_map_lookup_elem(&gather, &zero);
	if (!gs)
		return -1;
	gs->tag = tag;
	gs->pkey = pkey;
	gs->me = sparse ? AGG_GATHER_ALL : bpf_get_smp_processor_id();
	gs->e0 = out->e0;
	gs->e1 = out->e1;
	gs->next = out->next;
	gs->sparse = sparse;
	gs->others = 0;
	gs->elems = K;
	if (bpf_loop(n, agg_gather, NULL, 0) != n)
		return -1;
	out->e0 = gs->e0;
	out->e1 = gs->e1;
	out->next = gs->next;
	out->others = gs->others;
	return 0;
}
#else
/* Spin-lock variant (build option, the baseline to measure against): one shared partial per
 * (slot, version), folded into under its bpf_spin_lock; returns it (NULL: a map error). */
static __always_inline struct agg_partial *accumulate(u32 pkey, u64 tag, struct agg_pkt *pk,
						      agg_lanes *pw, const struct agg_contrib *c,
						      const u32 K)
{
	struct agg_locked_partial *lp = bpf_map_lookup_elem(&locked_partials, &pkey);
	int err;

	if (!lp)
		return NULL;
	/* verifier: no helper calls between lock and unlock; fold() makes none */
	bpf_spin_lock(&lp->lock);
	err = fold(&lp->p, tag, pk, pw, c, K);
	bpf_spin_unlock(&lp->lock);
	return err ? NULL : &lp->p;
}

/* Every addition of the round is finished (the `added` count says so) and no new round can
 * start before this result is sent, so the shared partial (`own`) is read without the lock. */
static __always_inline int note_cpu(u32 pkey, u32 pos)
{
	return 0; /* one shared partial: nothing to gather */
}

static __always_inline int gather_round(u32 pkey, u64 tag, struct agg_partial *own, u64 n,
					bool sparse, struct agg_round *out, const u32 K)
{
	out->e0 = own->e0;
	out->e1 = own->e1;
	out->next = own->next;
	out->others = 0; /* one shared partial holds the whole round */
	return 0;
}
#endif

/* Sum the round's partials into the packet and the stored result: the other CPUs' gathered
 * into r->data first (gather_round), and own added in the pass that publishes (one pass when
 * no other CPU saw the round). Returns -1 on a map error. */
static __always_inline int complete_slot(struct agg_pkt *pk, agg_lanes *pw, struct agg_result *r,
					 u32 pkey, u64 tag, struct agg_partial *own, u64 n,
					 const u32 K)
{
	struct agg_round rs;

	if (gather_round(pkey, tag, own, n, false, &rs, K))
		return -1;
	return publish_result(pk, pw, r, (agg_lanes *)own->sum, rs.others, rs.e0, rs.e1, K);
}

#ifdef AGG_TEST_RACE_DELAY
/* Test-only (tests/root/test_xdp_concurrency.py; never in a production build): widen the window
 * between a contribution's arrival count and the end of its addition by spinning a pseudo-random
 * 0..AGG_TEST_RACE_DELAY ns. The jitter is what matters: a contribution that arrived first can
 * then finish its addition after one that arrived later, which is the interleaving a completion
 * decided on the arrival count gets wrong (a fixed delay would keep arrival order). */
#define AGG_TEST_RACE_SPINS 2048 /* ktime reads, each tens of ns: covers the delays the test uses */
AGG_PERCPU_ARRAY(race_end, u64, 1); /* 0 -> when this CPU's race window ends (ktime ns) */

/* The spin's callback: 1, which ends bpf_loop, once the
 * window's end has passed. */
AGG_CALLBACK_FN(agg_race_spin)
{
	u32 zero = 0;
	u64 *end = bpf_map_lookup_elem(&race_end, &zero);

	return !end || bpf_ktime_get_ns() >= *end;
}

static __always_inline void race_window(void)
{
	u32 zero = 0;
	u64 *end = bpf_map_lookup_elem(&race_end, &zero);

	if (!end)
		return;
	*end = bpf_ktime_get_ns() + bpf_get_prandom_u32() % (AGG_TEST_RACE_DELAY + 1);
	/* verifier: a callback, verified as a whole at each call; a bounded loop of ktime reads
	 * was walked iteration by iteration at every one, which took the sparse build past the
	 * verifier's limit */
	bpf_loop(AGG_TEST_RACE_SPINS, agg_race_spin, NULL, 0);
}
#else
#define race_window() \
	do {          \
	} while (0)
#endif

/* A new contribution's arrival, its bit just won in `seen` (dense, or a sparse job's: c):
 * counted into this CPU's partial of its round. 1: it is the round's last addition, this CPU
 * completes the round (the round's tag and the partial in *tag, *own); 0: counted, not the
 * last; -1: an internal error. */
static __always_inline int arrive(struct agg_pkt *pk, struct agg_job *job, struct agg_worker *w,
				  struct agg_slot *st, u32 vi, u32 pkey, u64 bit, agg_lanes *pw,
				  const struct agg_contrib *c, u64 *tag, struct agg_partial **own,
				  const u32 K)
{
	u64 n = job->num_workers, a, round, done;

	__sync_fetch_and_and(&st->seen[vi ^ 1], ~bit); /* w has moved on from the other version */
	a = __sync_fetch_and_add(&st->arrivals[vi], 1);
	round = a / n;
	*tag = ((u64)job->epoch << 32) | (u32)round;
	count_worker(w, contributions);

	race_window(); /* nothing unless a test build asks for it */
	*own = accumulate(pkey, *tag, pk, pw, c, K);
	if (!*own || note_cpu(pkey, a - round * n))
		return -1;
	done = __sync_fetch_and_add(&st->added[vi], 1) + 1;
#ifdef AGG_TEST_MUTANT_COMPLETE_ON_ARRIVAL
	/* Test-only, deliberately wrong (the mutant tests/root/test_xdp_concurrency.py must catch): the
	 * n-th arrival completes the slot, though another CPU's addition may not have finished. */
	done = a + 1;
#endif
	if (done != (round + 1) * n) {
		count(w->job, AGG_AGGREGATED);
		return 0;
	}
	return 1;
}

/* The UDP checksum, in three steps (checksum_ok): the one's complement sum of the pseudo-header
 * and H bytes of headers from the UDP header on (bounds-checked by the caller; even), ... */
static __always_inline u64 csum_start(struct agg_pkt *pk, const u32 H)
{
	u16 *h = (u16 *)pk->udp;
	u64 sum = (u64)pk->ip->saddr + pk->ip->daddr + bpf_htons(IPPROTO_UDP) + pk->udp->len;

#pragma unroll
	for (int i = 0; i < H / 2; i++)
		sum += h[i];
	return sum;
}

/* ... K int32 of payload at pl (lying `in` the packet or a map value) added into *sum, 32 bits at
 * a time (-1: the loop stopped short) ... */
static __always_inline int csum_add_payload(u64 *sum, __be32 *pl, struct agg_where in, const u32 K)
{
	/* a step of one block at any size: a longer one's sum is a longer chain, which clang
	 * splits into more partial sums than there are registers */
	struct agg_where one = {.pkt = in.pkt, .blocks = 1, .end = in.end};
	const agg_word32 *p;
	u64 s = *sum;
	u32 k;

	AGG_EACH_STEP(k, one, K) {
		p = (const agg_word32 *)step_at((agg_lanes *)pl, k, AGG_BLOCK_WORDS);
		if (step_past_end((agg_lanes *)p, one, AGG_BLOCK_WORDS))
			break;
#pragma unroll
		for (int i = 0; i < 2 * AGG_BLOCK_WORDS; i++)
			s += p[i];
	}
	*sum = s;
	return agg_all_steps(k, one, K);
}

/* ... and the sum folded to 16 bits: right when all ones. */
static __always_inline bool csum_folds_to_ok(u64 sum)
{
	sum = (sum & 0xffffffff) + (sum >> 32);
	sum = (sum & 0xffffffff) + (sum >> 32);
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return sum == 0xffff;
}

/* True when the UDP checksum of a packet is right (the caller skips a zero checksum: none was
 * sent): its H bytes of headers from the UDP header on, then K int32 of payload at pl (lying
 * `in` the packet or a map value). One's complement sum of the pseudo-header, the headers and the
 * payload; the sum of 16-bit words does not depend on their byte order (RFC 1071), so the words
 * are added as they lie in memory, the payload 32 bits at a time. A payload loop stopped short
 * fails the packet as a wrong checksum would: dropped before it changes anything. */
static __always_inline bool checksum_ok(struct agg_pkt *pk, const u32 H, __be32 *pl,
					struct agg_where in, const u32 K)
{
	u64 sum = csum_start(pk, H);

	return !csum_add_payload(&sum, pl, in, K) && csum_folds_to_ok(sum);
}

/* The UDP checksum of a dense packet of K elements (checksum_ok): the UDP, SwitchML and
 * exponent headers (18 bytes, bounds-checked by the parser) and the payload. */
static __always_inline bool udp_checksum_ok(struct agg_pkt *pk, __be32 *pl, const u32 K)
{
	return checksum_ok(pk, sizeof(struct udphdr) + SML_HLEN + SML_EXP_HLEN, pl,
			   agg_payload_where(pk, K), K);
}

/* A result, addressed to the job's group, on its way to the job's workers: once with XDP_TX
 * (group delivery), or (unicast delivery) broadcast through the job's devmap of n entries, where
 * xdp_agg_copy addresses copy k to worker k. */
static __always_inline int deliver(struct xdp_md *ctx, struct agg_job *job, u32 jid)
{
	void *copies;

	if (job->delivery != AGG_DELIVERY_UNICAST)
		return AGG_TX(ctx);
	copies = bpf_map_lookup_elem(&job_copies, &jid);
	if (!copies)
		return XDP_ABORTED; /* the control plane makes the devmap before the job is active */
	/* verifier: an inner map of job_copies is a devmap, which redirect_map takes */
	return bpf_redirect_map(copies, 0, BPF_F_BROADCAST);
}

/* Tree jobs: the parent's result for our slot g, version vi (docs/protocol.md section 3.7). */
static __always_inline int from_parent(struct xdp_md *ctx, struct agg_pkt *pk, struct agg_job *job,
				       struct agg_worker *w, struct agg_slot *st, u32 g, u32 vi,
				       u32 rkey, const u32 K)
{
	void *data_end = pk->data_end;
	agg_lanes *pw = (agg_lanes *)(pk->exp + 1);
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
	r = bpf_map_lookup_elem(&results, &rkey);
	if (!r)
		return XDP_ABORTED;
	if (!AGG_DIRECT(K)) {
		/* a jumbo payload spans buffers: one helper call reads all of them */
		if (bpf_xdp_load_bytes(ctx, SML_PAYLOAD_OFFSET, r->data, K * 4))
			return XDP_DROP;
	} else if (copy_words((agg_lanes *)r->data, AGG_IN_MAP, pw, agg_in_pkt(data_end), K)) {
		return XDP_DROP;
	}
	r->e0 = pk->exp->e0;
	r->e1 = pk->exp->e1;
	/* the parent's sum is stored before the round reads as published */
	__sync_fetch_and_add(&st->published[vi], 1);
	count(w->job, AGG_PARENT_RESULT);
	address_down(pk, job, g, vi);
	return deliver(ctx, job, w->job);
}

/* The payload of a packet of K elements that starts at `pl` in the packet, frame offset `off`,
 * where the element loops read it: in the packet (direct access) when K is a size that fits the
 * first buffer, else copied into this CPU's scratch. NULL: the payload is not where it must be
 * (counted as truncated by the caller). */
static __always_inline __be32 *payload_at(struct xdp_md *ctx, struct agg_pkt *pk, __be32 *pl,
					  const u32 off, const u32 K)
{
	void *data_end = pk->data_end;
	u32 zero = 0;
	struct agg_scratch *s;

	if (AGG_DIRECT(K)) {
		/* verifier: a constant-size range check on the packet pointer. The length was checked;
		 * in a frags program this also fails for a frame split before its payload's end,
		 * which no driver here does at these sizes (consts.h) */
		return (void *)(pl + K) > data_end ? NULL : pl;
	}
	s = bpf_map_lookup_elem(&scratch, &zero);
	/* verifier: K * 4 is a constant no larger than the scratch value (AGG_MAX_ELEMS) */
	if (!s || bpf_xdp_load_bytes(ctx, off, s->data, K * 4))
		return NULL;
	return s->data;
}

/* The payload of a dense packet of K elements (payload_at), after the exponent header. */
static __always_inline __be32 *payload(struct xdp_md *ctx, struct agg_pkt *pk, const u32 K)
{
	return payload_at(ctx, pk, (__be32 *)(pk->exp + 1), SML_PAYLOAD_OFFSET, K);
}

/* A completed result, its payload and exponents written, on its way to every worker of the
 * job: by the switch's devmap broadcast, or addressed to the job's group (deliver). */
static __always_inline int send_result(struct xdp_md *ctx, struct agg_pkt *pk, struct agg_job *job,
				       struct agg_worker *w)
{
	if (job->delivery == AGG_DELIVERY_BROADCAST) {
		/* every copy carries the result's fields; the egress program only addresses it */
		result_fields(pk);
		ipv4_csum(pk->ip);
		return bpf_redirect_map(&tx_ports, 0, BPF_F_BROADCAST);
	}
	address_to_group(pk, job);
	return deliver(ctx, job, w->job);
}

/* A packet of ours with K elements from worker w for slot g, version vi. */
static __always_inline int aggregate(struct xdp_md *ctx, struct agg_pkt *pk, struct agg_job *job,
				     struct agg_worker *w, u32 g, u32 vi, const u32 K)
{
	__be32 *pl = payload(ctx, pk, K);
	agg_lanes *pw = (agg_lanes *)pl;
	u32 pkey = AGG_POOL_ENTRY(g, vi);
	u64 n = job->num_workers;
	struct agg_partial *own;
	struct agg_result *r;
	struct agg_slot *st;
	u64 old, tag, bit;
	int last;

	if (!pl) {
		count(w->job, AGG_DROP_TRUNCATED);
		count_worker(w, dropped);
		return XDP_DROP;
	}
	if ((job->flags & AGG_JOB_VERIFY_UDP_CSUM) && pk->udp->check &&
	    !udp_checksum_ok(pk, pl, K)) {
		count(w->job, AGG_DROP_BAD_CHECKSUM); /* before any state changes */
		count_worker(w, dropped);
		return XDP_DROP;
	}
	st = bpf_map_lookup_elem(&slots, &g);
	if (!st)
		return XDP_ABORTED;
	if (w->index == AGG_PARENT_INDEX)
		return from_parent(ctx, pk, job, w, st, g, vi, pkey, K);
	bit = 1ULL << w->index; /* a worker's index is < AGG_MAX_WORKERS here (ingress checked) */
	old = __sync_fetch_and_or(&st->seen[vi], bit);
	if (old & bit)
		return answer_duplicate(ctx, pk, job, w, st, vi, pkey, K);
	last = arrive(pk, job, w, st, vi, pkey, bit, pw, NULL, &tag, &own, K);
	if (last <= 0)
		return last ? XDP_ABORTED : XDP_DROP;

	/* The last addition of the round: this CPU alone completes the slot. */
	r = bpf_map_lookup_elem(&results, &pkey);
	if (!r)
		return XDP_ABORTED;
	if (complete_slot(pk, pw, r, pkey, tag, own, n, K))
		return XDP_ABORTED;
	/* a jumbo sum was published into the scratch copy: one helper call writes every buffer */
	if (!AGG_DIRECT(K) && bpf_xdp_store_bytes(ctx, SML_PAYLOAD_OFFSET, pl, K * 4))
		return XDP_ABORTED;
	if (job->flags & AGG_JOB_TREE) {
		/* the partial is stored; the parent's result for this round is still to be taken */
		__sync_fetch_and_and(&st->seen[vi], ~AGG_PARENT_BIT);
		st->up_round[vi] = round_key(pk);
		__sync_fetch_and_add(&st->up[vi], 1); /* barrier: partial and key before `up` */
		count(w->job, AGG_FORWARDED_UP);
		address_up(pk, job, g, vi);
		return AGG_TX(ctx);
	}
	__sync_fetch_and_add(&st->published[vi], 1);
	count(w->job, AGG_COMPLETED);
	return send_result(ctx, pk, job, w);
}

/* A dense job's packet of a jumbo size (K int32, more than AGG_DIRECT_MAX_ELEMS: copied through
 * scratch) from worker w for slot and version pkey (AGG_POOL_ENTRY): aggregate(), one
 * subprogram for the jumbo sizes. verifier: a global function, as sparse.h agg_sparse: checked
 * once, by itself, its loops all over map values, K bounded here one compare at a time; the
 * main function keeps the sizes read in place (the kernel's passes after the walk take time
 * with each instruction of it: the load's CPU 0.13 s with the jumbo sizes inline, 0.09 s
 * without). clang knows K is no size read in place after the second compare. */
__noinline int agg_jumbo(struct xdp_md *ctx, struct agg_job *job, struct agg_worker *w, u32 pkey,
			 u32 K)
{
	struct agg_pkt pk;

	if (!job || !w || K > AGG_MAX_ELEMS || !repoint(ctx, &pk))
		return XDP_ABORTED;
	barrier_var(K);
	if (AGG_DIRECT(K))
		return XDP_ABORTED;
	return aggregate(ctx, &pk, job, w, pkey >> 1, pkey & 1, K);
}

#endif
