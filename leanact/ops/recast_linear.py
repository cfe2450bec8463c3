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

from typing import Optional

import torch
import torch.nn.functional as F

from .amp import autocast_off

__all__ = ["RecastLinear", "recast_linear", "compiled_recast_linear"]


class RecastLinear(torch.autograd.Function):
    """``linear(x, weight, bias)`` in ``dtype`` on a 2-D ``x`` (module doc); ``share``: an object whose
    ``take(x)`` returns ``x.to(dtype)`` (kept: ``x``), or None (kept: the cast). ``transposed``: the
    weight is stored (in, out), as transformers' ``Conv1D`` (GPT-2) keeps it: ``addmm(bias, x, weight)``."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype, share, transposed):
        # (the keyword: Python's argument parsing of .to(dtype) tries the device overloads first)
        xc = x if x.dtype == dtype else x.to(dtype=dtype)
        wc, bc = weight.to(dtype=dtype), None if bias is None else bias.to(dtype=dtype)
        if transposed:
            y = torch.addmm(bc, xc, wc) if bc is not None else torch.mm(xc, wc)
        else:
            y = F.linear(xc, wc, bc)  # (2-D: addmm / mm with the weight transposed)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.dtype, ctx.share = dtype, share if need_w else None
        ctx.has_bias, ctx.transposed = bias is not None, transposed
        ctx.save_for_backward((x if share is not None else xc) if need_w else None, weight if need_x else None)
        return y

    @staticmethod
    def backward(ctx, grad):
        # addmm's / mm's backward: dX = dY mat2ᵀ; d(mat2) = mat1ᵀ dY, computed as (dYᵀ mat1)ᵀ where
        # mat2 is column-major (the Linear's Wᵀ: its dW is then dYᵀ X itself)
        kept_x, weight = ctx.saved_tensors
        dtype = ctx.dtype
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            wc = weight.to(dtype=dtype)
            gx = grad.mm(wc.t() if ctx.transposed else wc)
        if ctx.needs_input_grad[1]:
            xc = kept_x if ctx.share is None else ctx.share.take(kept_x)
            gw = xc.t().mm(grad) if ctx.transposed else grad.t().mm(xc)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = grad.sum(0)
        return gx, gw, gb, None, None, None


def recast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                  share=None, transposed: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``transposed``: ``x @ weight + bias``, GPT-2's ``Conv1D``) under
    autocast to ``dtype`` (``x`` contiguous, at least 2-D), keeping the fp32 ``weight`` (and, with
    ``share``, the fp32 ``x``) instead of their casts. An N-D ``x`` is flattened to 2-D and the
    output viewed back, as aten's ``linear`` and ``Conv1D`` do (the Function's own output is no
    view: in-place ops on the result work as on ``F.linear``'s)."""
    if x.dim() == 2:
        return RecastLinear.apply(x, weight, bias, dtype, share, transposed)
    y = RecastLinear.apply(x.view(-1, x.shape[-1]), weight, bias, dtype, share, transposed)
    return y.view(*x.shape[:-1], weight.shape[1 if transposed else 0])


# -- the same op for torch.compile ---------------------------------------------------------------
# Traced, a Linear under autocast is a cast of the weight and a matmul in the graph, and AOTAutograd's
# partitioner keeps the cast for the backward's matmul (a node used by a matmul in the backward is
# never recomputed: measured, a compiled patched Llama under autocast keeps every 16-bit weight copy).
# As a custom op the forward's cast is inside the op: the backward casts the fp32 weight again, and
# the partitioner saves the weight itself, free (a parameter).

@torch.library.custom_op("leanact::recast_linear", mutates_args=())
def _recast_linear_op(xc: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      transposed: bool) -> torch.Tensor:
    dtype = xc.dtype
    wc, bc = weight.to(dtype=dtype), None if bias is None else bias.to(dtype=dtype)
    with autocast_off(xc.device.type):
        if transposed:
            return torch.addmm(bc, xc, wc) if bc is not None else torch.mm(xc, wc)
        return F.linear(xc, wc, bc)


@_recast_linear_op.register_fake
def _(xc, weight, bias, transposed):
    return xc.new_empty((xc.shape[0], weight.shape[1 if transposed else 0]))


def _recast_setup(ctx, inputs, output):
    xc, weight, bias, transposed = inputs
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    ctx.save_for_backward(xc if need_w else None, weight if need_x else None)
    ctx.transposed, ctx.has_bias, ctx.dtype, ctx.weight_dtype = transposed, bias is not None, xc.dtype, weight.dtype


def _recast_grad(ctx, grad):
    xc, weight = ctx.saved_tensors
    gx = gw = gb = None
    with autocast_off(grad.device.type):
        if ctx.needs_input_grad[0]:
            wc = weight.to(dtype=ctx.dtype)
            gx = grad.mm(wc.t() if ctx.transposed else wc)
        if ctx.needs_input_grad[1]:
            gw = (xc.t().mm(grad) if ctx.transposed else grad.t().mm(xc)).to(ctx.weight_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = grad.sum(0)
    return gx, gw, gb, None


_recast_linear_op.register_autograd(_recast_grad, setup_context=_recast_setup)


def compiled_recast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                           transposed: bool = False) -> torch.Tensor:
    """:func:`recast_linear` while ``torch.compile`` traces (no ``share``): the input's cast in the graph
    (where the compiler may fuse it with its producer), the rest the custom op ``leanact::recast_linear``,
    which keeps the cast input and the fp32 weight."""
    xc = x if x.dtype == dtype else x.to(dtype=dtype)
    y = _recast_linear_op(xc.reshape(-1, x.shape[-1]), weight, bias, transposed)
    return y.view(*x.shape[:-1], weight.shape[1 if transposed else 0])
