"""Triton kernel of the rotary position embedding (:mod:`leanact.ops.rotary`): one program per
(batch, head) and block of positions, both halves of the head dimension in one pass.

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
from cache), where the unfused sequence moves 80 (bf16 q, fp32 tables) in 14 launches per tensor.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kernels import UNFUSED, _KINDS, _load_f32, _round, _store
from .launch import cdiv, launch, next_power_of_2

__all__ = ["rotary"]


@triton.jit
def _rotary_kernel(x_ptr, c_ptr, s_ptr, o_ptr, H, S, sxb, sxh, sxs, sob, soh, sos, scb, scs, ssb, sss,
                   HALF: tl.constexpr, BACKWARD: tl.constexpr, P_KIND: tl.constexpr, X_KIND: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Positions pid(1)·BLOCK_S ... of head pid(0) % H of batch pid(0) // H (module doc)."""
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
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


def _block_s(half: int) -> int:
    """Positions per program: about 4096 elements of each half."""
    return max(1, min(64, 4096 // next_power_of_2(half)))


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, backward: bool,
           p_dtype: torch.dtype, x_dtype: torch.dtype) -> None:
    """``out`` (x's shape (B, H, S, D)) from x and the tables (cos, sin: (B or 1, S, D)), forward or
    backward (module doc). Every tensor has unit stride along D; ``p_dtype``: the promoted dtype,
    ``x_dtype``: the rotated tensor's (in backward, x is the gradient and ``out`` the input's
    gradient)."""
    bsz, heads, seq, d = x.shape
    half = d // 2
    if x.numel() == 0:
        return
    block_s = _block_s(half)
    bc = 0 if cos.shape[0] == 1 else cos.stride(0)
    bs = 0 if sin.shape[0] == 1 else sin.stride(0)
    grid = (bsz * heads, cdiv(seq, block_s))
    launch(_rotary_kernel, grid, x, cos, sin, out, heads, seq, *x.stride()[:3], *out.stride()[:3], bc,
           cos.stride(1), bs, sin.stride(1), HALF=half, BACKWARD=backward, P_KIND=_KINDS[p_dtype],
           X_KIND=_KINDS[x_dtype], BLOCK_S=block_s, BLOCK_D=next_power_of_2(half), num_warps=4, **UNFUSED)
