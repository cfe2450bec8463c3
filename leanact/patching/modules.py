"""Replacement modules used by :func:`leanact.patch` where the plain drop-in is not enough."""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..nn.activation import GELU
from ..ops.gelu import gelu
from ..ops.transforms import functorch_active
from ..recompute.producers import quick_gelu
from .source import forward_body

__all__ = ["PatchedGELU", "PatchedQuickGELU", "quick_gelu_reason", "hook_kinds", "hooks_reason", "RUN_TIME_HOOKS",
           "lean_subclass", "reclass", "fresh_containers", "unchanged"]

_LEAN_SUBCLASSES: dict[tuple[type, type], type] = {}
_QUICK_GELU_CHECKED: dict[type, str | None] = {}


def lean_subclass(mixin: type, base: type) -> type:
    """``Lean<base>``: the class deriving from ``(mixin, base)``, created once per pair.

    Such a class is made at run time (one per Hugging Face class met), so pickle cannot find it by
    name: its instances reduce to :func:`_new_lean` with ``mixin`` and ``base``, both importable,
    which rebuilds the class where the object is loaded (``torch.save(model)`` then ``torch.load``
    in a fresh process, ``copy.deepcopy``)."""
    key = (mixin, base)
    cls = _LEAN_SUBCLASSES.get(key)
    if cls is None:
        cls = type(f"Lean{base.__name__}", (mixin, base), {"__module__": mixin.__module__, "__reduce_ex__": _reduce_ex})
        _LEAN_SUBCLASSES[key] = cls
    return cls


_CONTAINERS = ("_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
               "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
               "_forward_hooks_always_called", "_non_persistent_buffers_set")


def fresh_containers(new: nn.Module) -> None:
    """Give a shallow copy of a module its own parameter/child/hook containers (same contents)."""
    for k in _CONTAINERS:
        if k in new.__dict__:
            v = new.__dict__[k]
            new.__dict__[k] = type(v)(v) if not isinstance(v, set) else set(v)


def reclass(m: nn.Module, mixin: type, **attributes) -> nn.Module:
    """The lean twin of a Hugging Face module: a shallow copy of ``m`` (the same children, Parameters
    and buffers, so state_dict keys, optimizer references and tying are unchanged) whose class is
    :func:`lean_subclass` ``(mixin, type(m))``, with containers of its own (hooks registered on the twin
    later do not reach ``m``, which :func:`leanact.unpatch` puts back) and ``attributes`` set on it."""
    new = copy.copy(m)
    new.__class__ = lean_subclass(mixin, type(m))
    fresh_containers(new)
    new.__dict__.update(attributes)
    return new


def _own_forward(m: nn.Module) -> bool:
    """No forward override on the instance, or only one computing the same values (leanact's weight
    recast, :class:`leanact.patching.weight_recast.RecastForward`)."""
    return "forward" not in m.__dict__ or getattr(m.__dict__["forward"], "same_computation", False) is True


def unchanged(m: nn.Module | None, cls: type) -> bool:
    """Still the module patching saw: that exact class, no forward override, no run-time hooks."""
    return (type(m) is cls and _own_forward(m) and not (m._forward_hooks or m._forward_pre_hooks
                                                                  or m._backward_hooks or m._backward_pre_hooks))


def _new_lean(mixin: type, base: type) -> nn.Module:
    """An empty instance of ``lean_subclass(mixin, base)`` (unpickling then sets its state)."""
    cls = lean_subclass(mixin, base)
    return cls.__new__(cls)


def _reduce_ex(self, protocol):
    mixin, base = type(self).__bases__
    state = self.__getstate__() if hasattr(self, "__getstate__") else self.__dict__.copy()
    return _new_lean, (mixin, base), state

# (attribute of nn.Module, name in messages). Forward hooks registered with ``with_kwargs`` or
# ``always_call`` live in ``_forward_hooks`` too; ``register_full_backward_hook`` and the old
# ``register_backward_hook`` both in ``_backward_hooks``.
RUN_TIME_HOOKS = (("_forward_pre_hooks", "forward-pre"), ("_forward_hooks", "forward"),
                  ("_backward_pre_hooks", "backward-pre"), ("_backward_hooks", "backward"))
_STATE_HOOKS = (("_state_dict_pre_hooks", "state_dict-pre"), ("_state_dict_hooks", "state_dict"),
                ("_load_state_dict_pre_hooks", "load_state_dict-pre"),
                ("_load_state_dict_post_hooks", "load_state_dict-post"))


def hook_kinds(m: nn.Module, kinds=RUN_TIME_HOOKS + _STATE_HOOKS) -> list[str]:
    """The kinds of hooks registered on ``m`` itself (not its children), e.g. ``["forward", "backward-pre"]``."""
    return [name for attr, name in kinds if getattr(m, attr, None)]


def hooks_reason(m: nn.Module) -> str | None:
    """Why ``m`` is left as it is when hooks are registered on it (None: no hooks). A replacement
    would be a different module object: the hooks registered on ``m`` would not fire."""
    kinds = hook_kinds(m)
    return f"has hooks registered on it ({', '.join(kinds)}): left as is so that they keep firing" if kinds else None


class PatchedGELU(GELU):
    """:class:`leanact.nn.GELU` that, when no backward will run, calls the module it replaced.

    With autograd the output is leanact's (the float64 truth rounded once; it can differ from
    torch's kernel by one ulp); without it (``torch.no_grad``, inference) the replaced module
    computes the output, so that a patched model's inference outputs are bit-identical to the
    unpatched model's; so does it under ``torch.func`` transforms (:mod:`leanact.ops.transforms`).
    The replaced module is kept as a plain attribute (not a submodule: it has no state and must not
    show up in ``modules()`` or the state dict).
    """

    def __init__(self, approximate: str = "none", reference: nn.Module | None = None) -> None:
        super().__init__(approximate)
        self.__dict__["_reference"] = reference

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and input.requires_grad and not functorch_active():
            return gelu(input, approximate=self.approximate)
        ref = self.__dict__.get("_reference")
        if ref is not None:
            return ref(input)
        return torch.nn.functional.gelu(input, approximate=self.approximate)


def quick_gelu_reason(m: nn.Module) -> str | None:
    """None if ``m`` computes Hugging Face's ``QuickGELUActivation`` expression
    ``input * torch.sigmoid(1.702 * input)`` (its class forward, not replaced on the instance, e.g.
    by a hub kernel), else why it is left."""
    if "forward" in m.__dict__:
        return "QuickGELUActivation whose forward was replaced on the instance (e.g. a hub kernel)"
    t = type(m)
    if t not in _QUICK_GELU_CHECKED:  # once per class
        body = forward_body(t.forward)
        ok = (body is not None and len(body[0]) == 1
              and body[1] == f"return{body[0][0]}*torch.sigmoid(1.702*{body[0][0]})")
        _QUICK_GELU_CHECKED[t] = (None if ok
                                  else "QuickGELUActivation whose forward is not input * torch.sigmoid(1.702 * input)")
    return _QUICK_GELU_CHECKED[t]


class PatchedQuickGELU(nn.Module):
    """Hugging Face's ``QuickGELUActivation`` (``x * sigmoid(1.702 x)``, CLIP) keeping only x.

    With autograd it runs :func:`leanact.recompute.producers.quick_gelu`: HF's very ops, so the
    output and gradients are bitwise HF's; it keeps x, where autograd keeps x and
    sigmoid(1.702 x). The next Linear keeps the output as usual, except inside a recipe transform
    (a patched model under autocast), where its copy is rebuilt from x. Without autograd and under
    ``torch.func`` transforms the replaced module runs (kept as a plain attribute, as in
    :class:`PatchedGELU`), so inference is bit-identical and keeps nothing.
    """

    def __init__(self, reference: nn.Module | None = None) -> None:
        super().__init__()
        self.__dict__["_reference"] = reference

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and input.requires_grad and not functorch_active():
            return quick_gelu(input)
        ref = self.__dict__.get("_reference")
        return ref(input) if ref is not None else input * torch.sigmoid(1.702 * input)
