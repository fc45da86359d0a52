/*
 * The counters of one all-reduce of the C fast path, and their names, from one list: the
 * struct, its size check and the Python dict (hostlib/_fastpath.c counters_dict) all expand
 * FP_COUNTERS, so a counter added here is counted, reported and named at once.
 */
#ifndef HOSTLIB_FP_COUNTERS_H
#define HOSTLIB_FP_COUNTERS_H

#include <stdint.h>

/* X(name): hostlib.native_stream adds them into StreamState.stats (the socket's calls and
 * errors into the DatagramSocket's own counters) */
#define FP_COUNTERS(X) \
    X(packets_sent)    \
    X(retransmissions) \
    X(timeouts)        \
    X(early_losses)    \
    X(results)         \
    X(duplicates)      \
    X(stale)           \
    X(malformed)       \
    X(bytes_sent)      \
    X(bytes_received)  \
    X(send_calls)      \
    X(recv_calls)      \
    X(send_errors)     \
    X(fault_drops)     \
    X(spurious)        \
    X(empty_sent)

#define FP_COUNTER_FIELD(name) uint64_t name;
typedef struct {
    FP_COUNTERS(FP_COUNTER_FIELD)
} Counters;
#undef FP_COUNTER_FIELD

#define FP_COUNTER_ONE(name) +1
enum { FP_N_COUNTERS = 0 FP_COUNTERS(FP_COUNTER_ONE) };
#undef FP_COUNTER_ONE

_Static_assert(sizeof(Counters) == FP_N_COUNTERS * sizeof(uint64_t),
               "Counters must be exactly the uint64_t fields of FP_COUNTERS");

#endif
