"""Triton kernels of the lean gated MLP's elementwise part, ``h = act(g) * u`` (SwiGLU: act =
SiLU; GeGLU: act = GELU, erf or tanh), one per direction, and their launchers.

They follow the PyTorch path of :mod:`.function` (eager torch) step by step, rounding
where it rounds:

- forward: ``a = act(g)`` rounded to the storage dtype (torch's ``F.silu`` / ``F.gelu`` return
  it), then ``h = a * u`` in float32 rounded once;
- backward, from g, u and dh (the down projection's input gradient): ``du = dh * a`` and
  ``dg = (dh * u) * act'(g)`` with ``dh * u`` rounded to the storage dtype first (autograd's
  product), ``act'`` then the product in float32 (torch's ``silu_backward`` / ``gelu_backward``),
  rounded once; optionally ``h = a * u`` again for the weight gradient, in the same pass.

``act`` and ``dy * act'`` are torch's CUDA formulas (ATen's SiLU and GELU kernels) in float32
with the same operations in the same order, FMAs where nvcc contracts ``a + b * c`` (launched with
``enable_fp_fusion=False``: no other contraction), ``erf`` from Triton's ``tl.erf`` (on CUDA the
``erff`` of the libdevice Triton bundles; torch's is the CUDA toolkit's it was built with: the two
builds need not agree, each is within 2 ulp of erf), and ``exp`` / ``tanh`` from :mod:`.math32`
(float32 arithmetic, no float64: within 1.35 / 3 ulps of the true value, and built to give the same
bits compiled and interpreted; torch's ``expf`` / ``tanhf`` are within 2 ulp of the correctly rounded value). So
the results are torch's wherever its ``expf`` / ``tanhf`` / ``erff`` return what the kernel's do,
and otherwise differ by what a change of that one value by up to 6 ulps makes through the formula:
at most ``48 u |g|`` in ``act(g)`` and ``48 u (1 + |g|) |dy|`` in ``dy * act'(g)`` (u = 2^-24,
the float32 unit roundoff; :data:`BOUND`; docs/triton.md), plus one ulp of the storage dtype where
the two fall on both sides of a rounding boundary. That last part is rare where the bound is a
small part of the storage ulp, but GeGLU (erf) for g < -2 computes ``1 + erf(g / sqrt 2)`` with
cancellation, where one ulp of erf moves ``act(g)`` by many 16-bit ulps (absolutely still within
the bound): a few percent of h and du may differ from torch's there (one-ulp erf differences on
about a quarter of the arguments; the measured share in docs/triton.md). The products around them (``a * u``,
``dh * a``, ``dh * u``) are exact copies of torch's roundings.

Each row of the (rows, n) views may have its own stride (the halves of a fused gate_up projection
are read in place); outputs are contiguous. Runs under ``TRITON_INTERPRET=1`` too (no libdevice;
bf16 rounded by integer operations, see :mod:`.kernels`). Imported with :mod:`.kernels`.
"""
from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from ..triton.common import UNFUSED, _store
from ..triton.math32 import exp as _exp, tanh as _tanh
from ..triton.launch import cdiv, launch, next_power_of_2

#: ``kind`` of :mod:`leanact.ops.gated_mlp` -> the kernels' ``KIND``.
KINDS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
#: Most columns per program.
BLOCK = 1024
#: The kernels' act(g) and dy act'(g) are within BOUND u |g| and BOUND u (1 + |g|) |dy| of torch's
#: (u = 2^-24; the module doc): exp / tanh up to 6 ulps apart, 8u per ulp through the formulas.
BOUND = 48


def _f32(v: float) -> tl.constexpr:
    """A float32 constant as torch's kernels spell it (a ``constexpr opmath_t``)."""
    return tl.constexpr(struct.unpack("f", struct.pack("f", v))[0])


# torch's constants (ATen's CUDA GELU kernels)
_ALPHA = _f32(math.sqrt(0.5))  # kAlpha = M_SQRT1_2
_BETA_ERF = _f32(2.0 / math.sqrt(math.pi) * math.sqrt(0.5) * 0.5)  # M_2_SQRTPI * M_SQRT1_2 / 2
_BETA_TANH = _f32(math.sqrt(2.0) * 2.0 / math.sqrt(math.pi) * 0.5)  # M_SQRT2 * M_2_SQRTPI / 2
_KAPPA = _f32(0.044715)
_KAPPA3 = _f32(3.0 * _KAPPA.value)  # opmath_t(3) * kKappa in float32 (the double product is exact)


@triton.jit
def _act(x, KIND: tl.constexpr):
    """act(x) for float32 x in torch's CUDA formula and order (SiLU; GELU erf; GELU tanh):
    x / (1 + e^-x); x/2 (1 + erf(x kAlpha)); x/2 (1 + tanh(kBeta (x + kKappa x^3)))."""
    if KIND == 0:
        r = tl.math.div_rn(x, 1.0 + _exp(-x))
    elif KIND == 1:
        r = x * 0.5 * (1.0 + tl.erf(x * _ALPHA))
    else:
        inner = tl.fma(_KAPPA, x * x * x, x) * _BETA_TANH
        r = 0.5 * x * (1.0 + _tanh(inner))
    return r


@triton.jit
def _act_grad(dy, x, KIND: tl.constexpr):
    """dy * act'(x) for float32 dy, x in torch's CUDA formula and order (``silu_backward``,
    ``gelu_backward``; nvcc contracts ``a + b * c`` into an FMA, so do these)."""
    if KIND == 0:
        s = tl.math.div_rn(1.0, 1.0 + _exp(-x))
        r = dy * s * tl.fma(x, 1.0 - s, 1.0)
    elif KIND == 1:
        cdf = 0.5 * (1.0 + tl.erf(x * _ALPHA))
        pdf = _exp(x * -0.5 * x) * _BETA_ERF
        r = dy * tl.fma(x, pdf, cdf)
    else:
        x_sq = x * x
        t = _tanh(tl.fma(_KAPPA, x_sq * x, x) * _BETA_TANH)
        left = 0.5 * x
        left_derivative = 0.5 * (1.0 + t)
        tanh_derivative = tl.fma(-t, t, 1.0)
        inner_derivative = tl.fma(_KAPPA3, x_sq, 1.0) * _BETA_TANH
        r = dy * tl.fma(left * tanh_derivative, inner_derivative, left_derivative)
    return r


@triton.jit
def _rounded(v, ptr):
    """float32 ``v`` rounded to nearest even in ``ptr``'s dtype, as float32 again (what torch's
    16-bit ops return, read back); float32 storage: ``v``."""
    if ptr.dtype.element_ty == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        r = tl.where(v != v, v, b.to(tl.float32, bitcast=True))
    elif ptr.dtype.element_ty == tl.float16:
        r = v.to(tl.float16).to(tl.float32)
    else:
        r = v
    return r


@triton.jit
def _glu_fwd_kernel(g_ptr, u_ptr, h_ptr, n, sg, su, KIND: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``program_id(0)``, columns block ``program_id(1)``: h = round(round(act(g)) * u)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    g = tl.load(g_ptr + row * sg + cols, mask=m, other=0.0)
    u = tl.load(u_ptr + row * su + cols, mask=m, other=0.0).to(tl.float32)
    a = _rounded(_act(g.to(tl.float32), KIND), g_ptr)
    _store(h_ptr + row * n + cols, a * u, m)


@triton.jit
def _glu_bwd_kernel(g_ptr, u_ptr, dh_ptr, dg_ptr, du_ptr, h_ptr, n, sg, su, KIND: tl.constexpr,
                    NEED_DG: tl.constexpr, NEED_DU: tl.constexpr, NEED_H: tl.constexpr, BLOCK: tl.constexpr):
    """du = round(dh * a), dg = round(round(dh * u) * act'(g)), h = round(a * u), a = round(act(g))."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    out = row * n + cols
    g = tl.load(g_ptr + row * sg + cols, mask=m, other=0.0)
    u = tl.load(u_ptr + row * su + cols, mask=m, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + out, mask=m, other=0.0).to(tl.float32)
    g = g.to(tl.float32)
    if NEED_DU or NEED_H:
        a = _rounded(_act(g, KIND), g_ptr)
        if NEED_DU:
            _store(du_ptr + out, dh * a, m)
        if NEED_H:
            _store(h_ptr + out, a * u, m)
    if NEED_DG:
        t = _rounded(dh * u, g_ptr)
        _store(dg_ptr + out, _act_grad(t, g, KIND), m)


def _grid(rows: int, n: int, block: int):
    return (rows, cdiv(n, block))


def _block(n: int, block) -> int:
    return block or min(BLOCK, max(16, next_power_of_2(n)))


def glu_forward(g: torch.Tensor, u: torch.Tensor, h: torch.Tensor, kind: str, block: int | None = None):
    """h (contiguous (rows, n)) = act(g) * u for (rows, n) views g, u with unit column stride."""
    rows, n = h.shape
    if h.numel():
        b = _block(n, block)
        launch(_glu_fwd_kernel, _grid(rows, n, b), g, u, h, n, g.stride(0), u.stride(0), KIND=KINDS[kind], BLOCK=b,
               **UNFUSED)


def glu_backward(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor, dg, du, h, kind: str, block: int | None = None):
    """dg, du, h (each contiguous (rows, n) or None) from g, u ((rows, n), unit column stride) and
    contiguous dh."""
    rows, n = dh.shape
    if dh.numel():
        b = _block(n, block)
        launch(_glu_bwd_kernel, _grid(rows, n, b), g, u, dh, dg if dg is not None else dh, du if du is not None else dh,
               h if h is not None else dh, n, g.stride(0), u.stride(0),
               KIND=KINDS[kind], NEED_DG=dg is not None, NEED_DU=du is not None,
               NEED_H=h is not None, BLOCK=b, **UNFUSED)
