"""Triton kernels of GELU with 16-bit storage, and their launchers (called by
:mod:`.launchers`): y and the packed branch bit from the lookup tables of
:mod:`.tables` (built by the PyTorch path, read here), bitwise the PyTorch path. (float32
storage: :mod:`.kernels32`.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton.common import FUSED, _grid, _pack8, _store, _unpack1
from ..triton.dispatch import BLOCK  # elements per program of the elementwise kernels
from ..triton.launch import launch


@triton.jit
def _gelu16_fwd_kernel(x_ptr, y_ptr, bits_ptr, tab_ptr, n, u, WITH_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """16-bit storage: y = table[pattern(x)] (int16 views), right = pattern < u, packed."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    pat = tl.load(x_ptr + offs, mask=m, other=0).to(tl.int32) & 0xFFFF
    tl.store(y_ptr + offs, tl.load(tab_ptr + pat, mask=m, other=0), mask=m)
    if WITH_BITS:
        right = ((pat < u) & m).to(tl.int32)
        boffs = pid.to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        tl.store(bits_ptr + boffs, _pack8(right, BLOCK), mask=boffs < (n + 7) // 8)


@triton.jit
def _gelu16_bwd_kernel(y_ptr, bits_ptr, dy_ptr, out_ptr, tab_ptr, n, BLOCK: tl.constexpr):
    """16-bit storage: out = gtable[pattern(y) + 65536 * bit] * dy in float32, rounded once."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    pat = tl.load(y_ptr + offs, mask=m, other=0).to(tl.int32) & 0xFFFF
    g = tl.load(tab_ptr + pat + (_unpack1(bits_ptr, offs, m) << 16), mask=m, other=0.0)
    dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
    _store(out_ptr + offs, g * dy, m)


def gelu_forward16(x: torch.Tensor, y: torch.Tensor, bits, table: torch.Tensor, u: int, block: int = BLOCK):
    n = x.numel()
    if n:
        launch(_gelu16_fwd_kernel, _grid(n, block), x.view(torch.int16), y.view(torch.int16),
               bits if bits is not None else y, table.view(torch.int16), n, u,
               WITH_BITS=bits is not None, BLOCK=block, **FUSED)


def gelu_backward16(y: torch.Tensor, bits: torch.Tensor, dy: torch.Tensor, out: torch.Tensor, table: torch.Tensor,
                    block: int = BLOCK):
    n = y.numel()
    if n:
        launch(_gelu16_bwd_kernel, _grid(n, block), y.view(torch.int16), bits, dy, out, table, n, BLOCK=block, **FUSED)
