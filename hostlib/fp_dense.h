/*
 * Dense all-reduces in the C fast path: the round strategy (fp_run.h RoundOps) whose packet p
 * is chunk p of the tensor, as hostlib/numpy_dense.py sends it (tests/unit/test_fastpath.py compares
 * the bytes). An int32 all-reduce sends its Pd chunks; a float one first a window of
 * exponent-only packets (chunk c's e0 in packet c), then chunk c as packet c + w, scaled by the
 * exponent its result agreed (docs/protocol.md 5.2). Packet p's slot takes packet p + w next.
 */
#ifndef HOSTLIB_FP_DENSE_H
#define HOSTLIB_FP_DENSE_H

#include <stdint.h>

#include "fp_run.h"

typedef struct {
    int64_t Pd;         /* chunks: ceil(L / ke) */
    const int8_t *exps; /* float: e0 of chunk c, Pd of them */
    int8_t *agreed;     /* float: E of chunk c from the results */
} DenseRun;

/* The dense strategy: Run.rs is a DenseRun, Run.P is Pd (int32) or Pd + w (floats). */
extern const RoundOps fp_dense_rounds;

#endif
