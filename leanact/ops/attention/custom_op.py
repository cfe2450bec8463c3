"""The recompute attention core as a ``torch.library`` custom op, for ``torch.compile``.

Traced by Dynamo, :class:`~leanact.ops.attention.core.RecomputeAttention`'s forward and backward
become one joint graph, and AOTAutograd's partitioner is free to keep any intermediate of it: it
keeps the s² probabilities the backward recomputes (measured: the same four tensors as the plain
composition). As a custom op the core is opaque to the compiler, so a compiled model keeps what
the eager one keeps: q, k, v (the caller's), the (b, H, s_q) log-sum-exp, the seed, the mask and the
sinks. Eager calls keep using the autograd Function (same forward and backward functions).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..amp import autocast_off
from .core import compute_dtype, recompute_backward, recompute_forward

__all__ = ["recompute_attention"]


@torch.library.custom_op("leanact::recompute_attention", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
             seed: Optional[torch.Tensor], sinks: Optional[torch.Tensor], p: float, causal: bool, scale: float,
             block: int, softcap: Optional[float], window: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    with autocast_off(q.device.type):  # the op's inputs are already cast; its inside runs as called
        return recompute_forward(q, k, v, mask, seed, p, causal, scale, block, softcap, sinks, window)


@_forward.register_fake
def _(q, k, v, mask, seed, sinks, p, causal, scale, block, softcap, window=None):
    b, h, s_q, _ = q.shape
    return q.new_empty((b, s_q, h, v.size(-1))), q.new_empty((b, h, s_q), dtype=compute_dtype(q.dtype))


@torch.library.custom_op("leanact::recompute_attention_backward", mutates_args=())
def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
              mask: Optional[torch.Tensor], seed: Optional[torch.Tensor], sinks: Optional[torch.Tensor], p: float,
              causal: bool, scale: float, block: int, softcap: Optional[float], mask_grad: bool,
              sinks_grad: bool, window: Optional[int] = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    with autocast_off(q.device.type):  # backward is often called inside the autocast block
        dq, dk, dv, dmask, dsinks = recompute_backward(dout, q, k, v, lse, mask, seed, sinks, p, causal, scale,
                                                       block, softcap, mask_grad, sinks_grad, window)
    # an op returns tensors (and no two the same): an empty one stands for "no gradient"
    return dq, dk, dv, q.new_empty(0) if dmask is None else dmask, q.new_empty(0) if dsinks is None else dsinks


@_backward.register_fake
def _(dout, q, k, v, lse, mask, seed, sinks, p, causal, scale, block, softcap, mask_grad, sinks_grad, window=None):
    # contiguous, as the real gradients are (whatever the inputs' strides)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            mask.new_empty(mask.shape) if mask_grad else q.new_empty(0),
            sinks.new_empty(sinks.shape) if sinks_grad else q.new_empty(0))


def _setup_context(ctx, inputs, output):
    q, k, v, mask, seed, sinks, p, causal, scale, block, softcap, window = inputs
    ctx.save_for_backward(q, k, v, output[1], mask, seed, sinks)
    ctx.args = (p, causal, scale, block, softcap)
    ctx.window = window


def _grad(ctx, dout, _dlse):
    q, k, v, lse, mask, seed, sinks = ctx.saved_tensors
    mask_grad = mask is not None and ctx.needs_input_grad[3]
    sinks_grad = sinks is not None and ctx.needs_input_grad[5]
    dq, dk, dv, dmask, dsinks = _backward(dout, q, k, v, lse, mask, seed, sinks, *ctx.args, mask_grad, sinks_grad,
                                          ctx.window)
    return (dq, dk, dv, dmask if mask_grad else None, None, dsinks if sinks_grad else None,
            None, None, None, None, None, None)


_forward.register_autograd(_grad, setup_context=_setup_context)


def recompute_attention(q, k, v, mask, seed, p, causal, scale, block, softcap=None, sinks=None,
                        window=None) -> torch.Tensor:
    """:class:`~leanact.ops.attention.core.RecomputeAttention` ``.apply`` with the same arguments and
    result (b, s_q, H, dv), through the custom op."""
    return _forward(q, k, v, mask, seed, sinks, float(p), bool(causal), float(scale), block,
                    None if softcap is None else float(softcap), None if window is None else int(window))[0]
