"""Gated mixture-of-experts MLPs (Mixtral, Qwen2/3-MoE layout) keeping only the experts' gate/up
outputs.

Experts stored as 3-D parameters ``gate_up_proj`` (E, 2I, h) and ``down_proj`` (E, h, I); every
token t goes to the k experts ``top_k_index[t]`` with weights ``top_k_weights[t]``::

    out[t] = Σ_j  w[t, j] · down_e(act(g) · u),   [g | u] = x[t] · gate_up_eᵀ,  e = top_k_index[t, j]

Plain autograd (HF's per-expert loop or its grouped matmuls) keeps, per routed token, a gathered
copy of x (the dispatch buffer), [g | u], act(g), the product and the expert's output (for the
routing weight's gradient): 2h + 4I elements. This op keeps **[g | u]** for every routed token
(one buffer of S·2I, S = T·k routed pairs, in the compute dtype), plus tensors that are alive
anyway: x (the router's input, kept by the router), the routing indices (kept by ``topk``'s
backward) and the weights (T·k). In backward, per expert: the gathered x is re-read from x, the
product rebuilt from g and u, and with z = dy·W_down (one matmul)::

    d(product) = w · z,   dw = Σ_i product_i · z_i,   dW_down = (w·dy)ᵀ · product

so neither the dispatch buffer nor the expert outputs are kept. While compiling, the op is the
custom op ``leanact::gated_experts`` (and its backward ``leanact::gated_experts_backward``): the
routing's loop over experts is no graph break, and the compiled graph keeps what eager keeps.
Forward runs HF's eager loop (per expert in ascending order, rows in ``torch.where`` order,
outputs ``index_add_``-ed into zeros: bitwise HF's eager experts) or, with ``grouped=True``, the
arithmetic of HF's grouped-matmul experts (the default in transformers 5: weights' dtype, the k
outputs summed in fp32 when the routing weights are fp32). Gradients are the exact formulas (fp32: within
rounding of HF's; 16-bit: within 16-bit rounding). Under autocast the activations and weights are
cast as ``F.linear`` under autocast casts them; weight gradients come back in the weights' dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..amp import autocast_dtype, autocast_off, no_autocast_backward
from ..gated_mlp import act_grad, gated_act
from ..transforms import functorch_active

__all__ = ["GatedExpertsFunction", "gated_experts", "route"]


def route(top_k_index: torch.Tensor, num_experts: int) -> list[tuple[int, torch.Tensor, torch.Tensor, int, int]]:
    """[(expert, token rows, top-k positions, start, end)] in HF's eager order: experts ascending,
    within an expert ``torch.where(expert_mask[e])`` order (position-major, then token); an index
    equal to ``num_experts`` (expert parallelism's sentinel) is skipped, as HF does."""
    T, k = top_k_index.shape
    flat = top_k_index.reshape(-1).to(torch.int64)
    tok = torch.arange(T, device=flat.device).repeat_interleave(k)
    pos = torch.arange(k, device=flat.device).repeat(T)
    order = torch.argsort(flat * (k * T) + pos * T + tok)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts].tolist()  # one host sync
    out, start = [], 0
    for e, c in enumerate(counts):
        if c:
            rows = order[start:start + c]
            out.append((e, tok[rows], pos[rows], start, start + c))
        start += c
    return out


def _loop(x, top_k_index, top_k_weights, gate_up, down, kind, dt, grouped, gu_all=None):
    """HF's experts forward: eager (``grouped=False``: each expert's output cast to x's dtype and
    ``index_add_``-ed) or grouped (summed in the promoted dtype of outputs and weights, cast once)."""
    res = torch.promote_types(dt, top_k_weights.dtype)
    final = torch.zeros(x.shape, dtype=res if grouped else x.dtype, device=x.device)
    for e, tok, pos, a, b in route(top_k_index, gate_up.shape[0]):
        xe, wgu = x[tok].to(dt), gate_up[e].to(dt)
        gu = F.linear(xe, wgu) if gu_all is None else torch.mm(xe, wgu.t(), out=gu_all[a:b])
        g, u = gu.chunk(2, dim=-1)
        y = F.linear(gated_act(kind, g) * u, down[e].to(dt)) * top_k_weights[tok, pos, None]
        final.index_add_(0, tok, y.to(final.dtype))
    return final.to(x.dtype)


def experts_forward(x, top_k_index, top_k_weights, gate_up, down, kind, dt, grouped):
    """(the experts' weighted sum, [g | u] of every routed token): what forward returns and keeps."""
    gu_all = x.new_empty((top_k_index.numel(), gate_up.shape[1]), dtype=dt)
    with autocast_off(x.device.type):
        final = _loop(x, top_k_index, top_k_weights, gate_up, down, kind, dt, grouped, gu_all)
    return final, gu_all


def experts_backward(dfinal, x, top_k_index, top_k_weights, gu_all, gate_up, down, kind, needs):
    """(dx, dw, dgate_up, ddown) from what forward kept, None where ``needs`` (four flags) says no."""
    need_x, need_w, need_gu, need_down = needs
    dt = gu_all.dtype
    res = torch.promote_types(dt, top_k_weights.dtype)  # HF: (expert output * weight) in this dtype
    dx = torch.zeros_like(x) if need_x else None
    dw = torch.zeros_like(top_k_weights) if need_w else None
    dgate_up = torch.zeros_like(gate_up) if need_gu else None
    ddown = torch.zeros_like(down) if need_down else None
    for e, tok, pos, a, b in route(top_k_index, gate_up.shape[0]):
        g, u = gu_all[a:b].chunk(2, dim=-1)
        act = gated_act(kind, g)
        prod = act * u
        w = top_k_weights[tok, pos, None]
        dy = dfinal[tok].to(res)
        z = dy.to(dt).mm(down[e].to(dt))  # dy · W_down: serves d(product) and dw
        if need_w:
            dw[tok, pos] = (prod.to(res) * z.to(res)).sum(-1).to(dw.dtype)
        if need_down:
            ddown[e] = (dy * w).to(dt).t().mm(prod).to(down.dtype)
        if need_x or need_gu:
            dprod = (z.to(res) * w).to(dt)
            dgu = torch.cat([act_grad(kind, dprod * u, g), dprod * act], dim=-1)
            if need_gu:
                dgate_up[e] = dgu.t().mm(x[tok].to(dt)).to(gate_up.dtype)
            if need_x:
                dx.index_add_(0, tok, dgu.mm(gate_up[e].to(dt)).to(dx.dtype))
    return dx, dw, dgate_up, ddown


class GatedExpertsFunction(torch.autograd.Function):
    """See the module doc. Inputs: x (T, h), top_k_index (T, k), top_k_weights (T, k),
    gate_up_proj (E, 2I, h), down_proj (E, h, I), the activation, the compute dtype, grouped."""

    @staticmethod
    def forward(ctx, x, top_k_index, top_k_weights, gate_up, down, kind, dt, grouped):
        final, gu_all = experts_forward(x, top_k_index, top_k_weights, gate_up, down, kind, dt, grouped)
        ctx.kind = kind
        ctx.save_for_backward(x, top_k_index, top_k_weights, gu_all, gate_up, down)
        return final

    @staticmethod
    @no_autocast_backward
    def backward(ctx, dfinal):
        x, top_k_index, top_k_weights, gu_all, gate_up, down = ctx.saved_tensors
        need_x, _, need_w, need_gu, need_down = ctx.needs_input_grad[:5]
        dx, dw, dgate_up, ddown = experts_backward(dfinal, x, top_k_index, top_k_weights, gu_all, gate_up, down,
                                                   ctx.kind, (need_x, need_w, need_gu, need_down))
        return dx, None, dw, dgate_up, ddown, None, None, None


def gated_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, kind: str = "silu", grouped: bool = False) -> torch.Tensor:
    """The experts' weighted sum (module doc); with autograd keeps only [g | u] per routed token.

    ``grouped``: follow HF's grouped-matmul experts (computed in the weights' dtype, summed over
    the k experts in the promoted dtype) instead of its eager loop (autocast's casts, each expert's
    output cast to x's dtype and accumulated). Under ``torch.func`` transforms the plain torch ops run;
    while compiling, the custom op ``leanact::gated_experts``."""
    if grouped:
        dt = gate_up.dtype
    else:
        dt = autocast_dtype(x.device.type) or x.dtype
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (x, top_k_weights, gate_up, down))
    if torch.compiler.is_compiling():  # one opaque node: the graph keeps what eager keeps
        return gated_experts_op(x, top_k_index, top_k_weights, gate_up, down, kind, dt, grouped)
    if not grads or functorch_active():
        with autocast_off(x.device.type):
            return _loop(x, top_k_index, top_k_weights, gate_up, down, kind, dt, grouped)
    return GatedExpertsFunction.apply(x, top_k_index, top_k_weights, gate_up, down, kind, dt, grouped)


# ---- the custom ops, for torch.compile ------------------------------------------------------------
@torch.library.custom_op("leanact::gated_experts", mutates_args=())
def _op(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: torch.Tensor,
             down: torch.Tensor, kind: str, dt: torch.dtype, grouped: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return experts_forward(x, top_k_index, top_k_weights, gate_up, down, kind, dt, grouped)


@_op.register_fake
def _(x, top_k_index, top_k_weights, gate_up, down, kind, dt, grouped):
    return x.new_empty(x.shape), x.new_empty((top_k_index.numel(), gate_up.shape[1]), dtype=dt)


@torch.library.custom_op("leanact::gated_experts_backward", mutates_args=())
def _op_backward(dfinal: torch.Tensor, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
              gu_all: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, kind: str,
              needs: list[bool]) -> list[torch.Tensor]:
    with autocast_off(x.device.type):  # backward is often called inside the autocast block
        grads = experts_backward(dfinal, x, top_k_index, top_k_weights, gu_all, gate_up, down, kind, tuple(needs))
    return [x.new_empty(0) if g is None else g.contiguous() for g in grads]  # an empty tensor: no gradient


@_op_backward.register_fake
def _(dfinal, x, top_k_index, top_k_weights, gu_all, gate_up, down, kind, needs):
    return [t.new_empty(t.shape) if n else x.new_empty(0) for t, n in zip((x, top_k_weights, gate_up, down), needs)]


def _op_setup_context(ctx, inputs, output):
    x, top_k_index, top_k_weights, gate_up, down, kind, dt, grouped = inputs
    ctx.save_for_backward(x, top_k_index, top_k_weights, output[1], gate_up, down)
    ctx.kind = kind


def _op_grad(ctx, dfinal, _dgu):
    x, top_k_index, top_k_weights, gu_all, gate_up, down = ctx.saved_tensors
    needs = [ctx.needs_input_grad[i] for i in (0, 2, 3, 4)]
    dx, dw, dgu, ddown = _op_backward(dfinal, x, top_k_index, top_k_weights, gu_all, gate_up, down, ctx.kind, needs)
    keep = iter(needs)
    dx, dw, dgu, ddown = (g if next(keep) else None for g in (dx, dw, dgu, ddown))
    return dx, None, dw, dgu, ddown, None, None, None


_op.register_autograd(_op_grad, setup_context=_op_setup_context)


def gated_experts_op(x, top_k_index, top_k_weights, gate_up, down, kind: str, dt: torch.dtype,
                     grouped: bool) -> torch.Tensor:
    """:class:`~leanact.ops.moe.gated.GatedExpertsFunction` ``.apply`` with the same arguments and result,
    through the custom op."""
    return _op(x, top_k_index, top_k_weights, gate_up, down, kind, dt, bool(grouped))[0]
