/*
 * The kernels of the C fast path (hostlib/fp_kernels.c): per-packet payload conversion and
 * the chunk exponents of float tensors.
 */
#ifndef HOSTLIB_FP_KERNELS_H
#define HOSTLIB_FP_KERNELS_H

#include <stdint.h>

#include "fp_util.h"

#define E_MIN (-128) /* the int8 exponent field (hostlib.scaling E_MIN, E_MAX) */
#define E_MAX 127

/* q = rint(x * f), clipped at +-M first when `clip`, big-endian into out (count elements). */
void quantise(const float *x, fp_ssize count, double f, int clip, double M, uint8_t *out);
/* float32 (native order) of the big-endian int32 sums `in`, divided by f. */
void dequantise(const uint8_t *in, fp_ssize count, double f, float *out);
/* count int32 from big-endian to native order (or back: the same swap). */
void bswap_copy(const uint8_t *in, fp_ssize count, uint8_t *out);
/* Exponents of the chunks of x (k elements each, the last one possibly short) into e.
 * Returns -1, or the index of the first NaN/Inf element (then e is incomplete). */
fp_ssize chunk_exponents(const float *x, fp_ssize L, int k, int8_t *e);
/* The blocks of k elements of x (int32 or float32, L elements, the last block possibly short)
 * for a sparse all-reduce: nz[b] = 1 where block b has a non-zero element, else 0; for floats
 * also e[b], its exponent (as chunk_exponents). Returns -1, or the index of the first NaN/Inf
 * element of a float x. */
fp_ssize block_scan(const void *x, fp_ssize L, int k, int is_float, uint8_t *nz, int8_t *e);

int fp_cpu_has_avx2(void);
int fp_simd_avx2(void); /* 1: the AVX2 kernels are in use */
/* Choose the AVX2 kernels (on) or the scalar ones; -1 when the CPU has no AVX2. */
int fp_set_simd_avx2(int on);

#endif
