/*
 * The kernels of the C fast path (hostlib/fp_kernels.c): per-packet payload conversion and
 * the chunk exponents of float tensors, straight from and to the tensor's own element type.
 */
#ifndef HOSTLIB_FP_KERNELS_H
#define HOSTLIB_FP_KERNELS_H

#include <stdint.h>

#include "fp_util.h"

#define E_MIN (-128) /* the int8 exponent field (hostlib.scaling E_MIN, E_MAX) */
#define E_MAX 127

/* The element types of a run's source and result (hostlib.engine DTYPES names them);
 * the two 16-bit ones are read and written as uint16 bit patterns. */
enum { FP_I32 = 0, FP_F32 = 1, FP_BF16 = 2, FP_F16 = 3 };

static inline int fp_dtype_size(int dt)
{
    return dt == FP_BF16 || dt == FP_F16 ? 2 : 4;
}

/* q = rint(x * f) of count elements of x (of type dt), clipped at +-M first when `clip`, as
 * big-endian int32 words into out: one q a word, or with `pairs` (a 16-bit job) two, q[2i] *
 * 2^16 + q[2i + 1] (an odd count's last word has b = 0): ceil(count / 2) words. */
void quantise(const void *x, int dt, fp_ssize count, double f, int clip, double M, int pairs,
              uint8_t *out);
/* count elements of type dt into out from the big-endian int32 sums `in` (one a word, or with
 * `pairs` two: wire.unpack_pairs), each divided by f in float64, rounded to float32 and from
 * there to nearest even of dt. */
void dequantise(const uint8_t *in, fp_ssize count, double f, int pairs, int dt, void *out);
/* count int32 from big-endian to native order (or back: the same swap). */
void bswap_copy(const uint8_t *in, fp_ssize count, uint8_t *out);
/* Exponents of the chunks of x (L elements of float type dt, k each, the last chunk possibly
 * short) into e. Returns -1, or the index of the first NaN/Inf element (then e is
 * incomplete). */
fp_ssize chunk_exponents(const void *x, int dt, fp_ssize L, int k, int8_t *e);
/* The blocks of k elements of x (type dt, L elements, the last block possibly short) for a
 * sparse all-reduce: nz[b] = 1 where block b has a non-zero element, else 0; for floats also
 * e[b], its exponent (as chunk_exponents). Returns -1, or the index of the first NaN/Inf
 * element of a float x. */
fp_ssize block_scan(const void *x, int dt, fp_ssize L, int k, uint8_t *nz, int8_t *e);

int fp_cpu_has_avx2(void); /* AVX2 and F16C (every AVX2 CPU has both) */
int fp_simd_avx2(void);    /* 1: the AVX2 kernels are in use */
/* Choose the AVX2 kernels (on) or the scalar ones; -1 when the CPU has no AVX2. */
int fp_set_simd_avx2(int on);

#endif
