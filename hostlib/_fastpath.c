/*
 * hostlib._fastpath: the native per-packet loop of the host library (issue 10, part 3).
 *
 * The numpy loop (hostlib/numpy_loop.py, run by hostlib.engine.StreamEngine) is the reference:
 * it moves one all-reduce as a self-clocked stream of packets with numpy, and pays tens of
 * microseconds of interpreter and numpy call overhead per batch. This module runs the same stream in C with the GIL released:
 * one Engine.allreduce() call builds the packets in place (headers, quantise or byte-swap into
 * the slot rows), sends them with sendmmsg + UDP GSO, receives with recvmmsg (+ UDP GRO),
 * validates and deduplicates the results, writes them into the output, runs the per-packet
 * timers (RFC 6298 estimate, Karn's rule, exponential back-off) and a congestion window (AIMD),
 * and returns when the all-reduce is done or stalled. It sends exactly the bytes the numpy
 * engine sends (tests/test_fastpath.py compares them), with the same float semantics as
 * hostlib/scaling.py: q = rint(x * f) in float64, f = M * 2^-E, result = (float)(sum / f).
 *
 * Wire layout (aggproto/wire.py; hostlib.native_loop checks VALUES_AT and EXP_LEN against it):
 *   byte 0 type/size, 1 job number, 2..5 tsi (big-endian), 6..7 pool index (big-endian,
 *   bit 15 version), 8 e0 (int8), 9 e1 (0), then k big-endian int32: p4app-switchML's order
 *   (b5c74a0, dpdk_worker_thread_utils.inc lines 132-134), the exponents before the payload.
 *
 * Plain CPython C API, Linux only (sendmmsg, recvmmsg, UDP_SEGMENT/UDP_GRO). AVX2 code is
 * compiled with a function target attribute and chosen at run time, so one build runs on any
 * x86-64; elsewhere only the scalar code exists. Both give identical bytes.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_link.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "_xsk.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif

#define EXP_AT           8 /* the exponent header (e0, e1) follows the SwitchML header */
#define EXP_LEN          2
#define VALUES_AT        (EXP_AT + EXP_LEN) /* the payload follows the exponent header */
#define E_MIN            (-128)
#define E_MAX            127
#define MAX_GSO_SEGMENTS 64 /* UDP_MAX_SEGMENTS of older kernels */
#define MAX_GSO_BYTES    (65507 - 8)
#define RECV_SLOT        (65536 + 4096) /* one GRO buffer: at most one 64 KiB datagram */
#define RECV_MSGS_GRO    32
#define RECV_MSGS_PLAIN  256
/* Busy-polling, as NumpyLoop._spin (hostlib/numpy_loop.py): while at most SPIN_OUTSTANDING
 * packets of the all-reduce are outstanding, for at most SPIN_TIME s; credit as there. Off with
 * EngineConfig.spin (XDP_AGG_SPIN=0). */
#define SPIN_OUTSTANDING 64
#define SPIN_TIME        60e-6
#define SPIN_PENALTY     2
#define SPIN_CREDIT_MAX  8
#define SPIN_BACKOFF     200
/* The drain loop hands over to sending once this many packets are ready, so that a long
 * burst of results does not let the pipe run dry. */
#define SEND_READY_AT 64

static int use_avx2 = 0; /* chosen at import; set_simd() switches it for tests */

/* --- small helpers ------------------------------------------------------------------------ */
static inline double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* the clock of Python's time.monotonic() */
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline uint32_t load_be32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return ntohl(v);
}

static inline void store_be32(uint8_t *p, uint32_t v)
{
    v = htonl(v);
    memcpy(p, &v, 4);
}

/* splitmix64: the Faults test hook's seeded PRNG (it need not match numpy's stream). */
static inline uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline double rng_uniform(uint64_t *s)
{
    return (double)(rng_next(s) >> 11) * (1.0 / 9007199254740992.0);
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

/* q = rint(x * f), clipped at +-M first when `clip`, big-endian into out (count elements). */
static void quant_scalar(const float *x, Py_ssize_t count, double f, int clip, double M,
                         uint8_t *out)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        double q = (double)x[i] * f;
        if (clip)
            q = q < -M ? -M : (q > M ? M : q);
        store_be32(out + 4 * i, (uint32_t)to_i32(rint(q))); /* rint: round half to even */
    }
}

/* (float)(sum / f) of count big-endian int32 sums. */
static void dequant_scalar(const uint8_t *in, Py_ssize_t count, double f, float *out)
{
    for (Py_ssize_t i = 0; i < count; i++)
        out[i] = (float)((double)(int32_t)load_be32(in + 4 * i) / f);
}

/* count int32 to/from big-endian (the same operation both ways). */
static void bswap_scalar(const uint8_t *in, Py_ssize_t count, uint8_t *out)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        uint32_t v;
        memcpy(&v, in + 4 * i, 4);
        v = __builtin_bswap32(v);
        memcpy(out + 4 * i, &v, 4);
    }
}

/* max over count float32 of their bit patterns with the sign cleared: for non-negative floats
 * integer order is float order, so this is the bit pattern of max|x| (NaN and Inf compare
 * above every finite value). */
static uint32_t absmax_bits_scalar(const float *x, Py_ssize_t count)
{
    uint32_t m = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
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

__attribute__((target("avx2"))) static void quant_avx2(const float *x, Py_ssize_t count, double f,
                                                       int clip, double M, uint8_t *out)
{
    const __m256d vf = _mm256_set1_pd(f), hi = _mm256_set1_pd(M), lo = _mm256_set1_pd(-M);
    const __m256i sw = BSWAP32_MASK;
    Py_ssize_t i = 0;
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

__attribute__((target("avx2"))) static void dequant_avx2(const uint8_t *in, Py_ssize_t count,
                                                         double f, float *out)
{
    const __m256d vf = _mm256_set1_pd(f);
    const __m256i sw = BSWAP32_MASK;
    Py_ssize_t i = 0;
    for (; i + 8 <= count; i += 8) {
        __m256i s = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(in + 4 * i)), sw);
        __m256d a = _mm256_div_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(s)), vf);
        __m256d b = _mm256_div_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(s, 1)), vf);
        _mm_storeu_ps(out + i, _mm256_cvtpd_ps(a)); /* rounds to nearest even */
        _mm_storeu_ps(out + i + 4, _mm256_cvtpd_ps(b));
    }
    dequant_scalar(in + 4 * i, count - i, f, out + i);
}

__attribute__((target("avx2"))) static void bswap_avx2(const uint8_t *in, Py_ssize_t count,
                                                       uint8_t *out)
{
    const __m256i sw = BSWAP32_MASK;
    Py_ssize_t i = 0;
    for (; i + 8 <= count; i += 8) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(in + 4 * i));
        _mm256_storeu_si256((__m256i *)(out + 4 * i), _mm256_shuffle_epi8(v, sw));
    }
    bswap_scalar(in + 4 * i, count - i, out + 4 * i);
}

__attribute__((target("avx2"))) static uint32_t absmax_bits_avx2(const float *x, Py_ssize_t count)
{
    const __m256i mask = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i m = _mm256_setzero_si256();
    Py_ssize_t i = 0;
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

static inline void quantise(const float *x, Py_ssize_t count, double f, int clip, double M,
                            uint8_t *out)
{
#if HAVE_X86
    if (use_avx2) {
        quant_avx2(x, count, f, clip, M, out);
        return;
    }
#endif
    quant_scalar(x, count, f, clip, M, out);
}

static inline void dequantise(const uint8_t *in, Py_ssize_t count, double f, float *out)
{
#if HAVE_X86
    if (use_avx2) {
        dequant_avx2(in, count, f, out);
        return;
    }
#endif
    dequant_scalar(in, count, f, out);
}

static inline void bswap_copy(const uint8_t *in, Py_ssize_t count, uint8_t *out)
{
#if HAVE_X86
    if (use_avx2) {
        bswap_avx2(in, count, out);
        return;
    }
#endif
    bswap_scalar(in, count, out);
}

static inline uint32_t absmax_bits(const float *x, Py_ssize_t count)
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

/* Exponents of the chunks of x (k elements each, the last one possibly short) into e.
 * Returns -1, or the index of the first NaN/Inf element (then e is incomplete). */
static Py_ssize_t chunk_exponents(const float *x, Py_ssize_t L, int k, int8_t *e)
{
    Py_ssize_t chunks = (L + k - 1) / k;
    for (Py_ssize_t c = 0; c < chunks; c++) {
        Py_ssize_t a = c * k, n = L - a < k ? L - a : k;
        uint32_t b = absmax_bits(x + a, n);
        if (b >= 0x7F800000u) {
            for (Py_ssize_t i = a; i < a + n; i++) {
                uint32_t v;
                memcpy(&v, x + i, 4);
                if ((v & 0x7FFFFFFFu) >= 0x7F800000u)
                    return i;
            }
        }
        e[c] = exponent_of_bits(b);
    }
    return -1;
}

/* --- the Engine object -------------------------------------------------------------------- */
typedef struct {
    uint64_t packets_sent, retransmissions, timeouts, results, duplicates, stale, malformed;
    uint64_t bytes_sent, bytes_received, send_calls, recv_calls, send_errors, fault_drops;
    uint64_t spurious;
} Counters;

static const char *COUNTER_NAMES[] = {
    "packets_sent", "retransmissions", "timeouts",    "results",        "duplicates",
    "stale",        "malformed",       "bytes_sent",  "bytes_received", "send_calls",
    "recv_calls",   "send_errors",     "fault_drops", "spurious",
};
#define N_COUNTERS (sizeof(COUNTER_NAMES) / sizeof(COUNTER_NAMES[0]))

typedef struct {
    PyObject_HEAD int fd;
    struct sockaddr_in dst;
    int k, plen, window, world;
    uint8_t type_size;
    int slot_base;
    int gso, gro;
    double rto_min, rto_max;
    /* kept across all-reduces */
    int have_rtt;
    double srtt, rttvar;
    int cwnd_fixed;
    double cwnd, ssthresh;
    int spin; /* busy-poll at all (EngineConfig.spin) */
    int spin_credit;
    int faults;
    double send_loss, recv_loss, send_dup, recv_dup;
    uint64_t rng;
    int last_errno;   /* of the last refused send, 0 if none yet */
    double ftab[256]; /* scale factor of exponent E at index uint8(E) */
    double M;
    /* buffers, sized for the window */
    uint8_t *rows; /* window x plen: the packet in flight per slot */
    double *deadline, *sent_at, *rto;
    int32_t *tries;
    int64_t *pkt;   /* packet in each slot, -1 when none in flight */
    int64_t *ready; /* per slot: the packet ready to go there, or -1 */
    int32_t *sendq; /* slots to send in one call (2x for duplicates) */
    struct iovec *siov;
    struct mmsghdr *smsg;
    char *sctrl;
    uint8_t *rbuf;
    struct iovec *riov;
    struct mmsghdr *rmsg;
    char *rctrl;
    int rcount, rslot;
    /* the AF_XDP path (hostlib/_xsk.c), NULL on the kernel socket's */
    Xsk *xsk;
    const uint8_t **xrows; /* the rows of one send (2x window) */
    int kernel_ready;      /* the kernel socket has datagrams too (results on other queues) */
    char xsk_why[320];     /* why AF_XDP was asked for and is not used ("" if it is or was not) */
} Engine;

#define SEG_CMSG_SPACE CMSG_SPACE(sizeof(uint16_t))
#define GRO_CMSG_SPACE CMSG_SPACE(sizeof(int))

/* The state of one all-reduce (lives on the C stack of Engine.allreduce). */
typedef struct {
    Engine *e;
    int is_float;
    const uint8_t *src; /* int32 or float32, L elements */
    uint8_t *dst;
    Py_ssize_t L;
    int64_t P, Pd, w;
    uint8_t jn;
    const uint8_t *versions; /* next version of each slot at the start */
    const int8_t *exps;      /* float: e0 of chunk c, Pd of them */
    int8_t *agreed;          /* float: E of chunk c from the results */
    /* per packet: 0 not sent yet, 1 in flight, 2 + n done (n: retransmissions that may still
     * prove spurious) */
    uint8_t *state;
    int64_t ndone, results_here, inflight, next_new;
    int64_t nready;  /* packets whose slot is free, not sent yet */
    int64_t base;    /* the lowest packet without its result */
    int64_t recover; /* AIMD: no second halving before this packet */
    double next_deadline, last_progress;
    double batch_sample_at; /* RTT: send time of the newest sample this batch */
    double batch_sample;
    Counters c;
    int gso_refused;
    double rx_now; /* AF_XDP: when the frames being taken arrived */
} Run;

static void engine_free_buffers(Engine *e)
{
    PyMem_RawFree(e->rows);
    PyMem_RawFree(e->deadline);
    PyMem_RawFree(e->sent_at);
    PyMem_RawFree(e->rto);
    PyMem_RawFree(e->tries);
    PyMem_RawFree(e->pkt);
    PyMem_RawFree(e->ready);
    PyMem_RawFree(e->sendq);
    PyMem_RawFree(e->siov);
    PyMem_RawFree(e->smsg);
    PyMem_RawFree(e->sctrl);
    PyMem_RawFree(e->rbuf);
    PyMem_RawFree(e->riov);
    PyMem_RawFree(e->rmsg);
    PyMem_RawFree(e->rctrl);
    PyMem_RawFree(e->xrows);
    e->xrows = NULL;
    xsk_close(e->xsk);
    e->xsk = NULL;
}

static void Engine_dealloc(Engine *e)
{
    engine_free_buffers(e);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

/* The AF_XDP path from spec = (ifindex, queue, src_mac, dst_mac, src_ip, src_port, ttl, tos,
 * zerocopy, mode): mode "drv", "skb" or "" (either). Returns -1 with a Python error on a bad spec;
 * 0 otherwise, with e->xsk NULL and the reason in e->xsk_why when AF_XDP cannot run here. */
static int open_xsk(Engine *e, PyObject *spec)
{
    XskConfig c;
    memset(&c, 0, sizeof c);
    const char *smac, *dmac, *sip, *mode;
    Py_ssize_t slen, dlen;
    int sport;
    if (!PyArg_ParseTuple(spec, "iiy#y#siiips", &c.ifindex, &c.queue, &smac, &slen, &dmac, &dlen,
                          &sip, &sport, &c.ttl, &c.tos, &c.zerocopy, &mode))
        return -1;
    struct in_addr a;
    if (slen != 6 || dlen != 6 || inet_pton(AF_INET, sip, &a) != 1 || sport < 1 || sport > 65535) {
        PyErr_SetString(PyExc_ValueError, "xsk: bad MAC, address or port");
        return -1;
    }
    memcpy(c.src_mac, smac, 6);
    memcpy(c.dst_mac, dmac, 6);
    c.src_ip = ntohl(a.s_addr);
    c.dst_ip = ntohl(e->dst.sin_addr.s_addr);
    c.src_port = (uint16_t)sport;
    c.dst_port = ntohs(e->dst.sin_port);
    c.plen = e->plen;
    c.prog_flags = strcmp(mode, "drv") == 0   ? XDP_FLAGS_DRV_MODE
                   : strcmp(mode, "skb") == 0 ? XDP_FLAGS_SKB_MODE
                                              : 0;
    e->xrows = PyMem_RawCalloc(2 * (size_t)e->window, sizeof *e->xrows);
    if (!e->xrows) {
        PyErr_NoMemory();
        return -1;
    }
    e->xsk = xsk_open(&c, e->xsk_why, sizeof e->xsk_why);
    return 0;
}

static int Engine_init(Engine *e, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"fd",        "host",      "port", "elems",   "window", "world_size",
                             "type_size", "slot_base", "rto",  "rto_max", "gso",    "gro",
                             "cwnd",      "faults",    "xsk",  "spin",    NULL};
    const char *host, *cwnd = "aimd";
    int port, type_size, gso = 1, gro = 1, spin = 1;
    PyObject *faults = Py_None, *xsk = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "isiiiiiidd|ppsOOp", kwlist, &e->fd, &host, &port,
                                     &e->k, &e->window, &e->world, &type_size, &e->slot_base,
                                     &e->rto_min, &e->rto_max, &gso, &gro, &cwnd, &faults, &xsk,
                                     &spin))
        return -1;
    e->spin = spin;
    if (e->k < 1 || e->window < 1 || e->world < 1 || port < 0 || port > 65535 || type_size < 0 ||
        type_size > 255) {
        PyErr_SetString(PyExc_ValueError, "bad engine parameters");
        return -1;
    }
    e->type_size = (uint8_t)type_size;
    memset(&e->dst, 0, sizeof e->dst);
    e->dst.sin_family = AF_INET;
    e->dst.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, host, &e->dst.sin_addr) != 1) {
        PyErr_Format(PyExc_ValueError, "not an IPv4 address: %s", host);
        return -1;
    }
    if (strcmp(cwnd, "aimd") == 0)
        e->cwnd_fixed = 0;
    else if (strcmp(cwnd, "fixed") == 0)
        e->cwnd_fixed = 1;
    else {
        PyErr_Format(PyExc_ValueError, "cwnd must be 'aimd' or 'fixed', not %s", cwnd);
        return -1;
    }
    e->faults = 0;
    if (faults != Py_None) {
        unsigned long long seed;
        if (!PyArg_ParseTuple(faults, "ddddK", &e->send_loss, &e->recv_loss, &e->send_dup,
                              &e->recv_dup, &seed))
            return -1;
        e->faults = 1;
        e->rng = seed * 0x2545F4914F6CDD1Dull + 1;
    }
    e->plen = VALUES_AT + 4 * e->k;
    e->gso = gso;
    e->gro = gro;
    e->have_rtt = 0;
    e->srtt = e->rttvar = 0;
    /* slow start from a small window; ssthresh at the slot window until the first loss */
    e->cwnd = e->cwnd_fixed ? e->window : (e->window < 16 ? e->window : 16);
    e->ssthresh = e->window;
    e->spin_credit = 0;
    e->last_errno = 0;
    e->M = (double)(2147483647 / e->world);
    for (int i = 0; i < 256; i++)
        e->ftab[i] = ldexp(e->M, -(int)(int8_t)i);

    engine_free_buffers(e);
    size_t w = (size_t)e->window;
    e->rows = PyMem_RawCalloc(w, (size_t)e->plen);
    e->deadline = PyMem_RawCalloc(w, sizeof(double));
    e->sent_at = PyMem_RawCalloc(w, sizeof(double));
    e->rto = PyMem_RawCalloc(w, sizeof(double));
    e->tries = PyMem_RawCalloc(w, sizeof(int32_t));
    e->pkt = PyMem_RawCalloc(w, sizeof(int64_t));
    e->ready = PyMem_RawCalloc(w, sizeof(int64_t));
    e->sendq = PyMem_RawCalloc(2 * w, sizeof(int32_t));
    e->siov = PyMem_RawCalloc(2 * w, sizeof(struct iovec));
    e->smsg = PyMem_RawCalloc(2 * w, sizeof(struct mmsghdr));
    e->sctrl = PyMem_RawCalloc(2 * w, SEG_CMSG_SPACE);
    e->rslot = e->gro ? RECV_SLOT : e->plen + 64; /* longer datagrams show as MSG_TRUNC */
    e->rcount = e->gro ? RECV_MSGS_GRO : RECV_MSGS_PLAIN;
    e->rbuf = PyMem_RawMalloc((size_t)e->rcount * (size_t)e->rslot);
    e->riov = PyMem_RawCalloc((size_t)e->rcount, sizeof(struct iovec));
    e->rmsg = PyMem_RawCalloc((size_t)e->rcount, sizeof(struct mmsghdr));
    e->rctrl = PyMem_RawCalloc((size_t)e->rcount, GRO_CMSG_SPACE);
    if (!e->rows || !e->deadline || !e->sent_at || !e->rto || !e->tries || !e->pkt || !e->ready ||
        !e->sendq || !e->siov || !e->smsg || !e->sctrl || !e->rbuf || !e->riov || !e->rmsg ||
        !e->rctrl) {
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < e->rcount; i++) {
        e->riov[i].iov_base = e->rbuf + (size_t)i * (size_t)e->rslot;
        e->riov[i].iov_len = (size_t)e->rslot;
        e->rmsg[i].msg_hdr.msg_iov = &e->riov[i];
        e->rmsg[i].msg_hdr.msg_iovlen = 1;
    }
    for (size_t i = 0; i < w; i++)
        e->pkt[i] = -1;
    e->xsk_why[0] = 0;
    e->kernel_ready = 0;
    return xsk == Py_None ? 0 : open_xsk(e, xsk);
}

/* --- sending ------------------------------------------------------------------------------ */
static int gso_refused_errno(int err)
{
    return err == EINVAL || err == EIO || err == ENOPROTOOPT || err == EOPNOTSUPP ||
           err == EMSGSIZE;
}

/* errors after which the datagrams are simply lost: the timers recover them (as udp_io) */
static int transient_errno(int err)
{
    return err == EAGAIN || err == EWOULDBLOCK || err == ENOBUFS || err == ENETUNREACH ||
           err == EHOSTUNREACH || err == ECONNREFUSED || err == EPERM;
}

/* Group iovecs [0, n) into messages: GSO messages of up to per_call segments, or one
 * datagram each. Returns the number of messages. */
static int build_msgs(Engine *e, int first_iov, int n)
{
    int per_call = 1;
    if (e->gso) {
        per_call = MAX_GSO_BYTES / e->plen;
        per_call = per_call > MAX_GSO_SEGMENTS ? MAX_GSO_SEGMENTS : (per_call < 1 ? 1 : per_call);
    }
    int m = 0;
    for (int i = first_iov; i < first_iov + n; i += per_call, m++) {
        int segs = first_iov + n - i < per_call ? first_iov + n - i : per_call;
        struct msghdr *h = &e->smsg[m].msg_hdr;
        memset(h, 0, sizeof *h);
        h->msg_name = &e->dst;
        h->msg_namelen = sizeof e->dst;
        h->msg_iov = &e->siov[i];
        h->msg_iovlen = (size_t)segs;
        if (segs > 1) { /* one buffer of segs datagrams, cut by the kernel at plen */
            char *ctl = e->sctrl + (size_t)m * SEG_CMSG_SPACE;
            memset(ctl, 0, SEG_CMSG_SPACE);
            h->msg_control = ctl;
            h->msg_controllen = SEG_CMSG_SPACE;
            struct cmsghdr *cm = CMSG_FIRSTHDR(h);
            cm->cmsg_level = SOL_UDP;
            cm->cmsg_type = UDP_SEGMENT;
            cm->cmsg_len = CMSG_LEN(sizeof(uint16_t));
            uint16_t seg = (uint16_t)e->plen;
            memcpy(CMSG_DATA(cm), &seg, sizeof seg);
        }
    }
    return m;
}

/* The AF_XDP send of the niov rows in siov: frames the rings had no room for are lost, as
 * datagrams a full socket buffer refuses (their timers resend them). */
static int send_xsk(Run *r, int niov)
{
    Engine *e = r->e;
    for (int i = 0; i < niov; i++)
        e->xrows[i] = e->siov[i].iov_base;
    uint64_t calls = 0;
    int q = xsk_send(e->xsk, e->xrows, niov, &calls);
    r->c.send_calls += calls;
    if (q < 0)
        return q;
    if (q < niov) {
        r->c.send_errors += (uint64_t)(niov - q);
        e->last_errno = ENOBUFS;
    }
    return 0;
}

/* Send the rows of slots sendq[0..n) (Faults applied). Returns 0, or -errno on an error that
 * is neither transient nor a GSO refusal (the caller raises OSError). */
static int send_slots(Run *r, int n)
{
    Engine *e = r->e;
    int niov = 0;
    r->c.packets_sent += (uint64_t)n;
    r->c.bytes_sent += (uint64_t)n * (uint64_t)e->plen;
    for (int i = 0; i < n; i++) {
        int copies = 1;
        if (e->faults) {
            if (rng_uniform(&e->rng) < e->send_loss) {
                r->c.fault_drops++;
                continue;
            }
            copies += rng_uniform(&e->rng) < e->send_dup;
        }
        while (copies--) {
            e->siov[niov].iov_base = e->rows + (size_t)e->sendq[i] * (size_t)e->plen;
            e->siov[niov].iov_len = (size_t)e->plen;
            niov++;
        }
    }
    if (e->xsk)
        return send_xsk(r, niov);
    int nmsg = build_msgs(e, 0, niov), i = 0, waited = 0;
    while (i < nmsg) {
        r->c.send_calls++;
        int got = sendmmsg(e->fd, &e->smsg[i], (unsigned)(nmsg - i), 0);
        if (got > 0) {
            i += got;
            waited = 0;
            continue;
        }
        int err = got < 0 ? errno : EAGAIN;
        if (err == EINTR)
            continue;
        if ((err == EAGAIN || err == EWOULDBLOCK) && !waited) {
            struct pollfd pfd = {.fd = e->fd, .events = POLLOUT};
            waited = 1;
            if (poll(&pfd, 1, 20) > 0) /* once, like udp_io: a full buffer may drain */
                continue;
        }
        if (e->gso && e->smsg[i].msg_hdr.msg_iovlen > 1 && gso_refused_errno(err)) {
            /* the path or the kernel cannot do GSO: plain datagrams from here on, for good */
            e->gso = 0;
            r->gso_refused = 1;
            int first = (int)(e->smsg[i].msg_hdr.msg_iov - e->siov);
            nmsg = build_msgs(e, first, niov - first);
            i = 0;
            continue;
        }
        if (transient_errno(err)) {
            r->c.send_errors++;
            e->last_errno = err;
            i++; /* these datagrams are lost; their timers resend them */
            waited = 0;
            continue;
        }
        return -err;
    }
    return 0;
}

/* --- building packets --------------------------------------------------------------------- */
/* Packet p's first 8 header bytes: type/size, job number, tsi, pool index (with version). */
static inline void header_of(const Run *r, int64_t p, uint8_t *h)
{
    const Engine *e = r->e;
    int64_t s = p % r->w;
    unsigned version = (r->versions[s] ^ (unsigned)((p / r->w) & 1)) & 1;
    uint16_t pool = (uint16_t)((version << 15) | ((unsigned)(e->slot_base + s) & 0x3FFFu));
    h[0] = e->type_size;
    h[1] = r->jn;
    store_be32(h + 2, (uint32_t)p);
    h[6] = (uint8_t)(pool >> 8);
    h[7] = (uint8_t)pool;
}

static void fill(Run *r, int64_t p, uint8_t *row)
{
    Engine *e = r->e;
    int k = e->k;
    uint8_t *vals = row + VALUES_AT, *exp = row + EXP_AT;
    header_of(r, p, row);
    exp[1] = 0;
    if (!r->is_float) {
        exp[0] = 0;
        Py_ssize_t a = (Py_ssize_t)p * k, n = r->L - a < k ? r->L - a : k;
        bswap_copy(r->src + 4 * a, n, vals);
        if (n < k)
            memset(vals + 4 * n, 0, (size_t)(k - n) * 4);
        return;
    }
    exp[0] = (uint8_t)(p < r->Pd ? r->exps[p] : E_MIN);
    if (p < r->w) { /* the first window carries exponents only */
        memset(vals, 0, (size_t)k * 4);
        return;
    }
    int64_t c = p - r->w;
    Py_ssize_t a = (Py_ssize_t)c * k, n = r->L - a < k ? r->L - a : k;
    int8_t E = r->agreed[c];
    /* |x| < 2^E keeps |x f| below M, except for values whose exponent was clipped at E_MAX:
     * the numpy engine clips once any agreed exponent reached E_MAX, which changes only
     * those chunks' values, so clipping exactly those gives the same bytes. */
    quantise((const float *)r->src + a, n, e->ftab[(uint8_t)E], E == E_MAX, e->M, vals);
    if (n < k)
        memset(vals + 4 * n, 0, (size_t)(k - n) * 4);
}

static void accept_result(Run *r, int64_t p, const uint8_t *buf)
{
    Engine *e = r->e;
    int k = e->k;
    if (!r->is_float) {
        Py_ssize_t a = (Py_ssize_t)p * k, n = r->L - a < k ? r->L - a : k;
        bswap_copy(buf + VALUES_AT, n, r->dst + 4 * a);
        return;
    }
    if (p < r->Pd)
        r->agreed[p] = (int8_t)buf[EXP_AT]; /* the max of the workers' e0 for chunk p */
    if (p >= r->w) {
        int64_t c = p - r->w;
        Py_ssize_t a = (Py_ssize_t)c * k, n = r->L - a < k ? r->L - a : k;
        dequantise(buf + VALUES_AT, n, e->ftab[(uint8_t)r->agreed[c]], (float *)r->dst + a);
    }
}

/* --- timers and the congestion window ----------------------------------------------------- */
static double first_rto(const Engine *e)
{
    if (!e->have_rtt)
        return e->rto_min;
    double t = e->srtt + 4 * e->rttvar;
    t = t < e->rto_min ? e->rto_min : t;
    return t > e->rto_max ? e->rto_max : t;
}

static void rtt_update(Engine *e, double sample)
{
    if (!e->have_rtt) {
        e->srtt = sample;
        e->rttvar = sample / 2;
        e->have_rtt = 1;
    } else {
        e->rttvar = 0.75 * e->rttvar + 0.25 * fabs(e->srtt - sample);
        e->srtt = 0.875 * e->srtt + 0.125 * sample;
    }
}

static inline int64_t window_now(const Run *r)
{
    int64_t c = (int64_t)r->e->cwnd;
    c = c < 1 ? 1 : c;
    return c > r->w ? r->w : c;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* First transmissions of ready packets, lowest packet number first, as far as the congestion
 * window allows -- except the lowest packet without a result (`base`), which may always go.
 *
 * Why: a packet completes only once every rank sent it. If a full window let each rank pick
 * its own subset of the ready packets (rank A holds p1 in flight with p0 waiting, rank B the
 * other way round), every rank could wait for a packet that another rank is holding back:
 * a deadlock. Every rank can always send its base packet (its slot is free: base - w is
 * done), so the lowest packet any rank still lacks always completes, and the stream moves. */
static int send_ready(Run *r, int *sent)
{
    Engine *e = r->e;
    int n = 0;
    *sent = 0;
    int64_t room = window_now(r) - r->inflight;
    if (r->nready == 0 || (room <= 0 && e->ready[r->base % r->w] != r->base))
        return 0;
    int64_t *cand = (int64_t *)e->siov; /* scratch: the iovecs are built after this */
    int64_t m = 0;
    for (int64_t s = 0; s < r->w; s++)
        if (e->ready[s] >= 0)
            cand[m++] = e->ready[s];
    if (m > 1 && room < m)
        qsort(cand, (size_t)m, sizeof *cand, cmp_i64);
    for (int64_t i = 0; i < m && (n < room || cand[i] == r->base); i++) {
        int64_t p = cand[i], s = p % r->w;
        fill(r, p, e->rows + (size_t)s * (size_t)e->plen);
        e->sendq[n++] = (int32_t)s;
        e->pkt[s] = p;
        e->ready[s] = -1;
        r->state[p] = 1;
        if (p >= r->next_new)
            r->next_new = p + 1;
    }
    r->nready -= n;
    *sent = n;
    if (n == 0)
        return 0;
    double t = now_s(), rto = first_rto(e);
    for (int i = 0; i < n; i++) {
        int s = e->sendq[i];
        e->tries[s] = 0;
        e->sent_at[s] = t;
        e->rto[s] = rto;
        e->deadline[s] = t + rto;
    }
    if (t + rto < r->next_deadline)
        r->next_deadline = t + rto;
    r->inflight += n;
    return send_slots(r, n);
}

/* Resend every packet whose timer expired (the identical bytes of its slot row). */
static int expire(Run *r, double now)
{
    Engine *e = r->e;
    int n = 0, halve = 0;
    double next = INFINITY;
    for (int64_t s = 0; s < r->w; s++) {
        if (e->deadline[s] <= now) {
            if (e->tries[s] == 0)
                r->c.timeouts++;
            e->tries[s]++;
            e->rto[s] = 2 * e->rto[s] < e->rto_max ? 2 * e->rto[s] : e->rto_max;
            e->deadline[s] = now + e->rto[s];
            e->sendq[n++] = (int32_t)s;
            halve |= e->pkt[s] >= r->recover;
        }
        if (e->deadline[s] < next)
            next = e->deadline[s];
    }
    r->next_deadline = next;
    if (n == 0)
        return 0;
    r->c.retransmissions += (uint64_t)n;
    if (halve && !e->cwnd_fixed) {
        /* multiplicative decrease, once per window: packets sent before this point that
         * expire later are the same loss event */
        e->cwnd = e->cwnd / 2 < 1 ? 1 : e->cwnd / 2;
        e->ssthresh = e->cwnd;
        r->recover = r->next_new;
    }
    return send_slots(r, n);
}

/* --- receiving ---------------------------------------------------------------------------- */
static void on_datagram(Run *r, const uint8_t *buf, double now)
{
    Engine *e = r->e;
    uint32_t tsi = load_be32(buf + 2);
    if (tsi >= (uint64_t)r->P) {
        r->c.stale++;
        return;
    }
    int64_t p = tsi, s = p % r->w;
    uint8_t h[8];
    header_of(r, p, h);
    if (memcmp(h, buf, 8) != 0) { /* another all-reduce, slot or version */
        r->c.stale++;
        return;
    }
    if (r->state[p] >= 2) {
        r->c.duplicates++;
        if (r->state[p] > 2) { /* the first copy's result came after a resend */
            r->c.spurious++;
            r->state[p]--;
        }
        return;
    }
    if (r->state[p] == 0) { /* echoes a packet not sent yet: not a result of ours */
        r->c.stale++;
        return;
    }
    int32_t tries = e->tries[s];
    r->state[p] = (uint8_t)(2 + (tries > 253 ? 253 : tries));
    r->c.results++;
    r->ndone++;
    r->results_here++;
    r->last_progress = now;
    accept_result(r, p, buf);
    e->deadline[s] = INFINITY;
    e->pkt[s] = -1;
    r->inflight--;
    if (tries == 0 && e->sent_at[s] > r->batch_sample_at) { /* Karn: not a resent one */
        r->batch_sample_at = e->sent_at[s];
        r->batch_sample = now - e->sent_at[s];
    }
    if (p + r->w < r->P) { /* its slot is free for the packet one window later */
        e->ready[s] = p + r->w;
        r->nready++;
    }
    while (r->base < r->P && r->state[r->base] >= 2)
        r->base++;
    if (!e->cwnd_fixed && e->cwnd < e->window) {
        /* slow start below ssthresh, then +1 per window of results */
        e->cwnd += e->cwnd < e->ssthresh ? 1.0 : 1.0 / e->cwnd;
        if (e->cwnd > e->window)
            e->cwnd = e->window;
    }
}

static void on_message(Run *r, const uint8_t *buf, size_t n, size_t seg, double now)
{
    Engine *e = r->e;
    size_t plen = (size_t)e->plen;
    r->c.bytes_received += n;
    /* seg is the GRO segment size (n for one datagram); a coalesced buffer may end with one
     * shorter datagram: keep the full rows, count the rest (as udp_io.RowReceiver) */
    size_t full = seg == plen ? n / plen : 0;
    if (full * plen != n)
        r->c.malformed++;
    for (size_t i = 0; i < full; i++) {
        const uint8_t *d = buf + i * plen;
        if (e->faults) {
            if (rng_uniform(&e->rng) < e->recv_loss) {
                r->c.fault_drops++;
                continue;
            }
            if (rng_uniform(&e->rng) < e->recv_dup)
                on_datagram(r, d, now);
        }
        on_datagram(r, d, now);
    }
}

/* One recvmmsg. Returns the messages received (0: none waiting), or -errno. */
static int receive_kernel(Run *r)
{
    Engine *e = r->e;
    for (int i = 0; i < e->rcount; i++) {
        struct msghdr *h = &e->rmsg[i].msg_hdr;
        h->msg_name = NULL;
        h->msg_namelen = 0;
        h->msg_flags = 0;
        if (e->gro) {
            h->msg_control = e->rctrl + (size_t)i * GRO_CMSG_SPACE;
            h->msg_controllen = GRO_CMSG_SPACE;
        } else {
            h->msg_control = NULL;
            h->msg_controllen = 0;
        }
    }
    r->c.recv_calls++;
    int m = recvmmsg(e->fd, e->rmsg, (unsigned)e->rcount, MSG_DONTWAIT, NULL);
    if (m < 0) {
        int err = errno;
        if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR || transient_errno(err))
            return 0; /* nothing, or an ICMP error queued on the socket: not data */
        return -err;
    }
    double now = now_s();
    r->batch_sample_at = -INFINITY;
    for (int i = 0; i < m; i++) {
        struct msghdr *h = &e->rmsg[i].msg_hdr;
        size_t n = e->rmsg[i].msg_len, seg = n;
        if (h->msg_flags & MSG_TRUNC) {
            r->c.bytes_received += n;
            r->c.malformed++;
            continue;
        }
        if (e->gro && h->msg_controllen) {
            for (struct cmsghdr *cm = CMSG_FIRSTHDR(h); cm; cm = CMSG_NXTHDR(h, cm)) {
                if (cm->cmsg_level == SOL_UDP && cm->cmsg_type == UDP_GRO &&
                    cm->cmsg_len >= CMSG_LEN(sizeof(int))) {
                    int gs;
                    memcpy(&gs, CMSG_DATA(cm), sizeof gs);
                    seg = gs > 0 ? (size_t)gs : n;
                }
            }
        }
        on_message(r, (const uint8_t *)e->riov[i].iov_base, n, seg, now);
    }
    /* One RTT sample per batch, from its most recently sent packet: the results of one batch
     * waited in the socket for different times, and the newest sent one waited least, so its
     * sample is closest to the path's round trip. (The timers themselves are only checked
     * after the socket was drained, so a late drain cannot fire them.) */
    if (r->batch_sample_at > -INFINITY)
        rtt_update(e, r->batch_sample);
    return m;
}

static void on_xsk_datagram(void *ctx, const uint8_t *payload, size_t len)
{
    Run *r = ctx;
    on_message(r, payload, len, len, r->rx_now); /* one datagram per frame: no GRO */
}

/* One batch: the AF_XDP RX ring, and the kernel socket when the last wait saw it readable
 * (results that came on a queue without the XSK, or before the program was attached). */
static int receive_batch(Run *r)
{
    Engine *e = r->e;
    if (!e->xsk)
        return receive_kernel(r);
    r->rx_now = now_s();
    r->batch_sample_at = -INFINITY;
    int m = xsk_receive(e->xsk, RECV_MSGS_PLAIN, on_xsk_datagram, r, &r->c.malformed);
    if (r->batch_sample_at > -INFINITY)
        rtt_update(e, r->batch_sample); /* as receive_kernel: one sample per batch */
    if (e->kernel_ready) {
        e->kernel_ready = 0;
        int k = receive_kernel(r);
        if (k < 0)
            return k;
        m += k;
    }
    return m;
}

/* --- the loop ----------------------------------------------------------------------------- */
enum { ST_DONE = 0, ST_STALLED = 1 };

/* Wait for the socket until `until` (monotonic seconds); EINTR returns early. */
static int wait_readable(Engine *e, double until)
{
    double dt = until - now_s();
    if (dt < 0)
        dt = 0;
    if (dt > 1.0)
        dt = 1.0; /* wake up now and then: the progress line and signals */
    struct timespec ts = {(time_t)dt, (long)((dt - (double)(time_t)dt) * 1e9)};
    struct pollfd pfd[2] = {{.fd = e->fd, .events = POLLIN}, {.fd = -1}};
    if (e->xsk)
        pfd[1] = (struct pollfd){.fd = xsk_fd(e->xsk), .events = POLLIN};
    int rc = ppoll(pfd, e->xsk ? 2 : 1, &ts, NULL);
    /* POLLERR too: a queued ICMP error is taken off by a receive, else ppoll would not wait */
    if (rc > 0 && e->xsk && (pfd[0].revents & (POLLIN | POLLERR)))
        e->kernel_ready = 1;
    return rc < 0 ? -errno : rc;
}

/* Returns ST_DONE, ST_STALLED, or -errno (OSError), or -EINTR after a Python exception was
 * set (a signal handler raised, or the progress callback failed). Called without the GIL;
 * takes it for the progress callback and for signals. */
static int run_loop(Run *r, double timeout, PyObject *progress, double progress_every,
                    PyThreadState **ts)
{
    Engine *e = r->e;
    double next_print = progress != Py_None ? r->last_progress + progress_every : INFINITY;
    int deferred = 0;
    while (r->ndone < r->P) {
        int sent = 0, rc = send_ready(r, &sent);
        if (rc < 0)
            return rc;
        /* drain: results already waiting count before any timer may fire */
        int got = 0, empty = 0;
        for (;;) {
            int m = receive_batch(r);
            if (m < 0)
                return m;
            if (m == 0) {
                empty = 1;
                break;
            }
            got += m;
            if (r->nready >= SEND_READY_AT || r->ndone >= r->P)
                break;
        }
        if (r->ndone >= r->P)
            break;
        double now = now_s();
        if (now >= r->next_deadline) {
            if (empty || deferred) {
                deferred = 0;
                if ((rc = expire(r, now)) < 0)
                    return rc;
            } else {
                deferred = 1; /* drain the rest first; at the latest on the next turn */
            }
        }
        if (now - r->last_progress > timeout)
            return ST_STALLED;
        if (now >= next_print) {
            PyEval_RestoreThread(*ts);
            PyObject *res = PyObject_CallFunction(progress, "LK", (long long)r->ndone,
                                                  (unsigned long long)r->c.retransmissions);
            Py_XDECREF(res);
            *ts = PyEval_SaveThread();
            if (!res)
                return -EINTR;
            next_print = now + progress_every;
        }
        if (got || sent || (r->nready > 0 && r->inflight < window_now(r)))
            continue;
        /* nothing to do until a result comes or a timer expires */
        if (e->spin && r->P - r->ndone <= SPIN_OUTSTANDING) {
            if (e->spin_credit < 0) {
                e->spin_credit++; /* a probe again after |credit| skipped chances */
            } else {
                double end = now_s() + SPIN_TIME;
                int m = 0;
                while ((m = receive_batch(r)) == 0 && now_s() < end)
                    ;
                if (m < 0)
                    return m;
                if (m > 0) {
                    e->spin_credit =
                        e->spin_credit + 1 > SPIN_CREDIT_MAX ? SPIN_CREDIT_MAX : e->spin_credit + 1;
                    continue;
                }
                e->spin_credit -= SPIN_PENALTY;
                if (e->spin_credit < 0)
                    e->spin_credit = -SPIN_BACKOFF;
            }
        }
        double until = r->next_deadline;
        if (r->last_progress + timeout < until)
            until = r->last_progress + timeout + 1e-4;
        if (next_print < until)
            until = next_print;
        rc = wait_readable(e, until);
        if (rc == -EINTR) {
            PyEval_RestoreThread(*ts);
            int bad = PyErr_CheckSignals();
            *ts = PyEval_SaveThread();
            if (bad)
                return -EINTR;
        } else if (rc < 0) {
            return rc;
        }
    }
    return ST_DONE;
}

static int get_buffer(PyObject *o, Py_buffer *b, int writable)
{
    return PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0));
}

static PyObject *counters_dict(const Counters *c)
{
    PyObject *d = PyDict_New();
    const uint64_t *v = (const uint64_t *)c;
    for (size_t i = 0; d && i < N_COUNTERS; i++) {
        PyObject *x = PyLong_FromUnsignedLongLong(v[i]);
        if (!x || PyDict_SetItemString(d, COUNTER_NAMES[i], x) < 0) {
            Py_XDECREF(x);
            Py_CLEAR(d);
            break;
        }
        Py_DECREF(x);
    }
    return d;
}

PyDoc_STRVAR(
    Engine_allreduce_doc,
    "allreduce(is_float, src, dst, P, w, job_number, versions, exponents, timeout,\n"
    "          progress=None, progress_every=1.0) -> dict\n\n"
    "Run the stream of one all-reduce with the GIL released. src and dst are contiguous buffers\n"
    "of L int32 or float32 (dst may be src); P packets over w slots; versions: the next version\n"
    "of each slot (bytes, >= w); exponents: float only, the e0 of each chunk (int8 bytes, see\n"
    "chunk_exponents). progress(ndone, retransmissions) is called every progress_every s.\n"
    "Returns {'status': 'done' | 'stalled', 'ndone', 'results_here', 'busy' (slot offsets with\n"
    "a packet in flight), 'counters' (this call's), 'gso_refused', 'last_errno'}; raises OSError\n"
    "on a socket error that is neither transient nor a GSO refusal.");

static PyObject *Engine_allreduce(Engine *e, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"is_float",       "src",      "dst",       "P",       "w",
                             "job_number",     "versions", "exponents", "timeout", "progress",
                             "progress_every", NULL};
    int is_float, jn;
    long long P, w;
    PyObject *src_o, *dst_o, *exps_o, *progress = Py_None;
    Py_buffer src, dst, vers, exps = {0};
    double timeout, progress_every = 1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "pOOLLiy*Od|Od", kwlist, &is_float, &src_o, &dst_o,
                                     &P, &w, &jn, &vers, &exps_o, &timeout, &progress,
                                     &progress_every))
        return NULL;
    PyObject *result = NULL;
    int have_src = 0, have_dst = 0, have_exps = 0;
    uint8_t *done = NULL;
    int8_t *agreed = NULL;
    if (get_buffer(src_o, &src, 0) < 0)
        goto out;
    have_src = 1;
    if (get_buffer(dst_o, &dst, 1) < 0)
        goto out;
    have_dst = 1;
    Py_ssize_t L = src.len / 4, k = e->k;
    int64_t Pd = (L + k - 1) / k;
    if (dst.len != src.len || src.len % 4 || w < 1 || w > e->window || vers.len < w ||
        P != (is_float ? Pd + w : Pd) || w > Pd) {
        PyErr_SetString(PyExc_ValueError, "allreduce: inconsistent P, w, buffers or versions");
        goto out;
    }
    if (is_float) {
        if (PyObject_GetBuffer(exps_o, &exps, PyBUF_C_CONTIGUOUS) < 0)
            goto out;
        have_exps = 1;
        if (exps.len < Pd) {
            PyErr_SetString(PyExc_ValueError, "allreduce: fewer exponents than chunks");
            goto out;
        }
        agreed = PyMem_RawCalloc((size_t)Pd + 1, 1);
    }
    done = PyMem_RawCalloc((size_t)P + 1, 1);
    if (!done || (is_float && !agreed)) {
        PyErr_NoMemory();
        goto out;
    }
    Run r;
    memset(&r, 0, sizeof r);
    r.e = e;
    r.is_float = is_float;
    r.src = src.buf;
    r.dst = dst.buf;
    r.L = L;
    r.P = P;
    r.Pd = Pd;
    r.w = w;
    r.jn = (uint8_t)jn;
    r.versions = vers.buf;
    r.exps = is_float ? exps.buf : NULL;
    r.agreed = agreed;
    r.state = done;
    r.recover = 0;
    r.next_deadline = INFINITY;
    for (int64_t s = 0; s < w; s++) {
        e->deadline[s] = INFINITY;
        e->tries[s] = 0;
        e->pkt[s] = -1;
    }
    for (int64_t p = 0; p < w; p++)
        e->ready[p] = p;
    r.nready = w;
    r.last_progress = now_s();

    PyThreadState *ts = PyEval_SaveThread();
    int rc = run_loop(&r, timeout, progress, progress_every, &ts);
    PyEval_RestoreThread(ts);

    if (rc == -EINTR && PyErr_Occurred())
        goto out;
    if (rc < 0) {
        errno = -rc;
        PyErr_SetFromErrno(PyExc_OSError);
        goto out;
    }
    PyObject *busy = PyList_New(0);
    for (int64_t s = 0; busy && s < w; s++) {
        if (e->deadline[s] < INFINITY) {
            PyObject *x = PyLong_FromLongLong(s);
            if (!x || PyList_Append(busy, x) < 0)
                Py_CLEAR(busy);
            Py_XDECREF(x);
        }
    }
    PyObject *cd = counters_dict(&r.c);
    if (busy && cd)
        result = Py_BuildValue(
            "{s:s,s:L,s:L,s:O,s:O,s:O,s:i}", "status", rc == ST_DONE ? "done" : "stalled", "ndone",
            (long long)r.ndone, "results_here", (long long)r.results_here, "busy", busy, "counters",
            cd, "gso_refused", r.gso_refused ? Py_True : Py_False, "last_errno", e->last_errno);
    Py_XDECREF(busy);
    Py_XDECREF(cd);
    for (int64_t s = 0; s < w; s++) /* no packet of this all-reduce is in flight any more */
        e->pkt[s] = -1, e->deadline[s] = INFINITY;
out:
    PyMem_RawFree(done);
    PyMem_RawFree(agreed);
    if (have_exps)
        PyBuffer_Release(&exps);
    if (have_dst)
        PyBuffer_Release(&dst);
    if (have_src)
        PyBuffer_Release(&src);
    PyBuffer_Release(&vers);
    return result;
}

static PyObject *Engine_get_srtt(Engine *e, void *c)
{
    (void)c;
    return PyFloat_FromDouble(e->have_rtt ? e->srtt : 0.0);
}

static PyObject *Engine_get_cwnd(Engine *e, void *c)
{
    (void)c;
    return PyFloat_FromDouble(e->cwnd);
}

static PyObject *Engine_get_gso(Engine *e, void *c)
{
    (void)c;
    return PyBool_FromLong(e->gso);
}

static PyObject *Engine_get_data_path(Engine *e, void *c)
{
    (void)c;
    if (!e->xsk)
        return PyUnicode_FromString("udp");
    return PyUnicode_FromFormat("afxdp-%s-%s", xsk_zerocopy(e->xsk) ? "zerocopy" : "copy",
                                xsk_attach_mode(e->xsk));
}

static PyObject *Engine_get_xsk_reason(Engine *e, void *c)
{
    (void)c;
    return PyUnicode_FromString(e->xsk_why);
}

static PyGetSetDef Engine_getset[] = {
    {"srtt", (getter)Engine_get_srtt, NULL, "smoothed round trip, s (0 before a sample)", NULL},
    {"cwnd", (getter)Engine_get_cwnd, NULL, "congestion window, packets", NULL},
    {"gso", (getter)Engine_get_gso, NULL, "whether sends still use UDP GSO", NULL},
    {"data_path", (getter)Engine_get_data_path, NULL,
     "'udp' (the kernel socket), or 'afxdp-copy-drv' / 'afxdp-zerocopy-drv' / 'afxdp-copy-skb'",
     NULL},
    {"xsk_reason", (getter)Engine_get_xsk_reason, NULL,
     "why AF_XDP was asked for and could not run ('' when it runs or was not asked for)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Engine_methods[] = {
    {"allreduce", (PyCFunction)(void (*)(void))Engine_allreduce, METH_VARARGS | METH_KEYWORDS,
     Engine_allreduce_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(
    Engine_doc,
    "Engine(fd, host, port, elems, window, world_size, type_size, slot_base, rto, rto_max,\n"
    "       gso=True, gro=True, cwnd='aimd', faults=None, xsk=None)\n\n"
    "The native stream of one worker over its data socket `fd` (non-blocking UDP), sending to\n"
    "host:port. Keeps the RTT estimate, the congestion window and the buffers across\n"
    "all-reduces. faults: None or (send_loss, recv_loss, send_duplicate, recv_duplicate, seed).\n"
    "xsk: None, or (ifindex, queue, src_mac, dst_mac, src_ip, src_port, ttl, tos, zerocopy, mode)\n"
    "to send and receive through an AF_XDP socket on that interface queue (hostlib/_xsk.c);\n"
    "where it cannot run, the kernel socket stays and xsk_reason says why.");

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hostlib._fastpath.Engine",
    .tp_basicsize = sizeof(Engine),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Engine_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
    .tp_getset = Engine_getset,
};

/* --- module functions (also the test entry points) ---------------------------------------- */
PyDoc_STRVAR(
    chunk_exponents_doc,
    "chunk_exponents(x, k) -> (bytes, bad)\n\n"
    "scaling.chunk_exponents of the float32 buffer x cut into chunks of k (the last one may be\n"
    "short): one int8 per chunk. bad is -1, or the index of the first NaN/Inf element.");

static PyObject *py_chunk_exponents(PyObject *m, PyObject *args)
{
    Py_buffer x;
    int k;
    (void)m;
    if (!PyArg_ParseTuple(args, "y*i", &x, &k))
        return NULL;
    if (k < 1 || x.len % 4) {
        PyBuffer_Release(&x);
        PyErr_SetString(PyExc_ValueError, "chunk_exponents: k >= 1 and float32 data");
        return NULL;
    }
    Py_ssize_t L = x.len / 4, chunks = (L + k - 1) / k;
    PyObject *out = PyBytes_FromStringAndSize(NULL, chunks);
    if (!out) {
        PyBuffer_Release(&x);
        return NULL;
    }
    Py_ssize_t bad;
    Py_BEGIN_ALLOW_THREADS bad = chunk_exponents(x.buf, L, k, (int8_t *)PyBytes_AS_STRING(out));
    Py_END_ALLOW_THREADS PyBuffer_Release(&x);
    return Py_BuildValue("Nn", out, bad);
}

PyDoc_STRVAR(
    quantise_doc,
    "quantise(x, exponents, world_size, k) -> bytes\n\n"
    "Test entry point: the big-endian int32 payload rows of the float32 chunks of x (k each, the\n"
    "last zero-padded) quantised with their agreed exponents, as the loop builds them.");

static PyObject *py_quantise(PyObject *m, PyObject *args)
{
    Py_buffer x, ex;
    int n, k;
    (void)m;
    if (!PyArg_ParseTuple(args, "y*y*ii", &x, &ex, &n, &k))
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t L = x.len / 4, chunks = (L + k - 1) / k;
    if (k < 1 || n < 1 || x.len % 4 || ex.len < chunks) {
        PyErr_SetString(PyExc_ValueError, "quantise: bad arguments");
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, chunks * k * 4);
    if (!out)
        goto done;
    double M = (double)(2147483647 / n);
    uint8_t *o = (uint8_t *)PyBytes_AS_STRING(out);
    memset(o, 0, (size_t)(chunks * k * 4));
    for (Py_ssize_t c = 0; c < chunks; c++) {
        int8_t E = ((const int8_t *)ex.buf)[c];
        Py_ssize_t a = c * k, cnt = L - a < k ? L - a : k;
        quantise((const float *)x.buf + a, cnt, ldexp(M, -(int)E), E == E_MAX, M, o + 4 * a);
    }
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&ex);
    return out;
}

PyDoc_STRVAR(
    dequantise_doc,
    "dequantise(sums, exponents, world_size, k) -> bytes\n\n"
    "Test entry point: float32 (native order) of the big-endian int32 sums (rows of k) with\n"
    "their agreed exponents, as the loop writes them into the output.");

static PyObject *py_dequantise(PyObject *m, PyObject *args)
{
    Py_buffer s, ex;
    int n, k;
    (void)m;
    if (!PyArg_ParseTuple(args, "y*y*ii", &s, &ex, &n, &k))
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t L = s.len / 4, chunks = (L + k - 1) / k;
    if (k < 1 || n < 1 || s.len % 4 || ex.len < chunks) {
        PyErr_SetString(PyExc_ValueError, "dequantise: bad arguments");
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, L * 4);
    if (!out)
        goto done;
    double M = (double)(2147483647 / n);
    for (Py_ssize_t c = 0; c < chunks; c++) {
        int8_t E = ((const int8_t *)ex.buf)[c];
        Py_ssize_t a = c * k, cnt = L - a < k ? L - a : k;
        dequantise((const uint8_t *)s.buf + 4 * a, cnt, ldexp(M, -(int)E),
                   (float *)PyBytes_AS_STRING(out) + a);
    }
done:
    PyBuffer_Release(&s);
    PyBuffer_Release(&ex);
    return out;
}

PyDoc_STRVAR(
    set_simd_doc,
    "set_simd(name) -> str\n\n"
    "Choose the kernels: 'avx2' (if the CPU has it) or 'scalar'; returns the previous choice.\n"
    "Both give identical bytes; tests use this to compare them. The default is the best the CPU\n"
    "offers, or 'scalar' when the environment has XDP_AGG_SIMD=scalar at import.");

static int cpu_has_avx2(void)
{
#if HAVE_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

static PyObject *py_set_simd(PyObject *m, PyObject *args)
{
    const char *name;
    (void)m;
    if (!PyArg_ParseTuple(args, "s", &name))
        return NULL;
    const char *prev = use_avx2 ? "avx2" : "scalar";
    if (strcmp(name, "scalar") == 0) {
        use_avx2 = 0;
    } else if (strcmp(name, "avx2") == 0) {
        if (!cpu_has_avx2()) {
            PyErr_SetString(PyExc_ValueError, "this CPU has no AVX2");
            return NULL;
        }
        use_avx2 = 1;
    } else {
        PyErr_Format(PyExc_ValueError, "simd must be 'avx2' or 'scalar', not %s", name);
        return NULL;
    }
    return PyUnicode_FromString(prev);
}

static PyObject *py_simd(PyObject *m, PyObject *noargs)
{
    (void)m;
    (void)noargs;
    return PyUnicode_FromString(use_avx2 ? "avx2" : "scalar");
}

static PyMethodDef module_methods[] = {
    {"chunk_exponents", py_chunk_exponents, METH_VARARGS, chunk_exponents_doc},
    {"quantise", py_quantise, METH_VARARGS, quantise_doc},
    {"dequantise", py_dequantise, METH_VARARGS, dequantise_doc},
    {"set_simd", py_set_simd, METH_VARARGS, set_simd_doc},
    {"simd", py_simd, METH_NOARGS, "The kernels in use: 'avx2' or 'scalar'."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "hostlib._fastpath",
    "The native per-packet loop of hostlib's stream engine (see hostlib/_fastpath.c).",
    -1,
    module_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__fastpath(void)
{
    const char *env = getenv("XDP_AGG_SIMD");
    use_avx2 = cpu_has_avx2() && !(env && strcmp(env, "scalar") == 0);
    if (PyType_Ready(&EngineType) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&module_def);
    if (!mod)
        return NULL;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(mod, "Engine", (PyObject *)&EngineType) < 0 ||
        PyModule_AddIntConstant(mod, "VALUES_AT", VALUES_AT) < 0 ||
        PyModule_AddIntConstant(mod, "EXP_LEN", EXP_LEN) < 0) {
        Py_DECREF(&EngineType);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
