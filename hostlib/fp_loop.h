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
#include "fp_util.h"

/* What the stream is (fixed for its life). */
typedef struct {
    int k, window, scaling_workers; /* int32 per packet, slots, float scaling's n */
    uint8_t type_size;              /* the first header byte: message type and size code */
    int slot_base;
    double rto_min, rto_max;
    int cwnd_fixed; /* 1: the congestion window is the slot window */
    int spin;       /* busy-poll at all (EngineConfig.spin) */
    int faults;     /* the Faults test hook is on */
    double send_loss, recv_loss, send_dup, recv_dup;
    uint64_t seed;
} StreamConfig;

/* The timers' and the window's state, kept across all-reduces. */
typedef struct {
    int have_rtt;
    double srtt, rttvar;
    double cwnd, ssthresh;
    int spin_credit;
} Congestion;

typedef struct {
    StreamConfig cfg;
    Congestion cc;
    Transport *t; /* owned: closed with the stream */
    int plen;
    uint64_t rng;     /* the Faults generator */
    double ftab[256]; /* scale factor of exponent E at index uint8(E) */
    double M;
    /* per slot, sized for the window */
    uint8_t *rows; /* window x plen: the packet in flight per slot */
    double *deadline, *sent_at, *rto;
    int32_t *tries;
    int64_t *pkt;           /* packet in each slot, -1 when none in flight */
    int64_t *ready;         /* per slot: the packet ready to go there, or -1 */
    int64_t *cand;          /* scratch: the ready packets of one send */
    int32_t *sendq;         /* slots to send in one call (2x for duplicates) */
    const uint8_t **txrows; /* the rows of one send (2x window) */
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

/* One all-reduce: its inputs, and the state of its packets. */
typedef struct {
    Stream *s;
    int is_float;
    const uint8_t *src; /* int32 or float32, L elements */
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
    int64_t nready;  /* packets whose slot is free, not sent yet */
    int64_t base;    /* the lowest packet without its result */
    int64_t recover; /* AIMD: no second halving before this packet */
    double next_deadline, last_progress;
    double batch_sample_at; /* RTT: send time of the newest sample this batch */
    double batch_sample;
    Counters c;
} Run;

enum { ST_DONE = 0, ST_STALLED = 1 };

/* Set up `s` over transport `t` (taken over). Returns 0, or -ENOMEM (t closed). */
int fp_stream_init(Stream *s, const StreamConfig *cfg, Transport *t);
void fp_stream_free(Stream *s);
/* Start run r of P packets over w slots (the caller filled the inputs: is_float, src, dst,
 * L, P, Pd, w, jn, versions, exps, agreed, state). */
void fp_run_start(Run *r, Stream *s);
/* Run it: ST_DONE, ST_STALLED (no result for `timeout` s), or -errno (-EINTR: a hook said
 * stop). */
int fp_run_loop(Run *r, double timeout, const LoopHooks *h);
/* After the loop (and after reading which slots are busy): no packet of it is in flight. */
void fp_run_end(Run *r);

#endif
