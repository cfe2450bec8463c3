"""Loss modules built on :mod:`leanact.ops`."""
from __future__ import annotations

import torch
from torch import nn

from ..ops.cross_entropy import linear_cross_entropy

__all__ = ["LinearCrossEntropyLoss"]


class LinearCrossEntropyLoss(nn.Module):
    """``nn.CrossEntropyLoss`` of a linear head's logits, without materialising them.

    ``loss_fn(input, weight, target, bias=None)`` equals
    ``nn.CrossEntropyLoss(...)(F.linear(input, weight, bias).float().flatten(0, -2), target.flatten())``
    (scaled and soft-capped first when asked), computed by
    :func:`leanact.ops.cross_entropy.function.linear_cross_entropy` over tiles: backward keeps
    8 bytes per token (fp32 log-sum-exp + int32 target) besides ``input`` and the parameters.
    ``num_items_in_batch`` may be given per call (Hugging Face's gradient-accumulation divisor).
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0, *,
                 scale: float = 1.0, softcap: float | None = None, grad_in_forward: bool = False,
                 chunk_tokens: int | None = None, tile_elements: int | None = None,
                 matmul_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.scale, self.softcap, self.grad_in_forward = scale, softcap, grad_in_forward
        self.chunk_tokens, self.tile_elements, self.matmul_dtype = chunk_tokens, tile_elements, matmul_dtype

    def forward(self, input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None, num_items_in_batch=None) -> torch.Tensor:
        return linear_cross_entropy(input, weight, target, bias, ignore_index=self.ignore_index,
                                    reduction=self.reduction, label_smoothing=self.label_smoothing,
                                    scale=self.scale, softcap=self.softcap, num_items_in_batch=num_items_in_batch,
                                    grad_in_forward=self.grad_in_forward, chunk_tokens=self.chunk_tokens,
                                    tile_elements=self.tile_elements, matmul_dtype=self.matmul_dtype)

    def extra_repr(self) -> str:
        s = f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}"
        if self.scale != 1.0:
            s += f", scale={self.scale}"
        if self.softcap is not None:
            s += f", softcap={self.softcap}"
        return s
