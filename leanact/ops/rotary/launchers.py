"""Kernel or PyTorch path for the rotary position embedding (:mod:`.function`).

Same contract as :mod:`leanact.ops.triton.dispatch`: :func:`rotary_forward` / :func:`rotary_backward`
return what the op's PyTorch path returns, from one kernel of :mod:`.kernels` (q and k in one launch,
bitwise: the same roundings), or ``None`` (the caller then runs its PyTorch path): CUDA plain tensors,
``LEANACT_TRITON`` on, float16/bfloat16/float32, (B, H, S, D) tensors and (B or 1, S, D) tables
with unit stride along an even D. The kernels launch under the name ``"rotary"`` (checked per
tensor dtype and promoted dtype), whose self-check :mod:`.function` registers.
"""
from __future__ import annotations

import torch

from ..triton.dispatch import _DTYPES, _FAILED, _launch, _usable, launchers

__all__ = ["rotary_forward", "rotary_backward", "pair_ok"]


def _module(k):
    return launchers(k, "leanact.ops.rotary.kernels", "rotary")


def usable(*tensors):
    """The rotary launchers when every tensor may run a kernel
    (:func:`leanact.ops.triton.dispatch._usable`), else None."""
    return _module(_usable(*tensors))


def tables_ok(cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """(B or 1, S, D) tables of one dtype, unit stride along D."""
    return (cos.dim() == 3 and sin.shape == cos.shape and cos.dtype in _DTYPES and sin.dtype == cos.dtype
            and cos.stride(-1) == 1 and sin.stride(-1) == 1)


def tensor_ok(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """``x`` (B, H, S, D), even D, unit stride along D, for tables that passed :func:`tables_ok`."""
    if x.dim() != 4 or x.dtype not in _DTYPES or x.stride(-1) != 1:
        return False
    b, _, s, d = x.shape
    cb, cs, cd = cos.shape
    return d % 2 == 0 and cs == s and cd == d and (cb == 1 or cb == b)


def pair_ok(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """q and k of one dtype, batch and positions (k may have fewer heads) that pass :func:`tensor_ok`,
    tables that pass :func:`tables_ok`, all four on one device: what one launch for both takes."""
    return (q.dtype == k.dtype and q.dim() == 4 and k.dim() == 4 and k.shape[0] == q.shape[0]
            and k.shape[2:] == q.shape[2:] and tables_ok(cos, sin) and tensor_ok(q, cos) and tensor_ok(k, cos)
            and q.get_device() == k.get_device() == cos.get_device() == sin.get_device())


def _shapes_ok(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return tables_ok(cos, sin) and tensor_ok(x, cos)


def forward_with(k, xs, cos: torch.Tensor, sin: torch.Tensor):
    """The rotations of the tensors ``xs`` (q, k: one dtype) in one launch, with the launchers ``k``
    and the shapes already checked (a tuple, each in its tensor's layout), or None."""
    x = xs[0]
    p = torch.promote_types(x.dtype, cos.dtype)
    outs = tuple(torch.empty_like(t, dtype=p) for t in xs)
    if _launch("rotary", x, k.rotary, tuple(zip(xs, outs)), cos, sin, False, p, x.dtype,
               check_key=(x.dtype, p)) is _FAILED:
        return None
    return outs


def backward_with(k, gs, cos: torch.Tensor, sin: torch.Tensor, x_dtype: torch.dtype):
    """The gradients of the inputs (``x_dtype``, each in its g's layout) from the gradients ``gs`` of
    the outputs :func:`forward_with` made (their shapes; autograd gives them the outputs' dtype, not
    their layout), in one launch: only the gs' layouts are checked. A tuple, or None."""
    p = torch.promote_types(x_dtype, cos.dtype)
    if any(g.dtype != p or g.stride(-1) != 1 for g in gs):
        return None
    dxs = tuple(torch.empty_like(g, dtype=x_dtype) for g in gs)
    if _launch("rotary", gs[0], k.rotary, tuple(zip(gs, dxs)), cos, sin, True, p, x_dtype,
               check_key=(x_dtype, p)) is _FAILED:
        return None
    return dxs


def rotary_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``x·cos + rotate_half(x)·sin`` in the promoted dtype (x's layout), or None."""
    k = usable(x, cos, sin)
    if k is None or not _shapes_ok(x, cos, sin):
        return None
    out = forward_with(k, (x,), cos, sin)
    return None if out is None else out[0]


def rotary_backward(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_dtype: torch.dtype):
    """The gradient of x (``x_dtype``, g's layout) from the output's gradient g, or None."""
    k = usable(g, cos, sin)
    if k is None or not _shapes_ok(g, cos, sin) or x_dtype not in _DTYPES:
        return None
    dx = backward_with(k, (g,), cos, sin, x_dtype)
    return None if dx is None else dx[0]
