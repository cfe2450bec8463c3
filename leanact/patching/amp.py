"""Under ``torch.autocast``, a patched model's forward runs with a recipe transform.

Autocast casts each low-precision op's input itself, and the op keeps that 16-bit cast: beside
the fp32 norm output the norm keeps (the residual stream is fp32 under autocast), each of Q, K, V
and the FFN's first Linear kept one more copy (2 B/element each). With a
:class:`~leanact.recompute.RecipeTransform` these casts are kept as recipes rebuilt from the kept
fp32 tensor in backward (:mod:`leanact.recompute.casts`: the same cast, so bitwise the same
tensor). It is set up around the model's forward (:class:`ContextForward`: one frame, nothing can
leave it active) only while autocast is enabled for the CPU or CUDA, with grad on and outside
foreign saved-tensor hooks; without autocast the forward is unchanged.

Where the model's Linear layers are wrapped by ``recast_weights`` (the default), the transform is
*ambient* (:class:`leanact.saved.ambient`): active only inside the norms that keep their output
(the sources of those casts) and the wrapped Linear layers (where the casts are kept), so the
other ops' saves (attention, dropout, GELU, residual adds, Hugging Face's own ops) skip the Python
saved-tensor pipeline. Otherwise it is active around the whole forward.
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable

from torch import nn

from ..ops.amp import autocast_dtype
from ..recompute.context_forward import ContextForward, unwrap_forward, wrap_forward
from ..recompute.recipes import RecipeTransform
from ..saved import ambient
from . import weight_recast
from .adapter import ModelStep, PatchRun

__all__ = ["AutocastRecipes", "install", "remove", "STEP"]

_DEVICES = ("cuda", "cpu")


class AutocastRecipes:
    """Context manager: a fresh :class:`RecipeTransform` while autocast is on, else nothing.

    Re-entrant and per thread (nested or concurrent forwards each get their own)."""

    def __init__(self, scoped: Callable[[], bool] = lambda: False):
        self._local = threading.local()
        self._scoped = scoped  # whether the casts are kept only inside wrapped Linear layers (module doc)

    def __enter__(self) -> "AutocastRecipes":
        stack = self._local.__dict__.setdefault("stack", [])
        cm = None
        if any(autocast_dtype(d) is not None for d in _DEVICES):
            tr = RecipeTransform()
            cm = ambient(tr) if self._scoped() else tr
            cm.__enter__()
        stack.append(cm)
        return self

    def __exit__(self, *exc) -> None:
        cm = self._local.stack.pop()
        if cm is not None:
            cm.__exit__(*exc)

    def __reduce__(self):  # deepcopy / pickle of a patched model: a fresh, idle one (whole-forward:
        return (AutocastRecipes, ())  # the copy's own Linear wrappers are not known here)


def install(model: nn.Module) -> ContextForward:
    """Wrap ``model.forward`` (see module doc); returns the wrapper for :func:`remove`."""
    ref = weakref.ref(model)

    def scoped() -> bool:
        m = ref()
        return m is not None and weight_recast.wraps_linears(m)

    return wrap_forward(model, AutocastRecipes(scoped))


def remove(model: nn.Module, wrapper: ContextForward | None) -> None:
    """Undo :func:`install`."""
    unwrap_forward(model, wrapper)


def _install(model: nn.Module, run: PatchRun) -> None:
    if run.cast_recipes:
        run.state["cast_recipes"] = install(model)


STEP = ModelStep("cast_recipes", _install, lambda model, run: remove(model, run.state.get("cast_recipes")))
