r"""Block floating point: floats through an int32 aggregator (docs/protocol.md section 5).

Each chunk of k elements gets an exponent e = floor(log2(max|x|)) + 1, so |x| < 2^e. The
workers agree on E = max of their e for that chunk (the aggregator takes the maximum of the e0
fields, one window ahead of the data), and each sends

    q = round(x * f),   f = M / 2^E,   M = floor((2^31 - 1) / n)

as int32. Since |x| < 2^E, |x f| < M, so |q| <= M (rounding a number below the integer M cannot
exceed M) and the sum of n workers' q stays within +-(2^31 - 1): it never wraps. The protocol
writes f = (2^31 - 1) / (n 2^E); rounding the numerator down to the integer M changes f by less
than n / 2^31 relative and is what makes the no-overflow argument exact. The worker divides the
aggregated sum by the same f.

Error bound, per element, of the all-reduced float32 r against the exact sum s = sum_i x_i:

    |r - s| <= n / (2 f) + 2^-24 |r|          ( n / (2 f) = n 2^E / (2 M) ~= n^2 2^(E - 32) )

The first term is the quantisation: each of the n workers rounds x f to an integer, an error of
at most 1/2 unit, i.e. 1/(2 f) in x's units. The second is float32 rounding of the result (the
products x f and the division are done in float64, exact to 2^-53, which the bound absorbs).
The bound is relative to the chunk's largest magnitude, not to each element: elements much
smaller than the largest of their chunk (over all workers) keep fewer significant bits.

Limits, by design of the one-byte exponent field:
- e is clipped to the int8 range [-128, 127]. Values with |x| >= 2^127 (float32 above about
  1.7e38) saturate at +-M units; values below 2^-128 in a chunk whose maximum is below 2^-128
  have the absolute bound above with E = -128.
- An all-zero chunk sends e = -128 (ZERO_EXPONENT), so it never raises another worker's E.
- NaN and Inf have no integer representation: they are rejected with ValueError.

16-bit jobs (docs/protocol.md section 5.6) scale the same way with M = floor((2^15 - 1) / n)
(`int_range(n, 16)`), over chunks of 2k elements (a packet's), and put each pair of quantised
elements (a, b) into one int32 word a * 2^16 + b (wire.pack_pairs): every aggregator sums the
words as int32, and since |sum a| and |sum b| stay within 2^15 - 1 both come back exactly
(wire.unpack_pairs). The bound is the one above with that M: n / (2 f) = n 2^E / (2 M), about
n^2 2^(E - 16), and the result's own rounding is that of its dtype, rounded from float32 to
nearest even: half a unit in the last place, at most 2^-8 |r| for bfloat16, 2^-11 for float16
(and 2^-25 absolute below its normal range), 2^-24 for float32.
"""

from __future__ import annotations

import numpy as np

from xdp_agg.proto import wire

E_MIN, E_MAX = -128, 127  # the int8 exponent field
ZERO_EXPONENT = E_MIN  # exponent of an all-zero chunk: neutral for the max


def int_range(n: int, wire_bits: int = 32) -> int:
    """M: the largest |q| one of n workers may send so that their sum fits int32 (at 16 bits:
    so that the sum of each half of a word fits 16 bits, wire.pair_range)."""
    if wire.check_wire_bits(wire_bits) == 16:
        return wire.pair_range(n)
    return (2**31 - 1) // n


def chunk_exponents(chunks: np.ndarray, offset: int = 0) -> np.ndarray:
    """e = floor(log2(max|x|)) + 1 per row of an (m, k) float32, bfloat16 or float16 array, as
    int8.

    Rows of zeros get ZERO_EXPONENT. ValueError if any element is NaN or infinite (`offset`:
    the index of the first element in the caller's tensor, for the message).
    """
    chunks = np.asarray(chunks)
    if chunks.shape[0] == 0:
        return np.zeros(0, dtype=np.int8)
    # max|x| as max(max x, -min x): no temporary of the whole tensor, and NaN propagates
    amax = np.maximum(chunks.max(axis=1), -chunks.min(axis=1))
    amax = amax.astype(np.float32, copy=False)  # exact; a 16-bit type's m maxima only
    if not np.isfinite(amax).all():
        bad = np.flatnonzero(~np.isfinite(chunks.reshape(-1)))[0]
        raise nonfinite_error(chunks.reshape(-1)[bad], offset + bad)
    _, e = np.frexp(amax)  # amax = m * 2^e with 0.5 <= m < 1, i.e. e = floor(log2 amax) + 1
    e[amax == 0] = ZERO_EXPONENT
    np.minimum(e, E_MAX, out=e)
    np.maximum(e, E_MIN, out=e)
    return e.astype(np.int8)


def nonfinite_error(value: object, index: int) -> ValueError:
    """The error for a NaN or Inf `value` at element `index` of an all-reduce input."""
    return ValueError(
        f"all-reduce input contains {value} at element {index}: "
        f"NaN and Inf cannot be sent as block-scaled integers"
    )


def scale_factors(exponents: np.ndarray, n: int, wire_bits: int = 32) -> np.ndarray:
    """f = M / 2^E per chunk, float64 (exact: an integer times a power of two)."""
    return np.ldexp(float(int_range(n, wire_bits)), -np.asarray(exponents, dtype=np.int32))


def quantise(
    chunks: np.ndarray,
    exponents: np.ndarray,
    n: int,
    out: np.ndarray | None = None,
    work: np.ndarray | None = None,
    wire_bits: int = 32,
) -> np.ndarray:
    """int32 round(x * f) of (m, k) float chunks (float32, bfloat16, float16) with their agreed
    exponents E (m,); at `wire_bits` 16 the (m, k / 2) words of their pairs (wire.pack_pairs).

    `out`: where to write them (any integer array of the words' shape, e.g. a big-endian view
    of packet payloads); `work`: a float64 array of the chunks' shape to compute in, so that
    repeated calls allocate nothing.
    """
    exponents = np.asarray(exponents)
    # only values >= 2^127, whose exponent was clipped, can exceed M
    limit = int_range(n, wire_bits) if (exponents >= E_MAX).any() else None
    f = scale_factors(exponents, n, wire_bits)
    return quantise_scaled(chunks, f, limit, out, work, wire_bits)


def quantise_scaled(
    chunks: np.ndarray,
    f: np.ndarray,
    limit: int | None,
    out: np.ndarray | None = None,
    work: np.ndarray | None = None,
    wire_bits: int = 32,
) -> np.ndarray:
    """quantise() given the scale factors f (m,); `limit`: M to clip at, or None if no chunk's
    exponent was clipped."""
    # the product in float64 (the ufunc converts as it goes: no float64 copy of x; a 16-bit
    # element widens exactly)
    q = np.multiply(chunks, f[:, None], out=work, dtype=np.float64)
    if limit is not None:
        np.clip(q, -limit, limit, out=q)
    np.rint(q, out=q)
    if wire.check_wire_bits(wire_bits) == 16:
        words = wire.pack_pairs(q.astype(np.int32))  # exact: integers within +-M
        if out is None:
            return words
        out[...] = words
        return out
    if out is None:
        out = np.empty(q.shape, np.int32)
    out[...] = q  # exact: integers within +-M
    return out


def dequantise(
    sums: np.ndarray,
    exponents: np.ndarray,
    n: int,
    out: np.ndarray | None = None,
    wire_bits: int = 32,
) -> np.ndarray:
    """sums / f of (m, k) int32 aggregated words (at `wire_bits` 16: their (m, 2k) unpacked
    pairs), float32 or into `out` (float32, bfloat16 or float16) if given."""
    return dequantise_scaled(sums, scale_factors(exponents, n, wire_bits), out, wire_bits)


def dequantise_scaled(
    sums: np.ndarray, f: np.ndarray, out: np.ndarray | None = None, wire_bits: int = 32
) -> np.ndarray:
    """dequantise() given the scale factors f (m,)."""
    if wire.check_wire_bits(wire_bits) == 16:
        sums = wire.unpack_pairs(sums)
    if out is None:
        out = np.empty(np.shape(sums), np.float32)
    if out.dtype == np.float32:
        # divided in float64, rounded once to float32 on the way out
        return np.divide(sums, f[:, None], out=out, dtype=np.float64, casting="unsafe")
    # a 16-bit result: rounded to float32, then from there to nearest even (the C loop's way);
    # a sum beyond the type's range is its Inf, as in C
    with np.errstate(over="ignore"):
        out[...] = np.divide(sums, f[:, None], dtype=np.float64).astype(np.float32)
    return out


def error_bound(exponents: np.ndarray, n: int, wire_bits: int = 32) -> np.ndarray:
    """The quantisation term n / (2 f) of the bound above, per chunk (float64)."""
    return n / (2.0 * scale_factors(exponents, n, wire_bits))
