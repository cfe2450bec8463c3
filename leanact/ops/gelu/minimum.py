"""GELU's minimum and the constants every part of the rebuild shares.

``x*`` (``GELU'(x*) = 0``) splits the inputs into two branches; the forward keeps one bit per
element saying which. Here: the minimum and the Taylor expansion of GELU about it (from mpmath, 50
digits), the working precision per storage dtype, and the threshold the forward compares with to
set the bit, per storage dtype (:data:`_THRESHOLDS`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_APPROXIMATE = ("none", "tanh")
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


def _below(v: float) -> float:
    """The largest float32 strictly below ``v``."""
    t = torch.tensor(v, dtype=torch.float32)
    if t.item() >= v:
        t = torch.nextafter(t, torch.tensor(-math.inf))
    return t.item()


def _all_patterns(dtype: torch.dtype, device) -> torch.Tensor:
    """Every 16-bit pattern, in the order of its unsigned value, as ``dtype``."""
    return torch.arange(1 << 16, dtype=torch.int32, device=device).to(torch.int16).view(dtype)


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
