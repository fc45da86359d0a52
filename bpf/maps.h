/* The aggregator's maps. One line each; key -> value. The control plane (xdp_switch/ctl_maps.py)
 * reads and writes them through their pins; the structures are in generated/abi.h. */
#ifndef XDP_AGG_MAPS_H
#define XDP_AGG_MAPS_H

/* One line per map, kept so by hand. */
/* clang-format off */
AGG_ARRAY(jobs, struct agg_job, AGG_MAX_JOBS);                                  /* job id -> job */
AGG_HASH(workers, struct agg_worker_key, struct agg_worker, AGG_WORKER_ROWS);    /* (src, port) -> job, index */
AGG_ARRAY(slots, struct agg_slot, AGG_POOL_SLOTS);                              /* slot -> shared round state */
AGG_ARRAY(slot_owner, u32, AGG_POOL_SLOTS);                                     /* slot -> job id + 1, 0 = free */
AGG_ARRAY(results, struct agg_result, AGG_POOL_SLOTS * 2);                      /* slot*2+v -> published sum */
AGG_PERCPU_ARRAY(stats, u64, AGG_STATS_ROWS);                                   /* job*reasons+reason -> packets */
AGG_PERCPU_ARRAY(worker_stats, struct agg_worker_stats, AGG_WORKER_ROWS);       /* job*workers+index -> counters */
AGG_DEVMAP(tx_ports, AGG_MAX_PORTS);                                             /* switch mode: ports to broadcast to */
AGG_HASH(port_workers, struct agg_port_key, struct agg_port_worker, AGG_MAX_JOBS * AGG_MAX_PORTS); /* (ifindex, job) -> worker */
AGG_ARRAY(copy_dests, struct agg_port_worker, AGG_MAX_JOBS * AGG_MAX_WORKERS); /* unicast: job*workers+k -> where copy k goes */
/* clang-format on */

/* Unicast delivery (one-arm, docs/protocol.md 3.5): job -> a devmap of the job's n copies, every
 * entry the aggregator's interface with xdp_agg_copy as its egress program. A broadcast reaches
 * every entry of a devmap, so each job has a devmap of its own (the control plane makes it,
 * xdp_switch/loader.py job_copies_devmap). */
AGG_ARRAY_OF_DEVMAPS(job_copies, AGG_MAX_JOBS, AGG_MAX_WORKERS); /* job -> its devmap of copies */

/* Which copy of a unicast result xdp_agg_copy addresses next, on this CPU. The kernel gives a
 * devmap egress program no entry index, but a broadcast enqueues a frame's copies one after
 * another, in entry order, on the CPU that broadcast it, and the egress program runs over them
 * in that order (kernel 6.18 kernel/bpf/devmap.c dev_map_enqueue_multi, bq_enqueue,
 * bq_xmit_all): copy k of a result is the k-th frame with its identity in a row. A clone that
 * fails ends the broadcast, so the copies that leave are always the first ones. */
struct agg_copy_cursor {
	u64 result; /* the identity of the result being copied (copy_identity) */
	u32 job;    /* its job */
	u32 k;	    /* the copy addressed last */
};
AGG_PERCPU_ARRAY(copy_cursor, struct agg_copy_cursor, 1); /* 0 -> this CPU's copy in progress */

/* Never read or written by the program: it puts the types no other map value carries (the wire
 * headers, the partials) into the program's BTF, where
 * tests/root/test_codegen.py compares their layout with xdp_agg/proto/wire.py and abi.py. */
struct agg_btf_anchor {
	struct switchml_hdr sml;
	struct exponents_hdr exp;
	struct sparse_hdr sparse;
	struct agg_partial partial;
};
AGG_ARRAY(btf_anchor, struct agg_btf_anchor, 1);

/* Per-CPU partial sums (slot*2+v -> struct agg_partial), which the completing packet gathers
 * from the other CPUs with bpf_map_lookup_percpu_elem. */
AGG_PERCPU_ARRAY(partials, struct agg_partial, AGG_POOL_SLOTS * 2); /* slot*2+v -> partial */

/* Per-CPU scratch: the payload of a jumbo packet (size codes above AGG_DIRECT_MAX_ELEMS), copied
 * out of the frame's buffers with bpf_xdp_load_bytes so that the element loops read it with the
 * constant bounds the verifier checks, as they read a packet that fits one buffer. */
struct agg_scratch {
	__be32 data[AGG_MAX_ELEMS];
};
AGG_PERCPU_ARRAY(scratch, struct agg_scratch, 1); /* 0 -> this CPU's payload copy */
/* A contribution to a sparse job (sparse.h), as its packet says: what a partial keeps of it
 * besides the payload (aggregate.h fold_sparse). A dense packet of a sparse job names next 0, as
 * every other dense one of its round, so that its e0 is maxed in as a dense round's is. */
struct agg_contrib {
	u64 key;    /* the round it belongs to: kind, block and blocks (sparse.h) */
	u32 next;   /* the sender's next non-zero block (docs/protocol.md 8.1) */
	s32 e0, e1; /* its exponents */
	u32 empty;  /* an empty contribution (msg_type 3), header-only or padded: nothing added */
};
/* In a map value, not on the stack: the verifier does not track what a map value holds, so the
 * state machine after sparse.h read_contrib is one state for every kind of packet. */
AGG_PERCPU_ARRAY(contrib, struct agg_contrib, 1); /* 0 -> this CPU's sparse contribution */

#ifndef AGG_SPINLOCK
/* Where each contribution of a round was folded, by its arrival position in the round: the CPU
 * whose partial holds it. The completing CPU gathers those CPUs' partials and no others, so its
 * work grows with the job's workers, never with the machine's CPUs (aggregate.h, note_cpu). */
struct agg_contrib_cpus {
	u16 cpu[AGG_MAX_WORKERS]; /* arrival position -> CPU (NR_CPUS is at most 8192 in Linux) */
};
/* The completion in progress on this CPU, for the gather callback (bpf_loop passes it an index;
 * it takes its state from here, not from a context pointer). */
struct agg_gather {
	u64 tag;    /* the round's partial tag */
	u32 pkey;   /* slot*2+v */
	u32 me;	    /* the completing CPU: its own partial is added last */
	s32 e0, e1; /* exponents' running max (sparse: e0 of those naming the smallest next) */
	u32 others; /* whether another CPU's partial was gathered into the result */
	u32 sparse; /* a sparse job's round: next and has_data count (gather_exponents) */
	u32 next;   /* sparse: the smallest next so far */
	u32 elems;  /* the round's int32 per packet */
};
/* clang-format off */
AGG_ARRAY(contrib_cpus, struct agg_contrib_cpus, AGG_POOL_SLOTS * 2); /* slot*2+v -> CPU of each arrival of the round */
AGG_PERCPU_ARRAY(gather, struct agg_gather, 1);                         /* 0 -> this CPU's completion in progress */
/* clang-format on */
#endif

#ifdef AGG_SPINLOCK
/* Spin-lock variant: one shared partial per (slot, version), folded into under its lock. */
struct agg_locked_partial {
	struct bpf_spin_lock lock;
	u32 pad;
	struct agg_partial p;
};
AGG_ARRAY(locked_partials, struct agg_locked_partial,
	  AGG_POOL_SLOTS * 2); /* slot*2+v -> locked partial */
#endif

#endif
