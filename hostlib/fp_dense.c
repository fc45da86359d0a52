/*
 * Dense all-reduces in the C fast path (hostlib/fp_dense.h): a packet's payload from its chunk,
 * and its result into the output.
 */
#include "fp_dense.h"

#include <string.h>

#include "fp_kernels.h"
#include "fp_wire.h"

static int64_t dense_start(Run *r)
{
    return r->P; /* every packet's result */
}

/* The wire layout: fp_run.h fp_header. */
static int dense_fill(Run *r, int64_t p, uint8_t *row)
{
    const DenseRun *d = r->rs;
    Stream *st = r->s;
    int k = st->cfg.k;
    uint8_t *vals = row + FP_VALUES_AT, *exp = row + FP_EXP_AT;
    fp_header(r, p, row);
    exp[1] = 0;
    if (!r->is_float) {
        exp[0] = 0;
        fp_ssize a = (fp_ssize)p * k, n = fp_chunk_len(r, p);
        bswap_copy(r->src + 4 * a, n, vals);
        if (n < k)
            memset(vals + 4 * n, 0, (size_t)(k - n) * 4);
        return st->plen;
    }
    exp[0] = (uint8_t)(p < d->Pd ? d->exps[p] : E_MIN);
    if (p < r->w) { /* the first window carries exponents only */
        memset(vals, 0, (size_t)k * 4);
        return st->plen;
    }
    int64_t c = p - r->w;
    fp_ssize n = fp_chunk_len(r, c), words = fp_words(st, n);
    int8_t E = d->agreed[c];
    /* |x| < 2^E keeps |x f| below M, except for values whose exponent was clipped at E_MAX:
     * the numpy engine clips once any agreed exponent reached E_MAX, which changes only
     * those chunks' values, so clipping exactly those gives the same bytes. */
    quantise(r->src + fp_elem_offset(r, (fp_ssize)c * st->ke), r->dtype, n, st->ftab[(uint8_t)E],
             E == E_MAX, st->M, st->cfg.pairs, vals);
    if (words < k)
        memset(vals + 4 * words, 0, (size_t)(k - words) * 4);
    return st->plen;
}

/* A result is packet tsi's when its header is the one we sent (not another all-reduce's, slot's
 * or version's). */
static int64_t dense_identify(Run *r, const uint8_t *buf, size_t len)
{
    (void)len; /* the loop passes whole rows only (varlen 0) */
    uint32_t tsi = load_be32(buf + 2);
    if (tsi >= (uint64_t)r->P) {
        r->c.stale++;
        return -1;
    }
    uint8_t h[8];
    fp_header(r, tsi, h);
    if (memcmp(h, buf, 8) != 0) {
        r->c.stale++;
        return -1;
    }
    return tsi;
}

static RoundStep dense_apply(Run *r, int64_t p, const uint8_t *buf)
{
    DenseRun *d = r->rs;
    Stream *st = r->s;
    /* its slot is free for the packet one window later */
    RoundStep step = {.next = p + r->w < r->P ? p + r->w : -1, .finished = 1};
    if (!r->is_float) {
        bswap_copy(buf + FP_VALUES_AT, fp_chunk_len(r, p), r->dst + 4 * (fp_ssize)p * st->ke);
        return step;
    }
    if (p < d->Pd)
        d->agreed[p] = (int8_t)buf[FP_EXP_AT]; /* the max of the workers' e0 for chunk p */
    if (p >= r->w) {
        int64_t c = p - r->w;
        dequantise(buf + FP_VALUES_AT, fp_chunk_len(r, c), st->ftab[(uint8_t)d->agreed[c]],
                   st->cfg.pairs, r->dtype, r->dst + fp_elem_offset(r, (fp_ssize)c * st->ke));
    }
    return step;
}

/* Every packet still to come is one without its result. */
static int64_t dense_left(const Run *r)
{
    return r->todo;
}

/* No `matches` (identify compared the whole header with the slot's packet), no `passed` (every
 * packet gets its result), fixed-length results. */
const RoundOps fp_dense_rounds = {.start = dense_start,
                                  .fill = dense_fill,
                                  .identify = dense_identify,
                                  .apply = dense_apply,
                                  .left = dense_left};
