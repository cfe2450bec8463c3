"""Drop-in ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` that keep only the output and rstd.

Subclasses of the torch modules: same constructor, attributes, state_dict keys and repr, so a
torch state_dict loads unchanged and ``isinstance(m, torch.nn.LayerNorm)`` holds. With grad,
forward calls :func:`leanact.ops.norms.layer_norm.layer_norm` / :func:`leanact.ops.norms.rms_norm.rms_norm`,
which keep for backward only the output y and one rstd per row (fp32 for 16-bit inputs on GPU;
torch's CPU LayerNorm kernel returns rstd in the input dtype). Why y: the Linear that follows a
norm in a Transformer keeps y for its weight gradient anyway, and storages are shared, so the
norm's net cost is one rstd per row instead of a copy of its input (plus mean and rstd).

When γ (or |γ| relative to |β|) is too small for y to determine x̂ exactly, the op falls back to
keeping the input (see :mod:`leanact.ops.norms.verdict`); the check runs once per optimizer step.
``from_output`` (None = auto, True/False = forced) and, for LayerNorm, ``max_ratio`` are plain
attributes, keyword-only in the constructor and left out of the repr. Without grad (no_grad,
inference) forward is torch's, saving nothing. Do not modify the output in place before backward:
it is saved, so backward would raise (torch's modules allow it).
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops.norms.verdict import DEFAULT_MAX_RATIO
from ..ops.norms.layer_norm import layer_norm
from ..ops.norms.rms_norm import rms_norm

__all__ = ["LayerNorm", "RMSNorm"]


class LayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` keeping (y, rstd) for backward instead of (x, mean, rstd)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None, *, from_output: bool | None = None, max_ratio: float = DEFAULT_MAX_RATIO):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.from_output = from_output
        self.max_ratio = max_ratio

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps,
                          from_output=self.from_output, max_ratio=self.max_ratio)


class RMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` keeping (y, rstd) for backward (torch's composite keeps x, x̂, rstd)."""

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True,
                 device=None, dtype=None, *, from_output: bool | None = None):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.from_output = from_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps, from_output=self.from_output)
