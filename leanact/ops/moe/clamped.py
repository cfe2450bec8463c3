"""GPT-OSS's mixture-of-experts MLP (biases, interleaved gate/up, clamped gating) keeping only each
routed token's gate/up outputs.

Experts stored transposed: ``gate_up_proj`` (E, h, 2I) with bias (E, 2I), ``down_proj`` (E, I, h)
with bias (E, h); gate and up interleaved (gate = columns 0, 2, ..., up = 1, 3, ...). Every token t
goes to the k experts ``top_k_index[t]`` with weights ``top_k_weights[t]``::

    gu = x[t]·W_gu[e] + b_gu[e],   g = min(gate(gu), L),   u = clamp(up(gu), -L, L)
    out[t] = Σ_j  w[t, j] · ((u + 1) · g·σ(α·g) · W_d[e] + b_d[e]),   e = top_k_index[t, j]

Plain autograd keeps, per routed token, a gathered copy of x, gu, the clamped g and u, σ(α·g),
g·σ(α·g), (u + 1) and the product and the expert's output. This op keeps **gu** (pre-clamp, 2I
values per routed token in the compute dtype), plus tensors alive anyway: x, the routing indices
and weights. In backward, per expert, the clamps, σ, glu and the product are rebuilt from gu, and
with z = dy·W_dᵀ (one matmul)::

    d(product) = w · z,   dw = Σ product·z + Σ dy·b_d,   dW_d = productᵀ · (w·dy),   db_d = Σ w·dy

and a clamp passes the gradient where its input lies within the bounds, bounds included (as
torch's ``clamp`` backward), and gives zero elsewhere. The gating's elementwise backward runs in
fp32 for 16-bit compute dtypes. Forward runs HF's eager loop (per expert, ascending; matmul then
bias; each weighted output cast to x's dtype and ``index_add_``-ed: bitwise HF's eager experts) or,
with ``grouped=True``, the arithmetic of HF's grouped-matmul experts (weights' dtype, the k weighted
outputs summed per token in the promoted dtype of outputs and routing weights). Autocast is off
inside (everything in the parameters' dtype): the patched module runs HF's own forward under it.
While compiling, the op is the custom op ``leanact::clamped_experts`` (and its backward): no graph
break, and the compiled graph keeps what eager keeps.
"""
from __future__ import annotations

import torch

from ..amp import autocast_off, no_autocast_backward
from ..transforms import functorch_active
from .gated import route

__all__ = ["ClampedExpertsFunction", "clamped_experts"]


def _gate(gu, alpha, limit):
    """HF GPT-OSS ``_apply_gate``: (up + 1) · g·σ(α·g), g and up clamped, in gu's dtype."""
    gate, up = gu[..., ::2].clamp(max=limit), gu[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _groups(top_k_index: torch.Tensor, num_experts: int, grouped: bool):
    """[(expert, token rows, top-k positions, start, end)]: HF's eager order
    (:func:`leanact.ops.moe.route`) or its grouped one (``torch.sort`` of the flattened indices, as
    HF sorts them); rows start:end of the (S, 2I) gate/up buffer are that expert's. Backward sorts
    the same indices again (a sort's result is a function of its input: no permutation kept)."""
    if not grouped:
        return route(top_k_index, num_experts)
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    perm = torch.sort(flat)[1]
    counts = torch.bincount(flat.to(torch.int64), minlength=num_experts + 1)[:num_experts].tolist()
    out, start = [], 0
    for e, c in enumerate(counts):
        if c:
            rows = perm[start:start + c]
            out.append((e, rows // k, rows % k, start, start + c))
        start += c
    return out


def _loop(x, top_k_index, top_k_weights, params, alpha, limit, grouped, gu_all=None):
    """The experts' weighted sum; with ``gu_all`` (S, 2I) each routed token's gu is written there,
    in :func:`_groups`' row order. Grouped: the gating runs once over all routed tokens, as HF's
    (a CPU's vectorised σ rounds by position in the tensor)."""
    gate_up, gu_bias, down, down_bias = params
    dt = gate_up.dtype
    T, k = top_k_index.shape
    if gu_all is None:
        gu_all = x.new_empty((T * k, gate_up.shape[2]), dtype=dt)
    groups = _groups(top_k_index, gate_up.shape[0], grouped)
    for e, tok, pos, a, b in groups:
        torch.mm(x[tok].to(dt), gate_up[e], out=gu_all[a:b]).add_(gu_bias[e])
    if not grouped:
        final = torch.zeros_like(x)
        for e, tok, pos, a, b in groups:
            out = _gate(gu_all[a:b], alpha, limit) @ down[e] + down_bias[e]
            final.index_add_(0, tok, (out * top_k_weights[tok, pos, None]).to(x.dtype))
        return final
    hh = _gate(gu_all, alpha, limit)
    weighted = torch.zeros((T * k, x.shape[1]), dtype=torch.promote_types(dt, top_k_weights.dtype), device=x.device)
    for e, tok, pos, a, b in groups:  # weighted outputs in (token, position) order, summed over positions
        weighted[tok * k + pos] = (hh[a:b] @ down[e] + down_bias[e]) * top_k_weights[tok, pos, None]
    return weighted.view(T, k, -1).sum(dim=1).to(x.dtype)


def clamped_forward(x, top_k_index, top_k_weights, params, alpha, limit, grouped):
    """(the experts' weighted sum, gu of every routed token): what forward returns and keeps."""
    gu_all = x.new_empty((top_k_index.numel(), params[0].shape[2]), dtype=params[0].dtype)
    with autocast_off(x.device.type):
        final = _loop(x, top_k_index, top_k_weights, params, alpha, limit, grouped, gu_all)
    return final, gu_all


def clamped_backward(dfinal, x, top_k_index, top_k_weights, gu_all, gate_up, down, down_bias, alpha, limit, grouped,
                     needs):
    """(dx, dw, dgate_up, dgate_up_bias, ddown, ddown_bias) from what forward kept, None where ``needs``
    (six flags) says no."""
    need_x, need_w, need_gu, need_gub, need_down, need_db = needs
    dt = gu_all.dtype
    res = torch.promote_types(dt, top_k_weights.dtype)  # HF: (expert output * weight) in this dtype
    ew = torch.promote_types(dt, torch.float32)  # the gating's elementwise backward
    dx = torch.zeros_like(x) if need_x else None
    dw = torch.zeros_like(top_k_weights) if need_w else None
    dgate_up = torch.zeros_like(gate_up) if need_gu else None
    dgu_bias = gate_up.new_zeros(gate_up.shape[0], gate_up.shape[2]) if need_gub else None
    ddown = torch.zeros_like(down) if need_down else None
    ddown_bias = torch.zeros_like(down_bias) if need_db else None
    for e, tok, pos, a, b in _groups(top_k_index, gate_up.shape[0], grouped):
        gu = gu_all[a:b]
        w = top_k_weights[tok, pos, None]
        dy = dfinal[tok].to(res)
        dout = (dy * w).to(dt)  # gradient of the expert's output (bias included)
        if need_down or need_w:
            prod = _gate(gu, alpha, limit)
        if need_down:
            ddown[e] = prod.t().mm(dout)
        if need_db:
            ddown_bias[e] = dout.sum(0)
        if not (need_w or need_x or need_gu or need_gub):
            continue
        z = dy.to(dt).mm(down[e].t())  # dy · W_dᵀ: serves d(product) and dw
        if need_w:
            dw[tok, pos] = ((prod.to(res) * z.to(res)).sum(-1)
                            + (dy * down_bias[e].to(res)).sum(-1)).to(dw.dtype)
        if not (need_x or need_gu or need_gub):
            continue
        dprod = (z.to(res) * w).to(dt).to(ew)
        g, u = gu[:, ::2].to(ew), gu[:, 1::2].to(ew)
        gc, uc = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        s = torch.sigmoid(gc * alpha)
        dglu = dprod * (uc + 1)
        dgu = torch.stack([torch.where(g <= limit, dglu * s * (1 + gc * alpha * (1 - s)), 0.0),
                           torch.where((u >= -limit) & (u <= limit), dprod * (gc * s), 0.0)], dim=-1)
        dgu = dgu.reshape(gu.shape).to(dt)
        if need_gub:
            dgu_bias[e] = dgu.sum(0)
        if need_gu:
            dgate_up[e] = x[tok].to(dt).t().mm(dgu)
        if need_x:
            dx.index_add_(0, tok, dgu.mm(gate_up[e].t()).to(dx.dtype))
    return dx, dw, dgate_up, dgu_bias, ddown, ddown_bias


class ClampedExpertsFunction(torch.autograd.Function):
    """See the module doc. Inputs: x (T, h), top_k_index (T, k), top_k_weights (T, k), gate_up_proj
    (E, h, 2I), its bias (E, 2I), down_proj (E, I, h), its bias (E, h), α, the limit, grouped."""

    @staticmethod
    def forward(ctx, x, top_k_index, top_k_weights, gate_up, gu_bias, down, down_bias, alpha, limit, grouped):
        final, gu_all = clamped_forward(x, top_k_index, top_k_weights, (gate_up, gu_bias, down, down_bias), alpha,
                                        limit, grouped)
        ctx.alpha, ctx.limit, ctx.grouped = alpha, limit, grouped
        ctx.save_for_backward(x, top_k_index, top_k_weights, gu_all, gate_up, down, down_bias)
        return final

    @staticmethod
    @no_autocast_backward
    def backward(ctx, dfinal):
        x, top_k_index, top_k_weights, gu_all, gate_up, down, down_bias = ctx.saved_tensors
        need_x, _, need_w, need_gu, need_gub, need_down, need_db = ctx.needs_input_grad[:7]
        grads = clamped_backward(dfinal, x, top_k_index, top_k_weights, gu_all, gate_up, down, down_bias, ctx.alpha,
                                 ctx.limit, ctx.grouped, (need_x, need_w, need_gu, need_gub, need_down, need_db))
        dx, dw, dgate_up, dgu_bias, ddown, ddown_bias = grads
        return dx, None, dw, dgate_up, dgu_bias, ddown, ddown_bias, None, None, None


def clamped_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: torch.Tensor,
                    gate_up_bias: torch.Tensor, down: torch.Tensor, down_bias: torch.Tensor, alpha: float,
                    limit: float, grouped: bool = False) -> torch.Tensor:
    """GPT-OSS's experts' weighted sum (module doc); with autograd keeps only gu per routed token.

    ``grouped``: follow HF's grouped-matmul experts (sum over the k experts per token in the
    promoted dtype) instead of its eager loop (each expert's output cast to x's dtype and
    accumulated). The four parameters share one dtype; in the eager loop x has it too. Under
    ``torch.func`` transforms the plain torch ops run; while compiling, the custom op
    ``leanact::clamped_experts``."""
    params = (gate_up, gate_up_bias, down, down_bias)
    if len({p.dtype for p in params}) != 1 or (not grouped and x.dtype != gate_up.dtype):
        raise TypeError(f"clamped_experts: x {x.dtype}, parameters {[p.dtype for p in params]}: the parameters "
                        "need one dtype (and x the same in the eager loop)")
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (x, top_k_weights, *params))
    if torch.compiler.is_compiling():  # one opaque node: the graph keeps what eager keeps
        return clamped_experts_op(x, top_k_index, top_k_weights, *params, alpha, limit, grouped)
    if not grads or functorch_active():
        with autocast_off(x.device.type):
            return _loop(x, top_k_index, top_k_weights, params, alpha, limit, grouped)
    return ClampedExpertsFunction.apply(x, top_k_index, top_k_weights, *params, alpha, limit, grouped)


# ---- the custom ops, for torch.compile ------------------------------------------------------------
@torch.library.custom_op("leanact::clamped_experts", mutates_args=())
def _clamped_op(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: torch.Tensor,
                     gate_up_bias: torch.Tensor, down: torch.Tensor, down_bias: torch.Tensor, alpha: float,
                     limit: float, grouped: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return clamped_forward(x, top_k_index, top_k_weights, (gate_up, gate_up_bias, down, down_bias), alpha, limit,
                           grouped)


@_clamped_op.register_fake
def _(x, top_k_index, top_k_weights, gate_up, gate_up_bias, down, down_bias, alpha, limit, grouped):
    return x.new_empty(x.shape), x.new_empty((top_k_index.numel(), gate_up.shape[2]), dtype=gate_up.dtype)


@torch.library.custom_op("leanact::clamped_experts_backward", mutates_args=())
def _clamped_op_backward(dfinal: torch.Tensor, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      gu_all: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, down_bias: torch.Tensor,
                      alpha: float, limit: float, grouped: bool, needs: list[bool]) -> list[torch.Tensor]:
    with autocast_off(x.device.type):
        grads = clamped_backward(dfinal, x, top_k_index, top_k_weights, gu_all, gate_up, down, down_bias, alpha,
                                 limit, grouped, tuple(needs))
    return [x.new_empty(0) if g is None else g.contiguous() for g in grads]


@_clamped_op_backward.register_fake
def _(dfinal, x, top_k_index, top_k_weights, gu_all, gate_up, down, down_bias, alpha, limit, grouped, needs):
    shapes = (x.shape, top_k_weights.shape, gate_up.shape, (gate_up.shape[0], gate_up.shape[2]), down.shape,
              down_bias.shape)
    dtypes = (x.dtype, top_k_weights.dtype, gate_up.dtype, gate_up.dtype, down.dtype, down_bias.dtype)
    return [x.new_empty(s, dtype=d) if n else x.new_empty(0) for s, d, n in zip(shapes, dtypes, needs)]


def _clamped_setup_context(ctx, inputs, output):
    x, top_k_index, top_k_weights, gate_up, gate_up_bias, down, down_bias, alpha, limit, grouped = inputs
    ctx.save_for_backward(x, top_k_index, top_k_weights, output[1], gate_up, down, down_bias)
    ctx.args = (alpha, limit, grouped)


def _clamped_grad(ctx, dfinal, _dgu):
    x, top_k_index, top_k_weights, gu_all, gate_up, down, down_bias = ctx.saved_tensors
    needs = [ctx.needs_input_grad[i] for i in (0, 2, 3, 4, 5, 6)]
    grads = _clamped_op_backward(dfinal, x, top_k_index, top_k_weights, gu_all, gate_up, down, down_bias, *ctx.args,
                              needs)
    dx, dw, dgu, dgub, ddown, ddb = (g if n else None for g, n in zip(grads, needs))
    return dx, None, dw, dgu, dgub, ddown, ddb, None, None, None


_clamped_op.register_autograd(_clamped_grad, setup_context=_clamped_setup_context)


def clamped_experts_op(x, top_k_index, top_k_weights, gate_up, gate_up_bias, down, down_bias, alpha: float,
                       limit: float, grouped: bool) -> torch.Tensor:
    """:class:`~leanact.ops.moe.clamped.ClampedExpertsFunction` ``.apply`` with the same arguments and
    result, through the custom op."""
    return _clamped_op(x, top_k_index, top_k_weights, gate_up, gate_up_bias, down, down_bias, float(alpha),
                            float(limit), bool(grouped))[0]
