/*
 * Sparse all-reduces in the C fast path (docs/protocol.md section 8; the numpy reference is
 * hostlib/numpy_sparse.py, which sends the same bytes): the tensor's B blocks of k, slot s of
 * w walking its column s, s + w, s + 2w, ... one round per block that some worker has data in.
 * A round strategy (fp_run.h RoundOps): the stream loop (fp_loop.c) runs the rounds as packets,
 * round j of slot s being packet j w + s, with the timers, congestion window and duplicate
 * detection it gives every strategy; this unit builds a round's packet, checks a result and
 * decides where its slot goes next. It calls nothing in the loop.
 */
#ifndef HOSTLIB_FP_SPARSE_H
#define HOSTLIB_FP_SPARSE_H

#include <stdint.h>

#include "fp_run.h"

typedef struct SparseRun {
    /* inputs (hostlib.native_sparse: from _fastpath.block_scan, before the all-reduce) */
    int64_t B;              /* blocks: ceil(L / k) */
    const uint8_t *nonzero; /* per block: 1 where this worker's block has a non-zero element */
    const int8_t *exps;     /* float: each block's exponent; NULL for int32 */
    /* per block, set up by fp_sparse_start: the next non-zero block of its column (B: none) */
    uint32_t *next;
    /* per slot */
    int64_t *block;    /* its round's block */
    int64_t *rounds;   /* rounds it ran (the caller's buffer: the versions advance by them) */
    int8_t *agreed;    /* float: the exponent agreed for its block */
    uint8_t *announce; /* its round is the float announce round */
    uint8_t *done;
    int zero; /* the output is not the input: the blocks without data get zeros (take) */
    int pad;  /* empty contributions carry k zero int32: room for the result (JobSpec.pad_empty) */
    /* rounds still to come, at least: this worker's non-zero blocks not sent yet and the slots
     * not done (the rounds at blocks only other workers have are not known in advance) */
    int64_t left;
    /* outputs */
    int64_t union_blocks; /* results with data: the blocks some worker had data in */
    int64_t bad_slot, bad_from, bad_to, bad_mine; /* ST_REFUSED: the result refused */
} SparseRun;

/* Allocate sp's per-block and per-slot arrays for B blocks and w slots (rounds is the
 * caller's, w int64). Returns 0 or -ENOMEM. */
int fp_sparse_alloc(SparseRun *sp, int64_t B, int64_t w);
void fp_sparse_free(SparseRun *sp);
/* The rounds' packets: P for B blocks over w slots, so that packet numbers stay below it. */
int64_t fp_sparse_packets(int64_t B, int64_t w, int is_float);

/* The sparse strategy: Run.rs is a SparseRun (its inputs filled, fp_sparse_alloc'd), Run.P
 * fp_sparse_packets'. Its start (without the GIL) zeroes dst unless it is src, finds each
 * column's next non-zero blocks, and puts every slot at its first round; a result that would
 * skip this worker's data ends the run with ST_REFUSED (bad_* say which). */
extern const RoundOps fp_sparse_rounds;

#endif
