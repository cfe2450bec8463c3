"""GELU kernels for float32 storage, in float32 arithmetic only (no float64 anywhere).

What :mod:`leanact.ops.gelu.rebuild32` computes in float64 (the forward rounded once from float64;
the backward as a table guess plus one float64 step), these kernels compute in float32:

- forward: ``y = x Phi(x)`` with ``Phi(x) = erfc(-x/sqrt 2)/2`` (tanh form ``x sigmoid(v)``) free of
  cancellation: ``erfc(a) = t exp(G(w)) exp(-x^2/2)`` (``t = 2/(2+a)``, ``w = 2t - 1``, ``G`` the
  Chebyshev series of ``scripts/erfc_chebyshev.py``, its first 14 terms), where ``x^2`` is split exactly into two
  floats (``fma``) and ``exp`` of the split argument is reduced by ``ln 2`` in two parts, so the
  tails keep their relative accuracy (a plain float32 ``exp(-x*x/2)`` is off by ``x^2`` ulps); the
  tanh form's ``v = K1 x (1 + A x^2)`` is carried as a two-float sum for the same reason.
- backward: the same table guess ``x0`` (float32), then, away from the minimum, one Newton step
  in float32 with the second-order expansion of the float64 path (``f'(x0 + q) = f' + q f'' +
  q^2 h``). Within 0.3 of the minimum ``x*`` the step is skipped: there the float32 residual
  ``y - f(x0)`` (a few ulps of ``y*``, divided by ``f' ~ c|x - x*|``) is noisier than the guess
  itself (``~3e-7 |x - x*|``).

Only correctly rounded operations: add, mul, ``fma``, ``div_rn``, integer and bit operations (no
``exp``/``erf`` intrinsics, no approximate division), launched with ``enable_fp_fusion=False``.
Compiled, they are not bit for bit what Triton's interpreter computes on the CPU (1-2 ulps apart on
about a third of the values on an H100); tests/test_triton_cuda.py checks them on a GPU against the
bounds the interpreter tests measure against float64 (``docs/gelu_bound.md``, section 8): forward within
6 ulps of the truth (tanh form 3), backward within the interval ``B(y)`` of what the stored output
allows plus 10 ulps of the gradient (tanh 13), inside ``B(y)`` next to the minimum. The PyTorch
path stays the float64 one (forward correctly rounded, backward within ``B(y)`` + 1/2 ulp); the
self-check allows the difference.

Cost per element (compiled PTX): about 86 float32 operations forward and 140 backward (tanh form 61
and 107), against 8 and 12 bytes of memory traffic (forward: x in, y and 1/8 byte out; backward:
y, dy, 1/8 byte and two L2-resident table entries in, dx out).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from leanact.ops.gelu import minimum as _gm
from leanact.ops.gelu import rebuild32 as _g32

from .dispatch import BLOCK
from .kernels import UNFUSED, _grid, _lerp01, _pack8, _unpack1
from .math32 import exp_split, f32 as _f32
from .launch import launch

__all__ = ["gelu32_forward", "gelu32_backward"]


def _split(v: float) -> tuple[float, float]:
    """``v`` as float32 ``hi + lo``."""
    hi = _f32(v)
    return hi, _f32(v - hi)


_INV_SQRT_2PI = tl.constexpr(_f32(1.0 / math.sqrt(2.0 * math.pi)))
_SQRT1_2 = tl.constexpr(_f32(_gm._SQRT1_2))
_K1_HI, _K1_LO = (tl.constexpr(c) for c in _split(_gm._K1))
_A = tl.constexpr(_f32(_gm._A))
_A_LO = tl.constexpr(_f32(_gm._A - _f32(_gm._A)))
_K1A3 = tl.constexpr(_f32(3.0 * _gm._A * _gm._K1))
_K1A6 = tl.constexpr(_f32(6.0 * _gm._A * _gm._K1))
_K1 = tl.constexpr(_f32(_gm._K1))
#: G(w) = ln(erfc(a) exp(a^2) / t) = sum_j c_j T_j(w): the first 14 coefficients of
#: scripts/erfc_chebyshev.py (the terms after them sum to 1.4e-9)
_G_C = tl.constexpr(tuple(_f32(c) for c in (
    -0.6513268598908547, 0.6419697923564902, 0.019476473204185836, -0.009561514786808632,
    -0.0009465953444820369, 0.00036683949785276145, 4.252332480690777e-05, -2.0278578112534242e-05,
    -1.6242900046470256e-06, 1.3036558355805232e-06, 1.5626441722066142e-08, -8.523809591492654e-08,
    6.5290544390988515e-09, 5.059343495551469e-09)))
#: Phi(x) = 1/2 + x sum_n c_n x^(2n), c_n = (-1)^n / (sqrt(2 pi) 2^n n! (2n + 1)) (|x| <= 1.5: the
#: dropped terms are below 2e-10)
_PHI_C = tl.constexpr(tuple(_f32((-1) ** n / (math.sqrt(2 * math.pi) * 2 ** n * math.factorial(n) * (2 * n + 1)))
                            for n in range(13)))
#: The backward takes Phi from that series for _SERIES_LO <= x <= 1.5 (below -1 the erfc form is closer)
_SERIES_LO = tl.constexpr(-1.0)
#: |x| beyond which the tails are flat in float32 (Phi(-20) ~ 3e-89, sigmoid(v(-20)) ~ e^-603).
_X_CLAMP = tl.constexpr(20.0)
_KEY_TINY = tl.constexpr(_g32._KEY_TINY)
_KEY_SCALE = tl.constexpr(_g32._KEY_SCALE)
_KEY_RIGHT_MAX = tl.constexpr(_g32._KEY_RIGHT_MAX)
_KEY_SHIFT = tl.constexpr(_g32._KEY_SHIFT)
_NCELL = tl.constexpr(_g32._NCELL)
_BIAS = tl.constexpr(64)
_TWO_BIAS = tl.constexpr(2.0 ** 64)
_INV_TWO_BIAS = tl.constexpr(2.0 ** -64)
#: Newton's step is skipped within this distance of the minimum (see the module doc).
_NO_STEP = tl.constexpr(0.3)


@triton.jit
def _exp_g(w):
    """``exp(G(w))``, ``G = sum c_j T_j(w)`` by Clenshaw's recurrence (:data:`_G_C`)."""
    w2 = w + w
    b1 = tl.zeros_like(w)
    b2 = tl.zeros_like(w)
    for j in tl.static_range(13, 0, -1):
        b0 = tl.fma(w2, b1, _G_C[j] - b2)
        b2 = b1
        b1 = b0
    g = tl.fma(w, b1, _G_C[0] - b2)
    return exp_split(tl.minimum(g, 0.0), tl.zeros_like(g), 0)  # G <= 0 (1.4e-9 above it at w = 1)


@triton.jit
def _scale(x):
    """``(bias, 2^bias, 2^-bias)``: in the left tail (x < -5) the tiny values Phi, phi, sigmoid(v),
    f, f', f'' are carried times 2^_BIAS, so none of them loses bits to subnormal range (y does
    from x < -13); the result is scaled back once, at the end."""
    tail = x < -5.0
    return (tl.where(tail, _BIAS, 0), tl.where(tail, _TWO_BIAS, 1.0), tl.where(tail, _INV_TWO_BIAS, 1.0))


@triton.jit
def _phis(x, bias, up, SERIES: tl.constexpr):
    """``(Phi(x), phi(x))`` times ``up = 2^bias`` in float32 for ``|x| <= 20``, each within a few
    ulps (relative). ``SERIES``: next to the minimum from erf's Taylor series (see below)."""
    p = x * x
    e = tl.fma(x, x, -p)  # x^2 = p + e exactly
    big = exp_split(p * -0.5, e * -0.5, bias)  # exp(-x^2/2) 2^bias
    a = tl.abs(x) * _SQRT1_2
    t = tl.math.div_rn(tl.full(x.shape, 2.0, tl.float32), a + 2.0)
    half_erfc = (t * _exp_g(t + t - 1.0)) * big * 0.5  # erfc(|x|/sqrt 2) / 2 = Phi(-|x|)
    phi_ = tl.where(x > 0, up - half_erfc, half_erfc)
    if SERIES:
        phi_ = _phi_series(x, p, phi_)
    return phi_, big * _INV_SQRT_2PI


@triton.jit
def _phi_series(x, p, other):
    """``Phi(x)`` as ``1/2 + x P(x^2)`` (erf's Taylor series) for -1 <= x <= 1.5, ``other``
    elsewhere. There it is ~3x closer than the erfc form, which matters for the backward only:
    next to the minimum ``f' = Phi + x phi`` cancels and the error of Phi passes to f'."""
    u = tl.minimum(p, 2.25)
    c = tl.fma(u, _PHI_C[12], _PHI_C[11])
    for j in tl.static_range(10, -1, -1):
        c = tl.fma(c, u, _PHI_C[j])
    return tl.where((x >= _SERIES_LO) & (x <= 1.5), tl.fma(x, c, 0.5), other)


@triton.jit
def _sigmoids(x, bias, up, down):
    """``(s 2^bias, 1 - s, 1 - 2s)`` with ``s = sigmoid(v)``, ``v = K1 x (1 + A x^2)`` carried as
    two floats (relative accuracy in the tails); ``up = 2^bias``, ``down = 2^-bias``. ``|x| <= 20``."""
    p = x * x
    e = tl.fma(x, x, -p)
    u = p * _A  # A x^2 = u + ue
    ue = tl.fma(p, _A, -u) + tl.fma(e, _A, p * _A_LO)
    s = u + 1.0  # 1 + A x^2 = s + se (TwoSum)
    bb = s - 1.0
    se = ((1.0 - (s - bb)) + (u - bb)) + ue
    m = x * s  # x (1 + A x^2) = m + me
    me = tl.fma(x, s, -m) + x * se
    v = m * _K1_HI  # v = v + ve
    ve = tl.fma(m, _K1_HI, -v) + tl.fma(me, _K1_HI, m * _K1_LO)
    neg = v < 0
    big = exp_split(-tl.abs(v), tl.where(neg, ve, -ve), bias)  # exp(-|v|) 2^bias
    inv = tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), big * down + 1.0)
    small = big * inv  # times 2^bias
    s_up = tl.where(neg, small, inv * up)
    c = tl.where(neg, inv, small * down)
    return s_up, c, c - tl.where(neg, small * down, inv)


@triton.jit
def _gelu32f_fwd_kernel(x_ptr, y_ptr, bits_ptr, n, thr, TANH: tl.constexpr, WITH_BITS: tl.constexpr,
                        BLOCK: tl.constexpr):
    """``y = x Phi(x)`` (tanh form ``x sigmoid(v)``) in float32; right = x > thr, packed."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    xc = tl.clamp(x, -_X_CLAMP, _X_CLAMP, propagate_nan=tl.PropagateNan.ALL)
    bias, up, down = _scale(xc)
    if TANH:
        s, _, _ = _sigmoids(xc, bias, up, down)
    else:
        s, _ = _phis(xc, bias, up, False)
    tl.store(y_ptr + offs, (x * s) * down, mask=m)  # +-inf: inf * 1 = inf, -inf * 0 = nan (as torch's float64)
    if WITH_BITS:
        right = ((x > thr) & m).to(tl.int32)
        boffs = pid.to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        tl.store(bits_ptr + boffs, _pack8(right, BLOCK), mask=boffs < (n + 7) // 8)


@triton.jit
def _gelu32f_bwd_kernel(y_ptr, bits_ptr, dy_ptr, out_ptr, ab_ptr, h_ptr, n, c32, xs, TANH: tl.constexpr,
                        BLOCK: tl.constexpr):
    """dx = dy f'(x), x rebuilt from (y, bit): the table guess of ``rebuild32._guess32`` (float32,
    the same operations), then f', f'' at the guess and, away from the minimum, one step."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    y = tl.load(y_ptr + offs, mask=m, other=0.0)
    dy = tl.load(dy_ptr + offs, mask=m, other=0.0)
    rf = _unpack1(bits_ptr, offs, m).to(tl.float32)
    # the guess: key, keep mask times dy, the cell's interpolated x and coefficient h
    kr = ((y - c32) - _KEY_TINY) * _KEY_SCALE  # right key
    key = -tl.math.div_rn(y, kr)  # left key
    kr = tl.minimum(kr, _KEY_RIGHT_MAX, propagate_nan=tl.PropagateNan.ALL)
    key = _lerp01(key, kr, rf)
    mk = tl.clamp(key * 1.7014118346046923e38, 0.0, 1.0, propagate_nan=tl.PropagateNan.ALL) * dy  # key 2^127
    idx = (key.to(tl.int32, bitcast=True) >> _KEY_SHIFT) & (_NCELL - 1)
    a = tl.load(ab_ptr + 2 * idx, mask=m, other=0.0)
    b = tl.load(ab_ptr + 2 * idx + 1, mask=m, other=0.0)
    h = tl.load(h_ptr + idx, mask=m, other=0.0)
    x = tl.fma(key, b, a)  # finite (cells no element reaches hold x = 1), at most ~32
    xc = tl.maximum(x, -_X_CLAMP)
    bias, up, down = _scale(xc)  # f, f', f'', h and q below: times 2^bias
    if TANH:
        s, c, c2 = _sigmoids(xc, bias, up, down)
        p = s * c  # sigmoid'
        d1 = tl.fma(x * x, _K1A3, _K1)  # v'
        xd = x * d1
        f = x * s
        g = tl.fma(p * x, d1, s)  # f' = s + p x v'
        f2 = p * (tl.fma(xd, c2 * d1, d1 + d1) + x * (x * _K1A6))  # p (2v' + x(1-2s)v'^2 + x v'')
    else:
        phi_, dens = _phis(xc, bias, up, True)
        f = x * phi_
        g = tl.fma(x, dens, phi_)  # f' = Phi + x phi
        f2 = dens * ((2.0 - x * x) - tl.fma(x, x, -(x * x)))  # f'' = phi (2 - x^2)
    q = tl.math.div_rn(y * up - f, g)
    stepped = tl.fma(q, tl.fma(q, h * up, f2), g)
    g = tl.where(tl.abs(x - xs) < _NO_STEP, g, stepped)
    tl.store(out_ptr + offs, (g * mk) * down, mask=m)


def gelu32_forward(x: torch.Tensor, y: torch.Tensor, bits, thr: float, tanh: bool, block: int = BLOCK):
    n = x.numel()
    if n:
        launch(_gelu32f_fwd_kernel, _grid(n, block), x, y, bits if bits is not None else y, n, thr, TANH=tanh,
               WITH_BITS=bits is not None, BLOCK=block, **UNFUSED)


def gelu32_backward(y: torch.Tensor, bits: torch.Tensor, dy: torch.Tensor, out: torch.Tensor, ab: torch.Tensor,
                    h: torch.Tensor, c32: float, xs: float, tanh: bool, block: int = BLOCK):
    n = y.numel()
    if n:
        launch(_gelu32f_bwd_kernel, _grid(n, block), y, bits, dy, out, ab.view(torch.float32), h, n, c32, xs, TANH=tanh,
               BLOCK=block, **UNFUSED)
