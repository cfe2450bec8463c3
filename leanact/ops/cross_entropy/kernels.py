"""Triton kernel of the fused head's chunk (:mod:`.function`): one program
per row of a chunk of logits z (rows × V, the matmul's output in its own dtype).

Pass 1 (``STATS``): the row's log-sum-exp by an online max / sum over vocabulary blocks in float32,
its target logit and (label smoothing) its sum, written to three float32 vectors. Pass 2
(``GRAD``): the gradient of ``coef · loss_row`` with respect to the raw logits,
``(exp(z − lse) − (1−ε)·[v = y] − ε/V) · coef`` (chained through the logit scale and a soft-cap),
written in place over z in z's dtype: the values the unfused backward rounds before its matmuls.
z is read twice and written once; no float32 copy of the chunk exists. ``exp`` / ``log`` are
Triton's (on CUDA approximate, within a few float32 ulp): the results are compared with the
PyTorch path within a tolerance, never bitwise (:mod:`.cross_entropy`'s self-check).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton.launch import launch, next_power_of_2

__all__ = ["chunk_"]

_BLOCK = 4096


@triton.jit
def _capped(x, scale, softcap, SOFTCAP: tl.constexpr):
    """(z, tanh(z/c)) of a raw logit block in float32: scaled, then c·tanh(·/c) when soft-capped."""
    x = x * scale
    t = x
    if SOFTCAP:
        e = tl.exp(-2.0 * tl.abs(x / softcap))
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(x < 0, -t, t)
        x = softcap * t
    return x, t


@triton.jit
def _ce_chunk_kernel(z_ptr, z_stride, y_ptr, coef_ptr, lse_ptr, zy_ptr, zsum_ptr, V, scale, softcap, eps,
                     STATS: tl.constexpr, GRAD: tl.constexpr, SOFTCAP: tl.constexpr, EPS: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * z_stride
    y = tl.load(y_ptr + row).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if STATS:
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.zeros([], tl.float32)
        total = tl.zeros([], tl.float32)
        for off in range(0, V, BLOCK):
            c = off + cols
            valid = c < V
            x, t = _capped(tl.load(base + c, mask=valid, other=0.0).to(tl.float32), scale, softcap, SOFTCAP)
            if EPS:
                total += tl.sum(tl.where(valid, x, 0.0), 0)
            x = tl.where(valid, x, float("-inf"))
            new_m = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), 0)
            m = new_m
        lse = m + tl.log(s)
        zy, ty = _capped(tl.load(base + y).to(tl.float32), scale, softcap, SOFTCAP)
        tl.store(lse_ptr + row, lse)
        tl.store(zy_ptr + row, zy)
        if EPS:
            tl.store(zsum_ptr + row, total)
    else:
        lse = tl.load(lse_ptr + row)
    if GRAD:
        cf = tl.load(coef_ptr + row).to(tl.float32) * scale
        for off in range(0, V, BLOCK):
            c = off + cols
            valid = c < V
            x, t = _capped(tl.load(base + c, mask=valid, other=0.0).to(tl.float32), scale, softcap, SOFTCAP)
            g = tl.exp(x - lse) - tl.where(c == y, 1.0 - eps, 0.0)
            if EPS:
                g = g - eps / V
            if SOFTCAP:
                g = g * (1.0 - t * t)
            tl.store(base + c, (g * cf).to(z_ptr.dtype.element_ty), mask=valid)


def chunk_(z: torch.Tensor, y: torch.Tensor, coef: torch.Tensor | None, lse: torch.Tensor, zy: torch.Tensor,
           zsum: torch.Tensor | None, scale: float, softcap: float | None, eps: float, stats: bool, grad: bool,
           block: int | None = None) -> None:
    """Launch over the rows of ``z`` (rows, V) with unit column stride: writes ``lse``, ``zy`` (and
    ``zsum`` with ``eps``) when ``stats``, reads ``lse`` otherwise; overwrites z with its gradient
    when ``grad`` (``coef``: per-row factors). y: (rows,) or (rows, 1) clamped targets."""
    rows, v = z.shape
    if rows == 0:
        return
    b = block or min(_BLOCK, next_power_of_2(v))
    launch(_ce_chunk_kernel, (rows,), z, z.stride(0), y, coef if coef is not None else lse, lse, zy,
           zsum if zsum is not None else lse, v, float(scale),
           float(softcap) if softcap is not None else 1.0, float(eps), STATS=stats, GRAD=grad,
           SOFTCAP=softcap is not None, EPS=bool(eps), BLOCK=b,
           num_warps=8 if b >= 2048 else 4)  # one program streams a whole row (V logits)
