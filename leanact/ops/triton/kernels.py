"""Triton kernels of the lean ops, one per op and direction, and their launchers.

Every kernel reads each input once and writes each output once. They compute what the PyTorch
path computes (:mod:`leanact.ops.dropout`, ``.layer_norm``, ``.rms_norm``, ``.gelu``):

- dropout: the counter-based hash of :mod:`leanact.ops.random` on uint32 lanes (products wrap
  mod 2^32, shifts of unsigned values are logical), so the mask is bit for bit the PyTorch one;
  ``x * keep * scale`` in float32, rounded once, as torch does it.
- GELU, 16-bit storage: the same lookup tables (built by the PyTorch path, read here), the branch
  bit packed in the kernel: bitwise the PyTorch path. float32 storage: the same float64 formulas
  in the same order (FMA only where torch fuses: ``addcmul``, ``add`` with ``alpha``; launched
  with ``enable_fp_fusion=False``), with our own float64 ``erfc`` (:func:`_erfc64`, ~1e-16
  relative; the interpreter has no libdevice): equal to the PyTorch path but for the rare
  element whose float64 value sits on a float32 rounding boundary (one ulp then).
- LayerNorm / RMSNorm: one program per row (forward) and a row loop per program accumulating
  dγ, dβ in float32 (backward); the reduction order differs from torch's, so results agree to
  float32 rounding, not bitwise.

Everything here runs under ``TRITON_INTERPRET=1`` on CPU tensors too (the tests do that), so it
uses only what both the interpreter and the compiler support: no libdevice, no inline asm. The
interpreter converts float32 to bfloat16 by truncation, so there bfloat16 results are rounded to
nearest even with integer operations (:func:`_store`); compiled, by the hardware's round-to-nearest-
even conversion: the same values. Float64
constants are built with ``tl.full`` (:func:`_f64`): a bare Python float may become a float32
constant in older Triton versions.

This module is imported only when a kernel is about to run (see :mod:`.dispatch`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from leanact.ops.gelu import minimum as _gm
from leanact.ops.gelu import rebuild32 as _g32

from .dispatch import BLOCK  # elements per program of the elementwise kernels

#: Launch options: contraction into FMAs allowed (the norms) or not (the float64 GELU rebuild, whose
#: rounding sequence is torch's). Always explicit: Triton 3.9 warns when it is left to its default.
FUSED, UNFUSED = {"enable_fp_fusion": True}, {"enable_fp_fusion": False}

# -- shared helpers --------------------------------------------------------------------------------


@triton.jit
def _f64(v: tl.constexpr):
    """A float64 constant, exact (not rounded through float32)."""
    return tl.full((), v, tl.float64)


#: Whether these kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` when this module was
#: imported: ``triton.jit`` made interpreted functions then).
_INTERPRETED = tl.constexpr(type(_f64).__name__ == "InterpretedFunction")


@triton.jit
def _store(ptr, v, mask):
    """Store the float32 ``v`` into ``ptr``'s dtype, rounded once to nearest even (compiled: the
    hardware conversion, ``cvt.rn``; interpreted: integer operations, as the interpreter truncates
    to bfloat16)."""
    if ptr.dtype.element_ty == tl.bfloat16 and _INTERPRETED:
        u = v.to(tl.float32).to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(v != v, 0x7FC0, r)
        tl.store(ptr, r.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _pack8(bit, BLOCK: tl.constexpr):
    """``BLOCK`` 0/1 int32 values -> ``BLOCK // 8`` bytes, bit ``i % 8`` of byte ``i // 8`` = value i."""
    b = tl.reshape(bit, (BLOCK // 8, 8))
    return tl.sum(b << tl.arange(0, 8)[None, :], axis=1).to(tl.uint8)


@triton.jit
def _unpack1(bits_ptr, offs, mask):
    """The packed bit of each element index ``offs`` (int32 0/1)."""
    byte = tl.load(bits_ptr + offs // 8, mask=mask, other=0).to(tl.int32)
    return (byte >> (offs % 8).to(tl.int32)) & 1


@triton.jit
def _lerp01(start, end, w):
    """``torch.lerp(start, end, w)`` for weights 0 or 1 (exact selections; inf/nan as torch)."""
    return tl.where(w < 0.5, start + w * (end - start), end - (end - start) * (1.0 - w))


# -- dropout: the counter-based hash of leanact.ops.random ----------------------------------------

_HM1 = tl.constexpr(0x4C1B838F)
_HM2 = tl.constexpr(0x4E13EDB5)
_HM3 = tl.constexpr(0x67455873)
_HM4 = tl.constexpr(0x654EB15B)
_HK0 = tl.constexpr(0x6D0A0665)
_HK1 = tl.constexpr(0x6386D131)


@triton.jit
def _mix(x, shift: tl.constexpr, mul: tl.constexpr):
    return (x ^ (x >> shift)) * mul  # uint32: logical shift, product mod 2^32


@triton.jit
def _seed_keys(seed_ptr):
    """(k0, k1) of the int64 seed at ``seed_ptr`` (random.seed_keys), as uint32 scalars."""
    s = tl.load(seed_ptr)
    lo = s.to(tl.uint32)
    hi = (s >> 32).to(tl.uint32)
    k0 = _mix(_mix(_mix((lo ^ _HK0) * _HM1, 16, _HM2) ^ hi, 15, _HM3), 16, _HM4)
    k1 = _mix(_mix(_mix((hi ^ _HK1) * _HM1, 16, _HM2) ^ k0, 15, _HM3), 16, _HM4)
    return k0, k1


@triton.jit
def _keep(idx, k0, k1, thr):
    """``word(idx) >= thr`` for int64 element indices (random._words, uint32 lanes)."""
    x = (idx.to(tl.uint32) ^ k0) * _HM1
    x = x ^ (idx >> 32).to(tl.uint32)
    x = _mix(x, 16, _HM2) ^ k1
    x = _mix(_mix(x, 15, _HM3), 16, _HM4)
    return x >= thr.to(tl.uint32)


@triton.jit(do_not_specialize=["offset", "thr"])  # n specialized: a mask of 16-element runs lets loads vectorize
def _dropout_kernel(x_ptr, out_ptr, seed_ptr, n, offset, thr, scale, APPLY: tl.constexpr, BLOCK: tl.constexpr):
    """APPLY: ``out = x * keep * scale`` (float32, rounded once); else ``out`` = keep (uint8)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    k0, k1 = _seed_keys(seed_ptr)
    keep = _keep(offs + offset, k0, k1, thr)
    if APPLY:
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        _store(out_ptr + offs, x * keep.to(tl.float32) * scale, m)
    else:
        tl.store(out_ptr + offs, keep.to(tl.uint8), mask=m)


def _grid(n: int, block: int):
    return (triton.cdiv(n, block),)


def dropout_apply(x: torch.Tensor, out: torch.Tensor, seed: torch.Tensor, thr: int, scale: float, block: int = BLOCK):
    """``out = x * keep_mask_like(seed, x.shape, p) * scale`` for contiguous x, out (may alias)."""
    n = x.numel()
    _dropout_kernel[_grid(n, block)](x, out, seed, n, 0, thr, scale, APPLY=True, BLOCK=block, **FUSED)
    return out


def keep_mask_range(seed: torch.Tensor, out: torch.Tensor, thr: int, offset: int, block: int = BLOCK):
    """``out`` (contiguous bool) = keep decisions of the indices offset .. offset + numel - 1."""
    n = out.numel()
    o = out.view(torch.uint8)
    _dropout_kernel[_grid(n, block)](o, o, seed, n, offset, thr, 1.0, APPLY=False, BLOCK=block, **FUSED)
    return out


@triton.jit(do_not_specialize=["thr"])
def _keep_rows_kernel(starts_ptr, out_ptr, seed_ptr, length, thr, BLOCK: tl.constexpr):
    """out[r, j] = keep(starts[r] + j) for j < length (uint8): attention's dropout blocks."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = cols < length
    k0, k1 = _seed_keys(seed_ptr)
    keep = _keep(tl.load(starts_ptr + r) + cols, k0, k1, thr)
    tl.store(out_ptr + r * length + cols, keep.to(tl.uint8), mask=m)


def keep_mask_rows(seed: torch.Tensor, starts: torch.Tensor, out: torch.Tensor, thr: int, block: int = BLOCK):
    """``out`` (contiguous bool (rows, length)) = keep decisions of the indices starts[r] + j."""
    rows, length = out.shape
    o = out.view(torch.uint8)
    _keep_rows_kernel[(rows, triton.cdiv(length, block))](starts, o, seed, length, thr, BLOCK=block, **FUSED)
    return out


# -- LayerNorm / RMSNorm ------------------------------------------------------------------------


@triton.jit
def _ln_fwd_kernel(x_ptr, y_ptr, w_ptr, b_ptr, rstd_ptr, N, eps,
                   HAS_W: tl.constexpr, HAS_B: tl.constexpr, RMS: tl.constexpr, BLOCK_N: tl.constexpr):
    """One row: LayerNorm (RMS=False) or RMSNorm; stores y and rstd (float32 arithmetic)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    m = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / N
        xc = tl.where(m, x - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / N
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(var + eps))
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=m, other=0.0).to(tl.float32)
    _store(y_ptr + row * N + cols, y, m)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _ln_bwd_kernel(dy_ptr, t_ptr, w_ptr, b_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, M, N, rows_per_prog,
                   HAS_W: tl.constexpr, HAS_B: tl.constexpr, RMS: tl.constexpr, FROM_OUTPUT: tl.constexpr,
                   NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows pid*rows_per_prog ...: dx, and this program's partial sums of dγ, dβ (float32).

    LayerNorm from output: x̂ = (y − β)/γ, g = dy·γ, dx = rstd·(g − mean(g) − x̂·mean(g·x̂)),
    dγ += dy·x̂, dβ += dy. RMSNorm: no mean(g) term; from output x̂ = y/γ and the dγ partial is
    Σ dy·y (the launcher divides by γ, as the PyTorch path); from the input x̂ = x·rstd.

    The next row's t, dy and rstd are loaded before this row is reduced (their memory latency
    overlaps this row's reductions); every program stores its whole partial rows (zeros when it
    has no rows), so the partials need no initialization.
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    m = cols < N
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=m, other=1.0).to(tl.float32)
    if HAS_B:
        b = tl.load(b_ptr + cols, mask=m, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    start = pid * rows_per_prog
    end = tl.minimum(start + rows_per_prog, M)
    base = start.to(tl.int64) * N
    mn = m & (cols * 0 + start < end)
    t_next = tl.load(t_ptr + base + cols, mask=mn, other=0.0)
    dy_next = tl.load(dy_ptr + base + cols, mask=mn, other=0.0)
    rstd_next = tl.load(rstd_ptr + tl.minimum(start, M - 1))  # rows M >= 1: an index in bounds
    for r in range(start, end):
        t = t_next.to(tl.float32)
        dy = dy_next.to(tl.float32)
        rstd = rstd_next.to(tl.float32)
        mn = m & (cols * 0 + r + 1 < end)
        t_next = tl.load(t_ptr + base + N + cols, mask=mn, other=0.0)
        dy_next = tl.load(dy_ptr + base + N + cols, mask=mn, other=0.0)
        rstd_next = tl.load(rstd_ptr + tl.minimum(r + 1, M - 1))
        if FROM_OUTPUT:
            xh = t
            if HAS_B:
                xh = xh - b
            if HAS_W:
                xh = tl.math.div_rn(xh, w)
        else:
            xh = t * rstd
        xh = tl.where(m, xh, 0.0)
        g = dy
        if HAS_W:
            g = dy * w
        if NEED_DX:
            if RMS and FROM_OUTPUT:
                c1 = tl.sum(dy * t, axis=0) / N  # g·x̂ = dy·y
            else:
                c1 = tl.sum(g * xh, axis=0) / N
            if RMS:
                dx = (g - xh * c1) * rstd
            else:
                dx = (g - tl.sum(g, axis=0) / N - xh * c1) * rstd
            _store(dx_ptr + base + cols, dx, m)
        if NEED_DW:
            if RMS and FROM_OUTPUT:
                dw_acc += dy * t
            else:
                dw_acc += dy * xh
        if NEED_DB:
            db_acc += dy
        base += N
    if NEED_DW:
        tl.store(dw_ptr + pid * N + cols, dw_acc, mask=m)
    if NEED_DB:
        tl.store(db_ptr + pid * N + cols, db_acc, mask=m)


def _warps(block_n: int) -> int:
    return max(1, min(16, block_n // 256))


def norm_forward(x: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, n: int, weight, bias, eps: float, rms: bool):
    """y (x's shape and dtype) and rstd (float32, one per row) of contiguous x viewed as (rows, n)."""
    rows = rstd.numel()
    if rows:
        block_n = triton.next_power_of_2(n)
        _ln_fwd_kernel[(rows,)](x, y, weight if weight is not None else x, bias if bias is not None else x, rstd,
                                n, eps, HAS_W=weight is not None, HAS_B=bias is not None, RMS=rms,
                                BLOCK_N=block_n, num_warps=_warps(block_n), **FUSED)


def norm_backward(dy: torch.Tensor, t: torch.Tensor, rstd: torch.Tensor, weight, bias, dx, dw, db, n: int, rms: bool,
                  from_output: bool):
    """dx (or None) and the per-program partial sums of dγ, dβ (float32 (programs, n), or
    None); ``dw.shape[0]`` (or ``db``'s) programs share the rows; one program without partials."""
    rows = rstd.numel()
    parts = dw if dw is not None else db
    p = parts.shape[0] if parts is not None else max(1, min(rows, 1024))
    if rows:
        block_n = triton.next_power_of_2(n)
        dummy = t
        _ln_bwd_kernel[(p,)](dy, t, weight if weight is not None else dummy, bias if bias is not None else dummy,
                             rstd, dx if dx is not None else dummy, dw if dw is not None else dummy,
                             db if db is not None else dummy, rows, n, triton.cdiv(rows, p),
                             HAS_W=weight is not None, HAS_B=bias is not None, RMS=rms, FROM_OUTPUT=from_output,
                             NEED_DX=dx is not None, NEED_DW=dw is not None, NEED_DB=db is not None, BLOCK_N=block_n,
                             num_warps=_warps(block_n), **FUSED)


# -- GELU ----------------------------------------------------------------------------------------


@triton.jit
def _gelu16_fwd_kernel(x_ptr, y_ptr, bits_ptr, tab_ptr, n, u, WITH_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """16-bit storage: y = table[pattern(x)] (int16 views), right = pattern < u, packed."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    pat = tl.load(x_ptr + offs, mask=m, other=0).to(tl.int32) & 0xFFFF
    tl.store(y_ptr + offs, tl.load(tab_ptr + pat, mask=m, other=0), mask=m)
    if WITH_BITS:
        right = ((pat < u) & m).to(tl.int32)
        boffs = pid.to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        tl.store(bits_ptr + boffs, _pack8(right, BLOCK), mask=boffs < (n + 7) // 8)


@triton.jit
def _gelu16_bwd_kernel(y_ptr, bits_ptr, dy_ptr, out_ptr, tab_ptr, n, BLOCK: tl.constexpr):
    """16-bit storage: out = gtable[pattern(y) + 65536 * bit] * dy in float32, rounded once."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    pat = tl.load(y_ptr + offs, mask=m, other=0).to(tl.int32) & 0xFFFF
    g = tl.load(tab_ptr + pat + (_unpack1(bits_ptr, offs, m) << 16), mask=m, other=0.0)
    dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
    _store(out_ptr + offs, g * dy, m)


# erfc in float64: our own Chebyshev fit (scripts/erfc_chebyshev.py: mpmath, 40 digits; the
# dropped tail is below 1e-18). For a >= 0, t = 2/(2+a), w = 2t - 1 in (-1, 1]:
# erfc(a) = t exp(-a^2) exp(G(w)), G = sum_j c_j T_j(w), a smooth function of w.
@triton.jit
def _erfc_series(w):
    """sum c_j T_j(w) by Clenshaw's recurrence (c_j: _ERFC_C, spelled out for older Triton)."""
    w2 = w + w
    b1 = _f64(0.0)
    b2 = _f64(0.0)
    b0 = w2 * b1 - b2 + _f64(-8.446077682509007e-19)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(2.3281042579529253e-18)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(5.003005559445898e-20)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(-2.816663087747177e-17)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(1.210237189224279e-16)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(-9.457494571291233e-17)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(-1.5230282014571043e-15)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(7.106097613609237e-15)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(3.810905255189232e-16)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(-1.1270822361367252e-13)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(3.130921399342958e-13)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(8.944879273090725e-13)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(-6.886027526497553e-12)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(2.3940380830391146e-12)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(9.646791102015527e-11)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(-2.273651222931836e-10)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(-9.91364156493033e-10)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(5.059343495551469e-09)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(6.5290544390988515e-09)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(-8.523809591492654e-08)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(1.5626441722066142e-08)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(1.3036558355805232e-06)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(-1.6242900046470256e-06)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(-2.0278578112534242e-05)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(4.252332480690777e-05)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(0.00036683949785276145)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(-0.0009465953444820369)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(-0.009561514786808632)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(0.019476473204185836)
    b2 = b1
    b1 = b0
    b0 = w2 * b1 - b2 + _f64(0.6419697923564902)
    b2 = b1
    b1 = b0
    return w * b1 - b2 + _f64(-0.6513268598908547)


@triton.jit
def _erfc64(z):
    """erfc(z) in float64 (relative error ~1e-16; erfc(-z) = 2 - erfc(z))."""
    a = tl.minimum(tl.abs(z), _f64(40.0), propagate_nan=tl.PropagateNan.ALL)  # erfc(40) = 0 in float64
    t = 2.0 / (a + 2.0)
    g = _erfc_series(t + t - 1.0)
    aa = a * a
    e = tl.fma(a, a, -aa)  # a^2 = aa + e exactly
    r = t * tl.exp(-aa) * tl.exp(g - e)
    return tl.where(z < 0, 2.0 - r, r)



@triton.jit
def _erfc64_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, _erfc64(tl.load(x_ptr + offs, mask=m, other=0.0)), mask=m)


def erfc64(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """:func:`_erfc64` of a contiguous float64 tensor (for tests)."""
    y = torch.empty_like(x)
    if x.numel():
        _erfc64_kernel[_grid(x.numel(), block)](x, y, x.numel(), BLOCK=block, **UNFUSED)
    return y

_SQRT1_2 = tl.constexpr(_gm._SQRT1_2)
_A = tl.constexpr(_gm._A)
_K1 = tl.constexpr(_gm._K1)  # 2 sqrt(2/pi)
_LN_INV_SQRT_2PI = tl.constexpr(_gm._LN_INV_SQRT_2PI)
_KEY_TINY = tl.constexpr(_g32._KEY_TINY)
_KEY_SCALE = tl.constexpr(_g32._KEY_SCALE)
_KEY_RIGHT_MAX = tl.constexpr(_g32._KEY_RIGHT_MAX)
_KEY_SHIFT = tl.constexpr(_g32._KEY_SHIFT)
_NCELL = tl.constexpr(_g32._NCELL)


@triton.jit
def _gelu32_fwd_kernel(x_ptr, y_ptr, bits_ptr, n, thr, TANH: tl.constexpr, WITH_BITS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """float32 storage: GELU in float64 (gelu.rebuild32._forward32's formulas), rounded once; right = x > thr."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    xd = x.to(tl.float64)
    if TANH:
        z = xd * xd * _f64(_A) + 1.0
        z = z * xd * _f64(_K1)
        s = 1.0 / (1.0 + tl.exp(-z))
    else:
        s = _erfc64(xd * _f64(-_SQRT1_2)) * 0.5
    tl.store(y_ptr + offs, (s * xd).to(tl.float32), mask=m)
    if WITH_BITS:
        right = ((x > thr) & m).to(tl.int32)
        boffs = pid.to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        tl.store(bits_ptr + boffs, _pack8(right, BLOCK), mask=boffs < (n + 7) // 8)


@triton.jit
def _gelu32_bwd_kernel(y_ptr, bits_ptr, dy_ptr, out_ptr, ab_ptr, h_ptr, n, c32, TANH: tl.constexpr,
                       BLOCK: tl.constexpr):
    """float32 storage: gelu.rebuild32._guess32 (float32) then _step32_erf / _step32_tanh (float64), fused.

    Same operations in the same order; ``addcmul`` and ``add(alpha=)`` are fused multiply-adds
    (as torch evaluates them), everything else rounds after each operation.
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    y = tl.load(y_ptr + offs, mask=m, other=0.0)
    dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
    rf = _unpack1(bits_ptr, offs, m).to(tl.float32)
    # stage 1 (float32): key, keep mask times dy, the cell's interpolated x and coefficient h
    kr = ((y - c32) - _KEY_TINY) * _KEY_SCALE  # right key
    key = -tl.math.div_rn(y, kr)  # left key
    kr = tl.minimum(kr, _KEY_RIGHT_MAX, propagate_nan=tl.PropagateNan.ALL)
    key = _lerp01(key, kr, rf)
    mk = tl.clamp(key * 1.7014118346046923e38, 0.0, 1.0, propagate_nan=tl.PropagateNan.ALL) * dy  # key 2^127
    idx = (key.to(tl.int32, bitcast=True) >> _KEY_SHIFT) & (_NCELL - 1)
    a = tl.load(ab_ptr + 2 * idx, mask=m, other=0.0)
    b = tl.load(ab_ptr + 2 * idx + 1, mask=m, other=0.0)
    h = tl.load(h_ptr + idx, mask=m, other=0.0)
    x = tl.fma(key, b, a).to(tl.float64)
    yd = y.to(tl.float64)
    md = mk.to(tl.float64)
    if TANH:
        wb = x * x
        z = tl.exp(tl.fma(wb, _f64(-_K1 * _A), _f64(-_K1)) * x)  # e = exp(-v)
        s = 1.0 / (z + 1.0)
        z = z * s  # 1 - s
        r = tl.fma(-x, s, yd)  # y - f
        wb = tl.fma(wb, _f64(3.0 * _A * _K1), _f64(_K1))  # v'
        x = x * wb  # x v'
        pp = s * z  # p = s (1 - s)
        z = z - s  # 1 - 2s
        s = tl.fma(pp, x, s)  # f'
        z = ((z * x + 4.0) * wb - _f64(2.0 * _K1)) * pp  # f''
        r = r / s  # q
        z = tl.fma(r, h, z)  # f'' + q h
        s = tl.fma(r, z, s)  # f' + q f'' + q^2 h
        out = s * md
    else:
        z = _erfc64(x * _f64(-_SQRT1_2))  # E = 2 Phi
        wb = tl.fma(x * -0.5, x, _f64(_LN_INV_SQRT_2PI))  # ln phi
        p = tl.exp(wb)  # phi
        r = tl.fma(x * -0.5, z, yd)  # y - f
        x = x * p  # x phi
        z = tl.fma(x, _f64(2.0), z)  # 2 f'
        r = r / z  # q / 2
        wb = wb + _f64(1.0 - _LN_INV_SQRT_2PI)  # 1 - x^2/2
        p = p * wb  # f''/2
        p = tl.fma(r, h, p)  # f''/2 + (q/2) h
        z = tl.fma(r * 8.0, p, z)  # 2 (f' + q f'' + q^2 h)
        out = z * md * 0.5
    tl.store(out_ptr + offs, out.to(tl.float32), mask=m)


def gelu_forward16(x: torch.Tensor, y: torch.Tensor, bits, table: torch.Tensor, u: int, block: int = BLOCK):
    n = x.numel()
    if n:
        _gelu16_fwd_kernel[_grid(n, block)](x.view(torch.int16), y.view(torch.int16),
                                            bits if bits is not None else y, table.view(torch.int16), n, u,
                                            WITH_BITS=bits is not None, BLOCK=block, **FUSED)


def gelu_backward16(y: torch.Tensor, bits: torch.Tensor, dy: torch.Tensor, out: torch.Tensor, table: torch.Tensor,
                    block: int = BLOCK):
    n = y.numel()
    if n:
        _gelu16_bwd_kernel[_grid(n, block)](y.view(torch.int16), bits, dy, out, table, n, BLOCK=block, **FUSED)


def gelu_forward32(x: torch.Tensor, y: torch.Tensor, bits, thr: float, tanh: bool, block: int = BLOCK):
    n = x.numel()
    if n:
        _gelu32_fwd_kernel[_grid(n, block)](x, y, bits if bits is not None else y, n, thr, TANH=tanh,
                                            WITH_BITS=bits is not None, BLOCK=block, **UNFUSED)


def gelu_backward32(y: torch.Tensor, bits: torch.Tensor, dy: torch.Tensor, out: torch.Tensor, ab: torch.Tensor,
                    h: torch.Tensor, c32: float, tanh: bool, block: int = BLOCK):
    n = y.numel()
    if n:
        _gelu32_bwd_kernel[_grid(n, block)](y, bits, dy, out, ab.view(torch.float32), h, n, c32, TANH=tanh,
                                            BLOCK=block, **UNFUSED)
