"""Linear layer with a randomized weight gradient: keeps S·X (k = ρ·N rows) and a seed.

``y = x Wᵀ + b`` exactly. For the weight gradient ``dW = dYᵀ X`` (X, dY: the N = x.numel() /
in_features token rows) backward uses the unbiased estimate

    dW ≈ (S dY)ᵀ (S X),   S = R / sqrt(k),   R: k × N Rademacher (±1, independent, fair),

since E[SᵀS] = I. Kept for backward: ``R X`` (k × in_features, x's dtype) and the 64-bit seed of
R (8 bytes) instead of X (N × in_features); R is regenerated from the seed in backward with
leanact's counter-based generator (:mod:`leanact.ops.random`: a fair ±1 per element from the
32-bit word, P = 1/2 exactly). ``dX = dY W`` and ``db = Σ dY`` are exact (W is a parameter, not
an activation). Every call draws a fresh seed from torch's generator (so each layer and each
step get their own S; the public code reused one S everywhere).

Rows are sketched in blocks of ``block`` tokens (block-diagonal S, each block with its own
``ceil(ρ·n_block)`` rows): still unbiased, and the sketch costs ``ρ·block·N·in`` multiply-adds
instead of ``ρ·N²·in``. k = Σ ceil(ρ·n_block) (= ρ·N when block and ρ·block divide evenly).

What it approximates: the weight gradient only (variance ~ (1/ρ - 1) · Σ_n |dy_n|² |x_n|²).
Double backward is not supported (``once_differentiable``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..backward import once_differentiable
from ..random import draw_seed, keep_mask_like
from ..transforms import functorch_active

__all__ = ["RandomizedLinearFunction", "randomized_linear", "sketch_rows", "sketch", "weight_grad", "DEFAULT_BLOCK"]

DEFAULT_BLOCK = 2048


def sketch_rows(n: int, ratio: float, block: int = DEFAULT_BLOCK) -> list[tuple[int, int, int]]:
    """``(start, stop, k)`` per token block: rows start..stop-1 are sketched to k rows."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio (ρ, the fraction of token rows kept) must be in (0, 1], got {ratio!r}")
    if block < 1:
        raise ValueError(f"block must be >= 1 tokens, got {block!r}")
    out = []
    for s in range(0, n, block):
        e = min(n, s + block)
        out.append((s, e, max(1, math.ceil(ratio * (e - s)))))
    return out


def _signs(seed: torch.Tensor, k: int, n: int, offset: int, dtype, device) -> torch.Tensor:
    """R block (k × n, ±1 in ``dtype``): element (r, c) uses counter ``offset + r*n + c``."""
    keep = keep_mask_like(seed, (k, n), 0.5, device=device, offset=offset)
    return keep.to(dtype).mul_(2).sub_(1)


def sketch(seed: torch.Tensor, rows: torch.Tensor, ratio: float, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """``R @ rows`` (unscaled ±1 sketch, k × d) for N × d ``rows``, R from ``seed`` (block-diagonal)."""
    n = rows.shape[0]
    parts, offset = [], 0
    for s, e, k in sketch_rows(n, ratio, block):
        parts.append(_signs(seed, k, e - s, offset, rows.dtype, rows.device) @ rows[s:e])
        offset += k * (e - s)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class RandomizedLinearFunction(torch.autograd.Function):
    """``F.linear`` keeping ``R X`` and a seed for an unbiased weight gradient (module doc)."""

    @staticmethod
    def forward(ctx, x, weight, bias, ratio, block, seed):
        dev = x.device.type
        cast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        if cast is not None:  # autocast: compute in its dtype; keep the parameter, not its cast copy
            x = x.to(cast)
        with torch.autocast(dev, enabled=False):
            y = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        ctx.meta = (ratio, block)
        if ctx.needs_input_grad[1]:
            if seed is None:
                seed = draw_seed(x.device)
            with torch.no_grad():
                sx = sketch(seed, x.reshape(-1, x.shape[-1]), ratio, block)
            ctx.save_for_backward(weight, sx, seed)
        else:
            ctx.save_for_backward(weight)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        ratio, block = ctx.meta
        saved = ctx.saved_tensors
        weight = saved[0]
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = dy.matmul(weight.to(dy.dtype))
        d2 = dy.reshape(-1, dy.shape[-1])
        if ctx.needs_input_grad[1]:
            _, sx, seed = saved
            dw = weight_grad(seed, d2, sx, ratio, block).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            db = d2.sum(0)
        return dx, dw, db, None, None, None


def weight_grad(seed: torch.Tensor, dy2: torch.Tensor, sx: torch.Tensor, ratio: float,
                block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """Σ over blocks of (R_b dY_b)ᵀ (R_b X_b) / k_b in float32 (float64 for float64 inputs):
    the unbiased estimate of dYᵀX from the kept sketch ``sx`` (R X) and ``seed``."""
    acc = torch.float64 if sx.dtype == torch.float64 else torch.float32
    dw, offset, row = None, 0, 0
    for s, e, k in sketch_rows(dy2.shape[0], ratio, block):
        r = _signs(seed, k, e - s, offset, dy2.dtype, dy2.device)
        part = (r @ dy2[s:e]).t().to(acc) @ sx[row:row + k].to(acc)
        part.div_(k)
        dw = part if dw is None else dw.add_(part)
        offset += k * (e - s)
        row += k
    return dw


def randomized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      ratio: float = 0.5, block: int = DEFAULT_BLOCK, seed: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with a randomized weight gradient (module doc).

    ``ratio``: ρ, kept rows per token row; ``seed``: a one-element int64 tensor (default: a fresh
    one per call, from torch's generator on x's device).
    """
    sketch_rows(1, ratio, block)  # validates
    if x.dim() < 1 or x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"x's last dimension ({tuple(x.shape)}) must equal in_features = {weight.shape[-1]}")
    if seed is not None and (seed.dtype != torch.int64 or seed.numel() != 1):
        raise TypeError(f"seed must be a one-element int64 tensor, got {seed.dtype} {tuple(seed.shape)}")
    if not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad
                                           or (bias is not None and bias.requires_grad)):
        return F.linear(x, weight, bias)
    if functorch_active():
        raise RuntimeError(
            "leanact.lossy randomized_linear cannot run under torch.func transforms (grad, vmap, ...): its "
            "randomized weight gradient is a custom autograd Function; remove the lossy options "
            "(leanact.lossy.remove(model)) or call the model outside the transform")
    return RandomizedLinearFunction.apply(x, weight, bias, ratio, block, seed)
