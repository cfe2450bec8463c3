"""Kernel or PyTorch path for GELU from its output (:mod:`leanact.ops.gelu`): the launchers of
:mod:`.kernels`' GELU kernels, with the tables and thresholds of :mod:`leanact.ops.gelu` (which
import nothing of this package).

Same contract as :mod:`.dispatch`: each function returns what
:mod:`leanact.ops.gelu.function`'s PyTorch path returns, from one kernel, or ``None`` (the caller
then runs its PyTorch path): bitwise for 16-bit storage (the same tables); for float32 storage
within the few ulps of :mod:`.gelu32_kernels` (float32 arithmetic where the PyTorch path rounds
once from float64). The kernels launch under the name ``"gelu"`` (checked per dtype and
approximation), whose self-check :mod:`leanact.ops.gelu.function` registers.
"""
from __future__ import annotations

import torch

from .dispatch import _DTYPES, _FAILED, _launch, _usable, launchers

__all__ = ["gelu_forward", "gelu_backward"]


def gelu_forward(x: torch.Tensor, approximate: str, with_bits: bool):
    """``(y, packed bits of x > x* or None)`` as ``leanact.ops.gelu.function._forward``, or None."""
    k = _usable(x)
    if k is None or x.dtype not in _DTYPES:
        return None
    from ..gelu import minimum, tables

    n = x.numel()
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device) if with_bits else None
    if x.dtype == torch.float32:
        k32 = launchers(k, "gelu32_kernels", "gelu32_forward")
        if k32 is None:
            return None
        r = _launch("gelu", x, k32.gelu32_forward, x.contiguous(), y, bits, minimum._THRESHOLDS[torch.float32][approximate][0],
                    approximate == "tanh", check_key=(x.dtype, approximate))
    else:
        table = tables._ACCESSORS["y16", tables._dtype_name(x.dtype), approximate](str(x.device))
        r = _launch("gelu", x, k.gelu_forward16, x.contiguous(), y, bits, table,
                    minimum._THRESHOLDS[x.dtype][approximate][1], check_key=(x.dtype, approximate))
    return None if r is _FAILED else (y, bits)


def gelu_backward(y: torch.Tensor, bits: torch.Tensor, dy: torch.Tensor, approximate: str):
    """``dy * GELU'(x)`` rebuilt from y and the packed bits, as ``leanact.ops.gelu.function._backward``, or None."""
    k = _usable(y, bits, dy)
    if k is None or y.dtype not in _DTYPES or dy.dtype != y.dtype:
        return None
    from ..gelu import minimum, rebuild32, tables

    dev = str(y.device)
    out = torch.empty_like(y, memory_format=torch.contiguous_format)
    if y.dtype == torch.float32:
        k32 = launchers(k, "gelu32_kernels", "gelu32_backward")
        if k32 is None:
            return None
        ab = tables._ACCESSORS["ab32", "float32", approximate](dev)
        h = tables._ACCESSORS["h32f", "float32", approximate](dev)
        r = _launch("gelu", y, k32.gelu32_backward, y.contiguous(), bits, dy.contiguous(), out, ab, h,
                    rebuild32._C32[approximate], minimum._CONSTS[approximate].xs,
                    approximate == "tanh", check_key=(y.dtype, approximate))
    else:
        table = tables._ACCESSORS["g16", tables._dtype_name(y.dtype), approximate](dev)
        r = _launch("gelu", y, k.gelu_backward16, y.contiguous(), bits, dy.contiguous(), out, table,
                    check_key=(y.dtype, approximate))
    return None if r is _FAILED else out
