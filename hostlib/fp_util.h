/*
 * Small helpers of the C fast path (hostlib._fastpath): the clock, big-endian loads and
 * stores, and the Faults test hook's seeded generator. No Python here: the kernels, the I/O and
 * the stream loop build without it, so that several loops can run in threads at once.
 */
#ifndef HOSTLIB_FP_UTIL_H
#define HOSTLIB_FP_UTIL_H

#include <arpa/inet.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef ptrdiff_t fp_ssize; /* element counts and offsets (Py_ssize_t's width) */

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

static inline void store_be16(uint8_t *p, uint16_t v)
{
    v = htons(v);
    memcpy(p, &v, 2);
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

#endif
