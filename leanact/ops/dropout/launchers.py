"""Kernel or PyTorch path for the seeded dropout and its keep-masks (:mod:`.function`,
:func:`leanact.ops.random.keep_mask_like`, attention's dropout blocks in
:mod:`leanact.ops.attention.core`): the launchers of :mod:`.kernels`.

Same contract as :mod:`leanact.ops.triton.dispatch`: each function returns what the caller's PyTorch path returns,
from one kernel, or ``None`` (the caller then runs its PyTorch path). The keep threshold
(``leanact.ops.random.keep_threshold(p)``: a word ``>= thr`` is kept) comes in from the caller, so
nothing here imports :mod:`leanact.ops.random`, which calls these. The kernels launch under the
name ``"dropout"``, whose self-check :mod:`.function` registers.
"""
from __future__ import annotations

import torch

from ..triton.dispatch import _DTYPES, _FAILED, BLOCK, _launch, _usable as _dispatch_usable, launchers

__all__ = ["dropout", "keep_mask_like", "keep_mask_rows"]


def _usable(*tensors):
    """The dropout kernels' launchers (:mod:`.kernels`) when every tensor may run a kernel
    (:func:`leanact.ops.triton.dispatch._usable`), else None."""
    return launchers(_dispatch_usable(*tensors), "leanact.ops.dropout.kernels", "dropout_apply")


def dropout(x: torch.Tensor, seed: torch.Tensor, thr: int, scale: float, inplace: bool):
    """``x * keep_mask_like(seed, x.shape, p) * scale`` (into x when ``inplace``) for the keep
    threshold ``thr`` of ``p``, or None."""
    k = _usable(x, seed)
    if k is None or x.dtype not in _DTYPES or thr >= 1 << 32:
        return None
    src = x if x.is_contiguous() else x.contiguous()
    out = src if inplace else torch.empty_like(x, memory_format=torch.contiguous_format)
    if _launch("dropout", x, k.dropout_apply, src, out, seed if seed.dim() == 0 else seed.reshape(()), thr,
               scale) is _FAILED:
        return None
    return x.copy_(out) if inplace and out is not x else out


def keep_mask_like(seed: torch.Tensor, shape, thr: int, device: torch.device, offset: int):
    """The bool keep-mask of a ``shape`` tensor whose element j has index ``offset + j``, for the
    keep threshold ``thr``, or None."""
    k = _usable(seed)
    if k is None or seed.device != device or thr >= 1 << 32:
        return None
    out = torch.empty(tuple(shape), dtype=torch.bool, device=device)
    if out.numel() and _launch("dropout", seed, k.keep_mask_range, seed.reshape(()), out, thr, offset) is _FAILED:
        return None
    return out


def keep_mask_rows(seed: torch.Tensor, starts: torch.Tensor, length: int, thr: int):
    """``keep_mask(seed, starts[:, None] + arange(length), p)`` (bool (rows, length)) for the keep
    threshold ``thr`` of ``p``, or None."""
    k = _usable(seed, starts)
    if k is None or starts.dim() != 1 or starts.device != seed.device or length >= 65535 * BLOCK or thr >= 1 << 32:
        return None
    out = torch.empty((starts.numel(), length), dtype=torch.bool, device=seed.device)
    if out.numel() and _launch("dropout", seed, k.keep_mask_rows, seed.reshape(()), starts.to(torch.int64).contiguous(),
                               out, thr) is _FAILED:
        return None
    return out
