"""Kernel or PyTorch path for the lossy options' pack/unpack (few-bit activations, 8-bit compression).

Same contract as :mod:`leanact.ops.triton.dispatch` (whose helpers these use): each function returns
what the caller's PyTorch path returns, computed by one kernel of :mod:`.kernels`, or ``None`` (the
caller then runs its PyTorch path). What the kernels need from higher layers (tables, the qmax of a
format, int8's uniforms) comes in as arguments: nothing here imports ``leanact.lossy``.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..triton import dispatch as _d

__all__ = ["fewbit_forward", "fewbit_backward", "compress_8bit", "decompress_8bit"]

_16BIT = (torch.float16, torch.bfloat16)
#: Largest compression block (elements per scale) handled by the kernel (larger: the PyTorch path).
MAX_QBLOCK = 8192


def _lossy_kernels(k):
    """The launchers standing for ``k``: :mod:`.kernels` for a kernel module without them
    (see :func:`leanact.ops.triton.dispatch.launchers`), else ``k`` itself (:mod:`.kernels` given to
    ``use_kernels``, :data:`leanact.ops.triton.dispatch.SHAPES_ONLY`)."""
    return _d.launchers(k, "leanact.ops.lossy.kernels", "fewbit_forward")


def _usable(*tensors):
    k = _d._usable(*tensors)
    return None if k is None else _lossy_kernels(k)


def fewbit_forward(x: torch.Tensor, tables: Callable[[], tuple], bits: int, y_table: Callable[[], torch.Tensor]):
    """``(y or None, packed index planes)`` of :class:`.fewbit.FewBitFunction`'s forward,
    or None. ``tables()``: ``(borders, labels)``, the float32 values of the borders rounded down to
    x's dtype and the uint8 level index of each interval; ``y_table()``: the activation of every
    16-bit pattern (contiguous 16-bit x only; otherwise y is None and the caller runs torch's
    activation). Neither is called on fake tensors (SHAPES_ONLY: the outputs only)."""
    k = _usable(x)
    if k is None or x.dtype not in _d._DTYPES:
        return None
    fake = _d._STATE["fake"]
    borders, labels = tables() if not fake else (None, None)
    n = x.numel()
    packed = torch.empty(bits * ((n + 7) // 8), dtype=torch.uint8, device=x.device)
    with_y = x.dtype in _16BIT and x.is_contiguous()
    y = torch.empty_like(x, memory_format=torch.contiguous_format) if with_y else None
    table = y_table() if with_y and not fake else None
    if _d._launch("fewbit", x, k.fewbit_forward, x.contiguous(), y, table, packed, borders, labels,
                  bits, check_key=(x.dtype, bits)) is _d._FAILED:
        return None
    return y, packed


def fewbit_backward(packed: torch.Tensor, levels: torch.Tensor, dy: torch.Tensor, bits: int):
    """``(dy.float() * levels[index]).to(dy.dtype)`` (dy's shape) for float32 levels, or None."""
    k = _usable(packed, levels, dy)
    if k is None or dy.dtype not in _d._DTYPES or levels.dtype != torch.float32:
        return None
    out = torch.empty_like(dy, memory_format=torch.contiguous_format)
    if _d._launch("fewbit", dy, k.fewbit_backward, packed, levels, dy.contiguous(), out, bits,
                  check_key=(dy.dtype, bits)) is _d._FAILED:
        return None
    return out


def compress_8bit(flat: torch.Tensor, fp8: bool, block: int, qmax: float, u):
    """``(values, scales)`` of ``leanact.lossy.compress.compress`` for a 1-D tensor, or None: fp8
    e4m3fn (``u`` None) or int8 values rounded stochastically with ``u`` (float32 uniforms, one per
    element of the zero-padded blocks, contiguous)."""
    k = _usable(flat, u)
    if k is None or flat.dtype not in _d._DTYPES or flat.dim() != 1 or not 0 < block <= MAX_QBLOCK:
        return None
    n = flat.numel()
    nb = -(-n // block)
    if u is not None and (u.dtype != torch.float32 or u.numel() != nb * block or not u.is_contiguous()):
        return None
    q = torch.empty(n, dtype=torch.float8_e4m3fn if fp8 else torch.int8, device=flat.device)
    scales = torch.empty(nb, dtype=torch.float32, device=flat.device)
    if _d._launch("compress", flat, k.quantize, flat.contiguous(), q, scales, u, block, qmax,
                  check_key=(flat.dtype, "fp8" if fp8 else "int8")) is _d._FAILED:
        return None
    return q, scales


def decompress_8bit(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, block: int):
    """``leanact.lossy.compress.decompress``: 1-D ``dtype`` values times their block's scale, or None."""
    k = _usable(values, scales)
    if (k is None or dtype not in _d._DTYPES or values.dtype not in (torch.float8_e4m3fn, torch.int8)
            or values.dim() != 1 or scales.dtype != torch.float32):
        return None
    out = torch.empty(values.numel(), dtype=dtype, device=values.device)
    if _d._launch("compress", values, k.dequantize, values.contiguous(), scales.contiguous(), out, block,
                  check_key=(dtype, "fp8" if values.dtype == torch.float8_e4m3fn else "int8")) is _d._FAILED:
        return None
    return out
