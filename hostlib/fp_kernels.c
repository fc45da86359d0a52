/*
 * The float and int kernels of the C fast path: quantise (float32 -> big-endian int32 at the
 * agreed exponent), dequantise, the byte-swapping copy of int32 payloads, and the chunk
 * exponents, with the semantics of hostlib/scaling.py: q = rint(x * f) in float64,
 * f = M * 2^-E, result = (float)(sum / f). AVX2 versions are compiled with a function target
 * attribute and chosen at run time (fp_set_simd), so one build runs on any x86-64; both give
 * identical bytes (tests/test_fastpath.py).
 */
#include "fp_kernels.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

/* the kernels in use: a process-wide choice made at import (and by tests), read-only while
 * loops run, so that loops in several threads share it safely */
static int use_avx2 = 0;

/* --- float and int kernels ---------------------------------------------------------------- */
/* double -> int32 as x86's cvtpd2dq does it (and numpy's cast there): out of range gives
 * INT32_MIN. Only a result whose agreed exponent is below the sender's own can get there. */
static inline int32_t to_i32(double q)
{
    if (!(q >= -2147483648.0 && q < 2147483648.0))
        return INT32_MIN;
    return (int32_t)q;
}

/* q = rint(x * f), clipped at +-M first when `clip`, big-endian into out (count elements). */
static void quant_scalar(const float *x, fp_ssize count, double f, int clip, double M, uint8_t *out)
{
    for (fp_ssize i = 0; i < count; i++) {
        double q = (double)x[i] * f;
        if (clip)
            q = q < -M ? -M : (q > M ? M : q);
        store_be32(out + 4 * i, (uint32_t)to_i32(rint(q))); /* rint: round half to even */
    }
}

/* (float)(sum / f) of count big-endian int32 sums. */
static void dequant_scalar(const uint8_t *in, fp_ssize count, double f, float *out)
{
    for (fp_ssize i = 0; i < count; i++)
        out[i] = (float)((double)(int32_t)load_be32(in + 4 * i) / f);
}

/* count int32 to/from big-endian (the same operation both ways). */
static void bswap_scalar(const uint8_t *in, fp_ssize count, uint8_t *out)
{
    for (fp_ssize i = 0; i < count; i++) {
        uint32_t v;
        memcpy(&v, in + 4 * i, 4);
        v = __builtin_bswap32(v);
        memcpy(out + 4 * i, &v, 4);
    }
}

/* max over count float32 of their bit patterns with the sign cleared: for non-negative floats
 * integer order is float order, so this is the bit pattern of max|x| (NaN and Inf compare
 * above every finite value). */
static uint32_t absmax_bits_scalar(const float *x, fp_ssize count)
{
    uint32_t m = 0;
    for (fp_ssize i = 0; i < count; i++) {
        uint32_t b;
        memcpy(&b, x + i, 4);
        b &= 0x7FFFFFFFu;
        m = b > m ? b : m;
    }
    return m;
}

#if HAVE_X86
#define BSWAP32_MASK                                                                               \
    _mm256_setr_epi8(3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12, 3, 2, 1, 0, 7, 6, 5, 4, \
                     11, 10, 9, 8, 15, 14, 13, 12)

__attribute__((target("avx2"))) static void quant_avx2(const float *x, fp_ssize count, double f,
                                                       int clip, double M, uint8_t *out)
{
    const __m256d vf = _mm256_set1_pd(f), hi = _mm256_set1_pd(M), lo = _mm256_set1_pd(-M);
    const __m256i sw = BSWAP32_MASK;
    fp_ssize i = 0;
    for (; i + 8 <= count; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256d a = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), vf);
        __m256d b = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)), vf);
        if (clip) {
            a = _mm256_min_pd(_mm256_max_pd(a, lo), hi);
            b = _mm256_min_pd(_mm256_max_pd(b, lo), hi);
        }
        /* round half to even, like rint in the default rounding mode */
        a = _mm256_round_pd(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        b = _mm256_round_pd(b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm256_cvtpd_epi32(a)),
                                            _mm256_cvtpd_epi32(b), 1);
        _mm256_storeu_si256((__m256i *)(out + 4 * i), _mm256_shuffle_epi8(q, sw));
    }
    quant_scalar(x + i, count - i, f, clip, M, out + 4 * i);
}

__attribute__((target("avx2"))) static void dequant_avx2(const uint8_t *in, fp_ssize count,
                                                         double f, float *out)
{
    const __m256d vf = _mm256_set1_pd(f);
    const __m256i sw = BSWAP32_MASK;
    fp_ssize i = 0;
    for (; i + 8 <= count; i += 8) {
        __m256i s = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(in + 4 * i)), sw);
        __m256d a = _mm256_div_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(s)), vf);
        __m256d b = _mm256_div_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(s, 1)), vf);
        _mm_storeu_ps(out + i, _mm256_cvtpd_ps(a)); /* rounds to nearest even */
        _mm_storeu_ps(out + i + 4, _mm256_cvtpd_ps(b));
    }
    dequant_scalar(in + 4 * i, count - i, f, out + i);
}

__attribute__((target("avx2"))) static void bswap_avx2(const uint8_t *in, fp_ssize count,
                                                       uint8_t *out)
{
    const __m256i sw = BSWAP32_MASK;
    fp_ssize i = 0;
    for (; i + 8 <= count; i += 8) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(in + 4 * i));
        _mm256_storeu_si256((__m256i *)(out + 4 * i), _mm256_shuffle_epi8(v, sw));
    }
    bswap_scalar(in + 4 * i, count - i, out + 4 * i);
}

__attribute__((target("avx2"))) static uint32_t absmax_bits_avx2(const float *x, fp_ssize count)
{
    const __m256i mask = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i m = _mm256_setzero_si256();
    fp_ssize i = 0;
    for (; i + 8 <= count; i += 8) {
        __m256i v = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i)), mask);
        m = _mm256_max_epi32(m, v); /* signed max is fine: the sign bit is cleared */
    }
    uint32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, m);
    uint32_t r = absmax_bits_scalar(x + i, count - i);
    for (int j = 0; j < 8; j++)
        r = lanes[j] > r ? lanes[j] : r;
    return r;
}
#endif

void quantise(const float *x, fp_ssize count, double f, int clip, double M, uint8_t *out)
{
#if HAVE_X86
    if (use_avx2) {
        quant_avx2(x, count, f, clip, M, out);
        return;
    }
#endif
    quant_scalar(x, count, f, clip, M, out);
}

void dequantise(const uint8_t *in, fp_ssize count, double f, float *out)
{
#if HAVE_X86
    if (use_avx2) {
        dequant_avx2(in, count, f, out);
        return;
    }
#endif
    dequant_scalar(in, count, f, out);
}

void bswap_copy(const uint8_t *in, fp_ssize count, uint8_t *out)
{
#if HAVE_X86
    if (use_avx2) {
        bswap_avx2(in, count, out);
        return;
    }
#endif
    bswap_scalar(in, count, out);
}

static inline uint32_t absmax_bits(const float *x, fp_ssize count)
{
#if HAVE_X86
    if (use_avx2)
        return absmax_bits_avx2(x, count);
#endif
    return absmax_bits_scalar(x, count);
}

/* scaling.chunk_exponents of one chunk from the bit pattern of its max|x| (finite):
 * e = floor(log2 max|x|) + 1 (frexp's exponent), ZERO_EXPONENT for zeros, clipped to int8. */
static int8_t exponent_of_bits(uint32_t b)
{
    int e;
    if (b == 0)
        return E_MIN;
    if (b < 0x00800000u) /* subnormal: b * 2^-149 */
        e = (32 - __builtin_clz(b)) - 149;
    else
        e = (int)(b >> 23) - 126; /* [2^(be-127), 2^(be-126)) */
    return (int8_t)(e < E_MIN ? E_MIN : (e > E_MAX ? E_MAX : e));
}

/* The chunks of x (k elements each, the last one possibly short): the exponent of each into e,
 * and into nz (unless NULL) whether it has a non-zero element (max|x| > 0: -0.0 is zero, as
 * numpy's x != 0 says). Returns -1, or the index of the first NaN/Inf element (then e and nz
 * are incomplete). */
static fp_ssize scan_floats(const float *x, fp_ssize L, int k, int8_t *e, uint8_t *nz)
{
    fp_ssize chunks = (L + k - 1) / k;
    for (fp_ssize c = 0; c < chunks; c++) {
        fp_ssize a = c * k, n = L - a < k ? L - a : k;
        uint32_t b = absmax_bits(x + a, n);
        if (b >= 0x7F800000u) {
            for (fp_ssize i = a; i < a + n; i++) {
                uint32_t v;
                memcpy(&v, x + i, 4);
                if ((v & 0x7FFFFFFFu) >= 0x7F800000u)
                    return i;
            }
        }
        e[c] = exponent_of_bits(b);
        if (nz)
            nz[c] = b != 0;
    }
    return -1;
}

fp_ssize chunk_exponents(const float *x, fp_ssize L, int k, int8_t *e)
{
    return scan_floats(x, L, k, e, NULL);
}

/* Whether any of n int32 is non-zero: eight at a time, stopping at the first (a block of
 * data usually shows it in its first bytes; a zero block is read once, at memory speed). */
static int any_nonzero(const uint8_t *x, fp_ssize n)
{
    fp_ssize i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v[4];
        memcpy(v, x + 4 * i, sizeof v);
        if (v[0] | v[1] | v[2] | v[3])
            return 1;
    }
    for (; i < n; i++) {
        uint32_t v;
        memcpy(&v, x + 4 * i, 4);
        if (v)
            return 1;
    }
    return 0;
}

fp_ssize block_scan(const void *x, fp_ssize L, int k, int is_float, uint8_t *nz, int8_t *e)
{
    if (is_float)
        return scan_floats(x, L, k, e, nz);
    for (fp_ssize c = 0, a = 0; a < L; c++, a += k)
        nz[c] = (uint8_t)any_nonzero((const uint8_t *)x + 4 * a, L - a < k ? L - a : k);
    return -1;
}

int fp_cpu_has_avx2(void)
{
#if HAVE_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

int fp_simd_avx2(void)
{
    return use_avx2;
}

int fp_set_simd_avx2(int on)
{
    if (on && !fp_cpu_has_avx2())
        return -1;
    use_avx2 = on;
    return 0;
}
