"""Kernel or PyTorch path for GELU from its output (:mod:`leanact.ops.gelu`): the launchers of
:mod:`.kernels16` (16-bit storage) and :mod:`.kernels32` (float32), with the
tables and thresholds of :mod:`leanact.ops.gelu` (which import nothing of this package).

Same contract as :mod:`leanact.ops.triton.dispatch`: each function returns what
:mod:`leanact.ops.gelu.function`'s PyTorch path returns, from one kernel, or ``None`` (the caller
then runs its PyTorch path): bitwise for 16-bit storage (the same tables); for float32 storage
within the few ulps of :mod:`.kernels32` (float32 arithmetic where the PyTorch path rounds
once from float64). The kernels launch under the name ``"gelu"`` (checked per dtype and
approximation), whose self-check :mod:`leanact.ops.gelu.function` registers.
"""
from __future__ import annotations

import torch

from ..triton.dispatch import _DTYPES, _FAILED, _STATE, _launch, _usable, launchers

__all__ = ["gelu_forward", "gelu_backward"]


#: (kind, dtype, approximation, device) -> what the kernels take besides the tensors (tables
#: and thresholds), looked up once: real tensors only (a tracing mode's stand-in is looked up again),
#: and never for fake tensors (leanact.estimate counts the tables it sees looked up)
_ARGS: dict = {}


def _args(kind: str, t: torch.Tensor, approximate: str) -> tuple:
    key = (kind, t.dtype, approximate, t.device)
    hit = None if _STATE["fake"] else _ARGS.get(key)
    if hit is None:
        from . import erfcx32, minimum, rebuild32, slope32, tables  # noqa: F401 (they register tables)

        dev, dn = str(t.device), tables._dtype_name(t.dtype)
        if kind == "forward":
            hit = ((minimum._THRESHOLDS[torch.float32][approximate][0],
                    tables._ACCESSORS["erfcx32", "float32", "none"](dev) if approximate == "none" else None)
                   if t.dtype == torch.float32 else
                   (tables._ACCESSORS["y16", dn, approximate](dev), minimum._THRESHOLDS[t.dtype][approximate][1]))
        elif t.dtype == torch.float32:
            hit = (tables._ACCESSORS["slope32", "float32", approximate](dev), rebuild32._C32[approximate])
        else:
            hit = (tables._ACCESSORS["g16", dn, approximate](dev),)
        if not _STATE["fake"] and all(type(a) is torch.Tensor for a in hit if isinstance(a, torch.Tensor)):
            _ARGS[key] = hit
    return hit


def gelu_forward(x: torch.Tensor, approximate: str, with_bits: bool):
    """``(y, packed bits of x > x* or None)`` as ``leanact.ops.gelu.function._forward``, or None."""
    k = _usable(x)
    if k is None or x.dtype not in _DTYPES:
        return None
    n = x.numel()
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device) if with_bits else None
    if x.dtype == torch.float32:
        k32 = launchers(k, "leanact.ops.gelu.kernels32", "gelu32_forward")
        if k32 is None:
            return None
        thr, table = _args("forward", x, approximate)
        r = _launch("gelu", x, k32.gelu32_forward, x.contiguous(), y, bits, table, thr,
                    check_key=(x.dtype, approximate))
    else:
        table, u = _args("forward", x, approximate)
        k16 = launchers(k, "leanact.ops.gelu.kernels16", "gelu_forward16")
        if k16 is None:
            return None
        r = _launch("gelu", x, k16.gelu_forward16, x.contiguous(), y, bits, table, u, check_key=(x.dtype, approximate))
    return None if r is _FAILED else (y, bits)


def gelu_backward(y: torch.Tensor, bits: torch.Tensor, dy: torch.Tensor, approximate: str):
    """``dy * GELU'(x)`` rebuilt from y and the packed bits, as ``leanact.ops.gelu.function._backward``, or None."""
    k = _usable(y, bits, dy)
    if k is None or y.dtype not in _DTYPES or dy.dtype != y.dtype:
        return None
    out = torch.empty_like(y, memory_format=torch.contiguous_format)
    if y.dtype == torch.float32:
        k32 = launchers(k, "leanact.ops.gelu.kernels32", "gelu32_backward")
        if k32 is None:
            return None
        table, c32 = _args("backward", y, approximate)
        r = _launch("gelu", y, k32.gelu32_backward, y.contiguous(), bits, dy.contiguous(), out, table, c32,
                    check_key=(y.dtype, approximate))
    else:
        table, = _args("backward", y, approximate)
        k16 = launchers(k, "leanact.ops.gelu.kernels16", "gelu_backward16")
        if k16 is None:
            return None
        r = _launch("gelu", y, k16.gelu_backward16, y.contiguous(), bits, dy.contiguous(), out, table,
                    check_key=(y.dtype, approximate))
    return None if r is _FAILED else out
