/*
 * The float and int kernels of the C fast path: quantise (float32, bfloat16 or float16 ->
 * big-endian int32 words at the agreed exponent, one element a word or, for a 16-bit job, a
 * pair a * 2^16 + b), dequantise (the words' sums back into the tensor's own type), the
 * byte-swapping copy of int32 payloads, and the chunk exponents, with the semantics of
 * hostlib/scaling.py: q = rint(x * f) in float64, f = M * 2^-E, result = (float)(sum / f),
 * then to the 16-bit type by rounding to nearest even. No float32 copy of a 16-bit tensor is
 * made: each element is widened in a register (bfloat16: a shift; float16: exactly, by F16C or
 * f16_to_f32_bits) and narrowed on the way out. AVX2 versions are compiled with a function
 * target attribute and chosen at run time (fp_set_simd), so one build runs on any x86-64;
 * both give identical bytes (tests/unit/test_fastpath.py).
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

/* --- 16-bit floats ------------------------------------------------------------------------ */
/* float16 -> float32 bits, exactly (every float16 is a float32), subnormals included. */
static inline uint32_t f16_to_f32_bits(uint16_t h)
{
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1F)
        return s | 0x7F800000u | (m << 13); /* Inf, NaN */
    if (e)
        return s | ((e + 112) << 23) | (m << 13);
    if (!m)
        return s;
    int sh = __builtin_clz(m) - 21; /* m * 2^-24, normalised: bit 10 set after the shift */
    m <<= sh;
    return s | ((uint32_t)(113 - sh) << 23) | ((m & 0x3FFu) << 13);
}

/* float32 bits -> float16, to nearest even, overflow to Inf, NaN a quiet NaN (as F16C's
 * vcvtps2ph and numpy's astype). Without branches on the value (results of 16-bit jobs mix
 * zeros and non-zeros at random, which a branchy routine mispredicts): the float unit rounds,
 * after scaling that puts float16's last mantissa bit at float32's (Maratyszcza's FP16
 * library, fp16_ieee_from_fp32_value). */
static inline uint16_t f32_bits_to_f16(uint32_t u)
{
    float f, base, bias_f;
    memcpy(&f, &u, 4);
    /* |f| scaled up by 2^112 and down by 2^-110: Inf above float16's range, else |f| * 4 */
    base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t shl1 = u + u, bias = shl1 & 0xFF000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias; /* float16's subnormals share one ulp */
    bias = (bias >> 1) + 0x07800000u;
    memcpy(&bias_f, &bias, 4);
    base += bias_f; /* the rounding: the bits below float16's ulp fall off */
    uint32_t bits;
    memcpy(&bits, &base, 4);
    uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    return (uint16_t)((u & 0x80000000u) >> 16) | (uint16_t)(shl1 > 0xFF000000u ? 0x7E00u : nonsign);
}

/* float32 bits -> bfloat16, to nearest even (ml_dtypes' astype); NaN kept quiet. */
static inline uint16_t f32_bits_to_bf16(uint32_t u)
{
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline uint16_t load_u16(const void *x, fp_ssize i)
{
    uint16_t h;
    memcpy(&h, (const uint8_t *)x + 2 * i, 2);
    return h;
}

/* element i of x (float type dt) as float32 bits */
static inline uint32_t load_bits(const void *x, int dt, fp_ssize i)
{
    uint32_t b;
    if (dt == FP_BF16)
        return (uint32_t)load_u16(x, i) << 16;
    if (dt == FP_F16)
        return f16_to_f32_bits(load_u16(x, i));
    memcpy(&b, (const uint8_t *)x + 4 * i, 4);
    return b;
}

static inline float load_float(const void *x, int dt, fp_ssize i)
{
    uint32_t b = load_bits(x, dt, i);
    float v;
    memcpy(&v, &b, 4);
    return v;
}

/* v into element i of out (float type dt), rounded to nearest even */
static inline void store_float(void *out, int dt, fp_ssize i, float v)
{
    uint32_t u;
    memcpy(&u, &v, 4);
    if (dt == FP_F32) {
        memcpy((uint8_t *)out + 4 * i, &v, 4);
        return;
    }
    uint16_t h = dt == FP_BF16 ? f32_bits_to_bf16(u) : f32_bits_to_f16(u);
    memcpy((uint8_t *)out + 2 * i, &h, 2);
}

/* --- float and int kernels ---------------------------------------------------------------- */
/* double -> int32 as x86's cvtpd2dq does it (and numpy's cast there): out of range gives
 * INT32_MIN. Only a result whose agreed exponent is below the sender's own can get there. */
static inline int32_t to_i32(double q)
{
    if (!(q >= -2147483648.0 && q < 2147483648.0))
        return INT32_MIN;
    return (int32_t)q;
}

/* rint(q), round half to even, without libm's call (x86-64's baseline has no roundsd): adding
 * and taking away 1.5 * 2^52 leaves no bits below the units, rounded by the float unit in its
 * default mode. Exact for |q| < 2^51; beyond (never within +-M), a value to_i32 still maps to
 * INT32_MIN, as it does rint's. */
static inline double round_even(double q)
{
    const double magic = 0x1.8p52; /* IEEE arithmetic (no -ffast-math): not folded into q */
    return (q + magic) - magic;
}

static inline int32_t quant_one(float x, double f, int clip, double M)
{
    double q = (double)x * f;
    if (clip)
        q = q < -M ? -M : (q > M ? M : q);
    return to_i32(round_even(q));
}

/* a 16-bit job's word: a * 2^16 + b, wrapping as numpy's int32 arithmetic (wire.pack_pairs) */
static inline uint32_t pack_pair(int32_t a, int32_t b)
{
    return ((uint32_t)a << 16) + (uint32_t)b;
}

/* and back: b the low half as int16, a = (w - b) / 2^16 (wire.unpack_pairs) */
static inline void unpack_pair(uint32_t w, int32_t *a, int32_t *b)
{
    *b = (int16_t)(w & 0xFFFFu);
    *a = (int32_t)(w - (uint32_t)*b) >> 16;
}

/* The kernels' loops, with dt and pairs constant in each instance (quant_scalar and
 * dequant_scalar, and their AVX2 twins, call them so), so that the compiler takes the type's
 * branches out of the loop. */
#define KERNEL_INLINE __attribute__((always_inline)) static inline
/* one instance per (type, width): X(dt, pairs) */
#define FP_INSTANCES(X) \
    X(FP_F32, 0) X(FP_F32, 1) X(FP_BF16, 0) X(FP_BF16, 1) X(FP_F16, 0) X(FP_F16, 1)
/* A dispatcher's body is FP_INSTANCES(FP_DISPATCH_CASE), with FP_CALL(DT, PAIRS) defined as the
 * call of its kernel's instance: each case runs that instance when dt and pairs are its own. */
#define FP_DISPATCH_CASE(DT, PAIRS)   \
    if (dt == DT && pairs == PAIRS) { \
        FP_CALL(DT, PAIRS);           \
        return;                       \
    }

KERNEL_INLINE void quant_scalar_of(const void *x, int dt, fp_ssize count, double f, int clip,
                                   double M, int pairs, uint8_t *out)
{
    if (!pairs) {
        for (fp_ssize i = 0; i < count; i++)
            store_be32(out + 4 * i, (uint32_t)quant_one(load_float(x, dt, i), f, clip, M));
        return;
    }
    for (fp_ssize i = 0; i < count; i += 2) {
        int32_t a = quant_one(load_float(x, dt, i), f, clip, M);
        int32_t b = i + 1 < count ? quant_one(load_float(x, dt, i + 1), f, clip, M) : 0;
        store_be32(out + 2 * i, pack_pair(a, b));
    }
}

/* (sum / f) of count elements from big-endian int32 words (pairs: two a word), into dt. */
KERNEL_INLINE void dequant_scalar_of(const uint8_t *in, fp_ssize count, double f, int pairs, int dt,
                                     void *out)
{
    if (!pairs) {
        for (fp_ssize i = 0; i < count; i++)
            store_float(out, dt, i, (float)((double)(int32_t)load_be32(in + 4 * i) / f));
        return;
    }
    for (fp_ssize i = 0; i < count; i += 2) {
        int32_t a, b;
        unpack_pair(load_be32(in + 2 * i), &a, &b);
        store_float(out, dt, i, (float)((double)a / f));
        if (i + 1 < count)
            store_float(out, dt, i + 1, (float)((double)b / f));
    }
}

static void quant_scalar(const void *x, int dt, fp_ssize count, double f, int clip, double M,
                         int pairs, uint8_t *out)
{
#define FP_CALL(DT, PAIRS) quant_scalar_of(x, DT, count, f, clip, M, PAIRS, out)
    FP_INSTANCES(FP_DISPATCH_CASE);
#undef FP_CALL
}

static void dequant_scalar(const uint8_t *in, fp_ssize count, double f, int pairs, int dt,
                           void *out)
{
#define FP_CALL(DT, PAIRS) dequant_scalar_of(in, count, f, PAIRS, DT, out)
    FP_INSTANCES(FP_DISPATCH_CASE);
#undef FP_CALL
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

/* max over count elements of x of their bit patterns with the sign cleared, as float32 bits:
 * for non-negative floats integer order is float order (float32's, and each 16-bit type's
 * own), so this is the bit pattern of max|x| (NaN and Inf compare above every finite value);
 * a 16-bit maximum is widened once, at the end. */
static uint32_t absmax_bits_scalar(const void *x, int dt, fp_ssize count)
{
    uint32_t m = 0;
    if (dt == FP_F32) {
        for (fp_ssize i = 0; i < count; i++) {
            uint32_t b = load_bits(x, dt, i) & 0x7FFFFFFFu;
            m = b > m ? b : m;
        }
        return m;
    }
    for (fp_ssize i = 0; i < count; i++) {
        uint32_t h = load_u16(x, i) & 0x7FFFu;
        m = h > m ? h : m;
    }
    return dt == FP_BF16 ? m << 16 : f16_to_f32_bits((uint16_t)m);
}

#if HAVE_X86
#define AVX2        __attribute__((target("avx2,f16c")))
#define AVX2_INLINE __attribute__((target("avx2,f16c"), always_inline)) static inline
#define BSWAP32_MASK                                                                               \
    _mm256_setr_epi8(3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12, 3, 2, 1, 0, 7, 6, 5, 4, \
                     11, 10, 9, 8, 15, 14, 13, 12)

/* elements i..i+7 of x (float type dt) as float32: bfloat16 by a shift, float16 by F16C */
AVX2_INLINE __m256 load8(const void *x, int dt, fp_ssize i)
{
    if (dt == FP_F32)
        return _mm256_loadu_ps((const float *)x + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint8_t *)x + 2 * i));
    if (dt == FP_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* v into elements i..i+7 of out (float type dt), rounded to nearest even as store_float */
AVX2_INLINE void store8(void *out, int dt, fp_ssize i, __m256 v)
{
    if (dt == FP_F32) {
        _mm256_storeu_ps((float *)out + i, v);
        return;
    }
    __m128i *to = (__m128i *)((uint8_t *)out + 2 * i);
    if (dt == FP_F16) {
        _mm_storeu_si128(to, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
        return;
    }
    /* bfloat16: no NaN here (a sum over a finite scale factor), so only the rounding */
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb),
                          16);
    u = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08); /* lanes 0 and 2 */
    _mm_storeu_si128(to, _mm256_castsi256_si128(u));
}

/* q = rint(v * f) of 8 floats (clipped at +-M when clip), in order */
AVX2_INLINE __m256i quant8(__m256 v, __m256d vf, int clip, __m256d lo, __m256d hi)
{
    __m256d a = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), vf);
    __m256d b = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)), vf);
    if (clip) {
        a = _mm256_min_pd(_mm256_max_pd(a, lo), hi);
        b = _mm256_min_pd(_mm256_max_pd(b, lo), hi);
    }
    /* round half to even, like rint in the default rounding mode */
    a = _mm256_round_pd(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    b = _mm256_round_pd(b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm256_cvtpd_epi32(a)),
                                   _mm256_cvtpd_epi32(b), 1);
}

/* the 8 words q[2j] * 2^16 + q[2j + 1] of 16 quantised elements q (0..7) and r (8..15) */
AVX2_INLINE __m256i pack8(__m256i q, __m256i r)
{
    /* in the even lanes: each pair's word (a << 16 plus b, the odd lane shifted down) */
    __m256i wq = _mm256_add_epi32(_mm256_slli_epi32(q, 16), _mm256_srli_epi64(q, 32));
    __m256i wr = _mm256_add_epi32(_mm256_slli_epi32(r, 16), _mm256_srli_epi64(r, 32));
    __m256i w = _mm256_blend_epi32(wq, _mm256_slli_epi64(wr, 32), 0xAA); /* w0 w4 w1 w5 ... */
    return _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
}

/* (float)(s / f) of 8 int32 */
AVX2_INLINE __m256 dequant8(__m256i s, __m256d vf)
{
    __m256d a = _mm256_div_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(s)), vf);
    __m256d b = _mm256_div_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(s, 1)), vf);
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm256_cvtpd_ps(a)), _mm256_cvtpd_ps(b),
                                1); /* each rounds to nearest even */
}

/* quant_scalar_of and dequant_scalar_of's twins (FP_INSTANCES of each) */
AVX2_INLINE void quant_avx2_of(const void *x, int dt, fp_ssize count, double f, int clip, double M,
                               int pairs, uint8_t *out)
{
    const __m256d vf = _mm256_set1_pd(f), hi = _mm256_set1_pd(M), lo = _mm256_set1_pd(-M);
    const __m256i sw = BSWAP32_MASK;
    fp_ssize i = 0;
    if (pairs) {
        for (; i + 16 <= count; i += 16) {
            __m256i q = quant8(load8(x, dt, i), vf, clip, lo, hi);
            __m256i r = quant8(load8(x, dt, i + 8), vf, clip, lo, hi);
            _mm256_storeu_si256((__m256i *)(out + 2 * i), _mm256_shuffle_epi8(pack8(q, r), sw));
        }
        quant_scalar((const uint8_t *)x + i * fp_dtype_size(dt), dt, count - i, f, clip, M, 1,
                     out + 2 * i);
        return;
    }
    for (; i + 8 <= count; i += 8) {
        __m256i q = quant8(load8(x, dt, i), vf, clip, lo, hi);
        _mm256_storeu_si256((__m256i *)(out + 4 * i), _mm256_shuffle_epi8(q, sw));
    }
    quant_scalar((const uint8_t *)x + i * fp_dtype_size(dt), dt, count - i, f, clip, M, 0,
                 out + 4 * i);
}

AVX2_INLINE void dequant_avx2_of(const uint8_t *in, fp_ssize count, double f, int pairs, int dt,
                                 void *out)
{
    const __m256d vf = _mm256_set1_pd(f);
    const __m256i sw = BSWAP32_MASK;
    fp_ssize i = 0;
    if (pairs) {
        for (; i + 16 <= count; i += 16) {
            __m256i w = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(in + 2 * i)), sw);
            __m256i b = _mm256_srai_epi32(_mm256_slli_epi32(w, 16), 16);
            __m256i a = _mm256_srai_epi32(_mm256_sub_epi32(w, b), 16);
            __m256i lo = _mm256_unpacklo_epi32(a, b), hi = _mm256_unpackhi_epi32(a, b);
            store8(out, dt, i, dequant8(_mm256_permute2x128_si256(lo, hi, 0x20), vf));
            store8(out, dt, i + 8, dequant8(_mm256_permute2x128_si256(lo, hi, 0x31), vf));
        }
        dequant_scalar(in + 2 * i, count - i, f, 1, dt, (uint8_t *)out + i * fp_dtype_size(dt));
        return;
    }
    for (; i + 8 <= count; i += 8) {
        __m256i s = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(in + 4 * i)), sw);
        store8(out, dt, i, dequant8(s, vf));
    }
    dequant_scalar(in + 4 * i, count - i, f, 0, dt, (uint8_t *)out + i * fp_dtype_size(dt));
}

AVX2 static void quant_avx2(const void *x, int dt, fp_ssize count, double f, int clip, double M,
                            int pairs, uint8_t *out)
{
#define FP_CALL(DT, PAIRS) quant_avx2_of(x, DT, count, f, clip, M, PAIRS, out)
    FP_INSTANCES(FP_DISPATCH_CASE);
#undef FP_CALL
}

AVX2 static void dequant_avx2(const uint8_t *in, fp_ssize count, double f, int pairs, int dt,
                              void *out)
{
#define FP_CALL(DT, PAIRS) dequant_avx2_of(in, count, f, PAIRS, DT, out)
    FP_INSTANCES(FP_DISPATCH_CASE);
#undef FP_CALL
}

AVX2 static void bswap_avx2(const uint8_t *in, fp_ssize count, uint8_t *out)
{
    const __m256i sw = BSWAP32_MASK;
    fp_ssize i = 0;
    for (; i + 8 <= count; i += 8) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(in + 4 * i));
        _mm256_storeu_si256((__m256i *)(out + 4 * i), _mm256_shuffle_epi8(v, sw));
    }
    bswap_scalar(in + 4 * i, count - i, out + 4 * i);
}

AVX2 static uint32_t absmax_bits_avx2(const void *x, int dt, fp_ssize count)
{
    fp_ssize i = 0;
    if (dt == FP_F32) {
        const __m256i mask = _mm256_set1_epi32(0x7FFFFFFF);
        __m256i m = _mm256_setzero_si256();
        for (; i + 8 <= count; i += 8) {
            __m256i v = _mm256_loadu_si256((const __m256i *)((const float *)x + i));
            m = _mm256_max_epi32(m, _mm256_and_si256(v, mask)); /* the sign bit is cleared */
        }
        uint32_t lanes[8], r = absmax_bits_scalar((const float *)x + i, dt, count - i);
        _mm256_storeu_si256((__m256i *)lanes, m);
        for (int j = 0; j < 8; j++)
            r = lanes[j] > r ? lanes[j] : r;
        return r;
    }
    const __m256i mask = _mm256_set1_epi16(0x7FFF);
    __m256i m = _mm256_setzero_si256();
    for (; i + 16 <= count; i += 16) {
        __m256i v = _mm256_loadu_si256((const __m256i *)((const uint8_t *)x + 2 * i));
        m = _mm256_max_epu16(m, _mm256_and_si256(v, mask));
    }
    uint16_t lanes[16];
    _mm256_storeu_si256((__m256i *)lanes, m);
    uint32_t h = 0;
    for (int j = 0; j < 16; j++)
        h = lanes[j] > h ? lanes[j] : h;
    h = dt == FP_BF16 ? h << 16 : f16_to_f32_bits((uint16_t)h); /* as absmax_bits_scalar's */
    uint32_t r = absmax_bits_scalar((const uint8_t *)x + 2 * i, dt, count - i);
    return r > h ? r : h;
}
#endif

void quantise(const void *x, int dt, fp_ssize count, double f, int clip, double M, int pairs,
              uint8_t *out)
{
#if HAVE_X86
    if (use_avx2) {
        quant_avx2(x, dt, count, f, clip, M, pairs, out);
        return;
    }
#endif
    quant_scalar(x, dt, count, f, clip, M, pairs, out);
}

void dequantise(const uint8_t *in, fp_ssize count, double f, int pairs, int dt, void *out)
{
#if HAVE_X86
    if (use_avx2) {
        dequant_avx2(in, count, f, pairs, dt, out);
        return;
    }
#endif
    dequant_scalar(in, count, f, pairs, dt, out);
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

static inline uint32_t absmax_bits(const void *x, int dt, fp_ssize count)
{
#if HAVE_X86
    if (use_avx2)
        return absmax_bits_avx2(x, dt, count);
#endif
    return absmax_bits_scalar(x, dt, count);
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
static fp_ssize scan_floats(const void *x, int dt, fp_ssize L, int k, int8_t *e, uint8_t *nz)
{
    fp_ssize chunks = (L + k - 1) / k;
    int size = fp_dtype_size(dt);
    for (fp_ssize c = 0; c < chunks; c++) {
        fp_ssize a = c * k, n = L - a < k ? L - a : k;
        uint32_t b = absmax_bits((const uint8_t *)x + a * size, dt, n);
        if (b >= 0x7F800000u) {
            for (fp_ssize i = a; i < a + n; i++)
                if ((load_bits(x, dt, i) & 0x7FFFFFFFu) >= 0x7F800000u)
                    return i;
        }
        e[c] = exponent_of_bits(b);
        if (nz)
            nz[c] = b != 0;
    }
    return -1;
}

fp_ssize chunk_exponents(const void *x, int dt, fp_ssize L, int k, int8_t *e)
{
    return scan_floats(x, dt, L, k, e, NULL);
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

fp_ssize block_scan(const void *x, int dt, fp_ssize L, int k, uint8_t *nz, int8_t *e)
{
    if (dt != FP_I32)
        return scan_floats(x, dt, L, k, e, nz);
    for (fp_ssize c = 0, a = 0; a < L; c++, a += k)
        nz[c] = (uint8_t)any_nonzero((const uint8_t *)x + 4 * a, L - a < k ? L - a : k);
    return -1;
}

int fp_cpu_has_avx2(void)
{
#if HAVE_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
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
