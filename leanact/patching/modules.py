"""Replacement modules used by :func:`leanact.patch` where the plain drop-in is not enough."""
from __future__ import annotations

import torch
from torch import nn

from ..nn.activation import GELU
from ..ops.gelu import gelu

__all__ = ["PatchedGELU"]


class PatchedGELU(GELU):
    """:class:`leanact.nn.GELU` that, when no backward will run, calls the module it replaced.

    With autograd the output is leanact's (the float64 truth rounded once; it can differ from
    torch's kernel by one ulp); without it (``torch.no_grad``, inference) the replaced module
    computes the output, so that a patched model's inference outputs are bit-identical to the
    unpatched model's. The replaced module is kept as a plain attribute (not a submodule: it has
    no state and must not show up in ``modules()`` or the state dict).
    """

    def __init__(self, approximate: str = "none", reference: nn.Module | None = None) -> None:
        super().__init__(approximate)
        self.__dict__["_reference"] = reference

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and input.requires_grad:
            return gelu(input, approximate=self.approximate)
        ref = self.__dict__.get("_reference")
        if ref is not None:
            return ref(input)
        return torch.nn.functional.gelu(input, approximate=self.approximate)
