"""The exact rebuild: solve ``GELU(x) = y`` on the stored branch, then evaluate ``GELU'(x)``.

Safeguarded Halley steps from asymptotic initial guesses (:func:`_grad_from_output`). For float64
storage it runs in float64 with error-free products (Dekker), compensated ``x/sqrt 2``, ``x**2``
and tanh argument in the tail, and the exact Taylor expansion of GELU about ``x*`` next to the
minimum. It also builds the 16-bit tables (:mod:`.tables`, run in float32) and gives the
working-precision forward (:func:`_forward_w`).
"""
from __future__ import annotations

import math

import torch

from .minimum import (_A, _CLAMP, _CONSTS, _INV_SQRT_2PI, _INV_SQRT_PI, _K1, _LN_INV_SQRT_2PI, _SQRT1_2, _Consts,
                      _dd, _near, _work_dtype)

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
