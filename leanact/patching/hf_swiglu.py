"""Hugging Face gated MLPs (SwiGLU and GeGLU: LLaMA, Qwen, Mistral, Gemma, OLMo 2, Phi-3, ...) -> a
subclass whose backward keeps only the gate and up projections' outputs.

HF's forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (separate projections) or, with
one fused ``gate_up_proj`` (Phi-3), ``gate, up = gate_up_proj(x).chunk(2, -1)`` and
``down_proj(up * act(gate))``. Besides x (kept by the projections: one storage, usually the
norm's output kept by the norm anyway), autograd keeps four tensors of size s·b·I: g (the
activation's input), act(g) and u (the product's inputs) and the product (down_proj's input). The
replacement keeps g and u only (one storage when fused), through
:func:`leanact.ops.gated_mlp.gated_down`, which rebuilds act(g)·u in backward with torch's kernels.
Outputs are bitwise HF's; gradients are torch's formulas (``tests/test_patch_swiglu.py``).

The kept tensors go through ``ctx.save_for_backward``: saved-tensor hooks active around the MLP
(``torch.autograd.graph.save_on_cpu``, a checkpoint region, a meter, a user's hooks) see exactly
what leanact keeps; under ``torch.compile`` ``gated_down`` is a custom op, opaque to the compiler,
so a compiled model keeps g and u too. Without autograd (``torch.no_grad``, inference), under
``torch.func`` transforms, and whenever the
activation or a projection changed or has hooks since patching (registered after patching,
``leanact.lossy``'s few-bit activation, a LoRA layer put in place), the module runs HF's own
forward, so inference is bit-identical to the unpatched model and the hooks fire.

Recognised from structure and forward, whatever the class name: a module defined in
``transformers.models.*`` whose children are ``nn.Linear`` projections (``gate_proj``, ``up_proj``,
``down_proj``, or ``gate_up_proj`` and ``down_proj``) and one activation (``act_fn``,
``activation_fn`` or ``act``: SiLU, GELU or GELU-tanh with torch's kernels), with no parameters of
its own and no hooks, and whose ``forward`` source is one of the expressions above (checked once
per class); anything else is left with a reason.
"""
from __future__ import annotations

import functools
import re

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.gated_mlp import gated_down
from ..ops.transforms import functorch_active
from .source import forward_body
from .modules import RUN_TIME_HOOKS, hook_kinds, hooks_reason, reclass, unchanged
from .adapter import ModuleAdapter

__all__ = ["hf_swiglu_replacement", "is_hf_swiglu_mlp", "activation_kind", "ADAPTER"]

_ACT_NAMES = ("act_fn", "activation_fn", "act")
_SEPARATE = ("gate_proj", "up_proj", "down_proj")
_FUSED = ("gate_up_proj", "down_proj")
_checked: dict[tuple[type, str, bool], str | None] = {}
def _layout(m: nn.Module) -> tuple[tuple[str, ...], str] | None:
    """(projection names, activation attribute) if ``m`` has a gated MLP's children, else None."""
    mods = m._modules
    act = [k for k in _ACT_NAMES if isinstance(mods.get(k), nn.Module)]
    if len(act) != 1:
        return None
    for names in (_SEPARATE, _FUSED):
        if all(isinstance(mods.get(k), nn.Module) for k in names):
            return names, act[0]
    return None


def is_hf_swiglu_mlp(m: nn.Module) -> bool:
    """A transformers module with a gated MLP's children (gate/up/down or gate_up/down projections
    and one activation), whatever its class name."""
    return type(m).__module__.startswith("transformers.models.") and _layout(m) is not None


def _forward_reason(t: type, act: str, fused: bool) -> str | None:
    """None if ``t.forward`` is one of HF's gated MLP expressions, else the reason to leave it."""
    key = (t, act, fused)
    if key not in _checked:
        body = forward_body(t.forward)
        if body is None or len(body[0]) != 1:
            _checked[key] = "forward source unavailable or not one argument: cannot check it is a gated MLP"
        else:
            x, code = re.escape(body[0][0]), body[1]
            a = re.escape(act)
            if fused:
                pat = (rf"(\w+)=self\.gate_up_proj\({x}\);(\w+),(\w+)=\1\.chunk\(2,dim=-1\);"
                       rf"(\w+)=(?:\3\*self\.{a}\(\2\)|self\.{a}\(\2\)\*\3);return(?:self\.down_proj\(\4\)|"
                       rf"(\w+)=self\.down_proj\(\4\);return\5)")
                what = "gate, up = gate_up_proj(x).chunk(2, -1); down_proj(up * act(gate))"
            else:
                prod = (rf"(?:self\.{a}\(self\.gate_proj\({x}\)\)\*self\.up_proj\({x}\)|"
                        rf"self\.up_proj\({x}\)\*self\.{a}\(self\.gate_proj\({x}\)\))")
                pat = rf"(?:returnself\.down_proj\({prod}\)|(\w+)=self\.down_proj\({prod}\);return\1)"
                what = f"down_proj({act}(gate_proj(x)) * up_proj(x))"
            _checked[key] = None if re.fullmatch(pat, code) else f"forward is not {what}"
    return _checked[key]


#: an activation class's forward function -> whether it is ``nn.functional.silu(x)`` (read once per
#: function: a compiled forward that checks its activation looks it up here, where reading the source
#: would be a graph break)
_SILU_FORWARD: dict = {}


def _silu_forward(t: type) -> bool:
    fn = t.forward
    ok = _SILU_FORWARD.get(fn)
    if ok is None:
        body = forward_body(fn)
        ok = _SILU_FORWARD[fn] = body is not None and body[1] == f"returnnn.functional.silu({body[0][0]})"
    return ok


def activation_kind(act: nn.Module | None) -> tuple[str | None, str | None]:
    """("silu" / "gelu" / "gelu_tanh", None) for an activation module computed by torch's kernel,
    else (None, reason)."""
    if act is None:
        return None, "no activation module"
    t = type(act)
    kind = None
    if t is nn.SiLU:
        kind = "silu"
    elif t is nn.GELU:
        kind = "gelu_tanh" if act.approximate == "tanh" else "gelu"
    elif t.__module__ == "transformers.activations":
        fn = getattr(act, "act", None)
        if t.__name__ == "SiLUActivation":
            kind = "silu" if _silu_forward(t) else None
        elif t.__name__ == "GELUActivation" and fn is F.gelu:
            kind = "gelu"
        elif (t.__name__ in ("GELUTanh", "PytorchGELUTanh") and isinstance(fn, functools.partial)
              and fn.func is F.gelu and fn.keywords == {"approximate": "tanh"} and not fn.args):
            kind = "gelu_tanh"
    if kind is None:
        return None, (f"activation is {t.__name__}, not SiLU or GELU with torch's kernel "
                      "(gated MLPs are covered for SiLU, GELU and GELU-tanh)")
    if "forward" in act.__dict__:
        return None, "the activation's forward was replaced on the instance (e.g. a hub kernel)"
    if hook_kinds(act, RUN_TIME_HOOKS):
        return None, f"the activation has hooks registered on it ({', '.join(hook_kinds(act, RUN_TIME_HOOKS))})"
    return kind, None


def _down_linear(m: nn.Module | None) -> bool:
    """The down projection, whose weight gated_down uses directly: an ``nn.Linear`` computing
    ``F.linear(x, weight, bias)`` on this input (the exact class, or a subclass declaring
    ``_leanact_exact_on_rebuilt_input``: lossy's RandomizedLinear, exact on an input that is rebuilt
    anyway), no forward override, no hooks. (The gate/up projections are called as modules: any.)"""
    if isinstance(m, nn.Linear) and getattr(type(m), "_leanact_exact_on_rebuilt_input", False):
        return unchanged(m, type(m))
    return unchanged(m, nn.Linear)


class LeanHFSwiGLU:
    """Mixin placed before the HF class: with autograd, keeps g and u (gated_down); otherwise HF's
    own forward. ``_leanact_gated`` = (projection names, activation attribute, activation class, kind)."""

    _leanact_lean = True

    def forward(self, *args, **kwargs) -> torch.Tensor:
        hf_forward = type(self).__mro__[2].forward  # the original HF class (Lean subclass -> HF class)
        names, act, act_cls, kind = self._leanact_gated
        mods = self._modules
        if (len(args) + len(kwargs) != 1 or not torch.is_grad_enabled() or functorch_active()
                or not unchanged(mods.get(act), act_cls)
                or not all(isinstance(mods.get(k), nn.Module) for k in names[:-1])
                or not _down_linear(mods.get(names[-1]))):
            return hf_forward(self, *args, **kwargs)
        x = args[0] if args else next(iter(kwargs.values()))  # the one argument, by position or name
        if len(names) == 2:
            g, u = mods["gate_up_proj"](x).chunk(2, dim=-1)
        else:
            g, u = mods["gate_proj"](x), mods["up_proj"](x)
        down = mods["down_proj"]
        return gated_down(g, u, down.weight, down.bias, kind)


def hf_swiglu_replacement(m: nn.Module) -> tuple[nn.Module | None, str | None]:
    """(new module sharing m's children and Parameters, None) or (None, reason)."""
    t = type(m)
    if isinstance(m, LeanHFSwiGLU):
        return None, None
    if (reason := hooks_reason(m)) is not None:
        return None, reason
    layout = _layout(m)
    if layout is None:
        return None, f"{t.__name__}: not a gated MLP's children (gate/up/down projections and one activation)"
    names, act = layout
    if any(type(m._modules[k]) is not nn.Linear for k in names):
        kinds = ", ".join(f"{k}: {type(m._modules[k]).__name__}" for k in names)
        return None, f"projections are not plain nn.Linear ({kinds})"
    if m._parameters or set(m._modules) != {*names, act}:
        return None, f"{t.__name__}: unexpected parameters/submodules (not the standard gated MLP)"
    kind, reason = activation_kind(m._modules[act])
    if reason is None:
        reason = _forward_reason(t, act, len(names) == 2)
    if reason is not None:
        return None, reason
    return reclass(m, LeanHFSwiGLU, _leanact_gated=(names, act, type(m._modules[act]), kind)), None


ADAPTER = ModuleAdapter("hf_swiglu", is_hf_swiglu_mlp, hf_swiglu_replacement,
                        "gated MLPs (SwiGLU, GeGLU; separate or fused gate/up projections)")
