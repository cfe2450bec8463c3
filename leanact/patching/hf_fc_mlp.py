"""Hugging Face ``fc1 → QuickGELU → fc2`` MLPs (CLIP's ``CLIPMLP``) -> a subclass keeping only fc1's output.

HF's forward is ``fc2(activation_fn(fc1(x)))`` with ``QuickGELUActivation``, ``x·sigmoid(1.702x)``.
Besides x (fc1's input), autograd keeps three tensors of size s·b·I: fc1's output h (the product's
input), sigmoid(1.702h), and the activation's output (fc2's input). The replacement keeps h only:
the activation is :func:`leanact.recompute.producers.quick_gelu` (HF's very ops; keeps h) and fc2
runs inside a :class:`~leanact.recompute.RecipeTransform`, so fc2's copy of the activation output
is rebuilt from h in backward, with the same ops (bitwise the same tensor). Outputs and gradients
are bitwise HF's (``tests/test_quick_gelu.py``).

fc1 and fc2 are called as modules (their hooks fire; leanact's weight recast applies). Under
someone else's innermost saved-tensor hooks (a checkpointed region, ``save_on_cpu``) no transform
is entered, so as not to shadow them: fc2 then keeps its input, as HF's does (the sigmoid is still
not kept). Without autograd, while compiling, under ``torch.func`` transforms, and whenever the
activation changed or got hooks since patching, the module runs HF's own forward. Recognised from
structure and forward, whatever the class name: a module defined in ``transformers.models.*``
whose children are ``fc1`` and ``fc2`` (``nn.Linear``) and one activation (``activation_fn``,
``act_fn`` or ``act``) that is HF's ``QuickGELUActivation``, with no parameters of its own and no
hooks, and whose ``forward`` is the expression above. A module that has these children but is not
recognised is left with a reason; its QuickGELU is still replaced on its own
(:class:`~leanact.patching.modules.PatchedQuickGELU`: fc2 then keeps its input).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from ..ops.transforms import functorch_active
from ..recompute.producers import quick_gelu
from ..recompute.recipes import RecipeTransform, foreign_hooks
from .modules import RUN_TIME_HOOKS, hook_kinds, hooks_reason, quick_gelu_reason, reclass
from .source import forward_body
from .adapter import ModuleAdapter

__all__ = ["is_hf_fc_mlp", "hf_fc_mlp_replacement", "ADAPTER"]

_ACT_NAMES = ("activation_fn", "act_fn", "act")
_checked: dict[tuple[type, str], str | None] = {}


def _is_quick_gelu(m: nn.Module | None) -> bool:
    t = type(m)
    return t.__name__ == "QuickGELUActivation" and t.__module__ == "transformers.activations"


def _act_name(m: nn.Module) -> str | None:
    acts = [k for k in _ACT_NAMES if isinstance(m._modules.get(k), nn.Module)]
    return acts[0] if len(acts) == 1 else None


def is_hf_fc_mlp(m: nn.Module) -> bool:
    """A transformers module with children ``fc1``, ``fc2`` and a QuickGELU activation."""
    if not type(m).__module__.startswith("transformers.models."):
        return False
    act = _act_name(m)
    mods = m._modules
    return (act is not None and _is_quick_gelu(mods[act])
            and isinstance(mods.get("fc1"), nn.Module) and isinstance(mods.get("fc2"), nn.Module))


def _forward_reason(t: type, act: str) -> str | None:
    """None if ``t.forward`` is ``fc2(act(fc1(x)))`` (in one or three statements), else the reason."""
    key = (t, act)
    if key not in _checked:
        body = forward_body(t.forward)
        if body is None or len(body[0]) != 1:
            _checked[key] = "forward source unavailable or not one argument: cannot check it is fc2(act(fc1(x)))"
        else:
            x, a, code = re.escape(body[0][0]), re.escape(act), body[1]
            steps = (rf"(\w+)=self\.fc1\({x}\);(\w+)=self\.{a}\(\1\);"
                     rf"(?:(\w+)=self\.fc2\(\2\);return\3|returnself\.fc2\(\2\))")
            nested = rf"returnself\.fc2\(self\.{a}\(self\.fc1\({x}\)\)\)"
            ok = re.fullmatch(steps, code) or re.fullmatch(nested, code)
            _checked[key] = None if ok else f"forward is not fc2({act}(fc1(x)))"
    return _checked[key]


class _LeanHFFcMLP:
    """Mixin placed before the HF class: with autograd, keeps fc1's output only (module doc);
    otherwise HF's own forward. ``_leanact_fc_mlp`` = the activation's attribute name."""

    _leanact_lean = True

    def forward(self, *args, **kwargs) -> torch.Tensor:
        hf_forward = type(self).__mro__[2].forward  # the original HF class (Lean subclass -> HF class)
        mods = self._modules
        act = mods.get(self._leanact_fc_mlp)
        if (len(args) + len(kwargs) != 1 or not torch.is_grad_enabled() or torch.compiler.is_compiling()
                or functorch_active() or not _is_quick_gelu(act) or "forward" in act.__dict__
                or hook_kinds(act, RUN_TIME_HOOKS)
                or not isinstance(mods.get("fc1"), nn.Module) or not isinstance(mods.get("fc2"), nn.Module)):
            return hf_forward(self, *args, **kwargs)
        x = args[0] if args else next(iter(kwargs.values()))  # the one argument, by position or name
        h = mods["fc1"](x)
        if foreign_hooks():  # someone else's saved-tensor hooks innermost: no transform, fc2 keeps its input
            return mods["fc2"](quick_gelu(h))
        with RecipeTransform():  # fc2's copy of quick_gelu(h) becomes a recipe rebuilt from h
            return mods["fc2"](quick_gelu(h))


def hf_fc_mlp_replacement(m: nn.Module) -> tuple[nn.Module | None, str | None]:
    """(new module sharing m's children and Parameters, None) or (None, reason)."""
    t = type(m)
    if isinstance(m, _LeanHFFcMLP):
        return None, None
    if (reason := hooks_reason(m)) is not None:
        return None, reason
    act = _act_name(m)
    if any(type(m._modules[k]) is not nn.Linear for k in ("fc1", "fc2")):
        return None, (f"fc1/fc2 are not plain nn.Linear ({type(m._modules['fc1']).__name__}, "
                      f"{type(m._modules['fc2']).__name__})")
    if m._parameters or set(m._modules) != {"fc1", "fc2", act}:
        return None, f"{t.__name__}: unexpected parameters/submodules (not fc1, activation, fc2)"
    reason = quick_gelu_reason(m._modules[act])
    if reason is None and hook_kinds(m._modules[act], RUN_TIME_HOOKS):
        reason = f"the activation has hooks registered on it ({', '.join(hook_kinds(m._modules[act], RUN_TIME_HOOKS))})"
    if reason is None:
        reason = _forward_reason(t, act)
    if reason is not None:
        return None, reason
    return reclass(m, _LeanHFFcMLP, _leanact_fc_mlp=act), None


ADAPTER = ModuleAdapter("hf_fc_mlp", is_hf_fc_mlp, hf_fc_mlp_replacement,
                        "CLIP's fc1 -> QuickGELU -> fc2 MLP")
