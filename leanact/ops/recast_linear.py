"""A Linear under autocast as one autograd Function that keeps no 16-bit copy of what lives anyway.

Under ``torch.autocast`` a Linear casts its input, weight and bias to the low dtype, and its matmul
keeps the weight's cast (2 bytes per parameter) and the input's cast (2 bytes per element) for
backward. :class:`RecastLinear` makes the same casts and the same matmul (``addmm`` with a bias,
``mm`` without, on the input flattened to 2-D: aten's ``linear``), and keeps instead:

* the fp32 weight parameter (it lives anyway), cast again in backward;
* where a ``share`` is given (the input is an fp32 tensor its producer keeps as is: a norm's
  output), the input itself, cast again in backward once for all the Linears that read it (Q, K
  and V: the share's ``take``); otherwise the input's cast, as autocast's matmul keeps it.

What it keeps follows autograd's ``addmm``: the input only where the weight needs a gradient, the
weight only where the input does. Backward computes what ``addmm`` / ``mm``'s backward computes,
from the same tensors and by the same kernels (``dX = dY W``, ``dW = dYᵀ X``, the bias's sum), so
outputs and gradients are bitwise those of ``nn.Linear`` under autocast; the gradients of fp32
leaves come back cast to fp32 by autograd, as autocast's casts' backward does.

The same savings as :func:`leanact.ops.weight_recast.hook_matmul_saves` (hooks on the saved
tensors of torch's own matmul node), in one Python call each way instead of a hook per saved
tensor, for plain Linear layers where nothing observes saves (``benchmarks/host_stub.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["RecastLinear", "recast_linear"]


class RecastLinear(torch.autograd.Function):
    """``linear(x, weight, bias)`` in ``dtype`` on a 2-D ``x`` (module doc); ``share``: an object whose
    ``take(x)`` returns ``x.to(dtype)`` (kept: ``x``), or None (kept: the cast)."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype, share):
        xc = x.to(dtype=dtype)  # (the keyword: Python's argument parsing of .to(dtype) tries the device overloads first)
        y = F.linear(xc, weight.to(dtype=dtype), None if bias is None else bias.to(dtype=dtype))  # 2-D: addmm / mm
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.dtype, ctx.share, ctx.has_bias = dtype, share if need_w else None, bias is not None
        ctx.save_for_backward((x if share is not None else xc) if need_w else None, weight if need_x else None)
        return y

    @staticmethod
    def backward(ctx, grad):
        kept_x, weight = ctx.saved_tensors
        dtype = ctx.dtype
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = grad.mm(weight.to(dtype=dtype))
        if ctx.needs_input_grad[1]:
            xc = kept_x if ctx.share is None else ctx.share.take(kept_x)
            gw = grad.t().mm(xc)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = grad.sum(0)
        return gx, gw, gb, None, None


def recast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                  share=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` under autocast to ``dtype`` (``x`` contiguous, at least 2-D),
    keeping the fp32 ``weight`` (and, with ``share``, the fp32 ``x``) instead of their casts. An
    N-D ``x`` is flattened to 2-D and the output viewed back, as aten's ``linear`` does (the
    Function's own output is no view: in-place ops on the result work as on ``F.linear``'s)."""
    if x.dim() == 2:
        return RecastLinear.apply(x, weight, bias, dtype, share)
    y = RecastLinear.apply(x.view(-1, x.shape[-1]), weight, bias, dtype, share)
    return y.view(*x.shape[:-1], weight.shape[0])
