"""No KV cache in training: a patched model called with autograd in train mode gets ``use_cache=False``.

Hugging Face causal LMs default to ``use_cache=True`` (GPT-2 too), so a training forward builds a
cache of every layer's keys and values that nothing reads and that lives as long as the output:
4 more B/sbh per GPT-2 layer on top of leanact's 20.57. A forward pre-hook on the model passes
``use_cache=False`` when the call is a training call (train mode, grad enabled) that did not ask for a
cache itself (no ``use_cache`` argument, no ``past_key_values``). The loss and gradients do not
change; ``past_key_values`` of such a call is None. Evaluation and ``generate`` are untouched.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

__all__ = ["install", "remove", "installed"]


def _no_training_cache(module: nn.Module, args, kwargs):
    if (module.training and torch.is_grad_enabled() and "use_cache" not in kwargs
            and kwargs.get("past_key_values") is None and getattr(module.config, "use_cache", False)):
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
