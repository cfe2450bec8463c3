"""What a model's eager attention computes for query rows whose keys are *all* masked.

The additive mask of dtype-min values absorbs the scores, so the forward is the uniform average of
the values; autograd still differentiates softmax(S + min) = softmax(S) at that uniform point, so q
and k get gradients: dS_ij = (dO_i·v_j - dO_i·mean(v)) / n. SDPA (and leanact's core) give such rows
0; :class:`EagerMaskedRows` adds the eager rows on top of the core's output.

While compiling, the caller passes every row's flag (a device tensor, no host read): rows that are
not dead add exact zeros, and the backward runs as the custom op ``leanact::dead_rows_grads``, opaque
to the compiler, which skips the work when no row is dead (one read of the flags, inside the op).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..amp import no_autocast_backward

__all__ = ["EagerMaskedRows"]


class EagerMaskedRows(torch.autograd.Function):
    """Adds the eager result of fully masked rows. Keeps q, k, v (the core keeps them: same storages)
    and the (b, 1|H, s_q) bool row mask; the backward forms d x d products (VᵀK, dOᵀQ) instead of any
    s_q x s_k tensor but under a softcap, where it works in blocks of query rows. No dropout."""

    @staticmethod
    def forward(ctx, q, k, v, dead, scale, softcap=None):
        c = torch.float64 if q.dtype == torch.float64 else torch.float32
        b, h, s_q, d = q.shape
        g = h // k.size(1)
        vmean = v.to(c).mean(2).repeat_interleave(g, dim=1)  # (b, H, dv)
        w = dead.to(c).expand(b, h, s_q).unsqueeze(-1)
        ctx.save_for_backward(q, k, v, dead)
        ctx.scale, ctx.softcap = scale, softcap
        return (w * vmean.unsqueeze(2)).to(v.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @no_autocast_backward
    def backward(ctx, dout):
        q, k, v, dead = ctx.saved_tensors
        grads = _dead_rows_grads_op if torch.compiler.is_compiling() else dead_rows_grads
        dq, dk, dv = grads(q, k, v, dead, dout, ctx.scale, ctx.softcap)
        return dq, dk, dv, None, None, None


def dead_rows_grads(q, k, v, dead, dout, scale: float, softcap: Optional[float]):
    """dq, dk, dv of :class:`EagerMaskedRows` for the incoming ``dout`` (rows not dead get none)."""
    c = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, h, s_q, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = h // hkv
    kc, vc = k.to(c), v.to(c)
    w = dead.to(c).expand(b, h, s_q).unsqueeze(-1)
    do = (dout.to(c) * w).reshape(b, hkv, g * s_q, -1)  # head h = hkv * g + j: groups are contiguous
    qg = q.to(c).reshape(b, hkv, g * s_q, d)
    vmean = vc.mean(2, keepdim=True)  # (b, Hkv, 1, dv)
    m = (do * vmean).sum(-1, keepdim=True)  # dO_i · mean(v)
    f = scale / n
    if softcap is None:
        dq = f * (do @ (vc.transpose(-1, -2) @ kc) - m * kc.sum(2, keepdim=True))
        dk = f * (vc @ (do.transpose(-1, -2) @ qg) - (m * qg).sum(2, keepdim=True))
    else:
        dq, dk = _softcapped(qg, kc, vc, do, m, scale, softcap)
    dv = (do.sum(2, keepdim=True) / n).expand(b, hkv, n, -1)
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _softcapped(qg, kc, vc, do, m, scale, softcap, rows=256):
    """dq, dk under a logit softcap c: the uniform softmax's score gradient (dO_i·v_j - dO_i·mean(v)) / n
    times 1 - tanh²(scale q_i·k_j / c), in blocks of query rows (the factor depends on each (i, j): no
    d x d shortcut). Rows of ``do`` that are not dead are 0."""
    n = kc.size(2)
    dq = torch.zeros_like(qg)
    dk = torch.zeros_like(kc)
    for i0 in range(0, qg.size(2), rows):
        i1 = min(i0 + rows, qg.size(2))
        qb, dob = qg[:, :, i0:i1], do[:, :, i0:i1]
        t = torch.tanh((qb @ kc.transpose(-1, -2)) * (scale / softcap))
        ds = (dob @ vc.transpose(-1, -2) - m[:, :, i0:i1]).div_(n).mul_(1 - t * t)
        dq[:, :, i0:i1] = scale * (ds @ kc)
        dk += scale * (ds.transpose(-1, -2) @ qb)
    return dq, dk


@torch.library.custom_op("leanact::dead_rows_grads", mutates_args=())
def _dead_rows_grads_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dead: torch.Tensor, dout: torch.Tensor,
                        scale: float, softcap: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not bool(dead.any()):  # the usual case (no left padding): nothing to add
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    return tuple(t.contiguous() for t in dead_rows_grads(q, k, v, dead, dout, scale, softcap))


@_dead_rows_grads_op.register_fake
def _(q, k, v, dead, dout, scale, softcap):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
