"""Kernel or PyTorch path for a chunk of the fused head (:mod:`.function`).

Same contract as :mod:`leanact.ops.triton.dispatch`: :func:`chunk_` runs :mod:`.kernels`' kernel and
returns True, or returns False and the caller runs its PyTorch path (CUDA plain tensors,
``LEANACT_TRITON`` on, float16/bfloat16/float32 logits with unit column stride). Its self-check
(``"cross_entropy"``, per logits dtype, soft-cap and smoothing) compares the kernel's statistics
and gradient with the PyTorch path's on small inputs: each no further from the float64 truth than
4x the PyTorch path's own error plus 2 ulp of its dtype (Triton's ``exp`` / ``log`` on CUDA are
approximations; torch's row-wise softmax sums in another order).
"""
from __future__ import annotations

import torch

from ..triton.dispatch import _DTYPES, _FAILED, _launch, _usable, forced, launchers, register_check

__all__ = ["chunk_"]


def _module(k):
    return launchers(k, "leanact.ops.cross_entropy.kernels", "chunk_")


def chunk_(z, y, coef, lse, zy, zsum, scale: float, softcap, eps: float, stats: bool, grad: bool) -> bool:
    """On a chunk of logits z (rows, V): the row statistics (``stats``: lse, target logit zy, sum
    zsum when ``eps``, float32) and/or the gradient of ``Σ coef_i·loss_i`` over z in place
    (``grad``), by one kernel; False when the kernel cannot run (nothing written)."""
    k = _module(_usable(z, y, lse))
    if (k is None or z.dtype not in _DTYPES or z.dim() != 2 or z.stride(-1) != 1 or z.stride(0) < z.shape[1]
            or lse.dtype != torch.float32):
        return False
    key = (z.dtype, softcap is not None, bool(eps))
    return _launch("cross_entropy", z, k.chunk_, z, y.reshape(-1), coef, lse, zy.reshape(-1),
                   zsum, scale, softcap, eps, stats, grad, check_key=key) is not _FAILED


def reference_(z, y, coef, scale, softcap, eps, dtype):
    """The PyTorch path's arithmetic for a chunk (float32 or float64 by ``dtype``):
    (lse, zy, zsum, gradient in z's dtype)."""
    x = z.to(dtype) * scale
    t = None
    if softcap is not None:
        t = torch.tanh(x / softcap)
        x = t * softcap
    lse = torch.logsumexp(x, 1)
    zy = x.gather(1, y[:, None]).squeeze(1)
    g = torch.softmax(x, 1)
    g.scatter_add_(1, y[:, None], torch.full_like(zy[:, None], -(1.0 - eps)))
    if eps:
        g = g - eps / x.shape[1]
    if t is not None:
        g = g * (1 - t * t)
    return lse, zy, x.sum(1), (g * (coef[:, None] * scale)).to(z.dtype)


def _check(device: torch.device, key) -> None:
    dtype, capped, smooth = key
    gen = torch.Generator(device=device).manual_seed(11)
    rows, v = 6, 5003  # two vocabulary blocks, a ragged tail
    z = (torch.randn(rows, v, generator=gen, device=device) * 3).to(dtype)
    y = torch.randint(0, v, (rows,), generator=gen, device=device)
    coef = torch.rand(rows, generator=gen, device=device)
    scale, softcap, eps = 0.7, (30.0 if capped else None), (0.1 if smooth else 0.0)
    truth = reference_(z.double(), y, coef.double(), scale, softcap, eps, torch.float64)
    ours = reference_(z, y, coef, scale, softcap, eps, torch.float32)
    lse, zy, zsum = (torch.empty(rows, device=device) for _ in range(3))
    g = z.clone()
    with forced("on"):
        if not chunk_(g, y, coef, lse, zy, zsum if smooth else None, scale, softcap, eps, True, True):
            raise AssertionError("the cross_entropy kernel did not run")
    names = ("log-sum-exp", "target logit", "logit sum", "gradient")
    for name, got, mine, true in zip(names, (lse, zy, zsum, g), ours, truth):
        if name == "logit sum" and not smooth:
            continue
        ulp = torch.finfo(mine.dtype).eps * true.abs().max().item()
        e_got = (got.double() - true.double()).abs().max().item()
        e_ref = (mine.double() - true.double()).abs().max().item()
        assert e_got <= 4 * e_ref + 2 * ulp, (f"cross_entropy {name}: error {e_got:.3g} against the PyTorch "
                                              f"path's {e_ref:.3g}")


register_check("cross_entropy", _check)
