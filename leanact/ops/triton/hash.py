"""The counter-based hash of :mod:`leanact.ops.random` in Triton, on uint32 lanes (products wrap mod
2^32, shifts of unsigned values are logical): the keep decisions of leanact's dropout, bit for bit
the PyTorch path's, for the kernels that drop out (:mod:`leanact.ops.dropout.kernels`,
:mod:`leanact.ops.norms.kernels`' dropout + add + LayerNorm).
"""
from __future__ import annotations

import triton
import triton.language as tl

_HM1 = tl.constexpr(0x4C1B838F)
_HM2 = tl.constexpr(0x4E13EDB5)
_HM3 = tl.constexpr(0x67455873)
_HM4 = tl.constexpr(0x654EB15B)
_HK0 = tl.constexpr(0x6D0A0665)
_HK1 = tl.constexpr(0x6386D131)


@triton.jit
def _mix(x, shift: tl.constexpr, mul: tl.constexpr):
    return (x ^ (x >> shift)) * mul  # uint32: logical shift, product mod 2^32


@triton.jit
def _seed_keys(seed_ptr):
    """(k0, k1) of the int64 seed at ``seed_ptr`` (random.seed_keys), as uint32 scalars."""
    s = tl.load(seed_ptr)
    lo = s.to(tl.uint32)
    hi = (s >> 32).to(tl.uint32)
    k0 = _mix(_mix(_mix((lo ^ _HK0) * _HM1, 16, _HM2) ^ hi, 15, _HM3), 16, _HM4)
    k1 = _mix(_mix(_mix((hi ^ _HK1) * _HM1, 16, _HM2) ^ k0, 15, _HM3), 16, _HM4)
    return k0, k1


@triton.jit
def _keep(idx, k0, k1, thr):
    """``word(idx) >= thr`` for int64 element indices (random._words, uint32 lanes)."""
    x = (idx.to(tl.uint32) ^ k0) * _HM1
    x = x ^ (idx >> 32).to(tl.uint32)
    x = _mix(x, 16, _HM2) ^ k1
    x = _mix(_mix(x, 15, _HM3), 16, _HM4)
    return x >= thr.to(tl.uint32)
