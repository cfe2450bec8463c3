"""Rotary position embedding of q and k, one kernel launch for both each way, bitwise Hugging Face's.

Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin)`` (Llama's form, copied into most decoder
models) computes ``(x * cos) + (rotate_half(x) * sin)`` for x = q and k: a negation, a
concatenation, two products and a sum per tensor, each a kernel that reads and writes the whole
tensor, and about as many again in backward. Under autocast with fp32 tables the products promote
the 16-bit q, k to fp32 (what attention then casts back). :func:`rotary` computes the same values
in one pass over each tensor, q and k in one launch (as Liger-Kernel's RoPE): the products and the
sum rounded in the promoted dtype, as torch rounds them, so the outputs are bitwise torch's, and the
gradients bitwise autograd's (each product's gradient rounded in the promoted dtype and cast to x's
dtype, the two contributions summed in x's dtype, as the engine does).

Kept for backward: the tables cos and sin (what the unfused products keep: shared by every layer,
(B or 1)·S·D each), nothing of q or k. On a CPU, under ``torch.compile`` or ``torch.func``, with
tables that need a gradient, or where the kernel does not apply, :func:`rotary` returns None and
the caller runs Hugging Face's function (:mod:`leanact.patching.hf_rotary`).
"""
from __future__ import annotations

import torch

from ..backward import once_differentiable
from ..triton.dispatch import register_check
from ..triton.selfcheck import both, forward_backward, generator, randn, same
from . import launchers as _kernel

__all__ = ["RotaryFunction", "rotary", "rotate_half", "rotary_reference", "rotary_backward_reference"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(−x₂, x₁): the second half of the last dimension negated, then the first half."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's arithmetic for one tensor x (B, H, S, D) and tables (B or 1, S, D)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


def rotary_backward_reference(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              x_dtype: torch.dtype) -> torch.Tensor:
    """x's gradient as autograd computes it through :func:`rotary_reference`: each product's
    gradient in g's dtype cast to x's, rotate_half's backward, the two summed in x's dtype."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = g.shape[-1] // 2
    a = (g * cos).to(x_dtype)
    b = (g * sin).to(x_dtype)
    return torch.cat((a[..., :half] + b[..., half:], a[..., half:] - b[..., :half]), dim=-1) + 0


class RotaryFunction(torch.autograd.Function):
    """(q_embed, k_embed) of :func:`rotary`; keeps cos and sin. ``launchers``: the kernels' launchers
    when the caller (:func:`rotary`) has checked the four tensors, or None (checked here). q and k
    take the kernel together, one launch each way (the gradients that exist), or the PyTorch path."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, launchers=None):
        if launchers is None:
            launchers = _kernel.usable(q, k, cos, sin)
            if launchers is not None and not _kernel.pair_ok(q, k, cos, sin):
                launchers = None
        outs = None if launchers is None else _kernel.forward_with(launchers, (q, k), cos, sin)
        ctx.kernel = outs is not None
        if outs is None:
            outs = (rotary_reference(q, cos, sin), rotary_reference(k, cos, sin))
        ctx.save_for_backward(cos, sin)
        ctx.dtypes = (q.dtype, k.dtype)
        ctx.set_materialize_grads(False)  # (an output nothing used: no zero gradient made and rotated)
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx, gq, gk):
        cos, sin = ctx.saved_tensors
        live = [i for i, (g, need) in enumerate(zip((gq, gk), ctx.needs_input_grad)) if g is not None and need]
        grads = [None, None]
        if live:
            gs = tuple((gq, gk)[i] for i in live)
            # the four tensors were checked in forward (the kernel ran there) and the gs have the
            # outputs' shapes: only the gs themselves are looked at
            launchers = _kernel.usable(*gs) if ctx.kernel else None
            dxs = None if launchers is None else _kernel.backward_with(launchers, gs, cos, sin, ctx.dtypes[0])
            for i, g, dx in zip(live, gs, dxs or (None,) * len(gs)):
                grads[i] = rotary_backward_reference(g, cos, sin, ctx.dtypes[i]) if dx is None else dx
        return grads[0], grads[1], None, None, None


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``(q·cos + rotate_half(q)·sin, k·cos + rotate_half(k)·sin)`` through the kernels, or None
    where they do not apply (module doc). q, k: (B, H, S, D) (k may have fewer heads); cos, sin:
    (B or 1, S, D), not needing a gradient. The checks run once here, not again in forward."""
    if cos.requires_grad or sin.requires_grad or q.dtype != k.dtype:
        return None
    if k.dim() != 4 or q.dim() != 4 or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        return None
    launchers = _kernel.usable(q, k, cos, sin)  # (None while compiling: no layout looked at then)
    if launchers is None or not _kernel.pair_ok(q, k, cos, sin):
        return None
    return RotaryFunction.apply(q, k, cos, sin, launchers)


def _check(device: torch.device, key) -> None:
    """The kernels against the PyTorch path, bitwise, forward and backward, on ragged shapes with
    values that round (and subnormal products), broadcast and per-sample tables."""
    x_dtype, p = key  # the tables in the promoted dtype (read as float32 either way)
    gen = generator(device)
    for bt in (1, 2):
        q = randn((2, 3, 37, 10), device, x_dtype, gen, 3.0).transpose(1, 2).contiguous().transpose(1, 2)
        k = randn((2, 1, 37, 10), device, x_dtype, gen, 3.0)
        cos = randn((bt, 37, 10), device, p, gen)
        sin = randn((bt, 37, 10), device, p, gen)
        cos[0, 0, :3] = torch.tensor([1e-30, -1e-38, 0.0], device=device).to(p)
        g = (randn((2, 3, 37, 10), device, p, gen, 2.0), randn((2, 1, 37, 10), device, p, gen, 2.0))

        def run():
            return forward_backward(RotaryFunction, (q, k, cos, sin), g, (True, True, False, False))

        (got_y, got_g), (ref_y, ref_g) = both(run)
        for what, a, b in (("q_embed", got_y[0], ref_y[0]), ("k_embed", got_y[1], ref_y[1]),
                           ("dq", got_g[0], ref_g[0]), ("dk", got_g[1], ref_g[1])):
            same(f"rotary {what} ({x_dtype}, {p})", a, b)


register_check("rotary", _check)
