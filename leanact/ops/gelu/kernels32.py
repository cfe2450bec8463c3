"""GELU kernels for float32 storage, in float32 arithmetic only (no float64 anywhere).

What :mod:`leanact.ops.gelu.rebuild32` computes in float64 (the forward rounded once from float64;
the backward as a table guess plus one float64 step), these kernels compute in float32, each with
a table of cubics (one 16-byte row per cell of a float32's exponent and top 5 (forward) or 4
(backward) mantissa bits: 128 / 64 KiB; the rest of the mantissa, as a fraction of the cell, is the
cubic's exact argument):

- forward, erf form: ``y = x Phi(x)``, ``Phi(-a) = R(a) exp(-a^2/2)`` for ``a = |x|`` (``1 -
  Phi(-a)`` above 0), ``R = erfcx(a/sqrt 2)/2`` from its cell's cubic
  (:mod:`leanact.ops.gelu.erfcx32`) and ``exp`` of ``-a^2/2`` split exactly into two floats
  (``fma``) and reduced by ``ln 2`` in two parts, so the tails keep their relative accuracy (a
  plain float32 ``exp(-x*x/2)`` is off by ``x^2`` ulps). Tanh form: ``x sigmoid(v)`` with ``v = K1
  x (1 + A x^2)`` carried as a two-float sum for the same reason (no table). ``exp``'s power of two
  (:func:`~leanact.ops.triton.math32.exp_parts`) is multiplied in last, after ``x``, so a ``y``
  below float32's normal range is rounded once, at the end.
- backward: the float32 path's key of ``(y, bit)`` (``rebuild32._guess32``, the same float32
  operations), then ``f'`` from the cubic of the key's cell (:mod:`leanact.ops.gelu.slope32`): no
  ``x``, no ``erfc``, no Newton step.

Only correctly rounded operations: add, mul, ``fma``, ``div_rn`` (or ``recip12``, the same bits;
the tanh form takes its two-step version, within 0.67 ulps), integer and bit operations (no
``exp``/``erf`` intrinsics, no approximate division), launched with ``enable_fp_fusion=False``.
tests/test_triton_cuda.py checks the compiled kernels on a GPU against the bounds the interpreter
tests measure against float64 (``docs/gelu_bound.md``, section 8): forward within 3.8 ulps of the
truth (tanh form 3.4), backward within the interval ``B(y)`` of what the stored output allows plus
1.7 ulps of the gradient, inside ``B(y)`` next to the minimum. The PyTorch path stays the float64
one (forward correctly rounded, backward within ``B(y)`` + 1/2 ulp); the self-check allows the
difference.

Cost per element: about 50 instructions each way (SASS for sm_90, static counts of the kernel
body, ``benchmarks/kernel_sass.py``; per Triton version in docs/triton.md, "Measurements behind
the kernels' constants"), against 8 and 12 bytes of memory traffic (forward: x in, y and 1/8 byte
out; backward: y, dy, 1/8 byte in, dx out) and a 16-byte table row from L1/L2 (the tanh forward
reads none). A negation ``-t`` may compile to an
instruction of its own (``0 - t``), so the forward's negations are folded into constants
(:func:`~leanact.ops.triton.math32.exp_half_neg_parts`,
:func:`~leanact.ops.triton.math32.recip12_of_negated`). The tanh form's quotient ``1 / (1 +
exp(-|v|))``, divisor in [1, 2], is :func:`~leanact.ops.triton.math32.recip12`'s two Newton steps
(six ``fma``), where ``div_rn`` took 6 more instructions per element and 24 registers a thread for
its slow-path call. The launchers' ``wide`` picks how a row is read: 0 (the default, the one timed
on a GPU) two 8-byte loads; 1 one ``[BLOCK, 2]`` load split in registers (through shared memory,
with barriers); 2 one 16-byte load by inline PTX (no interpreter: checked on a GPU by
``benchmarks/gelu_directions.py``, which times the three). The backward's ``fma_div`` computes its
one quotient by :func:`~leanact.ops.triton.math32.quotient` (no slow-path call: 34 registers a
thread instead of 56, 7-10 more instructions per element), the same bits where the key is kept;
``gelu_directions.py`` times both.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton.common import UNFUSED, _grid, _pack8, _unpack1
from ..triton.dispatch import BLOCK
from ..triton.launch import launch
from ..triton.math32 import exp_half_neg_parts, exp_parts, f32 as _f32, quotient, recip12_of_negated
from . import erfcx32 as _mills
from . import minimum as _gm
from . import rebuild32 as _g32
from . import slope32 as _slope


__all__ = ["gelu32_forward", "gelu32_backward"]


def _split(v: float) -> tuple[float, float]:
    """``v`` as float32 ``hi + lo``."""
    hi = _f32(v)
    return hi, _f32(v - hi)


_K1_HI, _K1_LO = (tl.constexpr(c) for c in _split(_gm._K1))
_NEG_K1_HI = tl.constexpr(-_split(_gm._K1)[0])
_A = tl.constexpr(_f32(_gm._A))
_A_LO = tl.constexpr(_f32(_gm._A - _f32(_gm._A)))
#: |x| beyond which the tails are flat in float32 (15 Phi(-15) ~ 6e-50 and 12 sigmoid(v(-12)) ~ 1e-61
#: round to zero, 1 - Phi(-15) and sigmoid(v(12)) to 1) and exp's 2^k stays two normal factors
#: (x^2 / 2 = 112.5 and |v(12)| = 142.5 give k = -163 and -206, inside [-126 - bias, 127 - bias] of
#: :func:`~leanact.ops.triton.math32.exp_parts` for the biases 64 and 96 the forms pass).
_X_CLAMP = tl.constexpr(15.0)
_X_CLAMP_TANH = tl.constexpr(12.0)
_INV_TWO_64 = tl.constexpr(2.0 ** -64)
_INV_TWO_96 = tl.constexpr(2.0 ** -96)
_KEY_TINY = tl.constexpr(_g32._KEY_TINY)
_KEY_SCALE = tl.constexpr(_g32._KEY_SCALE)
_KEY_RIGHT_MAX = tl.constexpr(_g32._KEY_RIGHT_MAX)
_SLOPE_SHIFT = tl.constexpr(_slope.SHIFT)
_SLOPE_NCELL = tl.constexpr(_slope.NCELL)
_SLOPE_UNIT = tl.constexpr(2.0 ** -_slope.SHIFT)
_SLOPE_LOW = tl.constexpr((1 << _slope.SHIFT) - 1)
_MILLS_SHIFT = tl.constexpr(_mills.SHIFT)
_MILLS_NCELL = tl.constexpr(_mills.NCELL)
_MILLS_UNIT = tl.constexpr(2.0 ** -_mills.SHIFT)
_MILLS_LOW = tl.constexpr((1 << _mills.SHIFT) - 1)


@triton.jit
def _halves(v):
    """The two float32 of an int64 (low word first, as they lie in memory)."""
    lo = v.to(tl.int32).to(tl.float32, bitcast=True)  # (the cast keeps the low 32 bits)
    hi = (v >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _row(tab_ptr, cell, WIDE: tl.constexpr):
    """``c0, c1, c2, c3``: the 16-byte row ``cell`` of a cubics table read as two int64 (``tab_ptr``:
    the table viewed as int64; every cell index lies inside it: no mask). ``WIDE`` (module doc): 0,
    two 8-byte loads; 1, one [BLOCK, 2] load, split; 2, one 16-byte load (``ld.global.nc.v2.b64``:
    the row is 16-byte aligned, the table is not written while a kernel reads it)."""
    if WIDE == 2:
        a, b = tl.inline_asm_elementwise("ld.global.nc.v2.b64 {$0, $1}, [$2];", "=l,=l,l", [tab_ptr + cell * 2],
                                         dtype=(tl.int64, tl.int64), is_pure=True, pack=1)
        c0, c1 = _halves(a)
        c2, c3 = _halves(b)
    elif WIDE:
        a, b = tl.split(tl.load(tab_ptr + ((cell * 2)[:, None] + tl.arange(0, 2)[None, :])))
        c0, c1 = _halves(a)
        c2, c3 = _halves(b)
    else:
        c0, c1 = _halves(tl.load(tab_ptr + cell * 2))
        c2, c3 = _halves(tl.load(tab_ptr + cell * 2 + 1))
    return c0, c1, c2, c3


@triton.jit
def _gelu_erf(x, xc, tab_ptr, WIDE: tl.constexpr):
    """``x Phi(x)`` (``xc``: x clamped to [-15, 15]), within a few ulps (relative, subnormal y
    rounded once): ``Phi(-a) = R(a) exp(-a^2/2)``, ``a = |x|``, ``R`` from its cell's cubic
    (:mod:`leanact.ops.gelu.erfcx32`), ``exp``'s powers of two multiplied in last
    (:func:`~leanact.ops.triton.math32.exp_half_neg_parts`): ``1 - Phi(-a)`` above 0, ``x R e^r`` below."""
    p = xc * xc
    e = tl.fma(xc, xc, -p)  # x^2 = p + e exactly
    q, sk = exp_half_neg_parts(p, e, 64)  # exp(-x^2/2) = q sk 2^-64
    ab = tl.abs(xc).to(tl.int32, bitcast=True)
    c0, c1, c2, c3 = _row(tab_ptr, (ab >> _MILLS_SHIFT) & (_MILLS_NCELL - 1), WIDE)
    s = (ab & _MILLS_LOW).to(tl.float32) * _MILLS_UNIT  # exact: 19 bits
    t = tl.fma(s, tl.fma(s, tl.fma(s, c3, c2), c1), c0) * q  # erfc(|x|/sqrt 2) / 2 = Phi(-|x|) = t sk 2^-64
    pos = xc > 0
    w = (tl.where(pos, t, xc * t) * sk) * _INV_TWO_64  # Phi(-x) above 0, x Phi(x) at and below
    return tl.where(pos, x * (1.0 - w), w)


@triton.jit
def _gelu_tanh(x, xc):
    """``x sigmoid(v)``, ``v = K1 x (1 + A x^2)`` carried as two floats (relative accuracy in the
    tails), ``xc``: x clamped to [-12, 12]: ``x / (1 + e^-|v|)`` at and above 0, ``x e^-|v| / (1 +
    e^-|v|)`` below; ``|v|`` from ``|x|``, and its negation and the divisor's made from negative
    constants (a negation ``-t`` may compile to an instruction of its own, ``0 - t``)."""
    ax = tl.abs(xc)
    p = ax * ax
    e = tl.fma(ax, ax, -p)  # x^2 = p + e exactly
    w = tl.fma(p, _A, 1.0)  # 1 + A x^2 = w + we: 1 - w is exact (w >= 1), so the fma's rounding
    we = tl.fma(p, _A_LO, tl.fma(e, _A, tl.fma(p, _A, 1.0 - w)))  # error is an fma away
    m = ax * w  # |x| (1 + A x^2) = m + me
    me = tl.fma(ax, we, tl.fma(ax, w, -m))
    vn = m * _NEG_K1_HI  # |v| = -vn + ve
    ve = tl.fma(me, _K1_HI, tl.fma(m, _K1_LO, tl.fma(m, _K1_HI, vn)))
    q, sk = exp_parts(vn, ve, 96)  # exp(-|v|) = q sk 2^-96
    inv = recip12_of_negated(tl.fma(q * sk, -_INV_TWO_96, -1.0), False)  # 1 / (1 + exp(-|v|)) within 0.67 ulps
    return tl.where(xc < 0, ((xc * (q * inv)) * sk) * _INV_TWO_96, x * inv)


@triton.jit
def _gelu32f_fwd_kernel(x_ptr, y_ptr, bits_ptr, tab_ptr, n, thr, TANH: tl.constexpr, WITH_BITS: tl.constexpr,
                        WIDE: tl.constexpr, EVEN: tl.constexpr, BLOCK: tl.constexpr):
    """``y = x Phi(x)`` (tanh form ``x sigmoid(v)``) in float32; right = x > thr, packed. ``EVEN``:
    ``BLOCK`` divides n (no masks)."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        x = tl.load(x_ptr + offs)
    else:
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    if TANH:
        y = _gelu_tanh(x, tl.clamp(x, -_X_CLAMP_TANH, _X_CLAMP_TANH, propagate_nan=tl.PropagateNan.ALL))
    else:
        y = _gelu_erf(x, tl.clamp(x, -_X_CLAMP, _X_CLAMP, propagate_nan=tl.PropagateNan.ALL), tab_ptr, WIDE)
    y = tl.where(x == -float("inf"), float("nan"), y)  # -inf Phi(-inf): nan, as torch's
    if EVEN:
        tl.store(y_ptr + offs, y)
    else:
        tl.store(y_ptr + offs, y, mask=offs < n)
    if WITH_BITS:
        boffs = pid.to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        if EVEN:
            tl.store(bits_ptr + boffs, _pack8((x > thr).to(tl.int32), BLOCK))
        else:
            right = ((x > thr) & (offs < n)).to(tl.int32)
            tl.store(bits_ptr + boffs, _pack8(right, BLOCK), mask=boffs < (n + 7) // 8)


@triton.jit
def _gelu32f_bwd_kernel(y_ptr, bits_ptr, dy_ptr, out_ptr, tab_ptr, n, c32, WIDE: tl.constexpr, FMA_DIV: tl.constexpr,
                        EVEN: tl.constexpr, BLOCK: tl.constexpr):
    """dx = dy f'(x) from (y, bit): the float32 path's key (``rebuild32._guess32``: the same float32
    operations), then the cubic of its cell (:mod:`leanact.ops.gelu.slope32`). ``FMA_DIV``: the left
    key's quotient by :func:`~leanact.ops.triton.math32.quotient` (``div_rn``'s bits wherever the
    key is kept) instead of ``div_rn``. ``EVEN``: ``BLOCK`` divides n (no masks)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        y = tl.load(y_ptr + offs)
        dy = tl.load(dy_ptr + offs)
        right = ((tl.load(bits_ptr + offs // 8).to(tl.int32) >> (offs % 8).to(tl.int32)) & 1) != 0
    else:
        m = offs < n
        y = tl.load(y_ptr + offs, mask=m, other=0.0)
        dy = tl.load(dy_ptr + offs, mask=m, other=0.0)
        right = _unpack1(bits_ptr, offs, m) != 0
    kr = ((y - c32) - _KEY_TINY) * _KEY_SCALE  # right key
    key = tl.where(right, tl.minimum(kr, _KEY_RIGHT_MAX, propagate_nan=tl.PropagateNan.ALL),
                   -(quotient(y, kr) if FMA_DIV else tl.math.div_rn(y, kr)))  # left key
    # keep: key > 0 (y above the minimum; on the left branch also y < 0): dy, else 0; nan stays nan
    mk = tl.clamp(key * 1.7014118346046923e38, 0.0, 1.0, propagate_nan=tl.PropagateNan.ALL) * dy  # key 2^127
    kb = key.to(tl.int32, bitcast=True)
    c0, c1, c2, c3 = _row(tab_ptr, (kb >> _SLOPE_SHIFT) & (_SLOPE_NCELL - 1), WIDE)
    s = (kb & _SLOPE_LOW).to(tl.float32) * _SLOPE_UNIT  # exact: 19 bits
    g = tl.fma(s, tl.fma(s, tl.fma(s, c3, c2), c1), c0)
    g = tl.where(tl.abs(y) < float("inf"), g, float("nan"))  # y = +-inf, nan: nan, as the PyTorch path
    if EVEN:
        tl.store(out_ptr + offs, g * mk)
    else:
        tl.store(out_ptr + offs, g * mk, mask=m)


def gelu32_forward(x: torch.Tensor, y: torch.Tensor, bits, table, thr: float, block: int = BLOCK, wide: int = 0,
                   num_warps: int = 4):
    """``y = GELU(x)``, ``bits``: x > thr packed (or None); ``table``: the erf form's Mills table
    (:mod:`leanact.ops.gelu.erfcx32`), None for the tanh form. ``block / (32 num_warps)`` elements
    per thread (8 by default)."""
    n = x.numel()
    if n:
        launch(_gelu32f_fwd_kernel, _grid(n, block), x, y, bits if bits is not None else y,
               x if table is None else table.view(torch.int64), n, thr, TANH=table is None,
               WITH_BITS=bits is not None, WIDE=wide, EVEN=n % block == 0, BLOCK=block, num_warps=num_warps,
               **UNFUSED)


def gelu32_backward(y: torch.Tensor, bits: torch.Tensor, dy: torch.Tensor, out: torch.Tensor, table: torch.Tensor,
                    c32: float, block: int = BLOCK, wide: int = 0, num_warps: int = 4, fma_div: bool = False):
    """``out = dy f'(x)``; ``table``: the mode's slope table (:mod:`leanact.ops.gelu.slope32`);
    ``fma_div``: the left key's quotient in ``fma`` (module doc)."""
    n = y.numel()
    if n:
        launch(_gelu32f_bwd_kernel, _grid(n, block), y, bits, dy, out, table.view(torch.int64), n, c32, WIDE=wide,
               FMA_DIV=fma_div, EVEN=n % block == 0, BLOCK=block, num_warps=num_warps, **UNFUSED)
