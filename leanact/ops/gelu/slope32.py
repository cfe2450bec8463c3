"""float32 storage on CUDA: GELU' as a function of the stored output, one cubic per cell of the key.

The float32 path's key (:mod:`.rebuild32`: a float32 computed from ``y`` and the branch bit, whose
exponent and top mantissa bits resolve the square-root branch point at the minimum and the left
tail) makes the derivative a smooth function within each cell of its exponent and top
:data:`KEY_BITS` mantissa bits. So instead of rebuilding ``x`` and evaluating ``GELU'`` there, the
CUDA kernel reads four float32 coefficients per cell and evaluates
``f'(x) = c0 + s (c1 + s (c2 + s c3))``, ``s`` the key's remaining mantissa bits as a fraction of
the cell (exact): the cubic through ``f'`` at the four Chebyshev nodes of the cell, computed in
float64 from the ``x`` that solves ``GELU(x) = y`` there. Its interpolation error is far below a
float32 ulp (a cell spans 1/16 of an octave of the key); what is left is the rounding of the
coefficients and of the evaluation: within 1.7 ulps of ``GELU'`` beyond the interval ``B(y)`` the
stored output allows (``docs/gelu_bound.md``, section 8), in about 20 float32 operations and one
division per element instead of an ``erfc`` (or ``exp``) evaluation and a Newton step.

The table: ``2**(8 + KEY_BITS)`` rows of 4 float32 (64 KiB), one 16-byte row per cell; cells no
element with a derivative reaches hold zeros.
"""
from __future__ import annotations

import torch

from .rebuild32 import _cell_points
from .rebuild64 import _derivs
from .tables import CUBIC_NODES, fit_cubics, real_cpu, register

__all__: list[str] = []

#: Mantissa bits of the key that pick the cell (with its 8 exponent bits)
KEY_BITS = 4
#: The key's bits below the cell: the local coordinate ``s = (bits & (2**SHIFT - 1)) / 2**SHIFT``
SHIFT = 23 - KEY_BITS
NCELL = 1 << (8 + KEY_BITS)

_SLOPE_CPU: dict[str, torch.Tensor] = {}


def slope_table(approximate: str) -> torch.Tensor:
    """The ``(NCELL, 4)`` float32 coefficients ``c0..c3`` on the CPU (module doc)."""
    hit = _SLOPE_CPU.get(approximate)
    if hit is None:
        with real_cpu():
            hit = _SLOPE_CPU[approximate] = _build_slope(approximate)
    return hit


def _build_slope(approximate: str) -> torch.Tensor:
    _, x, ok = _cell_points(approximate, KEY_BITS, CUBIC_NODES)
    _, f1, _, _ = _derivs(x, torch.zeros_like(x), approximate, True, False)
    f1 = torch.where(ok.all(0, keepdim=True), f1, 0.0)  # (nodes, cells); unreachable cells: 0
    return fit_cubics(f1).to(torch.float32)


def _build_slope32(dtype, approximate, device):
    return slope_table(approximate).to(device)


register("slope32", _build_slope32, ("float32",))
