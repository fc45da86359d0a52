/*
 * What the stream loop of the C fast path (fp_loop.h) and its round strategies share: the
 * Stream (what outlives an all-reduce), the Run (one all-reduce on it), and RoundOps, the
 * strategy that says what an all-reduce's packets are and what their results do -- a dense
 * one (fp_dense.c: packet p is chunk p) or a sparse one (fp_sparse.c: rounds that walk the
 * non-zero blocks). The loop owns the packets' timers, the congestion window, duplicate
 * detection and the Transport; a strategy owns its payloads and which packet comes next. The
 * strategies see the loop through these types and the inline helpers below only: they call
 * nothing in fp_loop.c, and the loop calls them through RoundOps only.
 */
#ifndef HOSTLIB_FP_RUN_H
#define HOSTLIB_FP_RUN_H

#include <stddef.h>
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
    int row_extra; /* row bytes beyond a dense packet's (the longest round's extra header) */
    double rto_min, rto_max; /* the timer before a round trip is measured (and its floor's
                              * ceiling), and its ceiling (docs/protocol.md 4.4) */
    int cwnd_fixed;          /* 1: the congestion window is the slot window */
    int early_loss;          /* 1: losses found from later results (4.4), 0: timers only */
    double rto_floor;        /* with early_loss: the least timer once round trips are measured */
    double queue_delay;      /* a queue: the standing round trip above min_rtt by this, s */
    int spin;                /* busy-poll at all (EngineConfig.spin) */
    int faults;              /* the Faults test hook is on */
    double send_loss, recv_loss, send_dup, recv_dup;
    uint64_t seed;
} StreamConfig;

#define FP_RECENT_RTTS 4 /* the standing round trip: the least of the last 4 samples */

/* The timers' and the window's state, kept across all-reduces. */
typedef struct {
    int have_rtt;
    double srtt, rttvar;
    double min_rtt;  /* the least round trip of this all-reduce and the last (INFINITY: none) */
    double min_here; /* the least of this all-reduce's (a path that changes is followed) */
    double recent[FP_RECENT_RTTS]; /* the last round trips sampled (fp_loop.c standing_rtt) */
    int recent_n;                  /* samples written to it, in all */
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
    int ke;           /* elements per packet (a chunk, a block): k, or 2k with pairs */
    int stride;       /* of rows: the longest packet (plen + cfg.row_extra) */
    uint64_t rng;     /* the Faults generator */
    double ftab[256]; /* scale factor of exponent E at index uint8(E) */
    double M;
    /* per slot, sized for the window */
    uint8_t *rows; /* window x stride: the packet in flight per slot */
    int *lens;     /* per slot: its packet's length */
    double *deadline, *sent_at, *rto;
    double *tx_at;    /* per slot: its packet's latest transmission (sent_at: its first) */
    uint8_t *early;   /* per slot: its deadline is the reordering allowance's, not its timer's */
    uint8_t *held;    /* per slot: its last round was resent or slow (loss_age waits longer) */
    double *reuse_at; /* per slot: no new packet there before this (a late copy may come) */
    int32_t *tries;
    int64_t *pkt;           /* packet in each slot, -1 when none in flight */
    int64_t *ready;         /* per slot: the packet ready to go there, or -1 */
    int64_t *cand;          /* scratch: the ready packets of one send */
    int32_t *sendq;         /* slots to send in one call (2x for duplicates) */
    const uint8_t **txrows; /* the rows of one send (2x window) */
    int *txlens;            /* and their lengths */
} Stream;

struct Run;

/* What one result did, as a strategy's apply says: the packet now ready in its slot (-1:
 * none), how many of the run's todo it finished, and a status that ends the run at once
 * (ST_REFUSED: a result the strategy's rules cannot produce; 0 while none). */
typedef struct {
    int64_t next;
    int finished;
    int fail;
} RoundStep;

/* A round strategy: the per-round operations of one kind of all-reduce, beside the
 * TransportOps that move its packets. Called with the loop's thread, without the GIL. */
typedef struct {
    /* Set the run's own state up (the output, the first round of each slot); the todo: how
     * many finished units (RoundStep.finished) end the run. */
    int64_t (*start)(struct Run *r);
    /* Build packet p into row (its slot's, stride bytes); its length. */
    int (*fill)(struct Run *r, int64_t p, uint8_t *row);
    /* The packet a datagram of len bytes answers, checked before duplicate detection, or -1
     * (counted: malformed or stale). */
    int64_t (*identify)(struct Run *r, const uint8_t *d, size_t len);
    /* After duplicate detection: whether it is a result of p's current round (0: counted
     * stale). NULL: identify checked all. */
    int (*matches)(struct Run *r, int64_t p, const uint8_t *d);
    /* p's result taken (the loop did its timer and window): into the output, and where its
     * slot goes next. */
    RoundStep (*apply)(struct Run *r, int64_t p, const uint8_t *d);
    /* Whether packet p will never be sent nor answered (its slot is done), for the lowest
     * packet without a result; NULL: every packet is answered. */
    int (*passed)(const struct Run *r, int64_t p);
    /* Packets still to come, at least (the loop busy-polls near the end). */
    int64_t (*left)(const struct Run *r);
    /* 1: results differ in length (each datagram of a GRO buffer goes to identify, the last
     * may be shorter); 0: every result is the stream's plen bytes. */
    int varlen;
} RoundOps;

/* One all-reduce: its inputs, and the state of its packets. Packet p goes in slot p % w; what
 * it carries and which packet follows it in its slot is the strategy's (RoundOps). */
typedef struct Run {
    Stream *s;
    const RoundOps *round; /* the strategy */
    void *rs;              /* its state (fp_dense.h DenseRun, fp_sparse.h SparseRun) */
    int is_float;
    int dtype;          /* of src and dst: FP_I32 (then is_float is 0), FP_F32, FP_BF16, FP_F16 */
    const uint8_t *src; /* L elements of dtype */
    uint8_t *dst;
    fp_ssize L;
    int64_t P, w; /* packet numbers stay below P */
    uint8_t jn;
    const uint8_t *versions; /* next version of each slot at the start */
    /* per packet: 0 not sent yet, 1 in flight, 2 + n done (n: retransmissions that may still
     * prove spurious) */
    uint8_t *state;
    int64_t ndone, results_here, inflight, next_new;
    int64_t todo;      /* until 0: what the strategy's start said, less what results finished */
    int fail;          /* a status that ends the loop at once (RoundStep.fail), 0 while none */
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

/* how fp_run_loop ends (or -errno); ST_REFUSED: a result the strategy's rules cannot produce */
enum { ST_DONE = 0, ST_STALLED = 1, ST_REFUSED = 2 };

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
