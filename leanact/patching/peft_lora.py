"""PEFT's LoRA layers inside modules that :func:`leanact.patch` replaces, and LoRA adapters wider
than their input (PEFT's default fp32 adapters on a 16-bit model: lora_A casts the input itself and
keeps the 16-bit one, not an fp32 copy; see :func:`install_upcasts`).

``get_peft_model`` replaces each targeted ``nn.Linear`` by a LoRA layer (``base_layer`` + ``lora_A``,
``lora_B``, ``lora_dropout``). The lean gated MLP (:mod:`leanact.patching.hf_swiglu`) reads
``down_proj``'s weight directly, which would bypass an adapter there, so an MLP whose projections are
LoRA layers gets :class:`_LoRASwiGLU` instead: with autograd, ``down_proj(silu(g) * u)`` calling the
projection modules (adapters included), the product a recipe (g, u) that down_proj's base layer and
lora_A rebuild in backward (:func:`leanact.recompute.producers.swiglu`), so only g and u are kept,
as without LoRA. SiLU gates with separate gate/up projections are covered; other MLPs with LoRA
projections are left, with the reason.

* Patching *after* ``get_peft_model``: the MLP is recognised by looking through its LoRA layers.
* Patching *before*: PEFT inserts its layers into the lean MLPs; the patched model's first training
  forward after that (:mod:`leanact.patching.functional_dropout`'s scope on the model, entered once
  PEFT has set ``peft_config`` on it) moves them to :class:`_LoRASwiGLU` (:func:`adopt`).

LoRA's own dropouts are ``nn.Dropout`` modules, swapped like any other (after), or sent to leanact's
dropout by the functional-dropout scope (before).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..ops.amp import autocast_dtype
from ..ops.backward import once_differentiable
from ..recompute import producers
from ..recompute.recipes import RecipeTransform, foreign_hooks
from .modules import lean_subclass, unchanged
from .adapter import ModelStep, PatchRun

__all__ = ["is_lora_layer", "replacement_through_lora", "adopt", "install_upcasts", "uninstall_upcasts", "STEP"]

Replace = Callable[[nn.Module], "tuple[nn.Module | None, str | None]"]


def is_lora_layer(m: nn.Module) -> bool:
    """A PEFT tuner layer wrapping a ``base_layer`` with LoRA adapters."""
    return (type(m).__module__.startswith("peft.tuners.") and isinstance(m._modules.get("base_layer"), nn.Module)
            and "lora_A" in m._modules)


class _LoRASwiGLU:
    """Mixin placed before the HF MLP class (projections are LoRA layers): with autograd, keeps g and u
    (down_proj's input is a recipe); otherwise HF's own forward. ``_leanact_gated`` as in hf_swiglu."""

    _leanact_lean = True

    def forward(self, *args, **kwargs) -> torch.Tensor:
        hf_forward = type(self).__mro__[2].forward  # Lean subclass -> this mixin -> the HF class
        names, act, act_cls, kind = self._leanact_gated
        mods = self._modules
        if (len(args) + len(kwargs) != 1 or not torch.is_grad_enabled() or torch.compiler.is_compiling()
                or foreign_hooks() or not unchanged(mods.get(act), act_cls)):
            return hf_forward(self, *args, **kwargs)
        x = args[0] if args else next(iter(kwargs.values()))
        with RecipeTransform():
            return mods["down_proj"](producers.swiglu(mods["gate_proj"](x), mods["up_proj"](x)))


def _lora_mlp(new: nn.Module, hf_class: type) -> bool:
    """Turn a lean gated MLP (built against the base layers) into its LoRA-calling form; False if its
    gate is not covered (a fused gate_up_proj, or an activation other than SiLU)."""
    from .hf_swiglu import LeanHFSwiGLU

    gated = getattr(new, "_leanact_gated", None)
    if not isinstance(new, (LeanHFSwiGLU, _LoRASwiGLU)) or gated is None or len(gated[0]) != 3 or gated[3] != "silu":
        return False
    new.__class__ = lean_subclass(_LoRASwiGLU, hf_class)
    return True


def adopt(model: nn.Module) -> int:
    """Move the lean gated MLPs of ``model`` into which PEFT has since put LoRA layers to
    :class:`_LoRASwiGLU` (those not covered keep running HF's forward); returns how many moved."""
    from .hf_swiglu import LeanHFSwiGLU

    moved = 0
    for m in model.modules():
        if isinstance(m, LeanHFSwiGLU) and any(c is not None and is_lora_layer(c) for c in m._modules.values()):
            moved += _lora_mlp(m, type(m).__mro__[2])
    install_upcasts(model)
    return moved


def replacement_through_lora(m: nn.Module, replace: Replace) -> tuple[nn.Module | None, str | None]:
    """``replace(m)`` with m's LoRA children seen as their base layers; the replacement then holds the
    LoRA layers again. ``m`` itself is unchanged afterwards."""
    loras = {k: c for k, c in m._modules.items() if c is not None and is_lora_layer(c)}
    if not loras:
        return replace(m)
    for k, c in loras.items():
        m._modules[k] = c._modules["base_layer"]
    try:
        new, reason = replace(m)
    finally:
        for k, c in loras.items():
            m._modules[k] = c
    if new is None:
        return None, reason
    if new._modules is m._modules or not _lora_mlp(new, type(m)):
        return None, (f"{', '.join(loras)}: PEFT LoRA layers, and only SiLU-gated MLPs with separate gate/up "
                      f"projections call them (a {type(new).__name__} would bypass them)")
    for k, c in loras.items():
        new._modules[k] = c
    return new, reason


# -- LoRA adapters wider than their input ------------------------------------------------------------
# PEFT keeps adapters in fp32 by default (autocast_adapter_dtype=True) and casts a 16-bit input up
# before lora_A: lora_A then keeps that fp32 copy for its weight gradient, twice the bytes of the input
# the norm before keeps anyway, once per projection (q, k, v each cast it again). Instead, lora_A takes
# the 16-bit input, casts it itself and keeps the input: the same forward (the same cast, the same
# linear), the cast redone in backward.

_UPCAST = "_leanact_upcast"


class _UpcastLinear(torch.autograd.Function):
    """``F.linear(x.to(w.dtype), w, b)``, keeping x (its dtype) and w; backward recasts x."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return torch.nn.functional.linear(x.to(w.dtype), w, b)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = dy.matmul(w).to(x.dtype)  # as autograd: the linear's input gradient, then the cast's
        if ctx.needs_input_grad[1]:
            dw = dy.reshape(-1, dy.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]).to(w.dtype))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.reshape(-1, dy.shape[-1]).sum(0)
        return dx, dw, db


class _UpcastingLoRAIn:
    """Mixin placed before ``nn.Linear`` (a LoRA layer's ``lora_A``): an input narrower than the weight
    is cast here (:class:`_UpcastLinear` with autograd), not by the LoRA layer before the call. Under
    autocast it is a plain Linear (``_leanact_plain_linear``: ``recast_weights`` treats it as one)."""

    _leanact_plain_linear = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dtype == w.dtype or not x.is_floating_point() or torch.compiler.is_compiling():
            return nn.Linear.forward(self, x.to(w.dtype))
        # (under autocast: PEFT's ops, the cast then autocast's linear)
        if (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
                and autocast_dtype(x.device.type) is None):
            return _UpcastLinear.apply(x, w, self.bias)
        return nn.Linear.forward(self, x.to(w.dtype))


def _upcast_candidate(layer: nn.Module) -> bool:
    """A LoRA Linear whose adapters are all plain -- an ``nn.Linear`` lora_A, no dropout (identity), no
    variant (DoRA...), PEFT's own input cast in use -- and wider than the base layer's weight (fp32
    adapters on a 16-bit model: PEFT's default)."""
    if not is_lora_layer(layer) or not callable(getattr(type(layer), "_cast_input_dtype", None)):
        return False
    if getattr(layer, "lora_variant", None) or not (getattr(layer, "cast_input_dtype_enabled", True)
                                                     or layer.__dict__.get(_UPCAST)):
        return False
    lora_a, drop = layer._modules.get("lora_A"), layer._modules.get("lora_dropout")
    base = getattr(layer._modules["base_layer"], "weight", None)
    if (not isinstance(lora_a, nn.ModuleDict) or not isinstance(drop, nn.ModuleDict) or not lora_a
            or not isinstance(base, torch.Tensor) or not base.is_floating_point()):
        return False
    return all(type(a) in (nn.Linear, lean_subclass(_UpcastingLoRAIn, nn.Linear))
               and isinstance(drop._modules.get(k), nn.Identity)
               and a.weight.is_floating_point() and a.weight.element_size() > base.element_size()
               for k, a in lora_a.items())


def install_upcasts(model: nn.Module) -> int:
    """Make the plain LoRA layers of ``model`` cast in lora_A (module comment); returns how many."""
    n = 0
    for m in model.modules():
        if _upcast_candidate(m):
            for a in m._modules["lora_A"].values():
                if type(a) is nn.Linear:
                    a.__class__ = lean_subclass(_UpcastingLoRAIn, nn.Linear)
            if _UPCAST not in m.__dict__:  # PEFT's own switch: its layer passes the input on as is
                m.cast_input_dtype_enabled = False
                m.__dict__[_UPCAST] = True
                n += 1
    return n


def uninstall_upcasts(model: nn.Module) -> None:
    """Undo :func:`install_upcasts`."""
    for m in model.modules():
        if m.__dict__.pop(_UPCAST, None):
            m.cast_input_dtype_enabled = True
        if type(m) is lean_subclass(_UpcastingLoRAIn, nn.Linear):
            m.__class__ = nn.Linear


def _install(model: nn.Module, run: PatchRun) -> None:
    if install_upcasts(model):
        run.summary.notes.append("PEFT LoRA adapters wider than their input: lora_A casts it and keeps the input, "
                                 "not a copy")


STEP = ModelStep("peft_upcasts", _install, lambda model, run: uninstall_upcasts(model))
