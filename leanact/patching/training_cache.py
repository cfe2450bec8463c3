"""No KV cache in training: a patched model called with autograd in train mode gets ``use_cache=False``.

Hugging Face causal LMs default to ``use_cache=True`` (GPT-2 too), so a training forward builds a
cache of every layer's keys and values that nothing reads and that lives as long as the output:
4 more B/sbh per GPT-2 layer on top of leanact's 20.57. A forward pre-hook on the model passes
``use_cache=False`` when the call is a training call (train mode, grad enabled) that did not ask for a
cache itself (no ``use_cache`` argument, no ``past_key_values`` / ``cache``). The loss and gradients do not
change; ``past_key_values`` of such a call is None. Evaluation and ``generate`` are untouched.

Packed sequences (``position_ids`` restarting at 0 and no ``attention_mask``, as
``DataCollatorWithFlattening`` and padding-free packing produce) keep the cache: transformers' mask
builder separates packed sequences only when the call has no cache, so an unpatched model called
with its default ``use_cache=True`` attends across the restarts and one called with
``use_cache=False`` does not. Dropping the cache there would change the loss. The cache holds the
keys and values that attention keeps for backward anyway (the same tensors), so keeping it costs
little; pass ``use_cache=False`` to separate the sequences (patched and unpatched alike).
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from .adapter import ModelStep, PatchRun

__all__ = ["install", "remove", "installed", "STEP"]


def _argument(module: nn.Module, args, kwargs, name: str):
    """The value of ``name`` in this call of ``module.forward`` (by keyword or by position), else None."""
    if name in kwargs:
        return kwargs[name]
    if args:
        try:
            return inspect.signature(module.forward).bind_partial(*args).arguments.get(name)
        except TypeError:
            return None
    return None


def _packed_format(module: nn.Module, args, kwargs) -> bool:
    """``position_ids`` without ``attention_mask``: the mask builder's packed-sequence detection depends
    on whether the call has a cache (module doc), so the cache stays."""
    return (_argument(module, args, kwargs, "position_ids") is not None
            and _argument(module, args, kwargs, "attention_mask") is None)


def _no_training_cache(module: nn.Module, args, kwargs):
    if (module.training and torch.is_grad_enabled() and "use_cache" not in kwargs
            and _argument(module, args, kwargs, "past_key_values") is None
            and _argument(module, args, kwargs, "cache") is None  # transformers >= 5.24's name
            and getattr(module.config, "use_cache", False) and not _packed_format(module, args, kwargs)):
        kwargs["use_cache"] = False
        return args, kwargs
    return None


def _takes_use_cache(model: nn.Module) -> bool:
    try:
        return "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def install(model: nn.Module) -> bool:
    """Register the pre-hook on ``model`` if it is a Hugging Face model whose forward takes ``use_cache``."""
    if not hasattr(getattr(model, "config", None), "use_cache") or not _takes_use_cache(model):
        return False
    if not installed(model):
        model.register_forward_pre_hook(_no_training_cache, with_kwargs=True)
    return True


def installed(model: nn.Module) -> bool:
    return any(h is _no_training_cache for h in model._forward_pre_hooks.values())


def remove(model: nn.Module) -> None:
    """Remove the pre-hook (found by identity: also on deep copies and unpickled models)."""
    for key, h in list(model._forward_pre_hooks.items()):
        if h is _no_training_cache:
            del model._forward_pre_hooks[key]
            model._forward_pre_hooks_with_kwargs.pop(key, None)


def _install(model: nn.Module, run: PatchRun) -> None:
    if install(model):
        run.summary.notes.append("use_cache=False for training calls (train mode, grad on): no KV cache kept")


STEP = ModelStep("training_cache", _install, lambda model, run: remove(model))
