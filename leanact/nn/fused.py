"""Modules built on recipes (:mod:`leanact.recompute`): norm→linear fusion and a lean MLP.

Drop-in producers (same arguments, parameters and state_dict as the torch module they subclass):
``RecipeLayerNorm``, ``RecipeRMSNorm``, ``RecipeGELU``, ``RecipeSiLU``, ``RecipeReLU``,
``RecipeDropout``. They keep their input (as torch's LayerNorm/GELU/SiLU do) and register a recipe
for their output; under a :class:`~leanact.recompute.RecipeTransform` (e.g.
``leanact.recompute.scope(model)``) the following Linear keeps nothing extra for it. ``inplace``
flags are ignored (the input is kept, so it is never overwritten).

Fused blocks that activate the transform themselves:

* :class:`LayerNormLinears` — norm, then several projections of the normalized input (Q, K, V):
  keeps x + mean/rstd once; the normalized input is rebuilt once in the projections' backward.
  state_dict: ``norm.weight``, ``norm.bias`` (as ``nn.LayerNorm``/``nn.RMSNorm``),
  ``linears.<i>.weight``, ``linears.<i>.bias`` (``nn.Linear`` children).
* :class:`LeanMLP` — fc1 → activation → dropout → fc2: keeps fc1's input and output (+ a seed);
  the activation/dropout output is rebuilt inside fc2's backward. state_dict: ``fc1.*``, ``fc2.*``
  (``nn.Linear``); for ``swiglu`` fc1 has ``2*ffn`` outputs, gate rows first, then up rows.
"""
from __future__ import annotations

import torch
from torch import nn

from leanact.recompute import producers
from leanact.recompute.recipes import RecipeTransform, foreign_hooks

__all__ = ["RecipeLayerNorm", "RecipeRMSNorm", "RecipeGELU", "RecipeSiLU", "RecipeReLU", "RecipeDropout",
           "LayerNormLinears", "LeanMLP", "MLP_ACTIVATIONS"]

MLP_ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu", "swiglu")


class RecipeLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` keeping x, mean, rstd; its output is a recipe for the next op."""

    def forward(self, x):
        return producers.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class RecipeRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` keeping x, rstd; its output is a recipe for the next op."""

    def forward(self, x):
        return producers.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class RecipeGELU(nn.GELU):
    """``nn.GELU`` keeping its input; its output is a recipe for the next op."""

    def forward(self, x):
        return producers.gelu(x, self.approximate)


class RecipeSiLU(nn.SiLU):
    """``nn.SiLU`` keeping its input; its output is a recipe for the next op."""

    def forward(self, x):
        return producers.silu(x)


class RecipeReLU(nn.ReLU):
    """``nn.ReLU`` keeping its input; its output is a recipe for the next op."""

    def forward(self, x):
        return producers.relu(x)


class RecipeDropout(nn.Dropout):
    """``nn.Dropout`` keeping an 8-byte seed; its output is a recipe (input, seed)."""

    def forward(self, x):
        return producers.dropout(x, self.p, self.training)


class _Scoped(nn.Module):
    """Runs ``_forward`` inside this module's own :class:`RecipeTransform` when grad is on (not
    while compiling, nor under foreign saved-tensor hooks such as a checkpointed region's)."""

    def __init__(self):
        super().__init__()
        self.recipes = RecipeTransform()

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled() or torch.compiler.is_compiling() or foreign_hooks():
            return self._forward(*args, **kwargs)
        with self.recipes:
            return self._forward(*args, **kwargs)


class LayerNormLinears(_Scoped):
    """``norm(x)`` followed by ``len(out_features)`` Linears of it; returns a tuple of outputs.

    Kept for backward: x and the norm statistics (once), the Linears' weights; not the normalized
    input (torch keeps it in addition: one more tensor of x's size). Under autocast each Linear gets
    its own cast of the normalized input (as autocast does: gradients summed in fp32), made by
    ``producers.cast`` so it is a recipe too (autocast's internal cast would be kept).
    """

    def __init__(self, normalized_shape: int, out_features: list[int] | tuple[int, ...], bias: bool = True,
                 eps: float | None = 1e-5, norm: str = "layer", elementwise_affine: bool = True,
                 norm_bias: bool = True, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        if norm == "layer":
            self.norm = RecipeLayerNorm(normalized_shape, eps=1e-5 if eps is None else eps,
                                        elementwise_affine=elementwise_affine, bias=norm_bias, **kw)
        elif norm == "rms":
            self.norm = RecipeRMSNorm(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, **kw)
        else:
            raise ValueError(f"norm must be 'layer' or 'rms', got {norm!r}")
        self.linears = nn.ModuleList(nn.Linear(normalized_shape, n, bias=bias, **kw) for n in out_features)

    def _forward(self, x):
        h = self.norm(x)
        if torch.is_autocast_enabled(h.device.type):  # cast per Linear (as autocast would), as recipes
            dt = torch.get_autocast_dtype(h.device.type)
            return tuple(lin(producers.cast(h, dt)) for lin in self.linears)
        return tuple(lin(h) for lin in self.linears)


class LeanMLP(_Scoped):
    """fc1 → activation → dropout → fc2 keeping fc1's input, fc1's output and a seed.

    ``activation``: "gelu", "gelu_tanh", "relu", "silu" or "swiglu" (fc1 → 2·ffn, silu(gate)·up).
    torch keeps in addition the activation output (and, with dropout, a mask and the dropout
    output). Exactly torch's numbers: outputs and gradients equal those of the same composition
    of ``nn.Linear``, ``F.gelu``/..., and leanact's seeded dropout.
    """

    def __init__(self, hidden: int, ffn: int, activation: str = "gelu", dropout: float = 0.0, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if activation not in MLP_ACTIVATIONS:
            raise ValueError(f"activation must be one of {MLP_ACTIVATIONS}, got {activation!r}")
        kw = dict(device=device, dtype=dtype)
        self.activation, self.p = activation, float(dropout)
        self.fc1 = nn.Linear(hidden, 2 * ffn if activation == "swiglu" else ffn, bias=bias, **kw)
        self.fc2 = nn.Linear(ffn, hidden, bias=bias, **kw)

    def _forward(self, x):
        u = self.fc1(x)
        a = producers.swiglu(u) if self.activation == "swiglu" else producers.activation(u, self.activation)
        return self.fc2(producers.dropout(a, self.p, self.training))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, dropout={self.p}"
