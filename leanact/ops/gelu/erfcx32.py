"""float32 storage on CUDA, erf form: ``Phi(-a) exp(a^2/2)`` as one cubic per cell of ``a``'s bits.

The CUDA float32 forward computes ``Phi(-a) = R(a) exp(-a^2/2)`` for ``a = |x|`` (``Phi(x) = 1 -
Phi(-a)`` above 0) with ``R(a) = erfcx(a/sqrt 2)/2``, Mills' ratio over ``sqrt(2 pi)``: ``exp`` of the
exactly split ``-a^2/2`` carries the Gaussian decay (the tails keep their relative accuracy) and
``R`` is smooth and slowly varying (1/2 at 0, ``~1/(a sqrt(2 pi))`` for large ``a``), so within
each cell of ``a``'s exponent and top :data:`KEY_BITS` mantissa bits a cubic in ``s``, the
remaining mantissa bits as a fraction of the cell (exact), reproduces it far below a float32 ulp.
The cubic goes through ``R`` at the cell's four Chebyshev nodes (float64 ``erfcx``). One table
read and three ``fma`` replace an ``erfc`` series, a division and a second ``exp``.

The table: ``2**(8 + KEY_BITS)`` rows of 4 float32 (128 KiB); the rows of ``a`` above 32 (never
read: the kernel clamps ``|x|`` to 20) hold zeros. It is registered as the table ``"erfcx32"`` (the
name leanact.estimate reports for it).
"""
from __future__ import annotations

import math

import torch

from .tables import CUBIC_NODES, fit_cubics, real_cpu, register

__all__: list[str] = []

#: Mantissa bits of ``a`` that pick the cell (with its 8 exponent bits)
KEY_BITS = 5
SHIFT = 23 - KEY_BITS
NCELL = 1 << (8 + KEY_BITS)
#: The cells up to this exponent (``a < 2**(_TOP + 1)``) are filled
_TOP = 4

_MILLS_CPU: torch.Tensor | None = None


def mills_table() -> torch.Tensor:
    """The ``(NCELL, 4)`` float32 coefficients of ``R`` on the CPU (module doc)."""
    global _MILLS_CPU
    if _MILLS_CPU is None:
        with real_cpu():
            _MILLS_CPU = _build_mills()
    return _MILLS_CPU


def _build_mills() -> torch.Tensor:
    cell = torch.arange(NCELL, dtype=torch.float64)
    e = torch.div(cell, 1 << KEY_BITS, rounding_mode="floor") - 127
    m = cell.remainder(1 << KEY_BITS)
    t = torch.tensor(CUBIC_NODES, dtype=torch.float64)[:, None]
    # exponent -127: float32 subnormals, a = m' 2**-149 with the same mantissa bits
    a = torch.where(e > -127, torch.pow(2.0, e) * (1 + (m + t) / (1 << KEY_BITS)),
                    2.0 ** -126 * (m + t) / (1 << KEY_BITS))
    r = torch.special.erfcx(a * math.sqrt(0.5)) * 0.5
    r = torch.where(e <= _TOP, r, 0.0)
    return fit_cubics(r).to(torch.float32)


def _build_erfcx32(dtype, approximate, device):
    return mills_table().to(device)


register("erfcx32", _build_erfcx32, ("float32",), ("none",))
