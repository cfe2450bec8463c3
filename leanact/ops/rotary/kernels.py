"""Triton kernel of the rotary position embedding (:mod:`.function`): q and k in one launch
each way, one program per (tensor, batch, head) and block of positions, both halves of the head
dimension in one pass.

Forward, for x = q or k (any strides, unit stride along the head dimension) and the tables c, s
(cos, sin: (batch or 1, positions, head dim)), with r = rotate_half(x) = (−x₂, x₁)::

    out = round_p(round_p(x·c) + round_p(r·s))

rounded where Hugging Face's ``(q * cos) + (rotate_half(q) * sin)`` rounds: each product and the
sum in the promoted dtype p of x and the tables (code ``P_KIND``), computed in float32 without FMA
contraction (launched with ``enable_fp_fusion=False``): bitwise torch's values.

Backward, from g (p's dtype): the gradient autograd computes through the same three ops, rounded
where it rounds: each product's gradient in p, cast to x's dtype (code ``X_KIND``) as the engine
casts a gradient to its input's dtype, ``rotate_half``'s backward (a shift and a negation, exact),
and the sum of the two contributions in x's dtype::

    dx₁ = round_x(round_x(round_p(g₁·c₁)) + round_x(round_p(g₂·s₂)))
    dx₂ = round_x(round_x(round_p(g₂·c₂)) − round_x(round_p(g₁·s₁)))

plus 0.0, which turns a −0 into +0 as the engine's third term (a zero-padded slice) does. Each
element of x, the tables and the output is read or written once: 2·(x's bytes + p's bytes) per
element of q and k over forward and backward (the tables, shared by every head, once per head
from cache; the unfused sequence's traffic in docs/triton.md, "Cost per kernel").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton.common import UNFUSED, _KINDS, _load_f32, _round, _store
from ..triton.launch import cdiv, launch, next_power_of_2

__all__ = ["rotary"]


@triton.jit
def _rotate(x_ptr, c_ptr, s_ptr, o_ptr, b, h, rows, sxb, sxh, sxs, sob, soh, sos, scb, scs, ssb, sss, S,
            HALF: tl.constexpr, BACKWARD: tl.constexpr, P_KIND: tl.constexpr, X_KIND: tl.constexpr,
            BLOCK_D: tl.constexpr):
    """Positions ``rows`` of head h of batch b of one tensor (module doc)."""
    cols = tl.arange(0, BLOCK_D)
    m = (rows < S)[:, None] & (cols < HALF)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    xo = x_ptr + b * sxb + h * sxh + r64 * sxs + cols[None, :]
    oo = o_ptr + b * sob + h * soh + r64 * sos + cols[None, :]
    co = c_ptr + b * scb + r64 * scs + cols[None, :]
    so = s_ptr + b * ssb + r64 * sss + cols[None, :]
    x1 = _load_f32(xo, m)
    x2 = _load_f32(xo + HALF, m)
    c1 = _load_f32(co, m)
    c2 = _load_f32(co + HALF, m)
    s1 = _load_f32(so, m)
    s2 = _load_f32(so + HALF, m)
    if BACKWARD:  # x: the output's gradient g (p's dtype); o: x's gradient (x's dtype)
        a1 = _round(_round(x1 * c1, P_KIND), X_KIND)
        a2 = _round(_round(x2 * c2, P_KIND), X_KIND)
        b1 = _round(_round(x1 * s1, P_KIND), X_KIND)
        b2 = _round(_round(x2 * s2, P_KIND), X_KIND)
        o1 = _round(a1 + b2, X_KIND) + 0.0
        o2 = _round(a2 - b1, X_KIND) + 0.0
    else:
        o1 = _round(_round(x1 * c1, P_KIND) + _round(-x2 * s1, P_KIND), P_KIND)
        o2 = _round(_round(x2 * c2, P_KIND) + _round(x1 * s2, P_KIND), P_KIND)
    _store(oo, o1, m)
    _store(oo + HALF, o2, m)


@triton.jit
def _rotary_kernel(x_ptr, o_ptr, y_ptr, p_ptr, c_ptr, s_ptr, H, HY, BH, S, sxb, sxh, sxs, sob, soh, sos,
                   syb, syh, sys_, spb, sph, sps, scb, scs, ssb, sss, HALF: tl.constexpr, BACKWARD: tl.constexpr,
                   P_KIND: tl.constexpr, X_KIND: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Positions pid(1)·BLOCK_S ... of one head: programs pid(0) < BH = B·H rotate x (head pid(0) % H
    of batch pid(0) // H) into o, the others y (HY heads) into p: q and k in one launch."""
    bh = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    if bh < BH:
        _rotate(x_ptr, c_ptr, s_ptr, o_ptr, (bh // H).to(tl.int64), (bh % H).to(tl.int64), rows, sxb, sxh, sxs,
                sob, soh, sos, scb, scs, ssb, sss, S, HALF, BACKWARD, P_KIND, X_KIND, BLOCK_D)
    else:
        j = bh - BH
        _rotate(y_ptr, c_ptr, s_ptr, p_ptr, (j // HY).to(tl.int64), (j % HY).to(tl.int64), rows, syb, syh, sys_,
                spb, sph, sps, scb, scs, ssb, sss, S, HALF, BACKWARD, P_KIND, X_KIND, BLOCK_D)


def _block_s(half: int) -> int:
    """Positions per program: about 4096 elements of each half."""
    return max(1, min(64, 4096 // next_power_of_2(half)))


def rotary(pairs, cos: torch.Tensor, sin: torch.Tensor, backward: bool, p_dtype: torch.dtype,
           x_dtype: torch.dtype) -> None:
    """For each ``(x, out)`` of ``pairs`` (one or two: q's and k's, one launch), ``out`` (x's shape
    (B, H, S, D), the pairs' B and S the same) from x and the tables (cos, sin: (B or 1, S, D)),
    forward or backward (module doc). Every tensor has unit stride along D; ``p_dtype``: the promoted
    dtype, ``x_dtype``: the rotated tensors' (in backward, the x are the gradients and the outs the
    inputs' gradients)."""
    pairs = [(x, out) for x, out in pairs if x.numel()]
    if not pairs:
        return
    (x, out), (y, y_out) = pairs[0], pairs[-1]  # (one pair: y is x, and no program reads it)
    bsz, heads, seq, d = x.shape
    y_heads = y.shape[1]
    half = d // 2
    block_s = _block_s(half)
    bc = 0 if cos.shape[0] == 1 else cos.stride(0)
    bs = 0 if sin.shape[0] == 1 else sin.stride(0)
    grid = (bsz * (heads + (y_heads if len(pairs) == 2 else 0)), cdiv(seq, block_s))
    launch(_rotary_kernel, grid, x, out, y, y_out, cos, sin, heads, y_heads, bsz * heads, seq, *x.stride()[:3],
           *out.stride()[:3], *y.stride()[:3], *y_out.stride()[:3], bc, cos.stride(1), bs, sin.stride(1), HALF=half,
           BACKWARD=backward, P_KIND=_KINDS[p_dtype], X_KIND=_KINDS[x_dtype], BLOCK_S=block_s,
           BLOCK_D=next_power_of_2(half), num_warps=4, **UNFUSED)
