/* Program-level constants of the XDP aggregator. Wire and ABI constants are generated from Python
 * (generated/wire.h, generated/abi.h); the loader sets the sizes that depend on the machine. */
#ifndef XDP_AGG_CONSTS_H
#define XDP_AGG_CONSTS_H

#ifndef AGG_POOL_SLOTS
#define AGG_POOL_SLOTS 1024 /* slots in the pool: the maps' sizes, set at load */
#endif
#ifndef AGG_NR_CPUS
#define AGG_NR_CPUS 2 /* possible CPUs: entries of the cpumap, set at load */
#endif

/* The pool's slots as the code compares with them: read-only data the loader sets before load
 * (xdp_switch/objload.py), which the verifier reads as the constant it is. */
const volatile u32 agg_pool_slots = AGG_POOL_SLOTS;
/* A bpf_loop() callback: a static function, whose reference (BPF_PSEUDO_FUNC) clang emits. */
#define AGG_CALLBACK_FN(name) static long name(u32 i, void *unused)

/* Packet sizes up to this many int32 are read and written in place (direct packet access: a frame
 * of 768 is 3124 bytes, inside the first buffer of every driver here, and veth and the test run
 * keep up to 3520 bytes there). Larger ones (the jumbo size codes, more than a page) are copied
 * through the per-CPU scratch map with bpf_xdp_load_bytes/bpf_xdp_store_bytes: the verifier
 * allows direct access only to the first buffer of a multi-buffer (frags) frame. */
#define AGG_DIRECT_MAX_ELEMS 768
#define AGG_DIRECT(K)	     ((K) <= AGG_DIRECT_MAX_ELEMS)

#define AGG_STATS_ROWS	((AGG_MAX_JOBS + 1) * AGG_NUM_REASONS) /* counters: (job or none) x reason */
#define AGG_WORKER_ROWS (AGG_MAX_JOBS * AGG_MAX_WORKERS)       /* per-worker counter rows */
#define AGG_EXP_NONE	(-128)				       /* neutral element of max over s8 */
#define AGG_PARENT_BIT	(1ULL << 63) /* tree jobs: the parent's result claimed, in `seen` */

#endif
