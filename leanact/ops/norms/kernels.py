"""Triton kernels of LayerNorm and RMSNorm (:mod:`.layer_norm`, :mod:`.rms_norm`,
:mod:`.dropout_add_norm`), one per direction, and the sum of the backward's partials; launched by
:mod:`.launchers`.

One program per row (forward) and a row loop per program accumulating dγ, dβ in float32
(backward); the reduction order differs from torch's, so results agree to float32 rounding, not
bitwise. The forward may normalize z = dropout(x) + residual instead of x (the sub-layer's end),
its keep-mask the dropout kernel's (:mod:`leanact.ops.triton.hash`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton.common import _KINDS, FUSED, UNFUSED, _round, _round_as, _store
from ..triton.hash import _keep, _seed_keys
from ..triton.launch import cdiv, launch, next_power_of_2
from . import launchers as _launchers


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
    :data:`.launchers.PROGRAMS_WITHOUT_PARTIALS` (None: one per row).

    ``residual`` (the forward of :func:`norm_forward` with a residual): dx (or None) is the
    residual's gradient, dz rounded to ``z_dtype`` then to dx's dtype; ``dh`` (or None) the
    gradient of the dropout's input (``seed``, ``thr``, ``scale`` as in the forward)."""
    rows = rstd.numel()
    parts = dw if dw is not None else db
    free = _launchers.PROGRAMS_WITHOUT_PARTIALS
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
