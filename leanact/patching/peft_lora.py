"""PEFT's LoRA layers inside modules that :func:`leanact.patch` replaces.

``get_peft_model`` replaces each targeted ``nn.Linear`` by a LoRA layer (``base_layer`` + ``lora_A``,
``lora_B``, ``lora_dropout``). Patching *after* it, a SwiGLU MLP whose projections are LoRA layers
is recognised by looking through them: the replacement is built against the base layers, then gets
the LoRA layers back as its children. This is done only for replacements whose forward calls the
projection modules (never their weights), so the adapters' contributions stay in: today the lean
SwiGLU MLP (:mod:`leanact.patching.hf_swiglu`). The LoRA layers' own dropouts are ``nn.Dropout``
modules and are swapped like any other. Patching *before* it, PEFT inserts its layers into the
already lean modules; its dropouts, created afterwards, keep a seed through
:mod:`leanact.patching.functional_dropout`.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

__all__ = ["is_lora_layer", "replacement_through_lora"]

Replace = Callable[[nn.Module], "tuple[nn.Module | None, str | None]"]


def is_lora_layer(m: nn.Module) -> bool:
    """A PEFT tuner layer wrapping a ``base_layer`` with LoRA adapters."""
    return (type(m).__module__.startswith("peft.tuners.") and isinstance(m._modules.get("base_layer"), nn.Module)
            and "lora_A" in m._modules)


def _calls_children(new: nn.Module) -> bool:
    from .hf_swiglu import _LeanHFSwiGLU

    return isinstance(new, _LeanHFSwiGLU)


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
    if not _calls_children(new) or new._modules is m._modules:
        return None, (f"{', '.join(loras)}: PEFT LoRA layers, which {type(new).__name__} would bypass")
    for k, c in loras.items():
        new._modules[k] = c
    return new, reason
