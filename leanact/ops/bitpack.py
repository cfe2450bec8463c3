"""Bit packing of boolean masks: 1/8 byte per element.

Used by ops that keep a branch bit or a mask for backward (e.g. GELU's side-of-the-minimum bit).
Written with plain tensor ops so it runs on any device and traces under torch.compile.
"""
from __future__ import annotations

import torch

__all__ = ["pack_bits", "unpack_bits", "packed_nbytes"]



def _bit_weights(device: torch.device) -> torch.Tensor:
    # 1, 2, 4, ..., 128 as uint8; built with arange so it is traceable (no cached constants).
    return torch.pow(2, torch.arange(8, device=device, dtype=torch.int32)).to(torch.uint8)


def packed_nbytes(numel: int) -> int:
    """Bytes used by :func:`pack_bits` for ``numel`` booleans: ceil(numel / 8)."""
    return (numel + 7) // 8


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a boolean tensor (any shape) into a flat uint8 tensor of ceil(numel/8) bytes.

    Bit ``i % 8`` of byte ``i // 8`` holds element ``i`` of ``mask.flatten()`` (C order).
    """
    if mask.dtype != torch.bool:
        raise TypeError(f"pack_bits expects a bool tensor, got {mask.dtype}; pass `mask != 0`.")
    flat = mask.reshape(-1)
    n = flat.numel()
    pad = (-n) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    bits = flat.view(-1, 8).to(torch.uint8)
    return (bits * _bit_weights(mask.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int, shape: torch.Size | tuple[int, ...] | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: a bool tensor of ``numel`` elements (reshaped to ``shape``)."""
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise TypeError("unpack_bits expects the flat uint8 tensor returned by pack_bits.")
    if packed.numel() != packed_nbytes(numel):
        raise ValueError(
            f"packed tensor has {packed.numel()} bytes but {numel} elements need {packed_nbytes(numel)}."
        )
    bits = torch.bitwise_and(packed.unsqueeze(1), _bit_weights(packed.device)) != 0
    flat = bits.reshape(-1)[:numel]
    return flat if shape is None else flat.view(shape)
