"""PEFT's LoRA layers inside modules that :func:`leanact.patch` replaces.

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

from ..recompute import producers
from ..recompute.recipes import RecipeTransform, foreign_hooks
from .hf_swiglu import _plain
from .modules import lean_subclass

__all__ = ["is_lora_layer", "replacement_through_lora", "adopt"]

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
                or foreign_hooks() or not _plain(mods.get(act), act_cls)):
            return hf_forward(self, *args, **kwargs)
        x = args[0] if args else next(iter(kwargs.values()))
        with RecipeTransform():
            return mods["down_proj"](producers.swiglu(mods["gate_proj"](x), mods["up_proj"](x)))


def _lora_mlp(new: nn.Module, hf_class: type) -> bool:
    """Turn a lean gated MLP (built against the base layers) into its LoRA-calling form; False if its
    gate is not covered (a fused gate_up_proj, or an activation other than SiLU)."""
    from .hf_swiglu import _LeanHFSwiGLU

    gated = getattr(new, "_leanact_gated", None)
    if not isinstance(new, (_LeanHFSwiGLU, _LoRASwiGLU)) or gated is None or len(gated[0]) != 3 or gated[3] != "silu":
        return False
    new.__class__ = lean_subclass(_LoRASwiGLU, hf_class)
    return True


def adopt(model: nn.Module) -> int:
    """Move the lean gated MLPs of ``model`` into which PEFT has since put LoRA layers to
    :class:`_LoRASwiGLU` (those not covered keep running HF's forward); returns how many moved."""
    from .hf_swiglu import _LeanHFSwiGLU

    moved = 0
    for m in model.modules():
        if isinstance(m, _LeanHFSwiGLU) and any(c is not None and is_lora_layer(c) for c in m._modules.values()):
            moved += _lora_mlp(m, type(m).__mro__[2])
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
