/*
 * Sparse all-reduces in the C fast path (hostlib/fp_sparse.h): the packets of a slot's rounds
 * and what a result does to its slot, as hostlib/numpy_sparse.py (the numpy reference; the
 * tests compare the bytes) and docs/protocol.md section 8.2 say:
 *
 * - the first round of slot s is at block s; for floats it is an announce round instead: an
 *   empty packet at s naming this worker's first non-zero block at or after s, and its
 *   exponent (section 8.2: a block's scale must be agreed before the block is sent);
 * - at block p a worker sends its block p (msg_type 2) when it is non-zero, else the empty
 *   msg_type 3; either way `next` is its first non-zero block of the column after p (B: none)
 *   and e0 the exponent of that block;
 * - the result carries the sum of the blocks sent (or nothing) and the smallest `next`, with
 *   the exponent agreed for it: the slot's next round is there, and at B the slot is done.
 */
#include "fp_sparse.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "fp_kernels.h"
#include "fp_wire.h"

int fp_sparse_alloc(SparseRun *sp, int64_t B, int64_t w)
{
    sp->B = B;
    sp->next = malloc((size_t)B * sizeof *sp->next);
    sp->block = calloc((size_t)w, sizeof *sp->block);
    sp->agreed = calloc((size_t)w, 1);
    sp->announce = calloc((size_t)w, 1);
    sp->done = calloc((size_t)w, 1);
    if (!sp->next || !sp->block || !sp->agreed || !sp->announce || !sp->done) {
        fp_sparse_free(sp);
        return -ENOMEM;
    }
    return 0;
}

void fp_sparse_free(SparseRun *sp)
{
    free(sp->next);
    free(sp->block);
    free(sp->agreed);
    free(sp->announce);
    free(sp->done);
    sp->next = NULL, sp->block = NULL, sp->agreed = NULL, sp->announce = NULL, sp->done = NULL;
}

int64_t fp_sparse_packets(int64_t B, int64_t w, int is_float)
{
    /* slot s visits at most its column's ceil((B - s) / w) blocks, after one announce round
     * for floats: round j is packet j w + s */
    return ((B + w - 1) / w + (is_float ? 1 : 0)) * w;
}

/* next[b] = the first non-zero block after b in b's column (b + w, b + 2w, ...), B if none:
 * one pass from the end, keeping each column's lowest non-zero block so far in last[]. Returns
 * the non-zero blocks. */
static int64_t find_columns(SparseRun *sp, int64_t w, int64_t *last)
{
    int64_t B = sp->B, n = 0;
    for (int64_t s = 0; s < w; s++)
        last[s] = B;
    for (int64_t b = B - 1, s = (B - 1) % w; b >= 0; b--, s = s ? s - 1 : w - 1) {
        sp->next[b] = (uint32_t)last[s];
        if (sp->nonzero[b]) {
            last[s] = b;
            n++;
        }
    }
    return n;
}

static int64_t sparse_start(Run *r)
{
    SparseRun *sp = r->rs;
    size_t bytes = (size_t)fp_elem_offset(r, r->L);
    /* blocks no round visits, and rounds whose result is empty, are zero on every worker: the
     * output gets zeros there as the slots pass them (take), unless the output is the input
     * (then they are zeros already: this worker's non-zero blocks are all visited, with data) */
    sp->zero = r->dst + bytes <= r->src || r->src + bytes <= r->dst;
    /* block[]: scratch until the slots start below */
    sp->left = find_columns(sp, r->w, sp->block) + r->w;
    for (int64_t s = 0; s < r->w; s++) {
        sp->block[s] = s;
        sp->rounds[s] = 1; /* the first round is ready (the loop's start) */
        sp->agreed[s] = 0;
        sp->announce[s] = (uint8_t)r->is_float;
        sp->done[s] = 0;
    }
    sp->union_blocks = 0;
    sp->bad_slot = sp->bad_from = sp->bad_to = sp->bad_mine = -1;
    return r->w; /* the slots, each done when a result says its column has no block left */
}

/* This worker's first non-zero block of p's column after p (at p or after it, with `at`). */
static inline int64_t next_nonzero(const SparseRun *sp, int64_t p, int at)
{
    return at && sp->nonzero[p] ? p : (int64_t)sp->next[p];
}

/* Block p's k big-endian int32 words into vals: its elements (the last block zero-padded),
 * float ones quantised with the exponent agreed for it (clipped at M where that was E_MAX, as
 * the dense strategy's fill explains), two a word in a 16-bit job. */
static void block_payload(const Run *r, int64_t p, int8_t E, uint8_t *vals)
{
    const Stream *st = r->s;
    int k = st->cfg.k;
    fp_ssize a = (fp_ssize)p * st->ke, n = fp_chunk_len(r, p), words = fp_words(st, n);
    if (r->is_float)
        quantise(r->src + fp_elem_offset(r, a), r->dtype, n, st->ftab[(uint8_t)E], E == E_MAX,
                 st->M, st->cfg.pairs, vals);
    else
        bswap_copy(r->src + 4 * a, n, vals);
    if (words < k)
        memset(vals + 4 * words, 0, (size_t)(k - words) * 4);
}

static int sparse_fill(Run *r, int64_t pk, uint8_t *row)
{
    SparseRun *sp = r->rs;
    int64_t s = pk % r->w, p = sp->block[s];
    int announce = sp->announce[s], data = !announce && sp->nonzero[p];
    int64_t q = next_nonzero(sp, p, announce);
    int type = data ? FP_MSG_TYPE_SPARSE : FP_MSG_TYPE_SPARSE_EMPTY;
    fp_header(r, pk, row);
    /* the job's width bit and size code */
    row[0] = (uint8_t)(type << 4 | (r->s->cfg.type_size & 0x0F));
    /* e0 names the exponent of the block the sender goes to next (-128 past the last one) */
    row[FP_EXP_AT] = (uint8_t)(!sp->exps ? 0 : q < sp->B ? sp->exps[q] : E_MIN);
    row[FP_EXP_AT + 1] = 0;
    store_be32(row + FP_SPARSE_AT, (uint32_t)p);
    store_be32(row + FP_SPARSE_AT + 4, (uint32_t)q);
    store_be32(row + FP_SPARSE_AT + 8, (uint32_t)sp->B);
    if (!data) {
        r->c.empty_sent++;
        if (!sp->pad)
            return FP_SPARSE_VALUES_AT;
        memset(row + FP_SPARSE_VALUES_AT, 0, (size_t)(4 * r->s->cfg.k)); /* never added */
        return FP_SPARSE_VALUES_AT + 4 * r->s->cfg.k;
    }
    block_payload(r, p, sp->agreed[s], row + FP_SPARSE_VALUES_AT);
    return FP_SPARSE_VALUES_AT + 4 * r->s->cfg.k;
}

/* Zeros into the output's blocks from, from + w, ... below `to` (of slot from % w's column):
 * blocks that the slot passed without data. Here rather than one memset of the whole output
 * before the all-reduce: each block is written once, data or zeros, and while the loop would
 * otherwise wait for results rather than before the first packet goes. */
static void zero_blocks(Run *r, int64_t from, int64_t to)
{
    for (int64_t b = from; b < to; b += r->w)
        memset(r->dst + fp_elem_offset(r, (fp_ssize)b * r->s->ke), 0,
               (size_t)fp_elem_offset(r, fp_chunk_len(r, b)));
}

/* Whether the result's next block q for slot s at block p is one the rules can produce
 * (docs/protocol.md 8.4): in the column, forward (or at p, after an announce round), and not
 * past this worker's own next non-zero block, which would skip its data (bad_* say so). */
static int next_ok(Run *r, int64_t s, int64_t p, int64_t q)
{
    SparseRun *sp = r->rs;
    int announce = sp->announce[s];
    int64_t mine = next_nonzero(sp, p, announce);
    int in_column = q == sp->B || q % r->w == s;
    int forward = q > p || (q == p && announce);
    if (in_column && forward && q <= mine)
        return 1;
    sp->bad_slot = s, sp->bad_from = p, sp->bad_to = q, sp->bad_mine = mine;
    return 0;
}

/* A result for packet pk (slot s at block p) taken: its sum into the output, and the slot on
 * to the result's next block (its next packet ready), or done (one of the run's todo). */
static RoundStep sparse_apply(Run *r, int64_t pk, const uint8_t *d)
{
    SparseRun *sp = r->rs;
    int64_t s = pk % r->w, p = sp->block[s], q = load_be32(d + FP_SPARSE_AT + 4);
    int data = d[0] >> 4 == FP_MSG_TYPE_SPARSE; /* else the empty type: identify checked */
    const Stream *st = r->s;
    RoundStep step = {.next = -1};
    sp->left -= !sp->announce[s] && sp->nonzero[p]; /* this worker's block p went */
    if (data) {
        fp_ssize a = (fp_ssize)p * st->ke, n = fp_chunk_len(r, p);
        const uint8_t *vals = d + FP_SPARSE_VALUES_AT;
        sp->union_blocks++;
        if (r->is_float)
            dequantise(vals, n, st->ftab[(uint8_t)sp->agreed[s]], st->cfg.pairs, r->dtype,
                       r->dst + fp_elem_offset(r, a));
        else
            bswap_copy(vals, n, r->dst + 4 * a);
    }
    if (!next_ok(r, s, p, q)) {
        step.fail = ST_REFUSED;
        return step;
    }
    if (sp->zero) /* block p unless it got data (an announce round has none), up to q */
        zero_blocks(r, data ? p + r->w : p, q);
    sp->announce[s] = 0;
    if (q >= sp->B) {
        sp->done[s] = 1;
        sp->left--;
        step.finished = 1;
        return step;
    }
    if (sp->exps) /* the exponent agreed for block q, among the workers with data there */
        sp->agreed[s] = (int8_t)d[FP_EXP_AT];
    sp->block[s] = q;
    sp->rounds[s]++;
    step.next = pk + r->w;
    return step;
}

/* The packet a datagram answers, or -1 (counted: malformed or stale): the checks of
 * hostlib/numpy_sparse.py _take before its duplicate detection, in its order. */
static int64_t sparse_identify(Run *r, const uint8_t *d, size_t len)
{
    int type = len ? d[0] >> 4 : 0, empty = type == FP_MSG_TYPE_SPARSE_EMPTY;
    size_t want = FP_SPARSE_VALUES_AT + (empty ? 0 : 4 * (size_t)r->s->cfg.k);
    if ((type != FP_MSG_TYPE_SPARSE && !empty) || len != want ||
        (d[0] & 0x0F) != (r->s->cfg.type_size & 0x0F)) { /* width bit, size code */
        r->c.malformed++;
        return -1;
    }
    uint32_t pk = load_be32(d + 2);
    if (d[1] != r->jn || pk >= (uint64_t)r->P) {
        r->c.stale++;
        return -1;
    }
    return pk;
}

/* After duplicate detection (a duplicate, or a round not started, was counted): whether the
 * result is of packet pk's round, the checks after it in hostlib/numpy_sparse.py _take. */
static int sparse_matches(Run *r, int64_t pk, const uint8_t *d)
{
    const SparseRun *sp = r->rs;
    uint8_t h[8];
    fp_header(r, pk, h);
    /* slot and version (bit 14 of the pool index is reserved: not compared, as numpy's), the
     * round's block, the tensor's */
    if (((d[6] ^ h[6]) & 0xBF) || d[7] != h[7] ||
        load_be32(d + FP_SPARSE_AT) != sp->block[pk % r->w] ||
        load_be32(d + FP_SPARSE_AT + 8) != (uint64_t)sp->B) {
        r->c.stale++;
        return 0;
    }
    return 1;
}

/* Whether packet p's slot is done (its later packet numbers are never used). */
static int sparse_passed(const Run *r, int64_t p)
{
    const SparseRun *sp = r->rs;
    return sp->done[p % r->w];
}

static int64_t sparse_left(const Run *r)
{
    const SparseRun *sp = r->rs;
    return sp->left;
}

const RoundOps fp_sparse_rounds = {
    .start = sparse_start,
    .fill = sparse_fill,
    .identify = sparse_identify,
    .matches = sparse_matches,
    .apply = sparse_apply,
    .passed = sparse_passed,
    .left = sparse_left,
    .varlen = 1,
};
