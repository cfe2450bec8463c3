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
weight gradient) are one Triton kernel each (:mod:`.launchers`), rounding where torch rounds;
they agree with torch's kernels within the bound of docs/triton.md, and keep the same tensors.
Because the op saves through ``ctx.save_for_backward``, any saved-tensor hooks active around it
(``torch.autograd.graph.save_on_cpu``, a checkpoint region, a meter) see exactly g and u.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..amp import autocast_dtype, autocast_off, no_autocast_backward
from ..transforms import functorch_active
from ..triton.dispatch import register_check
from . import launchers as _triton

__all__ = ["GATED_ACTIVATIONS", "GatedDownFunction", "gated_down", "gated_act", "act_grad"]

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


def act_grad(kind: str, d: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``d · act'(g)`` with torch's derivative kernel (differentiable when a graph is being built):
    the activation's part of this op's backward and of the MoE experts' (:mod:`leanact.ops.moe`)."""
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
        y = gated_down_forward(g, u, weight, bias, kind, cast)
        ctx.kind, ctx.cast, ctx.bias_dtype = kind, cast, None if bias is None else bias.dtype
        ctx.save_for_backward(g, u, weight)
        return y

    @staticmethod
    @no_autocast_backward
    def backward(ctx, dy):
        g, u, weight = ctx.saved_tensors
        return (*gated_down_backward(dy, g, u, weight, ctx.kind, ctx.cast, ctx.bias_dtype, ctx.needs_input_grad[:4]),
                None, None)


def gated_down_forward(g, u, weight, bias, kind, cast):
    """:class:`GatedDownFunction`'s forward (no autograd)."""
    w = weight if cast is None else weight.to(cast)
    b = bias if (bias is None or cast is None) else bias.to(cast)
    with autocast_off(g.device.type):
        return F.linear(_act_mul(kind, g, u), w, b)


def gated_down_backward(dy, g, u, weight, kind, cast, bias_dtype, needs):
    """:class:`GatedDownFunction`'s backward: (dg, du, dW, db), None where ``needs`` (four bools) says no."""
    w = weight if cast is None else weight.to(cast)
    need_g, need_u, need_w, need_b = needs
    dy2 = dy.reshape(-1, dy.shape[-1])
    dg = du = dw = db = h = None
    if need_g or need_u:
        dh = dy2.mm(w).view(*dy.shape[:-1], w.shape[1])  # MmBackward's grad_self
        # one kernel for dg, du and h on CUDA (not under double backward: it is not differentiable)
        fused = None if torch.is_grad_enabled() else _triton.glu_backward(g, u, dh, kind, need_g, need_u, need_w)
        if fused is not None:
            dg, du, h = fused
        else:
            a = gated_act(kind, g)
            if need_u:
                du = dh * a
            if need_g:
                dg = act_grad(kind, dh * u, g)
            if need_w:
                h = a * u
    if need_w:
        if h is None:
            h = gated_act(kind, g) * u if torch.is_grad_enabled() else _act_mul(kind, g, u)
        h = h.reshape(-1, u.shape[-1])
        # dyᵀ·h, as MmBackward computes the gradient of linear's column-major weight.t(): contiguous like
        # the weight (a transposed result would make AccumulateGrad copy it into the weight's layout)
        dw = dy2.t().mm(h)
        if dw.dtype != weight.dtype:
            dw = dw.to(weight.dtype)
    if bias_dtype is not None and need_b:
        db = dy2.sum(0).to(bias_dtype)
    return dg, du, dw, db


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
    if torch.compiler.is_compiling():  # opaque to AOTAutograd, which would keep act(g) * u (below)
        return _gated_down_op(g, u, weight, bias, kind, cast)
    return GatedDownFunction.apply(g, u, weight, bias, kind, cast)


# -- the same op for torch.compile ---------------------------------------------------------------
# Traced by Dynamo, GatedDownFunction's forward and backward become one joint graph and AOTAutograd's
# partitioner keeps the product act(g) * u that the backward rebuilds (measured: a third tensor of
# the intermediate size per layer). As a custom op the op is opaque: a compiled model keeps g and u.

@torch.library.custom_op("leanact::gated_down", mutates_args=())
def _gated_down_op(g: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], kind: str,
                   cast: Optional[torch.dtype]) -> torch.Tensor:
    return gated_down_forward(g, u, weight, bias, kind, cast)


@_gated_down_op.register_fake
def _(g, u, weight, bias, kind, cast):
    return g.new_empty((*g.shape[:-1], weight.shape[0]), dtype=cast or g.dtype)


@torch.library.custom_op("leanact::gated_down_backward", mutates_args=())
def _gated_down_backward_op(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, kind: str,
                            cast: Optional[torch.dtype], bias_dtype: Optional[torch.dtype],
                            needs: list[bool]) -> list[torch.Tensor]:
    with autocast_off(g.device.type):
        grads = gated_down_backward(dy, g, u, weight, kind, cast, bias_dtype, needs)
    return [g.new_empty(0) if t is None else t for t in grads]  # an empty tensor: no gradient


@_gated_down_backward_op.register_fake
def _(dy, g, u, weight, kind, cast, bias_dtype, needs):
    shapes = (g.shape, u.shape, weight.shape, weight.shape[:1])
    dtypes = (g.dtype, u.dtype, weight.dtype, bias_dtype)
    return [g.new_empty(s, dtype=d) if n else g.new_empty(0) for s, d, n in zip(shapes, dtypes, needs)]


def _gated_setup(ctx, inputs, output):
    g, u, weight, bias, kind, cast = inputs
    ctx.save_for_backward(g, u, weight)
    ctx.kind, ctx.cast, ctx.bias_dtype = kind, cast, None if bias is None else bias.dtype


def _gated_grad(ctx, dy):
    g, u, weight = ctx.saved_tensors
    needs = [bool(n) for n in ctx.needs_input_grad[:4]]
    needs[3] = needs[3] and ctx.bias_dtype is not None
    grads = _gated_down_backward_op(dy, g, u, weight, ctx.kind, ctx.cast, ctx.bias_dtype, needs)
    return (*(t if n else None for t, n in zip(grads, needs)), None, None)


_gated_down_op.register_autograd(_gated_grad, setup_context=_gated_setup)


# -- the self-check of the "gated_mlp" kernels ----------------------------------------------------


def _self_check(device: torch.device, key) -> None:
    """``act(g) * u`` and its backward through the kernels for ``key`` (dtype, kind): no further
    from float64 than 4x torch's ops plus 2 ulp (see :mod:`leanact.ops.triton.selfcheck`)."""
    from ..triton.dispatch import forced
    from ..triton.selfcheck import both, generator, no_worse, randn

    dtype, kind = key
    gen = generator(device)
    g, u, dh = (randn((2, 3, 600), device, dtype, gen, 3.0) for _ in range(3))
    h, h0 = both(lambda: _act_mul(kind, g, u))
    gd, ud, hd = (t.double() for t in (g, u, dh))
    a64 = gated_act(kind, gd)
    no_worse(f"gated MLP ({kind}) forward", h, h0, a64 * ud)
    with forced("on"):
        fused = _triton.glu_backward(g, u, dh, kind, True, True, True)
    assert fused is not None, f"gated MLP ({kind}) backward: the kernel did not run"
    a = gated_act(kind, g)
    ref = (act_grad(kind, dh * u, g), dh * a, a * u)
    truth = (act_grad(kind, hd * ud, gd), hd * a64, a64 * ud)
    for what, x, r, t in zip(("dg", "du", "h"), fused, ref, truth):
        no_worse(f"gated MLP ({kind}) backward {what}", x, r, t)


register_check("gated_mlp", _self_check)
