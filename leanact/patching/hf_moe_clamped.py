"""Hugging Face GPT-OSS experts (``GptOssExperts``: biases, interleaved gate/up, clamped gating) ->
a subclass whose backward keeps only each routed token's gate/up outputs
(:func:`leanact.ops.moe.clamped.clamped_experts`): no dispatch buffer, no clamped or activated
copies, no product, no expert outputs.

Follows the arithmetic of the configured ``config._experts_implementation`` (``"eager"``: HF's loop
over experts; ``"grouped_mm"``: tokens sorted by expert, the k outputs summed per token). Any other
implementation, expert parallelism, autocast, no autograd, ``torch.func`` transforms, parameters of
mixed dtypes or a gate replaced since patching run HF's own forward. While compiling, the experts run
as the custom op ``leanact::clamped_experts`` (:mod:`leanact.ops.moe.custom_op`).

Recognised from structure and code, whatever the class name: a module of ``transformers.models.*``
with exactly the Parameters ``gate_up_proj`` (E, h, 2I), ``gate_up_proj_bias`` (E, 2I),
``down_proj`` (E, I, h), ``down_proj_bias`` (E, h), no children, numbers ``alpha`` and ``limit``,
HF's flags for that layout (gated, interleaved, transposed, with bias, no post-expert norm), HF's
GPT-OSS loop as its forward and HF's GPT-OSS clamped gating as its ``_apply_gate`` (checked once per
class).
"""
from __future__ import annotations

import numbers

import torch
from torch import nn

from ..ops.amp import autocast_dtype
from ..ops.moe import clamped_experts
from ..ops.transforms import functorch_active
from .hf_moe import IMPLEMENTATIONS, flags_reason, is_hf_experts
from .modules import hooks_reason, reclass
from .source import forward_body
from .adapter import ModuleAdapter

__all__ = ["is_hf_clamped_experts", "hf_clamped_experts_replacement", "ADAPTER"]

_PARAMS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_LOOP = (
    "next_states=torch.zeros_like({x},dtype={x}.dtype,device={x}.device);withtorch.no_grad():;"
    "expert_mask=torch.nn.functional.one_hot(;{i},num_classes=self.num_experts;);"
    "expert_mask=expert_mask.permute(2,1,0);expert_hit=torch.greater(expert_mask.sum(dim=(-1,-2)),0).nonzero();"
    "forexpert_idxinexpert_hit:;expert_idx=expert_idx[0];ifexpert_idx==self.num_experts:;continue;"
    "top_k_pos,token_idx=torch.where(expert_mask[expert_idx]);current_state={x}[token_idx];"
    "gate_up=current_state@self.gate_up_proj[expert_idx]+self.gate_up_proj_bias[expert_idx];"
    "gated_output=self._apply_gate(gate_up);"
    "out=gated_output@self.down_proj[expert_idx]+self.down_proj_bias[expert_idx];"
    "weighted_output=out*{w}[token_idx,top_k_pos,None];"
    "next_states.index_add_(0,token_idx,weighted_output.to({x}.dtype));returnnext_states")
_GATE = ("gate,up={g}[...,::2],{g}[...,1::2];gate=gate.clamp(min=None,max=self.limit);"
         "up=up.clamp(min=-self.limit,max=self.limit);glu=gate*torch.sigmoid(gate*self.alpha);"
         "gated_output=(up+1)*glu;returngated_output")
_FLAGS = {"has_gate": True, "has_bias": True, "is_transposed": True, "is_concatenated": False,
          "has_post_expert_norm": False, "_is_expert_parallel": False}
_checked: dict[type, str | None] = {}


def is_hf_clamped_experts(m: nn.Module) -> bool:
    """A transformers experts module with biases (``gate_up_proj_bias``): GPT-OSS's layout."""
    return type(m).__module__.startswith("transformers.models.") and "gate_up_proj_bias" in m._parameters


def _code_reason(t: type) -> str | None:
    if t not in _checked:
        body, gate = forward_body(t.forward), forward_body(getattr(t, "_apply_gate", None))
        ok = (body is not None and len(body[0]) == 3
              and body[1] == _LOOP.format(x=body[0][0], i=body[0][1], w=body[0][2]))
        _checked[t] = (None if ok else "experts' forward is not HF's GPT-OSS loop over biased experts")
        if ok and not (gate is not None and len(gate[0]) == 1 and gate[1] == _GATE.format(g=gate[0][0])):
            _checked[t] = "experts' _apply_gate is not HF's GPT-OSS clamped gating"
    return _checked[t]


def _state_reason(m: nn.Module) -> str | None:
    """What may change after patching: flags, implementation, α and the limit, the gate."""
    if (reason := flags_reason(m, _FLAGS)) is not None:
        return reason
    for k in ("alpha", "limit"):
        v = getattr(m, k, None)
        if not isinstance(v, numbers.Real) or isinstance(v, bool):
            return f"experts' {k} is {v!r}, not a number"
    if "_apply_gate" in m.__dict__:
        return "experts with an _apply_gate set on the instance"
    return None


class _LeanHFClampedExperts:
    """Mixin placed before the HF class: with autograd, the experts through clamped_experts."""

    _leanact_lean = True

    def forward(self, hidden_states, router_indices=None, routing_weights=None):
        hf_forward = type(self).__mro__[2].forward  # the original HF class (Lean subclass -> HF class)
        params = [self._parameters.get(k) for k in _PARAMS]
        if (not torch.is_grad_enabled() or functorch_active()
                or autocast_dtype(hidden_states.device.type) is not None or _state_reason(self) is not None
                or hidden_states.dim() != 2 or any(p is None for p in params)
                or len({p.dtype for p in params}) != 1):
            return hf_forward(self, hidden_states, router_indices, routing_weights)
        grouped = IMPLEMENTATIONS[getattr(getattr(self, "config", None), "_experts_implementation", None)]
        if not grouped and hidden_states.dtype != params[0].dtype:
            return hf_forward(self, hidden_states, router_indices, routing_weights)
        return clamped_experts(hidden_states, router_indices, routing_weights, *params, float(self.alpha),
                               float(self.limit), grouped=grouped)


def hf_clamped_experts_replacement(m: nn.Module) -> tuple[nn.Module | None, str | None]:
    """(new module sharing m's Parameters, None) or (None, reason)."""
    t = type(m)
    if isinstance(m, _LeanHFClampedExperts):
        return None, None
    if (reason := hooks_reason(m)) is not None:
        return None, reason
    if set(m._parameters) != set(_PARAMS) or m._modules or m._buffers:
        return None, (f"{t.__name__}: parameters {sorted(m._parameters)}, children {sorted(m._modules)}; covered are "
                      f"biased experts with exactly {', '.join(_PARAMS)} (GPT-OSS)")
    gu, gub, down, db = (m._parameters[k] for k in _PARAMS)
    E, h, two_i = gu.shape if gu.dim() == 3 else (0, 0, 0)
    if (two_i % 2 or tuple(gub.shape) != (E, two_i) or tuple(down.shape) != (E, two_i // 2, h)
            or tuple(db.shape) != (E, h) or E == 0):
        return None, (f"{t.__name__}: gate_up_proj {tuple(gu.shape)}, its bias {tuple(gub.shape)}, down_proj "
                      f"{tuple(down.shape)}, its bias {tuple(db.shape)} not (E, h, 2I), (E, 2I), (E, I, h), (E, h)")
    reason = _state_reason(m) or _code_reason(t)
    if reason is not None:
        return None, reason
    return reclass(m, _LeanHFClampedExperts), None


ADAPTER = ModuleAdapter("hf_moe_clamped", lambda m: is_hf_experts(m) and is_hf_clamped_experts(m),
                        hf_clamped_experts_replacement, "MoE experts with biases and clamps (GPT-OSS)")
