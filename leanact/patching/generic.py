"""Generic in-place module replacements: torch / Hugging Face modules -> leanact drop-ins.

Each rule looks at one module and returns either a replacement (built around the *same*
Parameter objects, so state_dict keys and values, optimizer references and tying are unchanged) or
a reason to leave it. Only exact types are replaced: a subclass may override ``forward``. A module
with hooks registered on it (any kind: forward, forward-pre, backward, backward-pre, state-dict) is
left, with that reason: its replacement would be another module object, on which they would not
fire. Hooks registered on a replacement after patching fire as on any module.
"""
from __future__ import annotations

from functools import partial
from typing import Sequence

from torch import nn

from .. import nn as lnn
from . import peft_lora
from .adapter import ModuleAdapter, PatchRun, Replacement
from .modules import PatchedGELU, PatchedQuickGELU, hooks_reason, quick_gelu_reason

__all__ = ["replacement_for", "swap_modules"]

# Types that keep nothing leanact can reduce (or keep only what backward inherently needs).
_NEUTRAL = (nn.Linear, nn.Embedding, nn.Identity, nn.ModuleList, nn.ModuleDict, nn.Sequential,
            nn.ParameterList, nn.ParameterDict, nn.modules.conv._ConvNd, nn.ReLU, nn.Tanh)
_LEAN_TYPES = (lnn.GELU, lnn.LayerNorm, lnn.RMSNorm, lnn.Dropout)


def _is_hf_conv1d(t: type) -> bool:
    """transformers' ``Conv1D`` (GPT-2's projections): a Linear with a transposed weight; like
    Linear it keeps only its input, which is the producer's business, not its own."""
    return t.__name__ == "Conv1D" and t.__module__ == "transformers.pytorch_utils"


def _layer_norm(m: nn.LayerNorm) -> nn.Module:
    new = lnn.LayerNorm(m.normalized_shape, eps=m.eps, elementwise_affine=m.elementwise_affine,
                        bias=m.bias is not None, device="meta")
    new.weight, new.bias = m.weight, m.bias  # the same Parameter objects (or None)
    return new


def hf_activation(m: nn.Module) -> tuple[nn.Module | None, str]:
    """HF activation classes (transformers.activations) -> leanact GELU where the function is GELU."""
    import torch.nn.functional as F

    name = type(m).__name__
    act = getattr(m, "act", None)
    if name == "GELUActivation":
        if act is F.gelu:
            return lnn.GELU("none"), ""
        if getattr(act, "__name__", "") == "_gelu_python":  # x/2 (1 + erf(x/sqrt 2)): the same function
            return lnn.GELU("none"), ""
        return None, "GELUActivation with an unrecognised implementation"
    if name in ("GELUTanh", "PytorchGELUTanh"):
        if getattr(act, "func", None) is F.gelu and getattr(act, "keywords", {}) == {"approximate": "tanh"}:
            return lnn.GELU("tanh"), ""
        if getattr(act, "__name__", "") == "_gelu_tanh_python":
            return lnn.GELU("tanh"), ""
        return None, f"{name} with an unrecognised implementation"
    if name in ("NewGELUActivation", "AccurateGELUActivation"):
        return lnn.GELU("tanh"), ""  # 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))), the tanh GELU
    if name == "FastGELUActivation":
        return None, "sqrt(2/pi) truncated to 0.7978845608: not exactly the tanh GELU"
    if name == "QuickGELUActivation":  # (leanact.patch replaces it with PatchedQuickGELU; this is GELU's rule)
        return None, "x*sigmoid(1.702x) is not GELU"
    if name == "ClippedGELUActivation":
        return None, "clipped GELU: no lean op for it yet"
    if name in ("SiLUActivation",):
        return None, "SiLU outside a SwiGLU MLP: no lean op for it yet"
    return None, "activation without a lean equivalent yet"


def replacement_for(m: nn.Module, adapters: Sequence[ModuleAdapter]) -> Replacement:
    """(new module, None) to replace ``m``; (None, reason) to leave it and report why; (None, None)
    when there is nothing to report (containers, Linear, modules that are already lean). torch's own
    modules and Hugging Face's activations first, then the first of ``adapters`` that recognises ``m``."""
    new, reason = _replacement(m, adapters)
    if new is not None and (hooks := hooks_reason(m)) is not None:
        return None, hooks  # a module with hooks stays, so that they keep firing
    return new, reason


def _replacement(m: nn.Module, adapters: Sequence[ModuleAdapter]) -> Replacement:
    """:func:`replacement_for` before the check for hooks registered on ``m``."""
    t = type(m)
    if isinstance(m, _LEAN_TYPES):
        return None, None
    if t is nn.GELU:
        new = PatchedGELU(m.approximate, reference=m)
    elif t is nn.LayerNorm:
        new = _layer_norm(m)
    elif t is nn.Dropout:
        new = lnn.Dropout(m.p, m.inplace)
    elif t.__module__ == "transformers.activations" and t.__name__ == "QuickGELUActivation":
        if (reason := quick_gelu_reason(m)) is not None:
            return None, reason
        new = PatchedQuickGELU(reference=m)
    elif t.__module__ == "transformers.activations":
        new, reason = hf_activation(m)
        if new is None:
            return None, reason
        new = PatchedGELU(new.approximate, reference=m)
    elif isinstance(m, (nn.GELU, nn.LayerNorm, nn.Dropout)):
        base = [c for c in (nn.GELU, nn.LayerNorm, nn.Dropout) if isinstance(m, c)][0]
        return None, f"subclass of torch.nn.{base.__name__} (may override forward)"
    elif isinstance(m, nn.RMSNorm) and t is nn.RMSNorm:
        new = lnn.RMSNorm(m.normalized_shape, eps=m.eps, elementwise_affine=m.elementwise_affine, device="meta")
        new.weight = m.weight
    elif (adapter := next((a for a in adapters if a.recognises(m)), None)) is not None:
        new, reason = adapter.replacement(m)
        if new is None:
            return None, reason
    elif t.__name__.endswith("Router") and t.__module__.startswith("transformers.models."):
        return None, None  # keeps its input (shared) and T x E probabilities: already their true size
    elif t.__name__.endswith("RotaryEmbedding") and t.__module__.startswith("transformers.models."):
        return None, "RoPE cos/sin tables (built without autograd)"
    elif isinstance(m, _NEUTRAL) or _is_hf_conv1d(t) or list(m.children()):
        return None, None
    else:
        return None, "no lean equivalent (not covered)"
    new.train(m.training)
    return new, None


def _label(new: nn.Module) -> str:
    """What a replacement is, for the summary."""
    if type(new).__module__.startswith(("leanact.patching.hf_", "leanact.patching.peft_")) or isinstance(
            new, PatchedQuickGELU):
        return f"leanact.patching.{type(new).__name__}"
    return (f"leanact.nn.{'GELU' if isinstance(new, lnn.GELU) else type(new).__name__}"
            + (f"({new.approximate!r})" if hasattr(new, "approximate") else ""))


def swap_modules(model: nn.Module, run: PatchRun, adapters: Sequence[ModuleAdapter]) -> None:
    """Replace every module of ``model`` that a rule above replaces (through PEFT's LoRA layers too),
    outermost first: a replaced module's children are not visited, except LoRA layers kept as its
    children (their dropouts). What is left is reported with the reason."""
    rule = partial(replacement_for, adapters=adapters)

    def visit(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            qual = f"{prefix}.{name}" if prefix else name
            new, reason = peft_lora.replacement_through_lora(child, rule)
            if new is not None:
                run.swap(parent, name, new, _label(new), qual)
                for k, c in new._modules.items():
                    if c is not None and peft_lora.is_lora_layer(c):
                        visit(c, f"{qual}.{k}")
                continue
            if reason is not None:
                run.summary.left.append((qual, type(child).__name__, reason))
            visit(child, qual)

    visit(model, "")
