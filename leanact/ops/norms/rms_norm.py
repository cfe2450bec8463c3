"""RMSNorm whose backward needs only its output y and one rstd per row.

y = x̂·γ with x̂ = x·rstd, rstd = 1/sqrt(mean(x²) + eps) (fp32 for 16-bit inputs). Backward:

    x̂ = y/γ,  g = dy·γ,  dx = rstd·(g − x̂·mean(g·x̂)),  dγ = Σ_rows dy·x̂ = (Σ_rows dy·y)/γ,

with g·x̂ = dy·y (no division there). As for LayerNorm (see :mod:`leanact.ops.norms.verdict`), y's
rounding error is ≤ u·(|y| + tiny), so x̂ = y/γ is off by ≤ u·(|x̂| + tiny/|γ|): there is no β to
amplify it, and the only conditions are |γ| ≥ tiny (y not subnormal, 1/γ finite), |γ|·sqrt(N) ≤
max (y cannot overflow) and γ finite. So γ = 1e-30 in fp32 stays exact on the from-output path;
γ = 0, a subnormal γ, or one that underflows to 0 in fp16 takes the fallback, which keeps the
input x and rstd (still less than torch's composite rms_norm, which keeps x, rstd and x̂, in fp32
for 16-bit inputs) and computes x̂ = x·rstd exactly.

Forward is ``torch._fused_rms_norm`` (bitwise equal to ``F.rms_norm``). The decision is cached
and can be given explicitly exactly as for LayerNorm (``from_output``); the op traces with
``torch.compile(fullgraph=True)`` when it is given. Modifying a saved tensor (y on the main path,
x on the fallback) in place before backward raises; double backward raises (once_differentiable).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...saved import keeping_output
from ..amp import no_autocast_backward, norm_inputs
from ..backward import once_differentiable
from ..transforms import functorch_active
from ..triton.dispatch import register_check
from . import launchers as _triton
from .layer_norm import compute_dtype, norm_self_check
from .verdict import confirm_verdicts, from_output_ok

__all__ = ["RMSNormFunction", "rms_norm"]


def _composite(x, shape, weight, eps):
    """(y, rstd) for torch builds without ``_fused_rms_norm``: y is F.rms_norm's, rstd recomputed."""
    xc = x.to(compute_dtype(x.dtype))
    eps = torch.finfo(xc.dtype).eps if eps is None else eps  # as torch 2.13: eps of the compute dtype
    rstd = torch.rsqrt(xc.pow(2).mean(tuple(range(-len(shape), 0)), keepdim=True) + eps)
    return F.rms_norm(x, shape, weight, eps), rstd


def _fused(x, shape, weight, eps):
    if hasattr(torch.ops.aten, "_fused_rms_norm"):  # traceable by dynamo, unlike torch._fused_rms_norm
        return torch.ops.aten._fused_rms_norm(x, list(shape), weight, eps)
    return _composite(x, shape, weight, eps)


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm saving (y, rstd) when ``from_output`` (x̂ = y/γ), else (x, rstd) (x̂ = x·rstd)."""

    @staticmethod
    def forward(ctx, x, weight, normalized_shape, eps, from_output):
        # torch's own fused kernel where it has one (it returns what this op keeps); leanact's Triton
        # forward only for torch builds without it (the composite reads x twice more)
        fused = None if hasattr(torch.ops.aten, "_fused_rms_norm") else _triton.rms_norm_forward(
            x, normalized_shape, weight, eps)
        y, rstd = _fused(x, normalized_shape, weight, eps) if fused is None else fused
        ctx.n = math.prod(normalized_shape)
        ctx.from_output = ctx.keeps_output = from_output
        ctx.save_for_backward(y if from_output else x, rstd, weight)
        return y

    @staticmethod
    @once_differentiable
    @no_autocast_backward
    def backward(ctx, dy):
        if ctx.from_output:
            confirm_verdicts()
        t, rstd, w = ctx.saved_tensors
        n = ctx.n
        fused = _triton.rms_norm_backward(dy, t, rstd, w, n, ctx.from_output, ctx.needs_input_grad[0],
                                          ctx.needs_input_grad[1])
        if fused is not None:  # CUDA: one kernel (plus the sum of the dγ partials)
            return (*fused, None, None, None)
        m = t.numel() // n if n else 0
        ct = compute_dtype(dy.dtype)
        t2 = t.reshape(m, n).to(ct)
        dy2 = dy.reshape(m, n).to(ct)
        r = rstd.reshape(m, 1).to(ct)
        wc = None if w is None else w.reshape(n).to(ct)
        g = dy2.to(ct, copy=True) if wc is None else dy2 * wc  # a fresh buffer, reused for dx
        if ctx.from_output:
            xhat = t2 if wc is None else t2 / wc
            p = dy2 * t2  # g·x̂ = dy·y, no division
        else:
            xhat = t2 * r
            p = g * xhat
        dx = dw = None
        if w is not None and ctx.needs_input_grad[1]:
            dw = (p.sum(0) / wc) if ctx.from_output else (dy2 * xhat).sum(0)
            dw = dw.to(w.dtype).reshape(w.shape)
        if ctx.needs_input_grad[0]:
            dx = g.addcmul_(xhat, p.mean(1, keepdim=True), value=-1).mul_(r).to(dy.dtype).reshape(dy.shape)
        return dx, dw, None, None, None


def rms_norm(
    x: torch.Tensor,
    normalized_shape,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    *,
    from_output: bool | None = None,
) -> torch.Tensor:
    """``F.rms_norm`` (identical output) that keeps only y and rstd for backward.

    eps None = as torch: ``finfo(compute dtype).eps`` in torch 2.13 (fp32's for 16-bit inputs).
    from_output: True = recover x̂ = y/γ; False = keep the input; None (default) = decide from γ
    (cached; graph-breaks under torch.compile).
    Without grad this is plain ``F.rms_norm``, saving nothing; under ``torch.func`` transforms too.
    """
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad))
    if not needs_grad or functorch_active():  # torch.func: torch's own op (leanact.ops.transforms)
        return F.rms_norm(x, shape, weight, eps)
    x, weight = norm_inputs(x, weight)  # autocast's policy for rms_norm (ops.amp)
    if from_output is None:
        from_output = from_output_ok(weight, None, math.prod(shape), x.dtype, math.inf)
    # its output (when kept) is the source of autocast's casts (leanact.patching.amp)
    return keeping_output(lambda: RMSNormFunction.apply(x, weight, shape, eps, bool(from_output)), bool(from_output))


register_check("rms_norm", norm_self_check(RMSNormFunction, rms=True))  # from output and from input
