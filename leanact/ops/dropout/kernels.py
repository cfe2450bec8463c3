"""Triton kernels of leanact's seeded dropout and its keep-masks, and their launchers (called by
:mod:`.launchers`).

The mask is the counter-based hash of :mod:`leanact.ops.random` (:mod:`leanact.ops.triton.hash`),
bit for bit the PyTorch path's; ``x * keep * scale`` is computed in float32 and rounded once, as torch does it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton.common import FUSED, _grid, _store
from ..triton.dispatch import BLOCK  # elements per program of the elementwise kernels
from ..triton.hash import _keep, _seed_keys
from ..triton.launch import cdiv, launch


@triton.jit(do_not_specialize=["offset", "thr"])  # n specialized: a mask of 16-element runs lets loads vectorize
def _dropout_kernel(x_ptr, out_ptr, seed_ptr, n, offset, thr, scale, APPLY: tl.constexpr, BLOCK: tl.constexpr):
    """APPLY: ``out = x * keep * scale`` (float32, rounded once); else ``out`` = keep (uint8)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    k0, k1 = _seed_keys(seed_ptr)
    keep = _keep(offs + offset, k0, k1, thr)
    if APPLY:
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        _store(out_ptr + offs, x * keep.to(tl.float32) * scale, m)
    else:
        tl.store(out_ptr + offs, keep.to(tl.uint8), mask=m)


def dropout_apply(x: torch.Tensor, out: torch.Tensor, seed: torch.Tensor, thr: int, scale: float, block: int = BLOCK):
    """``out = x * keep_mask_like(seed, x.shape, p) * scale`` for contiguous x, out (may alias)."""
    n = x.numel()
    launch(_dropout_kernel, _grid(n, block), x, out, seed, n, 0, thr, scale, APPLY=True, BLOCK=block, **FUSED)
    return out


def keep_mask_range(seed: torch.Tensor, out: torch.Tensor, thr: int, offset: int, block: int = BLOCK):
    """``out`` (contiguous bool) = keep decisions of the indices offset .. offset + numel - 1."""
    n = out.numel()
    o = out.view(torch.uint8)
    launch(_dropout_kernel, _grid(n, block), o, o, seed, n, offset, thr, 1.0, APPLY=False, BLOCK=block, **FUSED)
    return out


@triton.jit(do_not_specialize=["thr"])
def _keep_rows_kernel(starts_ptr, out_ptr, seed_ptr, length, thr, BLOCK: tl.constexpr):
    """out[r, j] = keep(starts[r] + j) for j < length (uint8): attention's dropout blocks."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = cols < length
    k0, k1 = _seed_keys(seed_ptr)
    keep = _keep(tl.load(starts_ptr + r) + cols, k0, k1, thr)
    tl.store(out_ptr + r * length + cols, keep.to(tl.uint8), mask=m)


def keep_mask_rows(seed: torch.Tensor, starts: torch.Tensor, out: torch.Tensor, thr: int, block: int = BLOCK):
    """``out`` (contiguous bool (rows, length)) = keep decisions of the indices starts[r] + j."""
    rows, length = out.shape
    o = out.view(torch.uint8)
    launch(_keep_rows_kernel, (rows, cdiv(length, block)), starts, o, seed, length, thr, BLOCK=block, **FUSED)
    return out
