"""What a family adapter is: the two kinds of rule :func:`leanact.patch` walks.

* A :class:`ModuleAdapter` recognises one kind of module (from its structure and forward, not its
  class name) and builds its lean twin around the same Parameters, or says why it leaves it.
* A :class:`ModelStep` changes the whole model (the attention implementation of its configs, the
  fused head, forward wrappers) and undoes that change.

:mod:`leanact.patching.registry` lists both in the order ``patch`` applies them; ``unpatch`` undoes the
steps in reverse, each putting back the modules it swapped. Adding a family is a module with its
adapter and one line in the registry.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from .patch_summary import PatchSummary

__all__ = ["ModuleAdapter", "ModelStep", "PatchRun", "Replacement", "ATTR"]

#: the attribute of a patched model holding its :class:`PatchRun`
ATTR = "_leanact_patch"

#: (lean twin, None) to replace; (None, reason) to leave the module and say why in the summary;
#: (None, None) to leave it silently (already lean, or nothing to reduce).
Replacement = tuple["nn.Module | None", "str | None"]


@dataclass(frozen=True)
class ModuleAdapter:
    """One kind of module leanact replaces.

    ``recognises(m)``: cheap and structural (which parameters and children ``m`` has). Only a module
    it recognises is given to ``replacement(m)``, which checks the forward's code and state and returns
    a :data:`Replacement`. ``covers``: the modules it is for, in words (docs and ``leanact.adapters()``).
    """

    name: str
    recognises: Callable[[nn.Module], bool]
    replacement: Callable[[nn.Module], Replacement]
    covers: str


@dataclass(frozen=True)
class ModelStep:
    """A change to the whole model. ``install(model, run)`` makes it and records what it did in
    ``run.summary``; ``uninstall(model, run)`` (None: nothing but the module swaps) undoes it. Modules
    swapped through :meth:`PatchRun.swap` are put back after ``uninstall``, by the engine."""

    name: str
    install: Callable[[nn.Module, "PatchRun"], None]
    uninstall: Callable[[nn.Module, "PatchRun"], None] | None = None


@dataclass
class PatchRun:
    """One patch of one model: the options it was given, the summary being written, each step's
    module swaps and its state. Kept on the model until ``unpatch`` (and copied with it)."""

    attention: str | bool
    fused_loss: bool
    cast_recipes: bool
    late_head_grad: bool | None = None  # (leanact.patch's argument)
    summary: PatchSummary = field(default_factory=PatchSummary)
    #: (step name, parent, attribute name, original child), in the order made
    swaps: list[tuple[str, nn.Module, str, nn.Module]] = field(default_factory=list)
    #: step name -> what its install left for its uninstall
    state: dict[str, Any] = field(default_factory=dict)
    step: str = ""  # the step running now (its swaps are recorded under it)
    installed: list[str] = field(default_factory=list)  # the steps whose install ran (or began)

    def swap(self, parent: nn.Module, name: str, new: nn.Module, label: str, qualname: str) -> None:
        """Put ``new`` in place of ``parent.<name>`` and record it: a row of the summary (``label``: what
        it became) and the original, which ``unpatch`` puts back."""
        original = parent._modules[name]
        parent._modules[name] = new
        self.swaps.append((self.step, parent, name, original))
        self.summary.replaced.append((qualname, type(original).__name__, label))
