"""Hugging Face RMSNorm classes (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``MistralRMSNorm``,
``Qwen3RMSNorm``, ...) -> a subclass whose backward keeps only y and one rstd per row.

HF's forward is ``w * (x.float() * rsqrt(mean(x.float()²) + eps)).to(dtype)``: it keeps, for
backward, the fp32 copy of x, rstd, the normalised fp32 x̂ and its cast (and w). The replacement's
*forward is HF's own* (the original class's ``forward``, called without autograd), so outputs are
bit-identical in every dtype; only what is kept changes: y (the output, already alive for the next
op) and rstd (fp32, one per row), and backward is :class:`leanact.ops.rms_norm.RMSNormFunction`'s
(x̂ = y/w). In fp32 this is exact to rounding (≤ 1 ulp in x̂); in 16-bit dtypes HF rounds x̂ to
the input dtype before multiplying by w, so x̂ = y/w is recovered within 16-bit rounding (the
gradients are within 16-bit tolerance, not bitwise HF's). When w cannot be divided by safely
(zero/subnormal entries) the input x is kept instead (x̂ = x·rstd, exact).

Recognised: a module whose class name ends in ``RMSNorm``, defined in ``transformers.models.*``,
with exactly the state ``weight`` (shape (h,)) and ``variance_epsilon``, and whose ``forward``
source is the standard one (checked once per class against the expression above) -- anything else
is left with a reason (e.g. Gemma's ``(1 + w)`` variant).
"""
from __future__ import annotations

import copy
import inspect
import math
import re
from collections import OrderedDict

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ..ops.layer_norm import from_output_ok
from ..ops.rms_norm import RMSNormFunction
from ..ops.transforms import functorch_active
from .modules import lean_subclass

__all__ = ["hf_rms_norm_replacement", "is_hf_rms_norm"]

_STANDARD = [
    r"input_dtype\s*=\s*hidden_states\.dtype",
    r"hidden_states\s*=\s*hidden_states\.to\(torch\.float32\)",
    r"variance\s*=\s*hidden_states\.pow\(2\)\.mean\(-1,\s*keepdim=True\)",
    r"hidden_states\s*=\s*hidden_states\s*\*\s*torch\.rsqrt\(variance\s*\+\s*self\.variance_epsilon\)",
    r"return\s+self\.weight\s*\*\s*hidden_states\.to\(input_dtype\)",
]
_checked: dict[type, str | None] = {}


def is_hf_rms_norm(m: nn.Module) -> bool:
    t = type(m)
    return t.__name__.endswith("RMSNorm") and t.__module__.startswith("transformers.models.")


def _unsupported(t: type) -> str | None:
    """None if ``t.forward`` is HF's standard RMSNorm, else the reason to leave it."""
    if t not in _checked:
        try:
            src = inspect.getsource(t.forward)
        except (OSError, TypeError):
            _checked[t] = "forward source unavailable: cannot check it is the standard RMSNorm"
        else:
            missing = [p for p in _STANDARD if not re.search(p, src)]
            lines = [ln for ln in src.splitlines()[1:] if ln.strip() and not ln.strip().startswith(("#", '"""'))]
            if missing or len(lines) != len(_STANDARD):
                _checked[t] = "forward is not the standard fp32 RMSNorm (e.g. a (1 + w) or extra-op variant)"
            else:
                _checked[t] = None
    return _checked[t]


# RMSNormFunction's backward as a plain function: dynamo cannot trace one Function's backward
# calling another Function's staticmethod ("Expected FakeBackwardCFunction").
_rms_norm_backward = inspect.unwrap(RMSNormFunction.__dict__["backward"].__func__)


class _HFRMSNormFunction(torch.autograd.Function):
    """forward: the HF module's own forward (bitwise); backward: RMSNormFunction's formulas."""

    @staticmethod
    def forward(ctx, x, weight, module, eps, from_output):
        ref = type(module).__mro__[2].forward  # the original HF class (Lean subclass -> HF class)
        y = ref(module, x)
        xf = x.to(torch.float32)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.n = x.shape[-1]
        ctx.from_output = ctx.keeps_output = from_output
        ctx.save_for_backward(y if from_output else x, rstd, weight)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        dx, dw, *_ = _rms_norm_backward(ctx, dy)
        return dx, dw, None, None, None


class _LeanHFRMSNorm:
    """Mixin placed before the HF class: ``forward`` keeps y and rstd only.

    ``from_output`` (instance attribute, default None): None = decide from w at each call (a host
    read of w: a graph break under torch.compile); True / False = keep y / keep x, fixed."""

    _leanact_lean = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not (torch.is_grad_enabled() and (hidden_states.requires_grad or w.requires_grad)) or functorch_active():
            return type(self).__mro__[2].forward(self, hidden_states)  # (torch.func: leanact.ops.transforms)
        if w.dtype != torch.float32 and w.dtype != hidden_states.dtype:
            return type(self).__mro__[2].forward(self, hidden_states)  # mixed precision: HF's promotion
        n = hidden_states.shape[-1]
        # y = w * x̂ (one rounding in fp32, two in 16-bit): the same conditions as leanact's rms_norm.
        from_output = getattr(self, "from_output", None)
        if from_output is None:
            from_output = from_output_ok(w, None, n, hidden_states.dtype, math.inf)
        return _HFRMSNormFunction.apply(hidden_states, w, self, float(self.variance_epsilon), bool(from_output))


def _subclass(t: type) -> type:
    return lean_subclass(_LeanHFRMSNorm, t)


def hf_rms_norm_replacement(m: nn.Module) -> tuple[nn.Module | None, str | None]:
    """(new module sharing m's Parameter, None) or (None, reason)."""
    t = type(m)
    if isinstance(m, _LeanHFRMSNorm):
        return None, None
    if set(m._parameters) != {"weight"} or m._buffers or m._modules or m.weight is None or m.weight.dim() != 1:
        return None, f"{t.__name__}: unexpected parameters/buffers (not the standard RMSNorm)"
    if not isinstance(getattr(m, "variance_epsilon", None), float):
        return None, f"{t.__name__}: no float variance_epsilon"
    reason = _unsupported(t)
    if reason is not None:
        return None, reason
    new = copy.copy(m)  # shallow: the same Parameter; fresh containers below
    new.__class__ = _subclass(t)
    for k in ("_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
              "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
              "_load_state_dict_post_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
              "_forward_hooks_always_called", "_non_persistent_buffers_set"):
        if k in new.__dict__:
            v = new.__dict__[k]
            new.__dict__[k] = type(v)(v) if not isinstance(v, set) else set(v)
    return new, None
