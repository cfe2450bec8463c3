"""Activation modules built on :mod:`leanact.ops`."""
from __future__ import annotations

import torch
from torch import nn

from ..ops import fake_rules
from ..ops.gelu import gelu
from ..ops.gelu.function import warm_tables

__all__ = ["GELU"]


class GELU(nn.Module):
    """Drop-in for :class:`torch.nn.GELU` that keeps its *output* for backward, not its input.

    Same constructor (``approximate="none"`` or ``"tanh"``), attribute, ``repr`` and (empty)
    state dict as ``torch.nn.GELU``; the forward is :func:`leanact.ops.gelu.gelu`.

    What backward keeps, and why: torch's GELU keeps its input ``x`` (``numel * element_size``
    bytes) to evaluate ``GELU'(x)``. This one keeps the output ``y`` plus one bit per element
    (``ceil(numel / 8)`` bytes, packed) saying on which side of GELU's minimum ``x`` was, and
    rebuilds ``x`` from ``(y, bit)`` by solving ``GELU(x) = y`` (exact, to within what the
    rounding of ``y`` allows; see ``docs/gelu_bound.md``). In a Transformer MLP the next
    ``nn.Linear`` keeps ``y`` anyway for its weight gradient, and the saved-tensor meter (like the
    allocator) counts that storage once, so GELU's net cost drops from ``numel * element_size``
    bytes to ``numel / 8``.

    Differences from ``torch.nn.GELU``: the output is the float64 truth rounded once (torch's
    float32 kernel cancels for ``x < -3``); backward costs a few more elementwise passes; double
    backward raises.
    """

    __constants__ = ["approximate"]
    approximate: str

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return gelu(input, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


def _warm(model: nn.Module, dtype: torch.dtype) -> None:
    """leanact.estimate: the tables of the GELUs in ``model`` built before its step on fake tensors."""
    warm_tables(dtype, {m.approximate for m in model.modules() if isinstance(m, GELU)})


fake_rules.register("GELU modules", warm=_warm)
