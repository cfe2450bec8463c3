"""An embedding lookup whose backward can take a tied head's weight gradient (:mod:`.tied_grad`).

Forward: ``F.embedding(ids, W, padding_idx)``. Keeps for backward the ids only (as torch does) and
the weight's row count. Backward:

* nothing handed to it: ``aten.embedding_dense_backward``, torch's own kernel -- the gradient
  ``F.embedding`` gives, bit for bit;
* a head's dW handed to it (the dense V × H tensor that would have waited in W's input buffer): the
  rows of the tokens present, summed per token by the same kernel over the distinct ids (U × H,
  U ≤ tokens: the same sums in the same order), are added into dW (``index_put_`` with
  ``accumulate``: one add per element, deterministic) and dW is returned. The whole gradient,
  without a second V × H tensor; with several heads' dW their sum first (the buffer's order).

``padding_idx`` rows get nothing from the embedding, as in torch. ``max_norm``, ``sparse`` and
``scale_grad_by_freq`` are not taken (torch's ``F.embedding`` runs; the patching leaves such
modules). Under ``create_graph=True`` the backward is torch's differentiable kernel (double backward as
torch's) and no head hands anything off.
"""
from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

from ..fake_rules import faking
from .tied_grad import register_embedding, take

__all__ = ["TiedEmbeddingFunction", "tied_embedding"]

_dense_backward = torch.ops.aten.embedding_dense_backward


class TiedEmbeddingFunction(torch.autograd.Function):
    """``F.embedding`` whose node can receive a head's dW (module doc)."""

    @staticmethod
    def forward(ctx, weight, ids, padding_idx):
        out = torch.nn.functional.embedding(ids, weight, padding_idx)
        ctx.save_for_backward(ids)
        ctx.padding_idx = -1 if padding_idx is None else padding_idx
        ctx.leanact_weight_shape = tuple(weight.shape)
        ctx.leanact_weight_dtype = weight.dtype
        register_embedding(ctx)
        return out

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        handed = take(ctx)
        rows = ctx.leanact_weight_shape[0]
        if not handed:
            if not ctx.needs_input_grad[0]:
                return None, None, None
            return _dense_backward(grad, ids, rows, ctx.padding_idx, False), None, None
        total = None
        for item in handed:  # (in the order handed: the order autograd's buffer would have added them)
            g = item() if callable(item) else item
            total = g if total is None else total.add_(g)
        flat = ids.reshape(-1)
        if faking() and is_fake(flat):  # (no values: every token taken as distinct, the most rows there can be)
            distinct, inverse = flat, torch.arange(flat.numel(), device=flat.device)
            n = distinct.numel()
        else:  # (leanact.estimate keeps integer inputs real: their values, outside the fake mode)
            with unset_fake_temporarily() if faking() else contextlib.nullcontext():
                distinct, inverse = torch.unique(flat, sorted=True, return_inverse=True)
                n = distinct.numel()
                if ctx.padding_idx >= 0:  # padding tokens to one extra row, which the kernel leaves at zero
                    inverse = torch.where(flat == ctx.padding_idx, n, inverse)
        token_rows = _dense_backward(grad.reshape(flat.numel(), -1), inverse, n + 1, n, False)[:n]
        total.index_put_((distinct,), token_rows.to(total.dtype), accumulate=True)
        return total, None, None


def tied_embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """``F.embedding(ids, weight, padding_idx)`` through :class:`TiedEmbeddingFunction` (normalises a
    negative ``padding_idx`` as torch does)."""
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return TiedEmbeddingFunction.apply(weight, ids, padding_idx)
