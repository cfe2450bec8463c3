"""Hugging Face mixture-of-experts experts (``MixtralExperts``, ``Qwen2MoeExperts``,
``Qwen3MoeExperts``: fused 3-D ``gate_up_proj`` / ``down_proj`` parameters) -> a subclass whose
backward keeps only each routed token's gate/up outputs (:func:`leanact.ops.moe.gated_experts`):
no dispatch buffer, no activation or product, no expert outputs.

transformers 5 dispatches the experts' forward on ``config._experts_implementation``: ``"eager"``
(a loop over experts) or ``"grouped_mm"`` (the default: tokens sorted by expert, grouped matmuls
in the weights' dtype, the k outputs summed in the routing weights' dtype). The replacement
follows the arithmetic of whichever of the two is configured; any other implementation (a hub
kernel, ``batched_mm``), expert parallelism, no autograd, ``torch.func`` transforms, or an
activation changed or hooked since patching run HF's own forward. While compiling, the experts run
as the custom op ``leanact::gated_experts`` (:mod:`leanact.ops.moe.custom_op`).

Recognised from structure and code, whatever the class name: a module of ``transformers.models.*``
with exactly the Parameters ``gate_up_proj`` (E, 2I, h) and ``down_proj`` (E, h, I), one activation
child ``act_fn`` (SiLU or GELU with torch's kernel), HF's flags for that layout (gated,
concatenated, not transposed, no bias, no post-expert norm) and HF's eager loop as its forward
(checked once per class). The router and the shared expert of the block are handled elsewhere
(the router keeps its T×E probabilities, its true size; a shared expert is a gated MLP).
"""
from __future__ import annotations


import torch
from torch import nn

from ..ops.moe import gated_experts
from ..ops.transforms import functorch_active
from .hf_swiglu import activation_kind
from .modules import hooks_reason, reclass
from .source import forward_body
from .adapter import ModuleAdapter

__all__ = ["is_hf_experts", "hf_experts_replacement", "flags_reason", "IMPLEMENTATIONS", "ADAPTER"]

_EAGER_LOOP = (
    "final_hidden_states=torch.zeros_like({x});withtorch.no_grad():;"
    "expert_mask=torch.nn.functional.one_hot({i},num_classes=self.num_experts{sentinel});"
    "expert_mask=expert_mask.permute(2,1,0);expert_hit=torch.greater(expert_mask.sum(dim=(-1,-2)),0).nonzero();"
    "forexpert_idxinexpert_hit:;expert_idx=expert_idx[0];ifexpert_idx==self.num_experts:;continue;"
    "top_k_pos,token_idx=torch.where(expert_mask[expert_idx]);current_state={x}[token_idx];"
    "gate,up=nn.functional.linear(current_state,self.gate_up_proj[expert_idx]).chunk(2,dim=-1);"
    "current_hidden_states=self.act_fn(gate)*up;"
    "current_hidden_states=nn.functional.linear(current_hidden_states,self.down_proj[expert_idx]);"
    "current_hidden_states=current_hidden_states*{w}[token_idx,top_k_pos,None];"
    "final_hidden_states.index_add_(0,token_idx,current_hidden_states.to(final_hidden_states.dtype));"
    "returnfinal_hidden_states")
_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
          "has_post_expert_norm": False, "_is_expert_parallel": False}
IMPLEMENTATIONS = {None: False, "eager": False, "grouped_mm": True}  # -> grouped arithmetic
_checked: dict[type, str | None] = {}


def is_hf_experts(m: nn.Module) -> bool:
    """A transformers module holding experts as 3-D ``gate_up_proj`` / ``down_proj`` parameters."""
    p = m._parameters
    return (type(m).__module__.startswith("transformers.models.") and isinstance(p.get("gate_up_proj"), torch.Tensor)
            and isinstance(p.get("down_proj"), torch.Tensor) and p["gate_up_proj"].dim() == 3)


def _forward_reason(t: type) -> str | None:
    if t not in _checked:
        body = forward_body(t.forward)
        # transformers 5.17 one-hot encodes num_experts classes, 5.23 one more (expert parallelism's sentinel)
        ok = body is not None and len(body[0]) == 3 and any(body[1] == _EAGER_LOOP.format(
            x=body[0][0], i=body[0][1], w=body[0][2], sentinel=extra) for extra in ("", "+1"))
        _checked[t] = None if ok else "experts' forward is not HF's loop over gate_up_proj / down_proj experts"
        apply_gate = getattr(t, "_apply_gate", None)
        if ok and apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate":
            _checked[t] = "experts with their own _apply_gate"
    return _checked[t]


def flags_reason(m: nn.Module, flags: dict = _FLAGS) -> str | None:
    for k, v in flags.items():
        if getattr(m, k, v) != v:
            return f"experts with {k}={getattr(m, k)!r} (covered: {k}={v!r})"
    impl = getattr(getattr(m, "config", None), "_experts_implementation", None)
    if impl not in IMPLEMENTATIONS:
        return f"experts implementation {impl!r} (covered: eager, grouped_mm)"
    return None


class _LeanHFExperts:
    """Mixin placed before the HF class: with autograd, the experts through gated_experts."""

    _leanact_lean = True

    def forward(self, hidden_states, top_k_index, top_k_weights):
        hf_forward = type(self).__mro__[2].forward  # the original HF class (Lean subclass -> HF class)
        act_cls, kind = self._leanact_experts
        act = self._modules.get("act_fn")
        if (not torch.is_grad_enabled() or functorch_active()
                or type(act) is not act_cls or activation_kind(act)[1] is not None or flags_reason(self) is not None
                or hidden_states.dim() != 2):
            return hf_forward(self, hidden_states, top_k_index, top_k_weights)
        grouped = IMPLEMENTATIONS[getattr(getattr(self, "config", None), "_experts_implementation", None)]
        return gated_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, kind,
                             grouped=grouped)


def hf_experts_replacement(m: nn.Module) -> tuple[nn.Module | None, str | None]:
    """(new module sharing m's Parameters and activation, None) or (None, reason)."""
    t = type(m)
    if isinstance(m, _LeanHFExperts):
        return None, None
    if (reason := hooks_reason(m)) is not None:
        return None, reason
    if set(m._parameters) != {"gate_up_proj", "down_proj"} or set(m._modules) != {"act_fn"} or m._buffers:
        return None, (f"{t.__name__}: parameters {sorted(m._parameters)}, children {sorted(m._modules)}; covered are "
                      "experts with exactly gate_up_proj, down_proj and an act_fn (no biases, HF's default gating)")
    gu, down = m.gate_up_proj, m.down_proj
    if (down.dim() != 3 or gu.shape[0] != down.shape[0] or gu.shape[1] != 2 * down.shape[2]
            or gu.shape[2] != down.shape[1]):
        return None, (f"{t.__name__}: gate_up_proj {tuple(gu.shape)} / down_proj {tuple(down.shape)} "
                      "not (E, 2I, h) / (E, h, I)")
    kind, reason = activation_kind(m._modules["act_fn"])
    reason = reason or flags_reason(m) or _forward_reason(t)
    if reason is not None:
        return None, reason
    return reclass(m, _LeanHFExperts, _leanact_experts=(type(m._modules["act_fn"]), kind)), None


ADAPTER = ModuleAdapter("hf_moe", is_hf_experts, hf_experts_replacement,
                        "MoE experts as 3-D gate_up/down parameters (Mixtral, Qwen2/3-MoE)")
