"""``Dropout`` module that keeps an 8-byte seed for backward instead of a mask."""
from __future__ import annotations

import torch

from ..ops.dropout.function import dropout

__all__ = ["Dropout"]


class Dropout(torch.nn.Dropout):
    """Drop-in for :class:`torch.nn.Dropout` (same arguments, attributes, repr, no state).

    What is kept for backward: one 0-dim int64 seed (8 bytes) per call, instead of a mask of the
    input's size (``torch.nn.Dropout`` keeps 1 byte per element on CUDA, the input's dtype on the
    CPU). Why it suffices: the keep-mask is a pure function of (seed, element index)
    (:mod:`leanact.ops.random`), so backward regenerates exactly the forward's mask, whatever
    random calls happen in between. The seed is drawn from the default generator of the input's
    device, so ``torch.manual_seed`` makes runs reproducible. Identity in eval mode.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return dropout(input, self.p, self.training, self.inplace)
