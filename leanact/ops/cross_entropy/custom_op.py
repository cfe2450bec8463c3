"""The fused linear + cross-entropy as a ``torch.library`` custom op, for ``torch.compile``.

Traced by Dynamo, :class:`~leanact.ops.cross_entropy.function.LinearCrossEntropyFunction` would
become a graph of its chunks (thousands of nodes at a long sequence) whose backward AOTAutograd's
partitioner could serve by keeping any chunk's logits. As a custom op it is one opaque node whose
memory is eager's ``grad_in_forward``: forward computes the loss and, chunk by chunk, the gradients
of x, W and b, and keeps those (x's, W's and b's sizes) for backward, which only scales them by the
incoming gradient. Reductions ``mean`` and ``sum`` (``num_items_in_batch`` divides the sum outside
the op). Second derivatives: torch.compile does not differentiate a compiled graph twice.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..amp import autocast_off
from .function import _acc_dtype, _forward as _fused_forward, _matmul_dtype

__all__ = ["linear_cross_entropy_op"]


@torch.library.custom_op("leanact::linear_cross_entropy", mutates_args=())
def _forward(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
             ignore_index: int, reduction: str, label_smoothing: float, scale: float, softcap: Optional[float],
             cdtype: torch.dtype, needs: list[bool]) -> list[torch.Tensor]:
    with autocast_off(x.device.type):  # the op's inputs are already cast; its inside runs as called
        _, loss, grads, _ = _fused_forward(x, weight, bias, target, ignore_index, reduction, label_smoothing, scale,
                                           softcap, _matmul_dtype(cdtype, x.device), None, None,
                                           tuple(needs) if any(needs) else None)
    for g in grads:  # gradients, not activations: the meter files them apart, lossy compression leaves them exact
        if g is not None:
            g._leanact_gradient = g._leanact_exact = True
    # an op returns tensors (and no two the same): an empty one stands for "no gradient"
    return [loss, *(x.new_empty(0) if g is None else g for g in grads)]


@_forward.register_fake
def _(x, weight, target, bias, ignore_index, reduction, label_smoothing, scale, softcap, cdtype, needs):
    like = (x, weight, bias)
    return [x.new_empty((), dtype=_acc_dtype(cdtype)),
            *(t.new_empty(t.shape) if n and t is not None else x.new_empty(0) for t, n in zip(like, needs))]


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*output[1:])  # the gradients computed in forward
    ctx.needs = inputs[-1]


def _grad(ctx, grads):
    g = grads[0]  # (of the loss; the gradients' own outputs get none)
    scaled = [(t * g).to(t.dtype) if n else None for t, n in zip(ctx.saved_tensors, ctx.needs)]
    dx, dw, db = scaled
    return dx, dw, None, db, None, None, None, None, None, None, None


_forward.register_autograd(_grad, setup_context=_setup_context)


def linear_cross_entropy_op(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
                            *, ignore_index: int, reduction: str, label_smoothing: float, scale: float,
                            softcap: float | None, cdtype: torch.dtype) -> torch.Tensor:
    """The fp32 (fp64 for fp64) loss of ``F.cross_entropy(F.linear(x, weight, bias) in cdtype, upcast
    [· scale] [→ c·tanh(·/c)], target, ...)`` through the custom op; x (N, H), target (N,);
    ``reduction`` "mean" or "sum"."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy_op: reduction 'mean' or 'sum', got {reduction!r}")
    needs = [x.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad]
    return _forward(x, weight, target, bias, int(ignore_index), reduction, float(label_smoothing), float(scale),
                    None if softcap is None else float(softcap), cdtype, needs)[0]
