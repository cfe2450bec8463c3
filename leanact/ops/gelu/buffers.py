"""Eager-mode plumbing shared by the 16-bit and float32 paths: slices, bit packing, workspaces.

Eager mode works through a tensor in slices of :data:`CHUNK` elements with preallocated buffers;
under ``torch.compile`` the whole tensor is one slice (one graph).
"""
from __future__ import annotations

import sys

import torch

from ..bitpack import pack_bits

#: Elements per slice in eager mode (a multiple of 8: slices start on a byte of the packed bits),
#: so the working-precision buffers (preallocated once per call, reused by every slice) stay small
#: whatever the tensor size: on the CPU sized for the cache; on accelerators larger, as every op
#: is a kernel launch (there the op is meant to run under torch.compile, which fuses it). Under
#: torch.compile the whole tensor is one graph.
CHUNK = 1 << 16
CHUNK_ACCELERATOR = 1 << 22


def _slices(n: int, device: torch.device):
    if torch.compiler.is_compiling() or n == 0:
        return [(0, n)]
    step = CHUNK if device.type == "cpu" else CHUNK_ACCELERATOR
    step = max(8, step - step % 8)  # slices start on a byte of the packed bits
    return [(i, min(i + step, n)) for i in range(0, n, step)]


# -- bit packing (the layout of leanact.ops.bitpack, computed with fewer passes) -----------------

_PACK_MUL = 0x0102040810204080  # (8 bytes of 0/1) * this: bit i of the top byte = byte i


def _pack(right: torch.Tensor, n: int) -> torch.Tensor:
    """``pack_bits(right[:n] != 0)`` for a flat uint8 tensor of 0/1 whose length is a multiple of 8
    (tail 0)."""
    if torch.compiler.is_compiling() or sys.byteorder != "little":
        return pack_bits(right[:n] != 0)
    v = right.view(torch.int64)
    return v.mul_(_PACK_MUL).bitwise_right_shift_(56).to(torch.uint8)  # wraps mod 2**64, as intended


def _unpack_into(packed: torch.Tensor, spread: torch.Tensor, ws) -> torch.Tensor:
    """The bits of ``packed`` as uint8 0/1 (8 per byte, lowest bit first): one gather."""
    k = packed.numel()
    bi, rb = ws.bi[:k], ws.rb[:k]
    bi.copy_(packed)
    torch.index_select(spread, 0, bi, out=rb)
    return rb.view(torch.uint8)


class _Workspace:
    """Preallocated per-slice buffers (eager slices reuse them; out= ops allocate nothing)."""

    def __init__(self, m: int, device, spec: dict[str, torch.dtype]):
        self.size = m
        for name, dt in spec.items():
            setattr(self, name, torch.empty(m, dtype=dt, device=device))
        self.bi = torch.empty((m + 7) // 8, dtype=torch.int32, device=device)
        self.rb = torch.empty((m + 7) // 8, dtype=torch.int64, device=device)

    def cut(self, n: int) -> "_Workspace":
        if n == self.size:
            return self
        w = _Workspace.__new__(_Workspace)
        w.size = n
        for name, t in self.__dict__.items():
            if isinstance(t, torch.Tensor):
                setattr(w, name, t[: (n + 7) // 8] if name in ("bi", "rb") else t[:n])
        return w
