"""A Transformer sub-layer's end, LayerNorm(dropout(h) + residual), as one op keeping y, rstd and a seed.

BERT-style post-norm blocks end each sub-layer with ``LayerNorm(dropout(dense(x)) + residual)``
(Hugging Face's ``BertSelfOutput`` / ``BertOutput`` and their copies). Run as three ops, the
dropout writes its output (and torch keeps its mask), the add writes the sum z, the norm reads z
and keeps it for backward. Here the three are one autograd Function:

    z = dropout(h; seed, p) + residual,   y = LayerNorm(z)

What is kept for backward: y and one rstd per row (the norm's from-output backward,
:mod:`leanact.ops.norms.layer_norm`; the next Linear keeps y anyway, so its net cost is rstd), and the
8-byte seed (the mask is regenerated, :mod:`leanact.ops.dropout`). Neither h, the residual, z nor a
mask is kept: the same bytes as leanact's dropout and LayerNorm run one after the other.

Backward: dz = LayerNorm's backward from y, the residual's gradient is dz and h's is dz times the
regenerated mask over (1 − p). On CUDA each direction is one Triton kernel over the rows (plus the
sum of dγ, dβ's partials): the forward reads h and the residual and writes y and rstd; the backward
reads dy and y and writes the two gradients. The dropout output and z are rounded to the dtypes
torch's dropout and add would give them (z: ``torch.result_type(h, residual)``), so the op computes
what leanact's dropout, ``+`` and LayerNorm compute one after the other: the same mask for the same
seed, the same roundings, the norm's statistics to float32 rounding. The seed is drawn as
:func:`leanact.ops.dropout.function.dropout` draws it, so the random stream advances as it would.

Where the norm cannot recover x̂ from y (γ near zero, see :func:`~leanact.ops.norms.verdict.from_output_ok`)
and wherever the fused Function does not apply (no autograd, ``torch.func`` transforms, compiling,
broadcasting residuals, p = 1), the op is the composition of leanact's dropout, ``+`` and LayerNorm.
"""
from __future__ import annotations

import math

import torch

from ...saved import keeping_output
from ..amp import autocast_dtype, no_autocast_backward
from ..backward import once_differentiable
from ..dropout.function import apply_dropout, dropout
from ..random import draw_seed, keep_threshold
from ..transforms import functorch_active
from ..triton.dispatch import register_check
from . import launchers as _triton
from .layer_norm import backward_from_output, layer_norm
from .verdict import DEFAULT_MAX_RATIO, confirm_verdicts, from_output_ok

__all__ = ["DropoutAddLayerNorm", "dropout_add_layer_norm"]


class DropoutAddLayerNorm(torch.autograd.Function):
    """y = LayerNorm(dropout(h; seed) + residual), saving (y, rstd, γ, β, seed) (module doc).

    ``seed`` None: no dropout. ``z_dtype``: the sum's dtype; ``norm_dtype``: the dtype the norm runs
    in (autocast's fp32 for norms on CUDA), y's dtype.
    """

    @staticmethod
    def forward(ctx, h, residual, weight, bias, seed, p, normalized_shape, eps, z_dtype, norm_dtype):
        thr, scale = (keep_threshold(p), 1.0 / (1.0 - p)) if seed is not None else (0, 1.0)
        fused = _triton.dropout_add_layer_norm_forward(h, residual, normalized_shape, weight, bias, eps, seed, thr,
                                                       scale, z_dtype, norm_dtype)
        if fused is not None:
            y, rstd = fused
        else:
            d = h if seed is None else apply_dropout(h, seed, p, False)
            z = torch.add(d, residual)  # (result_type(h, residual): z_dtype)
            y, _mean, rstd = torch.native_layer_norm(z.to(norm_dtype), normalized_shape, weight, bias, eps)
        ctx.save_for_backward(y, rstd, weight, bias, seed)
        ctx.dims = (p, thr, scale, normalized_shape, z_dtype, h.dtype, residual.dtype)
        ctx.keeps_output = True  # (leanact.ops.amp.keeps_output)
        return y

    @staticmethod
    @once_differentiable
    @no_autocast_backward
    def backward(ctx, dy):
        confirm_verdicts()
        y, rstd, w, b, seed = ctx.saved_tensors
        p, thr, scale, shape, z_dtype, h_dtype, r_dtype = ctx.dims
        needs = ctx.needs_input_grad[:4]
        none = (None,) * 6
        fused = _triton.dropout_add_layer_norm_backward(dy, y, rstd, w, b, shape, seed, thr, scale, z_dtype, h_dtype,
                                                        r_dtype, needs)
        if fused is not None:  # CUDA: one kernel (plus the sum of dγ, dβ partials)
            return (*fused, *none)
        dz, dw, db = backward_from_output(dy, y, rstd, w, b, shape, (needs[0] or needs[1], needs[2], needs[3]))
        dh = dr = None
        if dz is not None:
            dz = dz.to(z_dtype)  # the add's output dtype, then each input's (torch's AddBackward)
            dr = dz.to(r_dtype) if needs[1] else None
            if needs[0]:
                dh = dz.to(h_dtype)
                if seed is not None:
                    dh = apply_dropout(dh, seed, p, False)
        return (dh, dr, dw, db, *none)


def _fusable(h, residual, weight, bias, p: float) -> bool:
    """Whether the Function applies (module doc): autograd needed, eager, same shapes, p < 1."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling() or functorch_active():
        return False
    if not any(t is not None and t.requires_grad for t in (h, residual, weight, bias)):
        return False
    return (h.shape == residual.shape and h.is_floating_point() and residual.is_floating_point() and p < 1.0
            and h.device == residual.device and h.numel() > 0)


def dropout_add_layer_norm(
    h: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    p: float = 0.0,
    training: bool = True,
    *,
    generator: torch.Generator | None = None,
    max_ratio: float = DEFAULT_MAX_RATIO,
) -> torch.Tensor:
    """``layer_norm(dropout(h, p, training) + residual, normalized_shape, weight, bias, eps)`` with
    leanact's :func:`~leanact.ops.dropout.function.dropout` (a seed, not a mask) and
    :func:`~leanact.ops.norms.layer_norm.layer_norm` (kept: y and rstd), as one op that keeps y, rstd and
    the seed, never h, the residual, their sum or a mask (module doc). The same result, gradients
    and random stream as the three calls one after the other.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    p = float(p) if training else 0.0
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not _fusable(h, residual, weight, bias, p):
        return layer_norm(dropout(h, p, training) + residual, shape, weight, bias, eps, max_ratio=max_ratio)
    z_dtype = torch.promote_types(h.dtype, residual.dtype)  # (same shapes: the add's result_type)
    autocast = h.device.type == "cuda" and autocast_dtype("cuda") is not None
    norm_dtype = torch.float32 if autocast else z_dtype  # autocast's policy for layer_norm (ops.amp.norm_inputs)
    # decided on the parameters themselves (a cast is a new tensor per call: the cached decision is per tensor)
    if not from_output_ok(weight, bias, math.prod(shape), norm_dtype, max_ratio):
        return layer_norm(dropout(h, p, training) + residual, shape, weight, bias, eps, from_output=False)
    if autocast:
        weight, bias = (t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                        for t in (weight, bias))
    seed = draw_seed(h.device, generator) if p > 0.0 else None
    return keeping_output(lambda: DropoutAddLayerNorm.apply(h, residual, weight, bias, seed, p, shape, eps, z_dtype,
                                                            norm_dtype))


# -- the self-check of the fused kernels, key (h dtype, residual dtype, norm dtype) -----------------


def _self_check(device: torch.device, key) -> None:
    """y and the four gradients through the kernels no further from the float64 PyTorch path than
    4x the PyTorch path plus 2 ulp (see :mod:`leanact.ops.triton.selfcheck`): a mask other than the PyTorch
    path's would put h's gradient far off."""
    from ..triton.selfcheck import both, forward_backward, generator, no_worse, randn

    h_dtype, r_dtype, n_dtype = key
    z_dtype = torch.promote_types(h_dtype, r_dtype)
    n = 600
    gen = generator(device)
    h = randn((2, 7, n), device, h_dtype, gen, 2.0)
    r = randn((2, 7, n), device, r_dtype, gen, 2.0)
    w = (torch.rand(n, generator=gen, device=device) + 0.5).to(n_dtype)
    b = randn(n, device, n_dtype, gen, 0.1)
    dy = randn((2, 7, n), device, n_dtype, gen)
    seed = torch.tensor(-77123, dtype=torch.int64, device=device)

    def run(h=h, r=r, w=w, b=b, dy=dy, z=z_dtype, nd=n_dtype):
        y, grads = forward_backward(DropoutAddLayerNorm, (h, r, w, b, seed, 0.25, (n,), 1e-5, z, nd), dy,
                                    (True, True, True, True) + (False,) * 6)
        return [y, *grads[:4]]

    got, ref = both(run)
    f64 = torch.float64
    truth = run(*(t.double() for t in (h, r, w, b, dy)), z=f64, nd=f64)
    for what, a, c, t in zip(("y", "dh", "dresidual", "dweight", "dbias"), got, ref, truth):
        no_worse(f"dropout + add + LayerNorm {what}", a, c, t)


register_check("dropout_add_layer_norm", _self_check)
