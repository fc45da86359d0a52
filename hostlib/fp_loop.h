/*
 * The stream loop of the C fast path: one worker's all-reduce as a self-clocked stream of
 * packets (docs/protocol.md section 4), the numpy loops' protocol (hostlib/numpy_*.py) with the
 * same bytes. A Stream (fp_run.h) holds what outlives an all-reduce: its configuration,
 * congestion state (RTT estimate, window), the Faults generator, the per-slot buffers and its
 * Transport. A Run is one all-reduce on it, run through a round strategy (fp_run.h RoundOps,
 * which the caller picks) that builds its packets and takes their results; the loop sends,
 * times, resends and deduplicates them alike for every strategy, and names none. Nothing is
 * global and nothing needs Python, so several Streams (each with its own socket, slots and
 * window) can run in threads at once.
 */
#ifndef HOSTLIB_FP_LOOP_H
#define HOSTLIB_FP_LOOP_H

#include "fp_run.h"

/* What the loop calls back (with the stream's thread; the Python type takes the GIL there):
 * progress every `every` s (NULL: never), and interrupted when a wait was cut by a signal.
 * Each returns nonzero to stop the all-reduce (-EINTR). */
typedef struct {
    int (*progress)(void *ctx, int64_t ndone, uint64_t retransmissions);
    int (*interrupted)(void *ctx);
    void *ctx;
    double every;
} LoopHooks;

/* Set up `s` over transport `t` (taken over). Returns 0, or -ENOMEM (t closed). */
int fp_stream_init(Stream *s, const StreamConfig *cfg, Transport *t);
void fp_stream_free(Stream *s);
/* Start run r of P packets over w slots (the caller filled the inputs: round and rs, the strategy
 * and its state, is_float, dtype, src, dst, L, P, w, jn, versions, state). */
void fp_run_start(Run *r, Stream *s);
/* Run it: ST_DONE, ST_STALLED (no result for `timeout` s), or -errno (-EINTR: a hook said
 * stop). */
int fp_run_loop(Run *r, double timeout, const LoopHooks *h);
/* After the loop (and after reading which slots are busy): no packet of it is in flight. */
void fp_run_end(Run *r);

#endif
