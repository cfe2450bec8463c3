"""Modules for the lossy options: few-bit activations and the randomized-gradient Linear."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.amp import keeps_output
from ..ops.lossy.fewbit import fewbit_activation, table
from ..ops.lossy.randomized_linear import DEFAULT_BLOCK, randomized_linear, sketch_rows
from ..ops.weight_recast import recast_weight
from ..patching.weight_recast import recast_dtype
from ..recompute import recipes
from ..saved import with_ambient

__all__ = ["FewBitActivation", "RandomizedLinear"]


class FewBitActivation(nn.Module):
    """GELU / tanh-GELU / SiLU whose backward keeps ``bits`` bits per element (approximate
    derivative, exact output; :mod:`leanact.ops.lossy.fewbit`). No parameters, empty state dict."""

    def __init__(self, function: str = "gelu", bits: int = 2) -> None:
        super().__init__()
        table(function, bits)  # validates
        self.function, self.bits = function, bits

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return fewbit_activation(input, self.function, self.bits)

    def extra_repr(self) -> str:
        return f"function={self.function!r}, bits={self.bits}"


class RandomizedLinear(nn.Linear):
    """:class:`torch.nn.Linear` whose weight gradient is an unbiased random estimate; keeps
    ``R X`` (ρ·N rows) and an 8-byte seed instead of its input (:mod:`leanact.ops.lossy.randomized_linear`),
    except when the input is kept anyway by the leanact op that made it (a norm or GELU keeping its
    output) or is a recipe's output (rebuilt in backward): then it is the exact Linear, which keeps
    nothing more.
    Same parameters and state dict as the Linear it replaces (:meth:`from_linear` shares them)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 ratio: float = 0.5, block: int = DEFAULT_BLOCK) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        sketch_rows(1, ratio, block)  # validates
        self.ratio, self.block = ratio, block

    @classmethod
    def from_linear(cls, m: nn.Linear, ratio: float = 0.5, block: int = DEFAULT_BLOCK) -> "RandomizedLinear":
        new = cls(m.in_features, m.out_features, bias=m.bias is not None, device="meta", ratio=ratio, block=block)
        new.weight, new.bias = m.weight, m.bias  # the same Parameter objects
        new.train(m.training)
        return new

    #: a lean gated MLP may use this down projection's weight directly (its input is rebuilt there)
    _leanact_exact_on_rebuilt_input = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        with with_ambient():  # the autocast recipes of a patched model (leanact.patching.amp), as its Linears
            if keeps_output(input) or (recipes.is_active() and recipes._find(input) is not None):
                # kept anyway by its producer, or a recipe (free): R X would be a second, lossy copy;
                # under autocast the weight is recast in backward as leanact.patch's Linears do
                dtype = recast_dtype(self.weight, input)
                if dtype is None:
                    return super().forward(input)
                with recast_weight(self.weight, dtype) as w:
                    return F.linear(input, w, self.bias)
            return randomized_linear(input, self.weight, self.bias, self.ratio, self.block)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", ratio={self.ratio}, block={self.block}"


