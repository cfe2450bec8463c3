"""float32 ``exp``, ``expm1`` and ``tanh`` for the kernels, in float32 arithmetic with only
correctly rounded operations (add, mul, ``fma``, ``div_rn``, integer operations).

Triton's own ``tl.exp`` compiles to ``ex2.approx`` on the argument times log2(e), whose rounding
costs up to ``|x|`` ulps; the interpreter computes it correctly rounded (numpy), so a kernel using
it computes different values on the GPU than under the tests. These are built to compute the same
bits in both places (launched with ``enable_fp_fusion=False``): ``exp`` within 1.35 ulps of the true value,
``tanh`` within 3 (2.5 measured; tests/test_triton_math32.py, over the float32 range against
float64), with no float64 (1/2 to 1/64 of float32's rate on GPUs).

``recip12``: ``1/d`` correctly rounded for ``d`` in [1, 2] (the ``div_rn`` quotient, tested on every
such float32) from a quadratic guess and three Newton steps, eight ``fma`` and no branch (two steps
within 0.67 ulps: ``EXACT=False``): ``div_rn``
calls a slow path it rarely takes, whose branch around every division keeps the compiler from
interleaving the eight quotients a thread computes. ``quotient``: ``a / b`` correctly rounded the
same way, through ``recip12`` of ``b``'s mantissa and one Markstein correction (for a normal
divisor and a normal quotient).

``exp_parts`` and ``exp_half_neg_parts``: what the float32 GELU forward uses: ``e^r`` and the power
of two ``2^k`` apart (the caller multiplies ``2^k`` in last, so a subnormal result is rounded once
without a bias), ``k`` rounded by adding ``1.5 2^23`` and read from the sum's bits, ``e^r`` as ``1 +
r (1 + r P(r))`` with a fitted ``P`` of degree 4 (six ``fma``): no clamp, ``floor``, conversion or
second power-of-two factor, which ``exp_split`` takes.

``exp``: ``x = k ln 2 + r`` with ``ln 2`` in two parts (``k ln2_hi`` exact for ``|k| < 512``),
``|r| <= ln 2 / 2``, ``e^r`` by its Taylor polynomial to degree 7 (remainder 0.1 ulp) in Horner's
form with ``fma``, times ``2^k`` as two normal factors (a subnormal result is rounded once).
"""
from __future__ import annotations

import math
import struct

import triton
import triton.language as tl

__all__: list[str] = []


def f32(v: float) -> float:
    """``v`` rounded to float32 (a constant the kernels use exactly)."""
    return struct.unpack("f", struct.pack("f", v))[0]


_L2E = tl.constexpr(f32(1.0 / math.log(2.0)))
_LN2_HI = tl.constexpr(0.693145751953125)  # 9 trailing zero bits: k * _LN2_HI exact for |k| < 512
_LN2_LO = tl.constexpr(f32(math.log(2.0) - 0.693145751953125))
#: exp's argument is clamped to [_EXP_FLOOR, _EXP_CEIL]: e^-160 2^64 underflows to 0 (64: the
#: largest ``bias`` of :func:`exp_split`, which the float32 GELU kernels use), e^89 overflows to
#: inf, and 2^k stays a product of two normal factors.
_EXP_FLOOR = tl.constexpr(-160.0)
_EXP_CEIL = tl.constexpr(89.0)


#: 1/d on [1, 2] ~ _R0 + d (_R1 + d _R2), relative error below 0.0102 (minimax, float32 coefficients)
_R0 = tl.constexpr(2.121136426925659)
_R1 = tl.constexpr(-1.4544689655303955)
_R2 = tl.constexpr(0.3232150375843048)
#: The one d in [1, 2] the steps round wrongly: 1/d = 1/2 + 2^-25 (1 + 2^-24 + ...), 2^-49 above the
#: midpoint of 1/2 and its successor; the last step starts from r = 1/2 and lands on the midpoint.
_D_TIE = tl.constexpr(2.0 - 2.0 ** -23)
_R_TIE = tl.constexpr(0.5 + 2.0 ** -24)


@triton.jit
def recip12(d, EXACT: tl.constexpr = True):
    """``1/d`` correctly rounded, for float32 ``d`` in [1, 2] (nan stays nan): each Newton step
    ``r + r (1 - d r)`` squares the relative error, 0.0102 -> 1e-4 -> 1e-8 -> 1e-16, and the last,
    from within an ulp, rounds once to the nearest float32, except at ``_D_TIE`` (selected; the
    exact value ``1/d (1 - e^2)`` the step rounds lies ``e^2/d`` below ``1/d``, and only there does
    that cross a midpoint). tests/test_triton_math32.py checks all 2^23 + 1 inputs.
    ``EXACT=False``: two steps (six ``fma``, no select), within 0.67 ulps of ``1/d`` (1e-8 before
    the last rounding; 4.3% of the quotients one ulp off): where a few ulps are allowed anyway."""
    return recip12_of_negated(-d, EXACT)


@triton.jit
def recip12_of_negated(dn, EXACT: tl.constexpr = True):
    """:func:`recip12` of ``-dn`` (``dn`` in [-2, -1]), the same bits: every step takes ``-d``
    where it would negate ``d`` (a caller that can make ``-d`` from constants saves the negation,
    which may compile to an instruction of its own, ``0 - d``)."""
    r = tl.fma(dn, tl.fma(dn, _R2, -_R1), _R0)  # R0 + d (R1 + d R2)
    r = tl.fma(r, tl.fma(dn, r, 1.0), r)
    r = tl.fma(r, tl.fma(dn, r, 1.0), r)
    if EXACT:
        r = tl.fma(r, tl.fma(dn, r, 1.0), r)
        r = tl.where(dn == -_D_TIE, _R_TIE, r)
    return r


_EXP_BITS = tl.constexpr(0x7F800000)
_MANT_BITS = tl.constexpr(0x007FFFFF)
_ONE_BITS = tl.constexpr(0x3F800000)
_SIGN_BITS = tl.constexpr(-0x80000000)
_TINY_NUMERATOR = tl.constexpr(2.0 ** -100)


@triton.jit
def quotient(a, b):
    """``a / b`` correctly rounded (``div_rn``'s bits) where ``b`` is normal, ``|b| < 2^126``, and the
    quotient is normal or zero. Elsewhere: nan if ``a`` or ``b`` is; for a subnormal or zero ``b``
    and a finite nonzero ``a``, a value of the quotient's sign; otherwise unspecified.
    ``y = RN(1/b)`` exactly (:func:`recip12` of the mantissa, times the power of two), ``q = RN(a y)``
    within an ulp, ``r = a - b q`` exact (``fma``), and ``RN(q + r y)`` is ``RN(a / b)``
    (Markstein's theorem); a numerator below 2^-100 is scaled by 2^64 first so that ``r`` stays normal."""
    bb = b.to(tl.int32, bitcast=True)
    mn = ((bb & _MANT_BITS) | (_ONE_BITS | _SIGN_BITS)).to(tl.float32, bitcast=True)  # -(|b|'s mantissa, in [1, 2))
    scale = (((254 << 23) - (bb & _EXP_BITS)) | (bb & _SIGN_BITS)).to(tl.float32, bitcast=True)  # +-2^-e
    y = recip12_of_negated(mn) * scale
    tiny = tl.abs(a) < _TINY_NUMERATOR
    a = a * tl.where(tiny, 18446744073709551616.0, 1.0)
    q = a * y
    q = tl.where(a == 0, q, tl.fma(tl.fma(-b, q, a), y, q))  # (the sum loses a zero's sign)
    return q * tl.where(tiny, 5.421010862427522e-20, 1.0)


@triton.jit
def _two_pow(ki):
    """``(2^(ki >> 1), 2^(ki - (ki >> 1)))``: two normal float32 factors for ``-252 <= ki <= 254``."""
    k1 = ki >> 1
    s1 = ((k1 + 127) << 23).to(tl.float32, bitcast=True)
    s2 = ((ki - k1 + 127) << 23).to(tl.float32, bitcast=True)
    return s1, s2


@triton.jit
def _reduce(hi, lo):
    """``(k, r)`` with ``hi + lo = k ln 2 + r``, ``|r| <= 0.35`` (``|lo|`` below ~1e-3)."""
    hi = tl.clamp(hi, _EXP_FLOOR, _EXP_CEIL, propagate_nan=tl.PropagateNan.ALL)
    k = tl.floor(hi * _L2E + 0.5)
    r = tl.fma(k, -_LN2_HI, hi)  # exact (the product is, and so is the difference)
    return k, tl.fma(k, -_LN2_LO, r) + lo


@triton.jit
def _expm1_poly(r):
    """``e^r - 1`` for ``|r| <= 0.35``: ``r + r^2 (1/2 + r/6 + ... + r^5/7!)``."""
    p = tl.fma(r, 1.0 / 5040.0, 1.0 / 720.0)
    p = tl.fma(p, r, 1.0 / 120.0)
    p = tl.fma(p, r, 1.0 / 24.0)
    p = tl.fma(p, r, 1.0 / 6.0)
    p = tl.fma(p, r, 0.5)
    return tl.fma(r * r, p, r)


@triton.jit
def exp_split(hi, lo, bias):
    """``exp(hi + lo) * 2^bias`` (``bias`` an int32, 0 to 64), relative error about one ulp."""
    k, r = _reduce(hi, lo)
    s1, s2 = _two_pow(k.to(tl.int32) + bias)
    return (_expm1_poly(r) + 1.0) * s1 * s2


#: e^r = 1 + r (1 + r P(r)) for |r| <= 0.35, P of degree 4 fitted to (e^r - 1 - r) / r^2 for the
#: least largest relative error (float32 coefficients: 0.08 ulps of e^r, against the Taylor
#: polynomial of degree 7's 0.1 in one more operation)
_P = (0.49999994039535522, 0.16666515171527863, 0.041668463498353958, 0.0083694076165556908,
      0.0013813229743391275)
_P0, _P1, _P2, _P3, _P4 = (tl.constexpr(c) for c in _P)
#: the same for e^(-r/2), |r| <= 0.7 (:func:`exp_half_neg_parts`): each coefficient times a power of
#: two, so every step is the undoubled one's times that power (the same bits)
_H0, _H1, _H2, _H3, _H4 = (tl.constexpr(c * 2.0 ** -(n + 2)) for n, c in enumerate(_P))
_MAGIC = tl.constexpr(12582912.0)  # 1.5 2^23: RN(v + _MAGIC) - _MAGIC is v rounded to an integer
_HALF_L2E = tl.constexpr(f32(0.5 / math.log(2.0)))
_LN2X2_HI = tl.constexpr(2 * 0.693145751953125)
_LN2X2_LO = tl.constexpr(f32(2 * (math.log(2.0) - 0.693145751953125)))


@triton.jit
def exp_parts(hi, lo, BIAS: tl.constexpr):
    """``(q, s)`` with ``e^(hi - lo) = q s 2^-BIAS``: ``q = e^r`` in [0.7, 1.42] within 1.35 ulps
    (1.0 measured), ``s = 2^(k + BIAS)`` a normal power of two, for ``k = hi log2(e)`` rounded, in
    [-126 - BIAS, 127 - BIAS], and ``|lo|`` below 1e-3 (nan: ``q`` nan). A caller multiplies its
    other factors into ``q``, then ``s``, then ``2^-BIAS``, so a value below float32's normal range
    is rounded once, at the end. (``lo`` is subtracted: a caller holding ``-lo`` passes it without a
    negation, which may compile to an instruction of its own.)

    ``k``: rounded by adding ``1.5 2^23`` (no ``floor``, no conversion: ``k`` is the sum's low bits,
    and ``s`` its bits shifted into the exponent), ``r = hi - k ln 2`` exact with ``ln 2``'s first
    part, then the second and ``lo``; ``e^r`` by :data:`_P`."""
    t = tl.fma(hi, _L2E, _MAGIC)
    k = t - _MAGIC
    r = tl.fma(k, -_LN2_LO, tl.fma(k, -_LN2_HI, hi)) - lo
    p = tl.fma(tl.fma(tl.fma(tl.fma(r, _P4, _P3), r, _P2), r, _P1), r, _P0)
    return tl.fma(tl.fma(p, r, 1.0), r, 1.0), _scale_of(t, BIAS)


@triton.jit
def exp_half_neg_parts(a, b, BIAS: tl.constexpr):
    """:func:`exp_parts` of ``hi = -a/2``, ``lo = b/2``, the same bits (``e^(-(a + b)/2)``, ``a >= 0``,
    the same range of ``k``), with no negation: every quantity is the other's times ``-2``
    (``rn = -2 r``), so the constants carry the signs and the factors of 2 (:data:`_H`)."""
    t = tl.fma(a, -_HALF_L2E, _MAGIC)
    k = t - _MAGIC
    rn = tl.fma(k, _LN2X2_LO, tl.fma(k, _LN2X2_HI, a)) + b  # -2 r
    # 1 + r (1 + r P(r)) with r = -rn/2: the Horner steps with every other sign flipped
    g = tl.fma(tl.fma(tl.fma(tl.fma(rn, _H4, -_H3), rn, _H2), rn, -_H1), rn, _H0)
    return tl.fma(tl.fma(g, rn, -0.5), rn, 1.0), _scale_of(t, BIAS)


@triton.jit
def _scale_of(t, BIAS: tl.constexpr):
    """``2^(k + BIAS)`` from ``t = 1.5 2^23 + k``."""
    # bits(t) = bits(1.5 2^23) + k = 0x4B400000 + k, whose low 9 bits are 0: shifted by 23, k's exponent field
    return ((t.to(tl.int32, bitcast=True) << 23) + ((127 + BIAS) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def exp(x):
    """``e^x`` for float32 ``x`` (0 below e^-104, inf above e^88.7; nan stays nan)."""
    return exp_split(x, tl.zeros_like(x), 0)


@triton.jit
def tanh(x):
    """``tanh(x) = -m / (2 + m)``, ``m = expm1(-2|x|)`` (no cancellation at any ``x``), with
    ``x``'s sign; ``+-0`` and nan kept."""
    k, r = _reduce(-2.0 * tl.abs(x), tl.zeros_like(x))
    s1, s2 = _two_pow(k.to(tl.int32))
    s = s1 * s2  # 2^k, k <= 0
    m = tl.fma(s, _expm1_poly(r), s - 1.0)  # 2^k (e^r - 1) + (2^k - 1), in (-1, 0]
    t = tl.math.div_rn(-m, m + 2.0)
    return tl.where(x == 0, x, tl.where(x < 0, -t, t))
