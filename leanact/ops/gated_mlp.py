"""The down projection of a gated MLP, ``linear(act(g) * u, W, b)``, keeping only g and u.

A gated MLP (SwiGLU: act = SiLU; GeGLU: act = GELU, erf or tanh) computes g = x·W_gᵀ and u = x·W_uᵀ
(or one fused projection split in halves), then ``down(act(g) * u)``. Plain autograd keeps g (the
activation's input), act(g) and u (the product's inputs) and the product h (the down projection's
input): four tensors of the intermediate size. The down projection's backward needs h only for
dW = dyᵀ·h, and the product's backward needs act(g) and u; both are cheap to rebuild from g and u,
so this op keeps **g and u** (one storage when they are the two halves of a fused projection) and
the weight (a parameter), and rebuilds act(g) and h in backward.

Forward and backward use torch's own kernels in torch's order (``F.linear``; the activation's
derivative kernel; ``mm`` for the linear's gradients as autograd's ``MmBackward`` does), so outputs
are bitwise torch's and gradients are torch's to the rounding of the weight-gradient ``mm``.
Under autocast the inputs are cast as autocast casts ``F.linear``'s (the weight to the autocast
dtype) and the weight gradient is returned in the weight's dtype, as autocast's cast backward does.
On CUDA with ``LEANACT_TRITON`` on, ``act(g) * u`` (forward) and dg, du (backward, with h for the
weight gradient) are one Triton kernel each (:mod:`.triton.gated`), rounding where torch rounds;
they agree with torch's kernels within the bound of docs/triton.md, and keep the same tensors.
Because the op saves through ``ctx.save_for_backward``, any saved-tensor hooks active around it
(``torch.autograd.graph.save_on_cpu``, a checkpoint region, a meter) see exactly g and u.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .amp import autocast_dtype, autocast_off, no_autocast_backward
from .transforms import functorch_active
from .triton import gated as _triton

__all__ = ["GATED_ACTIVATIONS", "GatedDownFunction", "gated_down", "gated_act"]

GATED_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def gated_act(kind: str, g: torch.Tensor) -> torch.Tensor:
    """act(g) with torch's kernel for ``kind`` (one of :data:`GATED_ACTIVATIONS`)."""
    if kind == "silu":
        return F.silu(g)
    return F.gelu(g, approximate="tanh" if kind == "gelu_tanh" else "none")


def _act_mul(kind: str, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``gated_act(kind, g) * u`` (not differentiable): one Triton kernel on CUDA when enabled, torch's two ops else."""
    h = _triton.glu_forward(g, u, kind)
    return gated_act(kind, g) * u if h is None else h


def _act_grad(kind: str, d: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and (g.requires_grad or d.requires_grad):  # double backward: differentiable
        g_ = g if g.requires_grad else g.detach().requires_grad_()
        (dg,) = torch.autograd.grad(gated_act(kind, g_), g_, d, create_graph=True)
        return dg
    if kind == "silu":
        return torch.ops.aten.silu_backward(d, g)
    return torch.ops.aten.gelu_backward(d, g, approximate="tanh" if kind == "gelu_tanh" else "none")


class GatedDownFunction(torch.autograd.Function):
    """``linear(act(g) * u, weight, bias)`` keeping g, u (and the weight); see the module doc."""

    @staticmethod
    def forward(ctx, g, u, weight, bias, kind, cast):
        w = weight if cast is None else weight.to(cast)
        b = bias if (bias is None or cast is None) else bias.to(cast)
        with autocast_off(g.device.type):
            y = F.linear(_act_mul(kind, g, u), w, b)
        ctx.kind, ctx.cast, ctx.bias_dtype = kind, cast, None if bias is None else bias.dtype
        ctx.save_for_backward(g, u, weight)
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx, dy):
        g, u, weight = ctx.saved_tensors
        w = weight if ctx.cast is None else weight.to(ctx.cast)
        need_g, need_u, need_w, need_b = ctx.needs_input_grad[:4]
        dy2 = dy.reshape(-1, dy.shape[-1])
        dg = du = dw = db = h = None
        if need_g or need_u:
            dh = dy2.mm(w).view(*dy.shape[:-1], w.shape[1])  # MmBackward's grad_self
            # one kernel for dg, du and h on CUDA (not under double backward: it is not differentiable)
            fused = None if torch.is_grad_enabled() else _triton.glu_backward(g, u, dh, ctx.kind, need_g, need_u, need_w)
            if fused is not None:
                dg, du, h = fused
            else:
                a = gated_act(ctx.kind, g)
                if need_u:
                    du = dh * a
                if need_g:
                    dg = _act_grad(ctx.kind, dh * u, g)
                if need_w:
                    h = a * u
        if need_w:
            if h is None:
                h = gated_act(ctx.kind, g) * u if torch.is_grad_enabled() else _act_mul(ctx.kind, g, u)
            h = h.reshape(-1, u.shape[-1])
            dw = h.t().mm(dy2).t()  # MmBackward's grad_mat2 of linear's weight.t()
            if dw.dtype != weight.dtype:
                dw = dw.to(weight.dtype)
        if ctx.bias_dtype is not None and need_b:
            db = dy2.sum(0).to(ctx.bias_dtype)
        return dg, du, dw, db, None, None


def gated_down(g: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               kind: str = "silu") -> torch.Tensor:
    """``F.linear(act(g) * u, weight, bias)``; with autograd keeps only g and u (module doc).

    ``kind``: "silu" (SwiGLU), "gelu" (GeGLU, erf) or "gelu_tanh" (GeGLU, tanh approximation).
    Without grad, and under ``torch.func`` transforms, the plain torch ops run (keeping nothing
    or what torch keeps)."""
    if kind not in GATED_ACTIVATIONS:
        raise ValueError(f"gated_down: kind must be one of {GATED_ACTIVATIONS}, got {kind!r}")
    if g.shape != u.shape:
        raise ValueError(f"gated_down: g and u must have the same shape, got {tuple(g.shape)} and {tuple(u.shape)}")
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (g, u, weight, bias))
    if not grads:
        return F.linear(_act_mul(kind, g, u), weight, bias)
    if functorch_active():
        return F.linear(gated_act(kind, g) * u, weight, bias)
    cast = autocast_dtype(g.device.type)
    if cast is not None and g.dtype != cast:  # autocast would cast the product, not the activation's input
        return F.linear(gated_act(kind, g) * u, weight, bias)
    return GatedDownFunction.apply(g, u, weight, bias, kind, cast)
