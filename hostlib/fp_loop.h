/*
 * The stream loop of the C fast path: one worker's all-reduce as a self-clocked stream of
 * packets (docs/protocol.md section 4), the numpy loop's protocol (hostlib/numpy_loop.py) with
 * the same bytes. A Stream holds what outlives an all-reduce: its configuration, congestion
 * state (RTT estimate, window), the Faults generator, the per-slot buffers and its Transport.
 * A Run is one all-reduce on it. Nothing is global and nothing needs Python, so several
 * Streams (each with its own socket, slots and window) can run in threads at once.
 */
#ifndef HOSTLIB_FP_LOOP_H
#define HOSTLIB_FP_LOOP_H

#include <stdint.h>

#include "fp_counters.h"
#include "fp_io.h"
#include "fp_kernels.h"
#include "fp_util.h"
#include "fp_wire.h"

/* What the stream is (fixed for its life). */
typedef struct {
    int k, window, scaling_workers; /* int32 words per packet, slots, float scaling's n */
    int pairs;                      /* a 16-bit job: two elements a word (wire.pack_pairs) */
    uint8_t type_size; /* the first header byte: message type, width bit and size code */
    int slot_base;
    double rto_min, rto_max; /* the timer before a round trip is measured (and its floor's
                              * ceiling), and its ceiling (docs/protocol.md 4.4) */
    int cwnd_fixed;          /* 1: the congestion window is the slot window */
    int early_loss;          /* 1: losses found from later results (4.4), 0: timers only */
    double rto_floor;        /* with early_loss: the least timer once round trips are measured */
    double queue_delay;      /* a queue: srtt above min_rtt by this and by min_rtt, s */
    int spin;                /* busy-poll at all (EngineConfig.spin) */
    int faults;              /* the Faults test hook is on */
    double send_loss, recv_loss, send_dup, recv_dup;
    uint64_t seed;
} StreamConfig;

/* The timers' and the window's state, kept across all-reduces. */
typedef struct {
    int have_rtt;
    double srtt, rttvar;
    double min_rtt;  /* the least round trip of this all-reduce and the last (INFINITY: none) */
    double min_here; /* the least of this all-reduce's (a path that changes is followed) */
    double cwnd, ssthresh;
    int reo_mult;  /* the reordering allowance in quarters of min_rtt (grows on needless resends) */
    int reo_quiet; /* early resends since the allowance last grew (it shrinks back after 16) */
    int floor_mult; /* the timers' floor, times this: doubles on needless resends, halves after
                     * an all-reduce without one */
    int backoff;    /* new packets' timers, times this: doubles when timers expire, 1 again at
                     * the next round trip sampled (RFC 6298 5.7) */
    int spin_credit;
} Congestion;

typedef struct {
    StreamConfig cfg;
    Congestion cc;
    Transport *t;     /* owned: closed with the stream */
    int plen;         /* a dense packet's UDP payload */
    int ke;           /* elements per packet (a chunk, a sparse block): k, or 2k with pairs */
    int stride;       /* of rows: the longest packet, a sparse one with data (plen + 12) */
    uint64_t rng;     /* the Faults generator */
    double ftab[256]; /* scale factor of exponent E at index uint8(E) */
    double M;
    /* per slot, sized for the window */
    uint8_t *rows; /* window x stride: the packet in flight per slot */
    int *lens;     /* per slot: its packet's length */
    double *deadline, *sent_at, *rto;
    double *tx_at;    /* per slot: its packet's latest transmission (sent_at: its first) */
    uint8_t *early;   /* per slot: its deadline is the reordering allowance's, not its timer's */
    double *reuse_at; /* per slot: no new packet there before this (a late copy may come) */
    int32_t *tries;
    int64_t *pkt;           /* packet in each slot, -1 when none in flight */
    int64_t *ready;         /* per slot: the packet ready to go there, or -1 */
    int64_t *cand;          /* scratch: the ready packets of one send */
    int32_t *sendq;         /* slots to send in one call (2x for duplicates) */
    const uint8_t **txrows; /* the rows of one send (2x window) */
    int *txlens;            /* and their lengths */
} Stream;

/* What the loop calls back (with the stream's thread; the Python type takes the GIL there):
 * progress every `every` s (NULL: never), and interrupted when a wait was cut by a signal.
 * Each returns nonzero to stop the all-reduce (-EINTR). */
typedef struct {
    int (*progress)(void *ctx, int64_t ndone, uint64_t retransmissions);
    int (*interrupted)(void *ctx);
    void *ctx;
    double every;
} LoopHooks;

struct SparseRun; /* a sparse all-reduce's blocks and slots (fp_sparse.h) */

/* One all-reduce: its inputs, and the state of its packets. A dense one sends P packets,
 * packet p in slot p % w; a sparse one (sp not NULL) numbers its rounds the same way, round r
 * of slot s being "packet" r w + s, but which block a round is about comes from the previous
 * result, and a slot ends when a result says its column has no block left (fp_sparse.c). */
typedef struct Run {
    Stream *s;
    struct SparseRun *sp; /* NULL: dense */
    int is_float;
    int dtype;          /* of src and dst: FP_I32 (then is_float is 0), FP_F32, FP_BF16, FP_F16 */
    const uint8_t *src; /* L elements of dtype */
    uint8_t *dst;
    fp_ssize L;
    int64_t P, Pd, w;
    uint8_t jn;
    const uint8_t *versions; /* next version of each slot at the start */
    const int8_t *exps;      /* float: e0 of chunk c, Pd of them */
    int8_t *agreed;          /* float: E of chunk c from the results */
    /* per packet: 0 not sent yet, 1 in flight, 2 + n done (n: retransmissions that may still
     * prove spurious) */
    uint8_t *state;
    int64_t ndone, results_here, inflight, next_new;
    int64_t todo;      /* until 0: dense, packets without a result; sparse, slots not done */
    int fail;          /* a status that ends the loop at once (ST_SPARSE_BAD), 0 while none */
    int64_t nready;    /* packets whose slot is free, not sent yet */
    int64_t held;      /* of those, held back by their slot's reuse_at (send_ready) */
    double held_until; /* the first of those slots free again */
    int64_t base;      /* the lowest packet without its result */
    int64_t recover;   /* AIMD: no second halving before this packet */
    int64_t needless;  /* resends whose packet's result came sooner than a round trip after */
    double next_deadline, last_progress;
    double batch_sample_at; /* RTT: send time of the newest sample this batch */
    double batch_sample;
    /* early loss detection (docs/protocol.md 4.4): the newest transmission whose result came
     * (its send time and packet), and whether it moved since the last scan */
    double rack_xmit;
    int64_t rack_pkt;
    int rack_moved;
    Counters c;
} Run;

/* how fp_run_loop ends (or -errno); ST_SPARSE_BAD: a result the sparse rules cannot produce */
enum { ST_DONE = 0, ST_STALLED = 1, ST_SPARSE_BAD = 2 };

/* Set up `s` over transport `t` (taken over). Returns 0, or -ENOMEM (t closed). */
int fp_stream_init(Stream *s, const StreamConfig *cfg, Transport *t);
void fp_stream_free(Stream *s);
/* Start run r of P packets over w slots (the caller filled the inputs: is_float, dtype, src, dst,
 * L, P, Pd, w, jn, versions, exps, agreed, state; sp and its inputs for a sparse one). */
void fp_run_start(Run *r, Stream *s);
/* Run it: ST_DONE, ST_STALLED (no result for `timeout` s), or -errno (-EINTR: a hook said
 * stop). */
int fp_run_loop(Run *r, double timeout, const LoopHooks *h);
/* After the loop (and after reading which slots are busy): no packet of it is in flight. */
void fp_run_end(Run *r);

/* For the sparse rounds (fp_sparse.c), the dense loop's bookkeeping of a packet p: */
/* whether a result for p is a duplicate (counted, a spurious resend too) or echoes a packet
 * not sent yet (counted stale): 1 when it is either, 0 for a result to take */
int fp_run_seen(Run *r, int64_t p);
/* p's result taken at `now`: counters, its timer, the RTT sample and the congestion window */
void fp_run_took(Run *r, int64_t p, double now);
/* packet p is ready to go in its slot (after fp_run_took freed it) */
void fp_run_ready(Run *r, int64_t p);
/* base on to the lowest packet without its result (a sparse slot that is done has none) */
void fp_run_advance(Run *r);

/* Packet p's first 8 header bytes: type/size, job number, tsi, pool index (with version). The
 * wire layout (docs/protocol.md, p4app-switchML's: b5c74a0, dpdk_worker_thread_utils.inc
 * lines 132-134): byte 0 type/size, 1 job number, 2..5 tsi (big-endian), 6..7 pool index
 * (big-endian, bit 15 version), 8 e0 (int8), 9 e1 (0), then k big-endian int32. */
static inline void fp_header(const Run *r, int64_t p, uint8_t *h)
{
    const Stream *st = r->s;
    int64_t s = p % r->w;
    unsigned version = (r->versions[s] ^ (unsigned)((p / r->w) & 1)) & 1;
    unsigned slot = (unsigned)(st->cfg.slot_base + s) & FP_POOL_SLOT_MASK;
    uint16_t pool = (uint16_t)((version ? FP_POOL_VERSION_BIT : 0) | slot);
    h[0] = st->cfg.type_size;
    h[1] = r->jn;
    store_be32(h + 2, (uint32_t)p);
    h[6] = (uint8_t)(pool >> 8);
    h[7] = (uint8_t)pool;
}

/* Elements of chunk (or block) c of run r: the stream's ke, fewer in the last one. */
static inline fp_ssize fp_chunk_len(const Run *r, int64_t c)
{
    fp_ssize a = (fp_ssize)c * r->s->ke;
    return r->L - a < r->s->ke ? r->L - a : r->s->ke;
}

/* Where element a of a run's tensor (src or dst) starts. */
static inline fp_ssize fp_elem_offset(const Run *r, fp_ssize a)
{
    return a * (r->dtype == FP_BF16 || r->dtype == FP_F16 ? 2 : 4);
}

/* Payload words that n elements fill (the rest of a packet's k is zero padding). */
static inline fp_ssize fp_words(const Stream *st, fp_ssize n)
{
    return st->cfg.pairs ? (n + 1) / 2 : n;
}

#endif
