"""Triton kernels of the lossy options' pack/unpack, one per op and direction, and their launchers.

They compute what the PyTorch paths compute, bit for bit:

- few-bit activations (:mod:`.fewbit`): forward compares x with the dtype-rounded
  borders (exact in float32 for 16-bit x), maps the interval to its level index through the labels
  and packs the ``bits`` bit planes; for 16-bit x it also writes y, looked up in a table of torch's
  own activation on every 16-bit pattern. Backward unpacks the index, looks up its float32 level
  and multiplies by dy in float32, rounded once.
- 8-bit compressed activations (``leanact.lossy.compress``): per block of ``block`` elements the
  float32 absmax, ``scale = absmax / qmax`` and ``inv = 1 / scale`` (correctly rounded divisions,
  ``div_rn``: Triton's float32 ``/`` is ``div.full.f32`` on CUDA, tests/test_triton_ptx.py; the
  PyTorch path divides by a tensor, as CUDA's division by a Python number multiplies by its
  float32 reciprocal), ``v = x * inv``; fp8 e4m3 by integer operations that follow c10's float -> e4m3fn
  conversion (round to nearest even, subnormals by one float addition; see :func:`_e4m3_bits`), int8
  by ``floor(v + u)`` clamped to +-127, u the caller's ``torch.rand`` draw (the PyTorch path adds
  the same u). Decompression: the value times its block's scale in float32, rounded once.

Launched with ``enable_fp_fusion=False``: ``x * inv + u`` must round twice, as torch does.
Imported only when a kernel is about to run (see :mod:`.launchers`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton.dispatch import BLOCK  # elements per program of the elementwise kernels
from ..triton.common import UNFUSED, _grid, _pack8, _store, _unpack1
from ..triton.launch import cdiv, launch, next_power_of_2

_TILE = 4096  # elements per program of the quantize kernel (whole blocks)

# -- few-bit activations --------------------------------------------------------------------------


@triton.jit
def _fewbit_fwd_kernel(x_ptr, y_ptr, tab_ptr, packed_ptr, borders_ptr, labels_ptr, n, per, NB: tl.constexpr,
                       BITS: tl.constexpr, KIND: tl.constexpr, WITH_Y: tl.constexpr, BLOCK: tl.constexpr):
    """KIND 0: float32 x; 1: bfloat16, 2: float16 (x read as int16 patterns, y = table[pattern]).
    index = labels[#borders below x] (NaN: the last interval), bit planes of ``per`` bytes each."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    if KIND == 0:
        x = tl.load(x_ptr + offs, mask=m, other=0.0)
    else:
        pat = tl.load(x_ptr + offs, mask=m, other=0).to(tl.int32) & 0xFFFF
        if WITH_Y:
            tl.store(y_ptr + offs, tl.load(tab_ptr + pat, mask=m, other=0), mask=m)
        if KIND == 1:
            x = (pat << 16).to(tl.float32, bitcast=True)
        else:
            x = pat.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    cnt = tl.zeros((BLOCK,), dtype=tl.int32)
    for j in tl.static_range(NB):
        cnt += (x > tl.load(borders_ptr + j)).to(tl.int32)
    cnt = tl.where(x != x, NB, cnt)
    idx = tl.load(labels_ptr + cnt, mask=m, other=0).to(tl.int32)
    boffs = pid.to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    for p in tl.static_range(BITS):
        bit = tl.where(m, (idx >> p) & 1, 0)
        tl.store(packed_ptr + p * per + boffs, _pack8(bit, BLOCK), mask=boffs < per)


@triton.jit
def _fewbit_bwd_kernel(packed_ptr, levels_ptr, dy_ptr, out_ptr, n, per, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """out = dy * levels[index] in float32, rounded once to out's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    idx = tl.zeros((BLOCK,), dtype=tl.int32)
    for p in tl.static_range(BITS):
        idx |= _unpack1(packed_ptr + p * per, offs, m) << p
    level = tl.load(levels_ptr + idx, mask=m, other=0.0)
    dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
    _store(out_ptr + offs, dy * level, m)


_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def fewbit_forward(x: torch.Tensor, y, table, packed: torch.Tensor, borders: torch.Tensor, labels: torch.Tensor,
                   bits: int, block: int = BLOCK):
    """packed (``bits`` planes of ceil(n / 8) bytes) from contiguous x; y = table[pattern] when y is given
    (16-bit x). ``borders``: float32, rounded down to x's dtype; ``labels``: uint8."""
    n = x.numel()
    if n:
        kind = _KIND[x.dtype]
        xv = x if kind == 0 else x.view(torch.int16)
        launch(_fewbit_fwd_kernel, _grid(n, block), xv, y.view(torch.int16) if y is not None else xv,
               table.view(torch.int16) if table is not None else xv, packed, borders,
               labels, n, (n + 7) // 8, NB=borders.numel(), BITS=bits, KIND=kind,
               WITH_Y=y is not None, BLOCK=block, **UNFUSED)


def fewbit_backward(packed: torch.Tensor, levels: torch.Tensor, dy: torch.Tensor, out: torch.Tensor, bits: int,
                    block: int = BLOCK):
    """out = dy * levels[index] (levels float32, dy and out contiguous)."""
    n = dy.numel()
    if n:
        launch(_fewbit_bwd_kernel, _grid(n, block), packed, levels, dy, out, n, (n + 7) // 8, BITS=bits, BLOCK=block,
               **UNFUSED)


# -- 8-bit compression --------------------------------------------------------------------------


@triton.jit
def _e4m3_bits(v):
    """float32 -> float8 e4m3fn bits (uint32 0..255) as c10's fp8e4m3fn_from_fp32_value (torch 2.13:
    |v| >= 464 and inf saturate to 448; torch releases before it returned NaN there. Never reached
    by compression: |x / scale| <= 448 (1 + 2^-22), and a non-finite block makes v NaN)."""
    b = v.to(tl.uint32, bitcast=True)
    sign = b & 0x80000000
    a = b ^ sign
    sub = ((a.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) - (141 << 23)) & 0xFF
    odd = (a >> 20) & 1
    norm = ((a - (120 << 23) + 0x7FFFF + odd) >> 20) & 0xFF
    r = tl.where(a < (121 << 23), sub, tl.minimum(norm, 0x7E))  # a carry into 0x7F (NaN) saturates
    r = tl.where(a >= (1087 << 20), tl.where(a > 0x7F800000, 0x7F, 0x7E), r)  # NaN; >= 480 and inf saturate
    return r | (sign >> 24)


@triton.jit
def _e4m3_value(q):
    """float8 e4m3fn bits (uint32 0..255) -> float32 (exact)."""
    sign = (q & 0x80) << 24
    e = (q >> 3) & 0xF
    mant = q & 7
    normal = (sign | ((e + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
    sub = (sign | (mant.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, sub, normal)
    return tl.where((q & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scale_ptr, u_ptr, n, nblocks, block, qmax, INT8: tl.constexpr,
                     R: tl.constexpr, BP: tl.constexpr):
    """R whole blocks per program: scale = absmax / qmax (NaN if the block holds one), q of x * (1 / scale)."""
    rows = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    cols = tl.arange(0, BP)
    offs = rows[:, None] * block + cols[None, :]
    m = (cols[None, :] < block) & (offs < n)
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(amax, qmax)
    scale = tl.where(tl.max((x != x).to(tl.int32), axis=1) > 0, float("nan"), scale)
    inv = tl.where(scale > 0, tl.math.div_rn(tl.full((R,), 1.0, tl.float32), scale), 0.0)
    v = x * inv[:, None]
    if INT8:
        r = tl.floor(v + tl.load(u_ptr + offs, mask=m, other=0.0))
        q = tl.where(r != r, 0.0, tl.clamp(r, -127.0, 127.0)).to(tl.int8)  # NaN: 0, as torch's cast
    else:
        q = _e4m3_bits(v).to(tl.uint8)
    tl.store(q_ptr + offs, q, mask=m)
    tl.store(scale_ptr + rows, scale, mask=rows < nblocks)


@triton.jit
def _dequantize_kernel(q_ptr, scale_ptr, out_ptr, n, block, FP8: tl.constexpr, BLOCK: tl.constexpr):
    """out = value * scale[element // block] in float32, rounded once to out's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    q = tl.load(q_ptr + offs, mask=m, other=0)
    if FP8:
        v = _e4m3_value(q.to(tl.uint32))
    else:
        v = q.to(tl.float32)
    _store(out_ptr + offs, v * tl.load(scale_ptr + offs // block, mask=m, other=0.0), m)


def quantize(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, u, block: int, qmax: float):
    """q (int8, or fp8 e4m3fn written through a uint8 view) and float32 scales of contiguous 1-D x;
    ``u``: int8's uniforms (float32, one per element of the zero-padded blocks), None for fp8."""
    n = x.numel()
    if n:
        bp = next_power_of_2(block)
        r = max(1, _TILE // bp)
        fp8 = q.dtype == torch.float8_e4m3fn
        launch(_quantize_kernel, (cdiv(scales.numel(), r),),
            x, q.view(torch.uint8) if fp8 else q, scales, u if u is not None else scales, n, scales.numel(),
            block, qmax, INT8=not fp8, R=r, BP=bp, **UNFUSED)


def dequantize(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int, tile: int = BLOCK):
    """out (contiguous, its dtype) = q * its block's scale."""
    n = q.numel()
    if n:
        fp8 = q.dtype == torch.float8_e4m3fn
        launch(_dequantize_kernel, _grid(n, tile), q.view(torch.uint8) if fp8 else q, scales, out, n, block, FP8=fp8,
               BLOCK=tile, **UNFUSED)
