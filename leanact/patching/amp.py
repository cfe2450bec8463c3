"""Under ``torch.autocast``, a patched model's forward runs inside a recipe transform.

Autocast casts each low-precision op's input itself, and the op keeps that 16-bit cast: beside
the fp32 norm output the norm keeps (the residual stream is fp32 under autocast), each of Q, K, V
and the FFN's first Linear kept one more copy (2 B/element each). Inside a
:class:`~leanact.recompute.RecipeTransform` these casts are kept as recipes rebuilt from the kept
fp32 tensor in backward (:mod:`leanact.recompute.casts`: the same cast, so bitwise the same
tensor). The transform is entered around the model's forward (:class:`ContextForward`: one frame,
nothing can leave it active) only while autocast is enabled for the CPU or CUDA, with grad on and
outside foreign saved-tensor hooks; without autocast the forward is unchanged.
"""
from __future__ import annotations

import threading

from torch import nn

from ..ops.amp import autocast_dtype
from ..recompute.context_forward import ContextForward, unwrap_forward, wrap_forward
from ..recompute.recipes import RecipeTransform

__all__ = ["AutocastRecipes", "install", "remove"]

_DEVICES = ("cuda", "cpu")


class AutocastRecipes:
    """Context manager: a fresh :class:`RecipeTransform` while autocast is on, else nothing.

    Re-entrant and per thread (nested or concurrent forwards each get their own)."""

    def __init__(self):
        self._local = threading.local()

    def __enter__(self) -> "AutocastRecipes":
        stack = self._local.__dict__.setdefault("stack", [])
        tr = RecipeTransform() if any(autocast_dtype(d) is not None for d in _DEVICES) else None
        if tr is not None:
            tr.__enter__()
        stack.append(tr)
        return self

    def __exit__(self, *exc) -> None:
        tr = self._local.stack.pop()
        if tr is not None:
            tr.__exit__(*exc)

    def __reduce__(self):  # deepcopy / pickle of a patched model: a fresh, idle one
        return (AutocastRecipes, ())


def install(model: nn.Module) -> ContextForward:
    """Wrap ``model.forward`` (see module doc); returns the wrapper for :func:`remove`."""
    return wrap_forward(model, AutocastRecipes())


def remove(model: nn.Module, wrapper: ContextForward | None) -> None:
    """Undo :func:`install`."""
    unwrap_forward(model, wrapper)
