"""Exact memory-lean GELU: keep the output and one bit per element, rebuild the gradient.

Tempo (arXiv 2210.10246) observed that the layer after a GELU keeps the GELU's output ``y``
anyway, so a GELU that keeps ``y`` (instead of its input ``x``) costs almost nothing extra. GELU
is not monotone, so ``y`` alone does not determine ``x``: one bit per element says on which side
of the minimum ``x*`` (``GELU'(x*) = 0``) the input was. Tempo rebuilt ``GELU'(x)`` from ``y``
with polynomial fits; here backward *solves* ``GELU(x) = y`` on the stored branch (no
data-dependent control flow, so it traces under ``torch.compile``), then evaluates the exact
derivative:

- 16-bit storage (bfloat16, float16): the derivative is a function of the 16-bit pattern of ``y``
  and the bit, 2 x 65536 values. They are computed once (per dtype, mode and device, lazily, with
  the exact rebuild below: ``_grad_from_output``) into a 512 KiB float32 table; backward is a
  gather and the product with the incoming gradient, rounded once, bitwise what the exact rebuild
  gives for every input. The forward is a 65536-entry table of GELU as well (bitwise the float32
  working-precision forward).
- float32 storage: an initial guess for ``x`` from a table (a key computed from ``y`` picks one of
  2**17 cells; linear interpolation in the cell; error ~1e-7), then one float64 step of third
  order (``f'(x0 + q) = f' + q f'' + q**2 h``, ``q = (y - f)/f'``, ``h`` from the table), so one
  float64 ``erfc`` and ``exp`` (tanh: one ``exp``) per element.
- float64 storage: safeguarded Halley steps from asymptotic initial guesses, with compensated
  arithmetic (below).

Kept for backward: ``y`` (``ctx.save_for_backward``, so modifying it in place afterwards makes
backward raise) and ``ceil(numel / 8)`` bytes of packed branch bits. ``x`` is not kept.

Precision (derivation in ``docs/gelu_bound.md``). The stored ``y`` is ``GELU(x)`` rounded, so
the true output lies within half an ulp of it and the best any output-based rebuild can return is
a derivative between the extremes of ``GELU'`` over those outputs. Next to the minimum the
inverse has a square-root branch point and that interval is wide: about
``sqrt(2 GELU''(x*) ulp(y*)/2)``, 8e-5 for float32, 2e-2 for bfloat16. This rebuild stays within
that interval plus the final rounding (float64: plus ~3 ulps) everywhere. To get there it works
in a wider precision than the storage: float32 for 16-bit storage (the table entries), float64
for float32; float64 storage runs in float64 with error-free products (Dekker), compensated
``x/sqrt 2``, ``x**2`` and tanh argument in the tail, and the exact Taylor expansion of GELU about
``x*`` next to the minimum.

Cost (``docs/gelu_bound.md``, "Speed"; one CPU thread, fwd+bwd): 16-bit storage is a table
gather each way, about 2x torch's fused erf kernel and on par with its tanh form (9-15x faster
than rebuilding every element); float32 storage is about 40 elementwise passes over 64k-element
slices, 10x torch's erf form and 6x its tanh form (2.3-3.2x faster than before). The float32
forward stays in float64: float32 ``erfc`` would misround about 40% of the outputs. The saved
bit of a NaN input is never used (its gradient is NaN on either branch).

The forward differs from ``torch.nn.functional.gelu`` on purpose: torch evaluates
``0.5*x*(1+erf(x/sqrt 2))`` (or ``1+tanh``), which cancels for ``x < -3`` (float32 at ``x=-5``:
-1.19e-6 against the true -1.433e-6; ``-0.0`` from ``x=-6``). Here ``Phi(x) = erfc(-x/sqrt 2)/2``
and the tanh form is ``x*sigmoid(2z)``, both free of cancellation and computed one precision
wider than the storage, so leanact's output is the truth rounded once (16-bit: but for a few in
10^4 values, one ulp off; float64: within ~2 ulps) and differs from torch's only where torch's has
that cancellation error (and is then the closer to the float64 truth). Output is contiguous (torch
keeps a transposed input's strides); values are the same. Special values
follow torch's float64 kernel: ``GELU(+inf) = inf`` (torch's float32/bf16 erf kernel returns nan
there), ``GELU(-inf) = nan``, ``GELU(nan) = nan``, signed zeros kept; the gradient at ``+-inf``
and ``nan`` is nan and at ``+-0`` 0.5, as torch's.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from .bitpack import pack_bits, unpack_bits
from .transforms import functorch_active
from .triton import dispatch as _triton

__all__ = ["gelu", "GeluFunction", "gelu_minimum", "gelu_grad_from_output"]

_APPROXIMATE = ("none", "tanh")
#: Elements per slice in eager mode (a multiple of 8: slices start on a byte of the packed bits),
#: so the working-precision buffers (preallocated once per call, reused by every slice) stay small
#: whatever the tensor size: on the CPU sized for the cache; on accelerators larger, as every op
#: is a kernel launch (there the op is meant to run under torch.compile, which fuses it). Under
#: torch.compile the whole tensor is one graph.
CHUNK = 1 << 16
CHUNK_ACCELERATOR = 1 << 22
_CLAMP = 50.0  # beyond |x| = 50 every Phi/phi/sigmoid term below is exactly 0 or 1 (fp32 and fp64)
_SQRT1_2 = math.sqrt(0.5)
_INV_SQRT_PI = 1.0 / math.sqrt(math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_LN_INV_SQRT_2PI = -0.5 * math.log(2.0 * math.pi)
_K1 = 2.0 * math.sqrt(2.0 / math.pi)  # tanh form: GELU(x) = x * sigmoid(v), v = K1 (x + A x^3)
_A = 0.044715
_TAYLOR_TERMS = 40  # f(x*+d) - y* = sum_{n=2}^{39} p_n d^n: truncation below 1e-20 for |d| <= 0.75
# float64 storage: where f - y* and f' come from that expansion: -0.75 <= x - x* <= 0.45. Left of
# x* the direct f' = Phi + x phi cancels (by up to 3x); right of x* + 0.45 it does not, and there
# y* + (f - y*) would cancel instead (f -> 0 as x -> 0).
_WINDOW = (-0.75, 0.45)


def _near(d: torch.Tensor) -> torch.Tensor:
    return (d - 0.5 * (_WINDOW[0] + _WINDOW[1])).abs() <= 0.5 * (_WINDOW[1] - _WINDOW[0])


@dataclass(frozen=True)
class _Consts:
    """Per-mode constants (plain floats: they trace as literals). ``*_lo``: double-double tails."""

    xs: float
    xs_lo: float
    ys: float
    ys_lo: float
    ys32: float  # y* split for float32 arithmetic: ys32 is a float32 number
    ys32_lo: float
    c2: float  # GELU''(x*)
    b1: float  # GELU'''(x*) / (3 GELU''(x*)), for the square-root initial guess
    taylor: tuple[float, ...]  # p_2 .. p_{N-1}: f(x* + d) - y* = sum p_n d^n
    dtaylor: tuple[float, ...]  # n p_n: f'(x* + d) = sum n p_n d^(n-1)


def _dd(v) -> tuple[float, float]:
    hi = float(v)
    return hi, float(v - hi)


def _mode_constants(approximate: str) -> _Consts:
    """Minimum, curvature and Taylor coefficients at the minimum (mpmath, 50 digits).

    The Taylor coefficients come from the ODEs the functions satisfy (exact power-series
    recurrences), not from fitting: erf form ``phi' = -x phi``; tanh form ``s' = s(1-s) v'``.
    """
    import mpmath as mp

    n = _TAYLOR_TERMS
    with mp.workdps(50):
        if approximate == "none":
            def grad(x):
                return mp.ncdf(x) + x * mp.npdf(x)
        else:
            k1, a = 2 * mp.sqrt(2 / mp.pi), mp.mpf("0.044715")

            def grad(x):
                s = 1 / (1 + mp.exp(-k1 * (x + a * x**3)))
                return s + x * s * (1 - s) * k1 * (1 + 3 * a * x**2)
        xs = mp.findroot(grad, mp.mpf("-0.75"))
        if approximate == "none":
            # phi(x*+d) = phi(x*) E(d), E' = (-x* - d) E  ->  (m+1) E_{m+1} = -x* E_m - E_{m-1}
            e = [mp.mpf(1), -xs]
            for m in range(1, n):
                e.append((-xs * e[m] - e[m - 1]) / (m + 1))
            h = [mp.ncdf(xs)] + [mp.npdf(xs) * e[m - 1] / m for m in range(1, n)]  # Phi(x*+d)
        else:
            # h(d) = sigmoid(v(x*+d)): h' = h (1-h) v'(x*+d), v' a quadratic in d
            vp = [k1 * (1 + 3 * a * xs**2), k1 * 6 * a * xs, k1 * 3 * a]
            h = [1 / (1 + mp.exp(-k1 * (xs + a * xs**3)))]
            hh = []  # coefficients of h (1 - h)
            for m in range(n - 1):
                hh.append(h[m] - sum(h[j] * h[m - j] for j in range(m + 1)))
                h.append(sum(hh[i] * vp[m - i] for i in range(max(0, m - 2), m + 1)) / (m + 1))
        f = [xs * h[0]] + [xs * h[m] + h[m - 1] for m in range(1, n)]  # f = (x* + d) h(d)
        xs_hi, xs_lo = _dd(xs)
        ys_hi, ys_lo = _dd(f[0])
        ys32 = torch.tensor(ys_hi, dtype=torch.float32).item()
        return _Consts(
            xs=xs_hi, xs_lo=xs_lo, ys=ys_hi, ys_lo=ys_lo, ys32=ys32, ys32_lo=float(f[0] - ys32),
            c2=float(2 * f[2]), b1=float(f[3] / f[2]),
            taylor=tuple(float(v) for v in f[2:]), dtaylor=tuple(float(m * f[m]) for m in range(2, n)),
        )


_CONSTS = {mode: _mode_constants(mode) for mode in _APPROXIMATE}


def _check(approximate: str) -> str:
    if approximate not in _APPROXIMATE:
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return approximate


def gelu_minimum(approximate: str = "none") -> tuple[float, float]:
    """``(x*, y*)``: where GELU has its minimum and the minimum value (float64)."""
    c = _CONSTS[_check(approximate)]
    return c.xs, c.ys


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Working precision: one step wider than the storage (float64 stays float64)."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    if dtype in (torch.float32, torch.float64):
        return torch.float64
    raise TypeError(f"leanact GELU supports float16, bfloat16, float32 and float64, got {dtype}")


# -- error-free float64 arithmetic (float64 storage only) --------------------------------------

_SPLIT_MASK = -(1 << 27)  # keeps the top 26 significant bits of a float64


def _split(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a = hi + lo`` exactly, ``hi`` with 26 significant bits (a bit mask: immune to reassociation)."""
    hi = torch.bitwise_and(a.view(torch.int64), _SPLIT_MASK).view(torch.float64)
    return hi, a - hi


def _prod_err(a: torch.Tensor, p: torch.Tensor, b=None, b_parts=None) -> torch.Tensor:
    """``a*b - p`` for ``p = fl(a*b)`` (Dekker), exact up to ~2**-100 relative."""
    ah, al = _split(a)
    bh, bl = b_parts if b_parts is not None else _split(b)
    return ((ah * bh - p) + ah * bl + al * bh) + al * bl


class _DDConst:
    """A real constant as float64 ``hi`` (plus its 26-bit split) and the tail ``lo``."""

    def __init__(self, value):
        self.hi, self.lo = _dd(value)
        hi, lo = _split(torch.tensor([self.hi], dtype=torch.float64))
        self.parts = (hi.item(), lo.item())

    def mul(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``a * value = p + e``: ``p`` rounded, ``e`` its error (to ~2**-100 relative)."""
        p = a * self.hi
        return p, _prod_err(a, p, b_parts=self.parts) + a * self.lo


def _dd_consts():
    import mpmath as mp

    with mp.workdps(40):
        k1 = 2 * mp.sqrt(2 / mp.pi)
        return _DDConst(mp.sqrt(mp.mpf(1) / 2)), _DDConst(k1), _DDConst(k1 * mp.mpf("0.044715"))


_C_SQRT1_2, _C_K1, _C_K3 = _dd_consts()


# -- GELU and its derivatives ------------------------------------------------------------------
# Few, mostly in-place elementwise ops and no torch.where on the float32/16-bit path: in eager
# mode every op is a pass over the slice (and torch.where costs about ten multiplications on CPU).


def _sigmoid_pair(v: torch.Tensor, stable: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sigmoid(v), sigmoid(-v))``. ``stable``: full relative precision down to subnormal results
    (torch.sigmoid returns 0 once exp(-v) overflows: below ~1e-38 in float32, ~1e-308 in float64)."""
    if not stable:
        return torch.sigmoid(v), torch.sigmoid(-v)
    e = v.abs().neg_().exp_()
    big = (e + 1.0).reciprocal_()
    small = e.mul_(big)
    neg = (v < 0).to(v.dtype)
    return torch.lerp(big, small, neg), torch.lerp(small, big, neg)  # exact selections (weights 0/1)


def _tanh_v(xc: torch.Tensor, precise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sigmoid(v), sigmoid(-v), x**2)`` for ``v = K1 (x + A x^3)`` (the tanh form, ``v = 2z``)."""
    x2 = xc * xc
    if not precise:
        v = (x2 * _A).add_(1.0).mul_(xc).mul_(_K1)
        return (*_sigmoid_pair(v, stable=xc.dtype != torch.float64), x2)
    # v = K1 x + K3 x^3 to ~2**-100 relative: in the tail the output's relative error is |v| err(v)
    r = _prod_err(xc, x2, xc)  # x^2 = x2 + r
    x3 = xc * x2
    e3 = _prod_err(xc, x3, x2) + xc * r  # x^3 = x3 + e3
    a1, ea1 = _C_K1.mul(xc)
    a3, ea3 = _C_K3.mul(x3)
    vh = a1 + a3
    bb = vh - a1
    vl = ((a1 - (vh - bb)) + (a3 - bb)) + ea1 + ea3 + e3 * _C_K3.hi
    s, sm = _sigmoid_pair(vh, stable=True)
    t = s * sm * vl  # sigmoid(vh + vl) = s + s (1 - s) vl + O(vl^2)
    return s + t, sm - t, x2


def _erf_cdf2(xc: torch.Tensor, precise: bool) -> torch.Tensor:
    """``2 Phi(x) = erfc(-x/sqrt 2)`` (no cancellation for x < 0)."""
    if not precise:
        return torch.special.erfc(xc * -_SQRT1_2)
    # x/sqrt2 = p + e exactly: a half-ulp error in p alone would cost x**2/2 ulps of Phi in the tail
    p, e = _C_SQRT1_2.mul(xc)
    return torch.special.erfc(-p) + e * torch.exp(-p * p) * (2.0 * _INV_SQRT_PI)


def _derivs(x: torch.Tensor, ny: torch.Tensor, approximate: str, precise: bool, third: bool):
    """``(f(x) - y, f'(x), f''(x), f'''(x) or None)`` for GELU ``f``; ``ny = -y``."""
    xc = x.clamp(-_CLAMP, _CLAMP)
    if approximate == "none":
        cdf2 = _erf_cdf2(xc, precise)
        x2 = xc * xc
        if precise:  # exp(-(x2 + r)/2) with x**2 = x2 + r exactly
            pdf = (x2 * -0.5).exp_().mul_(_prod_err(xc, x2, xc).mul_(-0.5).add_(1.0)).mul_(_INV_SQRT_2PI)
        else:
            pdf = (x2 * -0.5).add_(_LN_INV_SQRT_2PI).exp_()
        xpdf = xc * pdf
        f3 = x2.sub_(4.0).mul_(xpdf) if third else None  # phi (x^3 - 4x)
        f2 = torch.addcmul(pdf, xc, xpdf, value=-1.0).add_(pdf)  # phi (2 - x^2)
        cdf = cdf2.mul_(0.5)  # halved first: x * cdf2 overflows for x ~ max float
        return torch.addcmul(ny, x, cdf), xpdf.add_(cdf), f2, f3
    s, sm, x2 = _tanh_v(xc, precise)
    p = s * sm  # s' = p v'
    v1 = (x2 * (3.0 * _A * _K1)).add_(_K1)  # v'
    v2 = xc * (6.0 * _A * _K1)  # v''
    d = sm - s  # 1 - 2s without cancellation
    s1 = p * v1
    s2 = (d * v1).mul_(v1).add_(v2).mul_(p)
    f3 = None
    if third:
        s3 = (1.0 - 6.0 * p).mul_(v1).mul_(v1).mul_(v1).add_(d.mul_(3.0).mul_(v1).mul_(v2))
        f3 = (xc * s3.add_(6.0 * _A * _K1).mul_(p)).add_(s2, alpha=3.0)
    return torch.addcmul(ny, x, s), (xc * s1).add_(s), (xc * s2).add_(s1, alpha=2.0), f3


def _forward_w(xw: torch.Tensor, approximate: str, precise: bool) -> torch.Tensor:
    """GELU(x) in the working precision (the clamp only keeps float64's error-free splits finite)."""
    xc = xw.clamp(-_CLAMP, _CLAMP) if precise else xw
    if approximate == "none":
        y = _erf_cdf2(xc, precise).mul_(0.5).mul_(xw)  # this order: no overflow at x ~ 3e38
    else:
        y = _tanh_v(xc, precise)[0].mul_(xw)
    if precise:  # next to the minimum: y* + (f - y*) from the expansion, rounded once
        c = _CONSTS[approximate]
        d = (xw - c.xs) - c.xs_lo
        y = torch.where(_near(d), c.ys + (c.ys_lo + _taylor(d, c.taylor, 2)), y)
    return y


# -- the rebuild: solve GELU(x) = y on the stored branch, then GELU'(x) -------------------------


def _initial_guess(y, rf, sign, big_y, approximate: str, c: _Consts) -> torch.Tensor:
    """Asymptotic initial guess for x on each branch.

    Near the minimum ``y - y* = c2/2 d^2 (1 + b1 d + ...)``, so ``d ~ u / sqrt(1 + b1 u)`` with
    ``u = +-sqrt(2 (y - y*) / c2)`` (the square-root branch point). Left tail: log space. Right,
    ``y >= 0.2``: one fixed-point step of ``x = y + x (1 - cdf(x))`` from ``x = y``.
    ``rf``: 1. on the right branch, 0. on the left; ``sign = 2 rf - 1``; ``big_y = y - y* > 0``.
    """
    u = big_y.sqrt().mul_(sign * math.sqrt(2.0 / c.c2))  # sqrt first: finite up to max float
    x_min = (u / (u * c.b1).add_(1.0).sqrt_()).add_(c.xs)
    tiny = torch.finfo(y.dtype).tiny * torch.finfo(y.dtype).eps  # smallest subnormal
    ln_y = (-y).clamp_min_(tiny).log_()  # ln(-y) on the left branch (finite everywhere)
    if approximate == "none":
        # -y = phi(x) |x| R(|x|), Mills ratio R(t) ~ 1/(t + 1/(t + 2/t)): -y ~ phi(x)(x^2+2)/(x^2+3)
        w = ln_y.mul_(-2.0).add_(2.0 * _LN_INV_SQRT_2PI)
        w += ((w + 2.0) / (w + 3.0)).log_().mul_(2.0)
        x_left = w.sqrt_().neg_()
        x_right = torch.special.erfc(y * _SQRT1_2).mul_(0.5).mul_(y).add_(y)
    else:
        # -y = t sigmoid(-K1 (t + A t^3)), t = -x: K1 (t + A t^3) ~ ln t - ln(-y). The cubic
        # A t^3 + t = q by the hyperbolic formula (ln t dropped), then Newton steps with ln t.
        lam = ln_y.neg_()
        z = lam * (1.5 * math.sqrt(3.0 * _A) / _K1)
        e = (z * z).add_(1.0).sqrt_().add_(z).log_().mul_(1.0 / 3.0).exp_()
        t = (e - e.reciprocal()).mul_(1.0 / math.sqrt(3.0 * _A))
        for _ in range(2):
            t2 = t * t
            h = (t2 * _A).add_(1.0).mul_(t).mul_(-_K1).add_(t.log()).add_(lam)
            t += h.div_(t2.mul_(3.0 * _A * _K1).add_(_K1).sub_(t.reciprocal()))
        x_left = t.neg_()
        yc = y.clamp(0.0, _CLAMP)
        x_right = (yc * yc).mul_(_A).add_(1.0).mul_(yc).mul_(-_K1).sigmoid_().mul_(y).add_(y)
    far = (y >= rf * 0.32 - 0.12).to(y.dtype)  # right: y >= 0.2; left: y >= -0.12 (x < -1.3)
    return torch.lerp(x_min, torch.lerp(x_left, x_right, rf), far)  # exact selections


def _taylor(d: torch.Tensor, coefs: tuple[float, ...], power: int) -> torch.Tensor:
    """``d**power * sum_k coefs[k] d**k`` by Horner (float64, |d| <= 0.75)."""
    acc = torch.full_like(d, coefs[-1])
    for coef in coefs[-2::-1]:
        acc = acc.mul_(d).add_(coef)
    return acc.mul_(d).mul_(d) if power == 2 else acc.mul_(d)


def _halley(x, ny, approximate: str, c: _Consts, precise: bool, third: bool, big_y=None):
    """One step for ``f(x) = y``: ``(step, f', f'', f''')`` at ``x``; the next iterate is ``x - step``.

    Chebyshev's form of the cubically convergent step, ``q (1 + q f''/(2 f'))`` with
    ``q = (f - y)/f'``: normalized (f, f', f'' may be ~1e-300) and free of a second division.
    """
    r, g0, f2, f3 = _derivs(x, ny, approximate, precise, third)
    if precise:  # next to the minimum f - y cancels: use the exact expansion there
        d = (x - c.xs) - c.xs_lo
        r = torch.where(_near(d), _taylor(d, c.taylor, 2) - big_y, r)
    q = r.div_(g0)
    return torch.addcmul(q, q, (q * f2).div_(g0), value=0.5), g0, f2, f3


def _grad_from_output(y: torch.Tensor, right: torch.Tensor, approximate: str) -> torch.Tensor:
    """GELU'(x) for the x with GELU(x) = y (storage dtype) on the branch ``right`` (x > x*).

    Returns the derivative in the working precision. Stage A (float32): initial guess and one
    safeguarded step, masked where float32 cannot improve the guess. Stage B (working precision):
    the last step, whose own Taylor expansion gives f' at the solution without another erfc/exp.
    float64 storage: three float64 steps with the compensated evaluations and Taylor residual.
    """
    c = _CONSTS[approximate]
    precise = y.dtype == torch.float64
    wa = torch.float64 if precise else torch.float32
    ya, rfa = y.to(wa), right.to(wa)
    sign = rfa * 2.0 - 1.0
    sx = sign * c.xs
    big = (ya - c.ys) - c.ys_lo if precise else (ya - c.ys32) - c.ys32_lo  # y - y* (Sterbenz: exact)
    # y rounded to (or below) the minimum: the outputs that round to y include y*, where f' = 0.
    # y = 0 on the left branch (underflow): f' lies between 0 and f'(x(-ulp/2)); returned: 0.
    keep = (big > 0) & ((ya < 0) | right)
    x = _initial_guess(ya, rfa, sign, big.clamp_min(1e-30), approximate, c)
    if precise:
        steps, yb, big_b = 3, ya, big
    else:
        # The first step in float32, skipped next to the minimum (f - y is float32 noise there;
        # the square-root guess is accurate) and in the deep left tail (float32 f, f' subnormal;
        # the log-space guess is accurate). Safeguard: the iterate stays on its branch.
        use = ((big > 1e-4) & ((ya < -1e-37) | right)).to(wa)
        step = _halley(x, -ya, approximate, c, False, False)[0]
        x = torch.maximum(x.sub_(step.nan_to_num_(0.0, 0.0, 0.0).mul_(use)).mul_(sign), sx).mul_(sign)
        wb = _work_dtype(y.dtype)
        steps, yb, x, big_b = 1, y.to(wb), x.to(wb), None
    for i in range(steps):
        last = i == steps - 1 and not precise
        step, g0, f2, f3 = _halley(x, -yb, approximate, c, precise, last, big_b)
        if not last:
            x = torch.maximum(x.sub_(step).mul_(sign), sx).mul_(sign)
    if precise:  # f' at the solution, directly; next to the minimum (where it cancels) expanded
        g = _derivs(x, -yb, approximate, True, False)[1]
        d = (x - c.xs) - c.xs_lo
        g = torch.where(_near(d), _taylor(d, c.dtaylor, 1), g)
    else:  # f'(x - step) from the expansion at x: no further erfc/exp evaluation
        g = torch.addcmul(g0, step, torch.addcmul(f2, step, f3, value=-0.5), value=-1.0)
    # Elements masked by `keep` may have iterated anywhere: sanitized, then zeroed. y * 0 is nan
    # exactly for y = +-inf or nan: their gradient is nan, as torch's.
    return g.nan_to_num_(0.0, 0.0, 0.0).mul_(keep).add_(yb * 0.0)


# -- lookup tables -----------------------------------------------------------------------------
# Built lazily, once per (kind, dtype, mode, device), outside autograd, and cached. Under
# torch.compile the accessor runs while the graph is traced and its result enters the graph as a
# constant (`assume_constant_result`), so the traced op reads the same table as eager mode. One
# accessor per (kind, dtype, mode), with its own code name: dynamo names the constant after it.

_TABLES: dict[tuple[str, str, str, str], torch.Tensor] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _table(kind: str, dtype: str, approximate: str, device: str) -> torch.Tensor:
    """The cached table ``kind`` (see ``_BUILDERS``) for storage ``dtype`` and mode on ``device``."""
    key = (kind, dtype, approximate, device)
    t = _TABLES.get(key)
    if t is None:
        with torch.no_grad():
            t = _BUILDERS[kind](getattr(torch, dtype), approximate, torch.device(device))
        if type(t) is torch.Tensor:  # a real tensor, not a tracing mode's stand-in: keep it
            _TABLES[key] = t
    return t


def _all_patterns(dtype: torch.dtype, device) -> torch.Tensor:
    """Every 16-bit pattern, in the order of its unsigned value, as ``dtype``."""
    return torch.arange(1 << 16, dtype=torch.int32, device=device).to(torch.int16).view(dtype)


def _build_y16(dtype, approximate, device):
    """16-bit storage: GELU of every input pattern, exactly what the working-precision forward
    (``_forward_w`` in float32, rounded once) returns for it."""
    return _forward_w(_all_patterns(dtype, device).to(torch.float32), approximate, False).to(dtype)


def _build_g16(dtype, approximate, device):
    """16-bit storage: the rebuilt derivative (float32, before the product with the incoming
    gradient) for every output pattern, left branch (entries 0..65535) then right branch."""
    y = _all_patterns(dtype, device).repeat(2)
    right = torch.arange(1 << 17, device=device) >= (1 << 16)
    return _grad_from_output(y, right, approximate)


def _build_spread(dtype, approximate, device):
    """Unpacking: entry b is the int64 whose 8 bytes are the bits of b (0 or 1), lowest first."""
    b = torch.arange(256, dtype=torch.int32, device=device)
    bits = (b[:, None] >> torch.arange(8, dtype=torch.int32, device=device)) & 1
    return bits.to(torch.uint8).contiguous().view(torch.int64).view(-1)


# float32 storage: initial guess for x from (y, bit) by a table, then one step in float64.
# The key is a float32 computed from y whose exponent and top _KEY_BITS mantissa bits pick the
# cell (x is interpolated linearly in the key within it). With D = y - c32, c32 the largest
# float32 below y* (D is exact next to the minimum, Sterbenz):
#   right branch: key = (D - 2**-52) 2**-77 (the offset, a quarter of an ulp of the smallest
#     positive D, only makes D = 0 negative): the cells resolve the square-root branch point; keys
#     in [2**-104, 2**-72), clamped above (y > 32, where x = y);
#   left branch: key = -y / (right key before the clamp) = |y| 2**77 / D: resolves both ends
#     (y -> y*, and the tail y -> 0-, float32 subnormals included); keys in [2**-70, 2**102).
# Both are positive exactly for the elements that have a derivative (y > y*; on the left branch
# also y < 0), and the two ranges do not overlap, so one table indexed by the key's exponent and
# top mantissa bits serves both branches.
_KEY_BITS = 9
_KEY_SHIFT = 23 - _KEY_BITS
_NCELL = 1 << (8 + _KEY_BITS)
_KEY_SCALE = 2.0 ** -77
_KEY_TINY = 2.0 ** -52  # normal: a subnormal operand in every element would be slow
_KEY_RIGHT = (-104, -72)
_KEY_LEFT = (-70, 102)
_KEY_RIGHT_MAX = float(torch.nextafter(torch.tensor(2.0 ** _KEY_RIGHT[1]), torch.tensor(0.0)))


def _below(v: float) -> float:
    """The largest float32 strictly below ``v``."""
    t = torch.tensor(v, dtype=torch.float32)
    if t.item() >= v:
        t = torch.nextafter(t, torch.tensor(-math.inf))
    return t.item()


def _f_f64(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """GELU in float64 without cancellation (for the table builder)."""
    if approximate == "none":
        return x * 0.5 * torch.special.erfc(x * -_SQRT1_2)
    return x * torch.sigmoid(x * _K1 * (1.0 + _A * x * x))  # relative accuracy down to x = -24


def _solve_f64(t: torch.Tensor, right: torch.Tensor, approximate: str) -> torch.Tensor:
    """x on the branch with GELU(x) = t, by bisection in float64 (for the table builder)."""
    xs = _CONSTS[approximate].xs
    lo = torch.where(right, torch.full_like(t, xs), torch.full_like(t, -40.0))
    hi = torch.where(right, torch.full_like(t, 40.0), torch.full_like(t, xs))
    for _ in range(52):  # 40 * 2**-52: 1e-14, relative to |x - x*| >= 7e-5 still 1e-10
        mid = 0.5 * (lo + hi)
        fm = _f_f64(mid, approximate)
        up = torch.where(right, fm < t, fm > t)  # the solution lies right of mid
        lo, hi = torch.where(up, mid, lo), torch.where(up, hi, mid)
    return 0.5 * (lo + hi)


_GUESS_CPU: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def _guess_tables(approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ab, h)`` on the CPU: per cell, x ~ a + b key (a, b float32 packed in an int64: linear
    interpolation in the cell), and h = (f''' - f''**2/f')/2 at the cell's centre
    (float64), the second-order coefficient of the float64 step."""
    if approximate in _GUESS_CPU:
        return _GUESS_CPU[approximate]
    c = _CONSTS[approximate]
    c32 = _below(c.ys)
    dc = (c.ys - c32) + c.ys_lo  # y* - c32, in (0, ulp)
    cell = torch.arange(_NCELL, dtype=torch.float64)
    e = torch.div(cell, 1 << _KEY_BITS, rounding_mode="floor") - 127
    m = cell.remainder(1 << _KEY_BITS)
    in_r = (e >= _KEY_RIGHT[0]) & (e < _KEY_RIGHT[1])
    in_l = (e >= _KEY_LEFT[0]) & (e < _KEY_LEFT[1])
    nodes = ((1 - math.sqrt(0.5)) / 2, (1 + math.sqrt(0.5)) / 2, 0.5)  # Chebyshev nodes, centre
    t = torch.tensor(nodes, dtype=torch.float64)[:, None]
    key = torch.pow(2.0, e) * (1 + (m + t) / (1 << _KEY_BITS))  # (3, cells)
    # right: D = y - c32 = key / scale; left: u = |y| / D = key * scale, D = |c32| / (1 + u)
    u = key * _KEY_SCALE
    d = torch.where(in_r, key / _KEY_SCALE, -c32 / (1 + u))
    y = torch.where(in_l & (u < 1), -(u * -c32) / (1 + u), c32 + d)  # the tail: relative accuracy
    ok = (in_r | in_l) & (d > dc)  # cells an element with a derivative can reach
    x = torch.ones_like(y)  # elsewhere x = 1: finite, harmless
    x[ok] = _solve_f64(y[ok], in_r.expand_as(y)[ok], approximate)
    xs = x.unbind()
    b = (xs[1] - xs[0]) / (key[1] - key[0])
    a = xs[0] - b * key[0]
    ab = torch.stack([a, b], 1).to(torch.float32).contiguous().view(torch.int64).view(-1)
    xc = xs[2]
    _, f1, f2, f3 = _derivs(xc, torch.zeros_like(xc), approximate, False, True)
    h = 0.5 * (f3 - f2 * f2 / f1)
    _GUESS_CPU[approximate] = (ab, h)
    return ab, h


def _build_ab32(dtype, approximate, device):
    return _guess_tables(approximate)[0].to(device)


def _build_h32(dtype, approximate, device):
    return _guess_tables(approximate)[1].to(device)


_BUILDERS = {
    "y16": _build_y16, "g16": _build_g16, "spread": _build_spread,
    "ab32": _build_ab32, "h32": _build_h32,
}


def _accessor(kind: str, dtype: str, approximate: str):
    def table(device: str) -> torch.Tensor:
        return _table(kind, dtype, approximate, device)

    name = f"_gelu_table_{kind}_{dtype}_{approximate}"
    table.__code__ = table.__code__.replace(co_name=name)
    table.__name__ = table.__qualname__ = name
    return torch.compiler.assume_constant_result(table)


_ACCESSORS = {
    (kind, dtype, mode): _accessor(kind, dtype, mode)
    for kind, dtypes in (("y16", ("bfloat16", "float16")), ("g16", ("bfloat16", "float16")),
                         ("ab32", ("float32",)), ("h32", ("float32",)))
    for dtype in dtypes for mode in _APPROXIMATE
}
_ACCESSORS["spread", "uint8", "none"] = _accessor("spread", "uint8", "none")


def _right_threshold(dtype: torch.dtype) -> tuple[float, int]:
    """``x > x*`` as the forward decides it (float32 or float64 comparison with x*): for float32
    input ``x > t`` with ``t`` a float32; for 16-bit input ``pattern < u`` with the pattern read
    as an unsigned integer (finite values and infinities; a NaN's bit is never used)."""
    out = {}
    for mode in _APPROXIMATE:
        xs = _CONSTS[mode].xs
        if dtype == torch.float32:  # x > xs (float64) <=> x > t, as xs is no float32
            assert torch.tensor(xs, dtype=torch.float32).item() != xs
            out[mode] = (_below(xs), 0)
            continue
        p = _all_patterns(dtype, "cpu")
        bit = p.to(torch.float32) > torch.tensor(xs, dtype=torch.float32)  # the forward's comparison
        u = 0x8000 + int(bit[0x8000:].sum())  # -0 and the negatives above x* come first
        pu = torch.arange(1 << 16)
        finite = ~torch.isnan(p.to(torch.float32))
        assert torch.equal(bit[finite], (pu < u)[finite])
        out[mode] = (0.0, u)
    return out


_THRESHOLDS = {dt: _right_threshold(dt) for dt in (torch.float32, torch.bfloat16, torch.float16)}
_C32 = {mode: _below(_CONSTS[mode].ys) for mode in _APPROXIMATE}  # the largest float32 below y*


# -- bit packing (the layout of leanact.ops.bitpack, computed with fewer passes) -----------------

_PACK_MUL = 0x0102040810204080  # (8 bytes of 0/1) * this: bit i of the top byte = byte i


def _pack(right: torch.Tensor, n: int) -> torch.Tensor:
    """``pack_bits(right[:n] != 0)`` for a flat uint8 tensor of 0/1 whose length is a multiple of 8
    (tail 0)."""
    if torch.compiler.is_compiling() or sys.byteorder != "little":
        return pack_bits(right[:n] != 0)
    v = right.view(torch.int64)
    return v.mul_(_PACK_MUL).bitwise_right_shift_(56).to(torch.uint8)  # wraps mod 2**64, as intended


def _unpack_into(packed: torch.Tensor, spread: torch.Tensor, ws) -> torch.Tensor:
    """The bits of ``packed`` as uint8 0/1 (8 per byte, lowest bit first): one gather."""
    k = packed.numel()
    bi, rb = ws.bi[:k], ws.rb[:k]
    bi.copy_(packed)
    torch.index_select(spread, 0, bi, out=rb)
    return rb.view(torch.uint8)


class _Workspace:
    """Preallocated per-slice buffers (eager slices reuse them; out= ops allocate nothing)."""

    def __init__(self, m: int, device, spec: dict[str, torch.dtype]):
        self.size = m
        for name, dt in spec.items():
            setattr(self, name, torch.empty(m, dtype=dt, device=device))
        self.bi = torch.empty((m + 7) // 8, dtype=torch.int32, device=device)
        self.rb = torch.empty((m + 7) // 8, dtype=torch.int64, device=device)

    def cut(self, n: int) -> "_Workspace":
        if n == self.size:
            return self
        w = _Workspace.__new__(_Workspace)
        w.size = n
        for name, t in self.__dict__.items():
            if isinstance(t, torch.Tensor):
                setattr(w, name, t[: (n + 7) // 8] if name in ("bi", "rb") else t[:n])
        return w


# -- 16-bit storage: forward and backward by lookup ----------------------------------------------


def _forward16(xf, yf, right, approximate, slices):
    dn = _dtype_name(xf.dtype)
    ytab = _ACCESSORS["y16", dn, approximate](str(xf.device))
    u = _THRESHOLDS[xf.dtype][approximate][1]
    ws = _Workspace(slices[0][1] - slices[0][0], xf.device, {"idx": torch.int32})
    for a, b in slices:
        idx = ws.cut(b - a).idx
        idx.copy_(xf[a:b].view(torch.uint16))  # the pattern
        torch.index_select(ytab, 0, idx, out=yf[a:b])
        if right is not None:
            torch.lt(idx, u, out=right[a:b])


def _backward16(yf, bits, gf, of, approximate, slices):
    dn = _dtype_name(yf.dtype)
    dev = str(yf.device)
    gtab = _ACCESSORS["g16", dn, approximate](dev)
    spread = _ACCESSORS["spread", "uint8", "none"](dev)
    ws = _Workspace(slices[0][1] - slices[0][0], yf.device, {"idx": torch.int32, "g": torch.float32})
    for a, b in slices:
        w = ws.cut(b - a)
        rb = _unpack_into(bits[a // 8:(b + 7) // 8], spread, w)[: b - a]
        w.idx.copy_(yf[a:b].view(torch.uint16)).add_(rb, alpha=1 << 16)
        torch.index_select(gtab, 0, w.idx, out=w.g)
        torch.mul(w.g, gf[a:b], out=of[a:b])  # float32 product, rounded once to the storage dtype


# -- float32 storage: forward in float64, backward from a table guess and one float64 step -----

def _forward32(xf, yf, right, approximate, slices):
    thr = _THRESHOLDS[torch.float32][approximate][0]
    ws = _Workspace(slices[0][1] - slices[0][0], xf.device, {"x": torch.float64, "z": torch.float64})
    for a, b in slices:
        w = ws.cut(b - a)
        x, z = w.x, w.z
        x.copy_(xf[a:b])
        if approximate == "none":  # (erfc(-x/sqrt 2) * 0.5) * x, as _forward_w, rounded once
            torch.mul(x, -_SQRT1_2, out=z).erfc_().mul_(0.5)
        else:  # sigmoid(K1 x (1 + A x^2)) * x, as _tanh_v
            torch.mul(x, x, out=z).mul_(_A).add_(1.0).mul_(x).mul_(_K1).sigmoid_()
        yf[a:b].copy_(z.mul_(x))
        if right is not None:
            torch.gt(xf[a:b], thr, out=right[a:b])


_WS32 = {"rf": torch.float32, "kr": torch.float32, "key": torch.float32, "m": torch.float32,
         "cc": torch.int64, "h": torch.float64, "x": torch.float64, "z": torch.float64,
         "w": torch.float64, "p": torch.float64, "r": torch.float64}


def _guess32(y, rb, dy, w, ab, h, c32):
    """Stage 1 (float32): the key, the keep mask times dy (``w.m``), the cell's interpolated x
    (float32, widened into ``w.x``) and its second-order coefficient (``w.h``)."""
    rf, kr, key, m = w.rf, w.kr, w.key, w.m
    rf.copy_(rb)
    torch.sub(y, c32, out=kr).sub_(_KEY_TINY).mul_(_KEY_SCALE)  # right key
    torch.div(y, kr, out=key).neg_()  # left key (finite for every finite y)
    kr.clamp_(max=_KEY_RIGHT_MAX)
    torch.lerp(key, kr, rf, out=key)  # exact selection (weight 0 or 1, both finite)
    # keep: key > 0 (y above the minimum; on the left branch also y < 0), so m = dy or 0 (the
    # smallest such key is 2**-103.7: the product saturates to 1); nan stays nan (y = nan, +-inf)
    torch.mul(key, 2.0 ** 127, out=m).clamp_(0.0, 1.0).mul_(dy)
    idx = torch.bitwise_right_shift(key.view(torch.int32), _KEY_SHIFT, out=kr.view(torch.int32))
    idx.bitwise_and_(_NCELL - 1)  # the cell: exponent and top mantissa bits (sign dropped)
    torch.index_select(ab, 0, idx, out=w.cc)
    torch.index_select(h, 0, idx, out=w.h)
    coef = w.cc.view(torch.float32).view(-1, 2)
    w.x.copy_(torch.addcmul(coef[:, 0], key, coef[:, 1], out=rf))


def _step32_erf(y, w, out, k):
    """Stage 2 (float64), erf form: with q = (y - f)/f' at x0 (x ~ x0 + q),
    f'(x) = f' + q f'' + q**2 h + O(q**3); ``out = f'(x) * m``, rounded once."""
    x, z, wb, p, r = w.x, w.z, w.w, w.p, w.r
    torch.mul(x, -_SQRT1_2, out=z).erfc_()  # E = 2 Phi
    torch.addcmul(k[0], x, x, value=-0.5, out=wb)  # ln phi
    torch.exp(wb, out=p)  # phi
    r.copy_(y)
    r.addcmul_(x, z, value=-0.5)  # y - f
    x.mul_(p)  # x phi
    z.add_(x, alpha=2.0)  # 2 f' = E + 2 x phi
    r.div_(z)  # q / 2
    wb.add_(1.0 - _LN_INV_SQRT_2PI)  # 1 - x^2/2
    p.mul_(wb)  # f''/2 = phi (1 - x^2/2)
    p.addcmul_(r, w.h)  # f''/2 + (q/2) h
    z.addcmul_(r, p, value=8.0)  # 2 (f' + q f'' + q^2 h)
    wb.copy_(w.m)
    z.mul_(wb).mul_(0.5)
    out.copy_(z)


def _step32_tanh(y, w, out, k):
    """Stage 2 (float64), tanh form (s = sigmoid(v), v = K1 (x + A x^3), p = s (1 - s)):
    f' = s + p x v', f'' = p (v' (4 + (1 - 2s) x v') - 2 K1)."""
    x, z, wb, s, r = w.x, w.z, w.w, w.p, w.r
    torch.mul(x, x, out=wb)  # x^2
    torch.add(k[0], wb, alpha=-_K1 * _A, out=z).mul_(x).exp_()  # e = exp(-v)
    torch.add(z, 1.0, out=s).reciprocal_()  # s
    z.mul_(s)  # 1 - s = e s
    r.copy_(y)
    r.addcmul_(x, s, value=-1.0)  # y - f
    torch.add(k[1], wb, alpha=3.0 * _A * _K1, out=wb)  # v'
    x.mul_(wb)  # x v'
    pp = torch.mul(s, z, out=w.pp)  # p
    z.sub_(s)  # 1 - 2s
    s.addcmul_(pp, x)  # f'
    z.mul_(x).add_(4.0).mul_(wb).sub_(2.0 * _K1).mul_(pp)  # f''
    r.div_(s)  # q
    z.addcmul_(r, w.h)  # f'' + q h
    s.addcmul_(r, z)  # f' + q f'' + q^2 h
    wb.copy_(w.m)
    out.copy_(s.mul_(wb))


def _backward32(yf, bits, gf, of, approximate, slices):
    dev = str(yf.device)
    ab = _ACCESSORS["ab32", "float32", approximate](dev)
    h = _ACCESSORS["h32", "float32", approximate](dev)
    spread = _ACCESSORS["spread", "uint8", "none"](dev)
    c32 = _C32[approximate]
    spec = dict(_WS32, pp=torch.float64) if approximate == "tanh" else _WS32
    ws = _Workspace(slices[0][1] - slices[0][0], yf.device, spec)
    k = torch.tensor([_LN_INV_SQRT_2PI if approximate == "none" else -_K1, _K1], dtype=torch.float64,
                     device=yf.device).unbind()  # 0-dim constants for the fused ops
    step = _step32_erf if approximate == "none" else _step32_tanh
    for a, b in slices:
        w = ws.cut(b - a)
        rb = _unpack_into(bits[a // 8:(b + 7) // 8], spread, w)[: b - a]
        _guess32(yf[a:b], rb, gf[a:b], w, ab, h, c32)
        step(yf[a:b], w, of[a:b], k)


# -- autograd Function -------------------------------------------------------------------------


def _slices(n: int, device: torch.device):
    if torch.compiler.is_compiling() or n == 0:
        return [(0, n)]
    step = CHUNK if device.type == "cpu" else CHUNK_ACCELERATOR
    step = max(8, step - step % 8)  # slices start on a byte of the packed bits
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def _forward(x: torch.Tensor, approximate: str, with_bits: bool):
    """``(GELU(x), packed bits of x > x* or None)``; ``y`` contiguous, rounded once from the wider
    working precision (16-bit storage: looked up)."""
    fused = _triton.gelu_forward(x, approximate, with_bits)  # CUDA: one kernel (None: this path)
    if fused is not None:
        return fused
    xf = x.reshape(-1)
    n = xf.numel()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    yf = y.view(-1)
    right = None
    if with_bits:
        right = torch.empty((n + 7) // 8 * 8, dtype=torch.uint8, device=x.device)  # 0 or 1
        right[n:] = 0
    slices = _slices(n, x.device)
    if x.dtype in (torch.float16, torch.bfloat16):
        _forward16(xf, yf, right, approximate, slices)
    elif x.dtype == torch.float32:
        _forward32(xf, yf, right, approximate, slices)
    else:
        w = _work_dtype(x.dtype)
        xs = _CONSTS[approximate].xs
        for a, b in slices:
            xw = xf[a:b].to(w)
            if right is not None:
                torch.gt(xw, xs, out=right[a:b])  # in the working precision: the exact side of x*
            yf[a:b] = _forward_w(xw, approximate, True)
    return y, (_pack(right, n) if right is not None else None)


def _backward(y: torch.Tensor, bits: torch.Tensor, grad_y: torch.Tensor, approximate: str) -> torch.Tensor:
    """``grad_y * GELU'(x)`` rebuilt from ``y`` and the packed bits, rounded once to y's dtype."""
    fused = _triton.gelu_backward(y, bits, grad_y, approximate)  # CUDA: one kernel (None: this path)
    if fused is not None:
        return fused
    yf, gf = y.reshape(-1), grad_y.reshape(-1)
    out = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    of = out.view(-1)
    n = yf.numel()
    slices = _slices(n, y.device)
    if n == 0:
        return out
    if y.dtype in (torch.float16, torch.bfloat16):
        _backward16(yf, bits, gf, of, approximate, slices)
    elif y.dtype == torch.float32:
        _backward32(yf, bits, gf, of, approximate, slices)
    else:
        right = unpack_bits(bits, n)
        for a, b in slices:
            # product in the working precision, rounded once on the copy
            of[a:b] = _grad_from_output(yf[a:b], right[a:b], approximate).mul_(gf[a:b])
    return out


def gelu_grad_from_output(y: torch.Tensor, right: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU'(x) rebuilt from ``y = GELU(x)`` and ``right = x > x*``, in ``y``'s dtype.

    What backward computes (for a gradient of ones), exposed for tests and analysis.
    """
    _check(approximate)
    _work_dtype(y.dtype)
    with torch.no_grad():
        bits = pack_bits(right.reshape(-1).to(torch.bool))
        return _backward(y.contiguous(), bits, torch.ones_like(y), approximate)


_NO_DOUBLE_BACKWARD = (
    b"leanact GELU does not support double backward: its gradient is rebuilt from the saved output "
    b"without autograd. Use torch.nn.functional.gelu where second derivatives are needed."
)


class GeluFunction(torch.autograd.Function):
    """``y = GELU(x)`` keeping ``y`` and one bit per element (see the module docstring).

    Double backward is not supported: with ``create_graph=True`` the first-order gradient is
    returned as usual, and differentiating it raises a RuntimeError that says so.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, approximate: str = "none"):
        y, bits = _forward(x, approximate, with_bits=True)
        ctx.approximate = approximate
        ctx.save_for_backward(y, bits)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        y, bits = ctx.saved_tensors
        create_graph = torch.is_grad_enabled()
        with torch.no_grad():
            out = _backward(y, bits, grad_y, ctx.approximate)
        if create_graph and not torch.compiler.is_compiling():
            # Like once_differentiable, but also when grad_y itself does not require grad.
            out = torch._C._functions.DelayedError(_NO_DOUBLE_BACKWARD, 1)(out.requires_grad_())
        return out, None


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU that keeps only its output and 1 bit per element for backward (exact gradient).

    Same signature and semantics as ``torch.nn.functional.gelu``. Without autograd (no grad mode
    or ``x`` not requiring grad) nothing is kept and no bits are packed. Under ``torch.func``
    transforms this is ``torch.nn.functional.gelu`` (:mod:`leanact.ops.transforms`).
    """
    _check(approximate)
    _work_dtype(x.dtype)
    if functorch_active():  # torch.func: torch's own op (leanact.ops.transforms)
        return torch.nn.functional.gelu(x, approximate=approximate)
    if torch.is_grad_enabled() and x.requires_grad:
        return GeluFunction.apply(x, approximate)
    return _forward(x, approximate, with_bits=False)[0]
