"""Hugging Face SwiGLU MLPs (``LlamaMLP``, ``Qwen2MLP``, ``Qwen3MLP``, ``MistralMLP``, ...) -> a
subclass whose backward keeps only the gate and up projections' outputs.

HF's forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``. Besides x (kept by gate_proj and
up_proj: one storage, usually the RMSNorm output kept by the norm anyway), autograd keeps four
tensors of size s·b·I: g = gate_proj(x) (SiLU's input), silu(g) and u = up_proj(x) (the product's
inputs) and the product (down_proj's input). The replacement keeps g and u only: the product is
:func:`leanact.recompute.producers.swiglu` (keeps g and u, exact torch gradients) and, inside a
:class:`~leanact.recompute.RecipeTransform`, down_proj's copy of it is a recipe (g, u) rebuilt in
down_proj's backward with the same kernels (bitwise equal), so it costs nothing.

Outputs and gradients are torch's own (the same kernels in the same order). Without autograd
(``torch.no_grad``, inference), while compiling (``torch.compile`` traces HF's forward), under
someone else's saved-tensor hooks (a ``torch.utils.checkpoint`` region) or ``torch.func``
transforms, and whenever ``act_fn`` has hooks (registered after patching) or a forward of its own,
the module runs HF's own forward, so inference is bit-identical to the unpatched model and the
hooks fire.

Recognised: a module whose class name ends in ``MLP``, defined in ``transformers.models.*``,
with ``nn.Linear`` children ``gate_proj``, ``up_proj``, ``down_proj`` and an ``act_fn`` that is
SiLU (``transformers.activations.SiLUActivation`` or ``nn.SiLU``), no hooks on it or on act_fn,
and whose ``forward`` source is the standard expression above (checked once per class) --
anything else is left with a reason (e.g. Gemma's GELU-tanh gate).
"""
from __future__ import annotations

import copy
import inspect
import re

import torch
from torch import nn

from ..recompute import producers
from ..recompute.recipes import RecipeTransform, foreign_hooks
from .modules import RUN_TIME_HOOKS, hook_kinds, hooks_reason, lean_subclass

__all__ = ["hf_swiglu_replacement", "is_hf_swiglu_mlp"]

_checked: dict[type, str | None] = {}
_HOOK_DICTS = ("_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
               "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
               "_forward_hooks_always_called", "_non_persistent_buffers_set")


def is_hf_swiglu_mlp(m: nn.Module) -> bool:
    """A transformers ``*MLP`` with gate/up/down projections (the SwiGLU layout, any activation)."""
    t = type(m)
    return (t.__name__.endswith("MLP") and t.__module__.startswith("transformers.models.")
            and all(isinstance(m._modules.get(k), nn.Module) for k in ("gate_proj", "up_proj", "down_proj")))


def _body(fn) -> tuple[str, str] | None:
    """(first argument name after self, code of the body without blanks/comments/docstring/spaces)."""
    try:
        src = inspect.getsource(fn)
        params = list(inspect.signature(fn).parameters)
    except (OSError, TypeError, ValueError):
        return None
    if len(params) != 2:
        return None
    lines = src.splitlines()[1:]
    code, in_doc = [], False
    for ln in lines:
        s = ln.strip()
        if in_doc:
            in_doc = not s.endswith(('"""', "'''"))
            continue
        if s.startswith(('"""', "'''")):
            in_doc = not (len(s) > 3 and s.endswith(s[:3]))
            continue
        if not s or s.startswith("#"):
            continue
        code.append(re.sub(r"\s+", "", s.split("#")[0]))
    return params[1], ";".join(code)


def _unsupported_forward(t: type) -> str | None:
    """None if ``t.forward`` is HF's standard SwiGLU expression, else the reason to leave it."""
    if t not in _checked:
        body = _body(t.forward)
        if body is None:
            _checked[t] = "forward source unavailable: cannot check it is the standard SwiGLU MLP"
        else:
            x, code = body
            expr = f"self.down_proj(self.act_fn(self.gate_proj({x}))*self.up_proj({x}))"
            ok = {f"return{expr}"} | {f"{v}={expr};return{v}" for v in re.findall(r"^(\w+)=", code)}
            _checked[t] = None if code in ok else "forward is not down_proj(act_fn(gate_proj(x)) * up_proj(x))"
    return _checked[t]


def _lean_act_fn(act: nn.Module | None) -> bool:
    """Cheap per-call check that the lean path may skip calling act_fn: still a SiLU class (the full
    check ran at patch time), no forward replaced on the instance and no hooks on it (registered
    since patching: HF's forward calls act_fn, so they fire)."""
    t = type(act)
    if not (t is nn.SiLU or (t.__name__ == "SiLUActivation" and t.__module__ == "transformers.activations")):
        return False
    return not (act._forward_hooks or act._forward_pre_hooks or act._backward_hooks or act._backward_pre_hooks
                or "forward" in act.__dict__)


def _silu_reason(act: nn.Module | None) -> str | None:
    if act is None:
        return "no act_fn module"
    t = type(act)
    if t is nn.SiLU:
        pass
    elif t.__name__ == "SiLUActivation" and t.__module__ == "transformers.activations":
        body = _body(t.forward)
        if body is None or body[1] != f"returnnn.functional.silu({body[0]})":
            return "SiLUActivation with an unrecognised implementation"
    else:
        return f"act_fn is {t.__name__}, not SiLU (only the SiLU gate is covered)"
    if "forward" in act.__dict__:
        return "act_fn's forward was replaced on the instance (e.g. a hub kernel)"
    if hook_kinds(act, RUN_TIME_HOOKS):
        return f"act_fn has hooks registered on it ({', '.join(hook_kinds(act, RUN_TIME_HOOKS))})"
    return None


class _LeanHFSwiGLU:
    """Mixin placed before the HF class: with autograd, keeps g = gate_proj(x) and u = up_proj(x);
    down_proj's input silu(g)·u is a recipe (g, u). Otherwise HF's own forward."""

    _leanact_lean = True

    def forward(self, *args, **kwargs) -> torch.Tensor:
        hf_forward = type(self).__mro__[2].forward  # the original HF class (Lean subclass -> HF class)
        if (len(args) + len(kwargs) != 1 or not torch.is_grad_enabled() or torch.compiler.is_compiling()
                or foreign_hooks() or not _lean_act_fn(self._modules.get("act_fn"))):
            # (act_fn swapped since patching, e.g. by leanact.lossy's few-bit SiLU, or hooked: HF's
            # forward calls it)
            return hf_forward(self, *args, **kwargs)
        x = args[0] if args else next(iter(kwargs.values()))  # the one argument, by position or name
        with RecipeTransform():
            g = self.gate_proj(x)
            u = self.up_proj(x)
            return self.down_proj(producers.swiglu(g, u))


def _subclass(t: type) -> type:
    return lean_subclass(_LeanHFSwiGLU, t)


def hf_swiglu_replacement(m: nn.Module) -> tuple[nn.Module | None, str | None]:
    """(new module sharing m's children and Parameters, None) or (None, reason)."""
    t = type(m)
    if isinstance(m, _LeanHFSwiGLU):
        return None, None
    if (reason := hooks_reason(m)) is not None:
        return None, reason
    names = ("gate_proj", "up_proj", "down_proj")
    if any(type(m._modules[k]) is not nn.Linear for k in names):
        kinds = ", ".join(f"{k}: {type(m._modules[k]).__name__}" for k in names)
        return None, f"projections are not plain nn.Linear ({kinds})"
    if m._parameters or set(m._modules) != {*names, "act_fn"}:
        return None, f"{t.__name__}: unexpected parameters/submodules (not the standard SwiGLU MLP)"
    reason = _silu_reason(m._modules.get("act_fn"))
    if reason is None:
        reason = _unsupported_forward(t)
    if reason is not None:
        return None, reason
    new = copy.copy(m)  # shallow: the same children and Parameters; fresh containers below
    new.__class__ = _subclass(t)
    for k in _HOOK_DICTS:
        if k in new.__dict__:
            v = new.__dict__[k]
            new.__dict__[k] = type(v)(v) if not isinstance(v, set) else set(v)
    return new, None
