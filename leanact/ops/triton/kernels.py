"""Triton kernels of the lean ops, one per op and direction, and their launchers.

Every kernel reads each input once and writes each output once. They compute what the PyTorch
path computes (:mod:`leanact.ops.dropout`, ``.layer_norm``, ``.rms_norm``, ``.gelu``):

- dropout: the counter-based hash of :mod:`leanact.ops.random` on uint32 lanes (products wrap
  mod 2^32, shifts of unsigned values are logical), so the mask is bit for bit the PyTorch one;
  ``x * keep * scale`` in float32, rounded once, as torch does it.
- GELU, 16-bit storage: the same lookup tables (built by the PyTorch path, read here), the branch
  bit packed in the kernel: bitwise the PyTorch path. (float32 storage: :mod:`.gelu32_kernels`.)
- LayerNorm / RMSNorm: one program per row (forward) and a row loop per program accumulating
  dγ, dβ in float32 (backward); the reduction order differs from torch's, so results agree to
  float32 rounding, not bitwise.

Everything here runs under ``TRITON_INTERPRET=1`` on CPU tensors too (the tests do that), so it
uses only what both the interpreter and the compiler support: no libdevice, no inline asm. The
interpreter converts float32 to bfloat16 by truncation, so there bfloat16 results are rounded to
nearest even with integer operations (:func:`_store`); compiled, by the hardware's round-to-nearest-
even conversion: the same values. No kernel uses float64 (1/2 to 1/64 of float32's rate on GPUs;
tests/test_triton_ptx.py checks the compiled code).

This module is imported only when a kernel is about to run (see :mod:`.dispatch`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import dispatch as _dispatch
from .dispatch import BLOCK  # elements per program of the elementwise kernels
from .launch import cdiv, launch, next_power_of_2

#: Launch options: contraction into FMAs allowed (the norms) or not (kernels whose rounding sequence
#: must be the interpreter's or torch's). Always explicit: Triton 3.9 warns when it is left to its default.
FUSED, UNFUSED = {"enable_fp_fusion": True}, {"enable_fp_fusion": False}

# -- shared helpers --------------------------------------------------------------------------------


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
def _load_f32(ptr, mask):
    """``ptr``'s values as float32, exactly (interpreted, bfloat16 through its bits: the interpreter's
    own conversion loses bfloat16 subnormals)."""
    if ptr.dtype.element_ty == tl.bfloat16 and _INTERPRETED:
        bits = tl.load(ptr, mask=mask, other=0.0).to(tl.uint16, bitcast=True).to(tl.uint32)
        return (bits << 16).to(tl.float32, bitcast=True)
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


#: Whether these kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` when this module was
#: imported: ``triton.jit`` made interpreted functions then).
_INTERPRETED = tl.constexpr(type(_store).__name__ == "InterpretedFunction")


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
    return (cdiv(n, block),)


def dropout_apply(x: torch.Tensor, out: torch.Tensor, seed: torch.Tensor, thr: int, scale: float, block: int = BLOCK):
    """``out = x * keep_mask_like(seed, x.shape, p) * scale`` for contiguous x, out (may alias)."""
    n = x.numel()
    launch(_dropout_kernel, _grid(n, block), x, out, seed, n, 0, thr, scale, APPLY=True, BLOCK=block, **FUSED)
    return out


def keep_mask_range(seed: torch.Tensor, out: torch.Tensor, thr: int, offset: int, block: int = BLOCK):
    """``out`` (contiguous bool) = keep decisions of the indices offset .. offset + numel - 1."""
    n = out.numel()
    o = out.view(torch.uint8)
    launch(_dropout_kernel, _grid(n, block), o, o, seed, n, offset, thr, 1.0, APPLY=False, BLOCK=block, **FUSED)
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
    launch(_keep_rows_kernel, (rows, cdiv(length, block)), starts, o, seed, length, thr, BLOCK=block, **FUSED)
    return out


# -- LayerNorm / RMSNorm ------------------------------------------------------------------------


@triton.jit
def _round(v, KIND: tl.constexpr):
    """float32 ``v`` rounded to nearest even in the dtype of code ``KIND`` (0 float32, 1 bfloat16,
    2 float16), returned as float32: a value the kernel does not store but torch would have (the
    dropout output, the residual sum)."""
    if KIND == 1:
        if _INTERPRETED:  # (the interpreter truncates to bfloat16: integer operations, as in _store)
            u = v.to(tl.uint32, bitcast=True)
            r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
            return tl.where(v != v, v, r.to(tl.float32, bitcast=True))
        return v.to(tl.bfloat16).to(tl.float32)
    elif KIND == 2:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def _round_as(v, ptr):
    """float32 ``v`` rounded to nearest even in ``ptr``'s element dtype, returned as float32."""
    if ptr.dtype.element_ty == tl.bfloat16:
        return _round(v, 1)
    elif ptr.dtype.element_ty == tl.float16:
        return _round(v, 2)
    else:
        return v


@triton.jit(do_not_specialize=["thr"])
def _ln_fwd_kernel(x_ptr, y_ptr, w_ptr, b_ptr, rstd_ptr, N, eps, r_ptr, seed_ptr, thr, scale,
                   HAS_W: tl.constexpr, HAS_B: tl.constexpr, RMS: tl.constexpr, BLOCK_N: tl.constexpr,
                   RESIDUAL: tl.constexpr, DROPOUT: tl.constexpr, Z_KIND: tl.constexpr):
    """One row: LayerNorm (RMS=False) or RMSNorm; stores y and rstd (float32 arithmetic).

    RESIDUAL: the row normalized is z = dropout(x) + r (the sub-layer's output, dropped out, plus
    the residual stream), neither kept nor stored: the dropout output rounded to x's dtype, the
    sum to z's (code Z_KIND), as torch's two ops round them. The keep-mask is the dropout
    kernel's, by element index of x (DROPOUT; else no dropout)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    m = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
    if RESIDUAL:
        if DROPOUT:
            k0, k1 = _seed_keys(seed_ptr)
            x = _round_as(x * _keep(row * N + cols, k0, k1, thr).to(tl.float32) * scale, x_ptr)
        x = _round(x + tl.load(r_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32), Z_KIND)
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


@triton.jit(do_not_specialize=["thr"])
def _ln_bwd_kernel(dy_ptr, t_ptr, w_ptr, b_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, M, N, rows_per_prog,
                   dh_ptr, seed_ptr, thr, scale,
                   HAS_W: tl.constexpr, HAS_B: tl.constexpr, RMS: tl.constexpr, FROM_OUTPUT: tl.constexpr,
                   NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, BLOCK_N: tl.constexpr,
                   RESIDUAL: tl.constexpr, NEED_DH: tl.constexpr, DROPOUT: tl.constexpr, Z_KIND: tl.constexpr):
    """Rows pid*rows_per_prog ...: dx, and this program's partial sums of dγ, dβ (float32).

    RESIDUAL (the forward normalized z = dropout(h) + r): dx is dz rounded to z's dtype (code
    Z_KIND), stored (NEED_DX) as r's gradient; dh (NEED_DH) is that rounded to h's dtype times the
    regenerated keep-mask and the dropout scale (DROPOUT), as torch's backward of the add and
    leanact's dropout round them.

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
    if DROPOUT:
        k0, k1 = _seed_keys(seed_ptr)
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
        if NEED_DX or NEED_DH:
            if RMS and FROM_OUTPUT:
                c1 = tl.sum(dy * t, axis=0) / N  # g·x̂ = dy·y
            else:
                c1 = tl.sum(g * xh, axis=0) / N
            if RMS:
                dx = (g - xh * c1) * rstd
            else:
                dx = (g - tl.sum(g, axis=0) / N - xh * c1) * rstd
            if RESIDUAL:
                dx = _round(dx, Z_KIND)
                if NEED_DH:
                    dh = dx
                    if DROPOUT:
                        dh = _round_as(dh, dh_ptr) * _keep(base + cols, k0, k1, thr).to(tl.float32) * scale
                    _store(dh_ptr + base + cols, dh, m)
            if NEED_DX:
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


#: dtype -> the code :func:`_round` takes
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def norm_forward(x: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, n: int, weight, bias, eps: float, rms: bool,
                 residual: torch.Tensor | None = None, seed: torch.Tensor | None = None, thr: int = 0,
                 scale: float = 1.0, z_dtype: torch.dtype = torch.float32):
    """y (its own dtype, x's shape) and rstd (float32, one per row) of contiguous x viewed as (rows, n).

    With ``residual`` (contiguous, x's shape): of z = dropout(x) + residual instead, the dropout
    from ``seed`` with keep threshold ``thr`` and factor ``scale`` (no dropout when ``seed`` is
    None), z rounded to ``z_dtype``; launched without FMA contraction, so that the dropout's product
    is rounded before the sum, as torch's two ops do."""
    rows = rstd.numel()
    if rows:
        block_n = next_power_of_2(n)
        add = residual is not None
        launch(_ln_fwd_kernel, (rows,), x, y, weight if weight is not None else x,
               bias if bias is not None else x, rstd, n, eps, residual if add else x,
               seed if seed is not None else rstd, thr, scale,
               HAS_W=weight is not None, HAS_B=bias is not None, RMS=rms,
               BLOCK_N=block_n, RESIDUAL=add, DROPOUT=add and seed is not None,
               Z_KIND=_KINDS[z_dtype], num_warps=_warps(block_n), **(UNFUSED if add else FUSED))


def norm_backward(dy: torch.Tensor, t: torch.Tensor, rstd: torch.Tensor, weight, bias, dx, dw, db, n: int, rms: bool,
                  from_output: bool, residual: bool = False, dh=None, seed: torch.Tensor | None = None, thr: int = 0,
                  scale: float = 1.0, z_dtype: torch.dtype = torch.float32):
    """dx (or None) and the per-program partial sums of dγ, dβ (float32 (programs, n), or
    None); ``dw.shape[0]`` (or ``db``'s) programs share the rows, without partials
    :data:`.dispatch.PROGRAMS_WITHOUT_PARTIALS` (None: one per row).

    ``residual`` (the forward of :func:`norm_forward` with a residual): dx (or None) is the
    residual's gradient, dz rounded to ``z_dtype`` then to dx's dtype; ``dh`` (or None) the
    gradient of the dropout's input (``seed``, ``thr``, ``scale`` as in the forward)."""
    rows = rstd.numel()
    parts = dw if dw is not None else db
    free = _dispatch.PROGRAMS_WITHOUT_PARTIALS
    p = parts.shape[0] if parts is not None else max(1, rows if free is None else min(rows, free))
    if rows:
        block_n = next_power_of_2(n)
        dummy = t
        launch(_ln_bwd_kernel, (p,), dy, t, weight if weight is not None else dummy,
               bias if bias is not None else dummy, rstd, dx if dx is not None else dummy,
               dw if dw is not None else dummy, db if db is not None else dummy, rows, n, cdiv(rows, p),
               dh if dh is not None else dummy, seed if seed is not None else rstd, thr, scale,
               HAS_W=weight is not None, HAS_B=bias is not None, RMS=rms, FROM_OUTPUT=from_output,
               NEED_DX=dx is not None, NEED_DW=dw is not None, NEED_DB=db is not None, BLOCK_N=block_n,
               RESIDUAL=residual, NEED_DH=residual and dh is not None,
               DROPOUT=residual and seed is not None, Z_KIND=_KINDS[z_dtype],
               num_warps=_warps(block_n), **FUSED)


@triton.jit
def _partials_sum_kernel(pw_ptr, pb_ptr, w_ptr, dw_ptr, db_ptr, P, N, HAS_DW: tl.constexpr, HAS_DB: tl.constexpr,
                         DIV_W: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Columns pid·BLOCK_N ...: dγ = Σ_p pw[p] (÷ γ when ``DIV_W``: RMSNorm from output) and dβ =
    Σ_p pb[p], each where needed; float32 sums (tiles of BLOCK_P rows added elementwise, then the
    tile's rows summed), rounded once to dγ's and dβ's dtypes (the parameters')."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_P)
    m = cols < N
    acc_w = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        r = p0 + rows
        mm = (r < P)[:, None] & m[None, :]
        offs = r.to(tl.int64)[:, None] * N + cols[None, :]
        if HAS_DW:
            acc_w += tl.load(pw_ptr + offs, mask=mm, other=0.0)
        if HAS_DB:
            acc_b += tl.load(pb_ptr + offs, mask=mm, other=0.0)
    if HAS_DW:
        dw = tl.sum(acc_w, axis=0)
        if DIV_W:
            dw = tl.math.div_rn(dw, tl.load(w_ptr + cols, mask=m, other=1.0).to(tl.float32))
        _store(dw_ptr + cols, dw, m)
    if HAS_DB:
        _store(db_ptr + cols, tl.sum(acc_b, axis=0), m)


def norm_partials_sum(pw, pb, dw, db, weight, n: int, div_w: bool):
    """``dw`` and ``db`` (each None where not needed; the parameters' dtypes) from the backward's
    float32 partial sums ``pw``, ``pb`` ((programs, n) each); ``div_w``: dγ ÷ γ (RMSNorm from
    output; ``weight`` contiguous)."""
    any_ = pw if pw is not None else pb
    out = dw if dw is not None else db
    block_n = 64
    launch(_partials_sum_kernel, (cdiv(n, block_n),),
        any_ if pw is None else pw, any_ if pb is None else pb, weight if div_w else any_,
        out if dw is None else dw, out if db is None else db, any_.shape[0], n, HAS_DW=pw is not None,
        HAS_DB=pb is not None, DIV_W=div_w, BLOCK_P=32, BLOCK_N=block_n, num_warps=4, **FUSED)

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


def gelu_forward16(x: torch.Tensor, y: torch.Tensor, bits, table: torch.Tensor, u: int, block: int = BLOCK):
    n = x.numel()
    if n:
        launch(_gelu16_fwd_kernel, _grid(n, block), x.view(torch.int16), y.view(torch.int16),
               bits if bits is not None else y, table.view(torch.int16), n, u,
               WITH_BITS=bits is not None, BLOCK=block, **FUSED)


def gelu_backward16(y: torch.Tensor, bits: torch.Tensor, dy: torch.Tensor, out: torch.Tensor, table: torch.Tensor,
                    block: int = BLOCK):
    n = y.numel()
    if n:
        launch(_gelu16_bwd_kernel, _grid(n, block), y.view(torch.int16), bits, dy, out, table, n, BLOCK=block, **FUSED)
