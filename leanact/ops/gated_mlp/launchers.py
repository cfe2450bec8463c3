"""Kernel or PyTorch path for the lean gated MLP's ``act(g) * u`` (:mod:`.function`).

Same contract as :mod:`leanact.ops.triton.dispatch` (whose checks these functions reuse): each
returns what the PyTorch path would compute, from one kernel of :mod:`.kernels`, or ``None`` (the caller then
runs its PyTorch path): CUDA plain tensors, ``LEANACT_TRITON`` on, float16/bfloat16/float32 with
g, u (and dh) of one dtype. g and u are read in place when each is a (rows, n) view with unit
column stride -- the two halves of a fused gate_up projection are -- and copied otherwise.
"""
from __future__ import annotations

import torch

from ..triton.dispatch import _DTYPES, _FAILED, _launch, _usable, launchers

__all__ = ["glu_forward", "glu_backward"]

_KINDS = ("silu", "gelu", "gelu_tanh")
_MAX_COLS = 65535 * 1024  # the column blocks go on the grid's second axis (at most 65535)


def _gated(k):
    """The launchers standing for ``k``: :mod:`.kernels` for the kernels module (see
    :func:`leanact.ops.triton.dispatch.launchers`)."""
    return launchers(k, "leanact.ops.gated_mlp.kernels", "glu_forward")


def _ok(kind: str, g: torch.Tensor, *ts) -> bool:
    return (kind in _KINDS and g.dim() >= 1 and g.dtype in _DTYPES and all(t.dtype == g.dtype and t.shape == g.shape
                                                                         for t in ts)
            and g.shape[-1] <= _MAX_COLS)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as (rows, n) with unit column stride: a view where the layout allows, else a copy."""
    n = t.shape[-1]
    if t.stride(-1) == 1 or n == 1:
        try:
            return t.view(-1, n)
        except RuntimeError:  # leading dims that do not merge
            pass
    return t.contiguous().view(-1, n)


def _empty(t: torch.Tensor, need: bool = True):
    return torch.empty_like(t, memory_format=torch.contiguous_format) if need else None


def glu_forward(g: torch.Tensor, u: torch.Tensor, kind: str):
    """``gated_act(kind, g) * u`` (contiguous, g's shape and dtype), or None."""
    k = _gated(_usable(g, u))
    if k is None or not _ok(kind, g, u):
        return None
    h = _empty(g)
    if h.numel() and _launch("gated_mlp", g, k.glu_forward, _rows(g), _rows(u), h.view(-1, g.shape[-1]),
                             kind, check_key=(g.dtype, kind)) is _FAILED:
        return None
    return h


def glu_backward(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor, kind: str, need_dg: bool, need_du: bool,
                 need_h: bool):
    """``(dg, du, h)`` of ``h = act(g) * u`` from dh (each None where not needed), or None."""
    k = _gated(_usable(g, u, dh))
    if k is None or not _ok(kind, g, u, dh):
        return None
    dg, du, h = _empty(g, need_dg), _empty(g, need_du), _empty(g, need_h)
    n = g.shape[-1]
    if g.numel() and _launch("gated_mlp", g, k.glu_backward, _rows(g), _rows(u), dh.contiguous().view(-1, n),
                             *(None if t is None else t.view(-1, n) for t in (dg, du, h)), kind,
                             check_key=(g.dtype, kind)) is _FAILED:
        return None
    return dg, du, h
