"""A module's forward run inside a context manager, in one frame.

A forward pre-hook / always-called forward hook pair cannot guarantee that a context entered
before a forward is left after it: torch runs always-called hooks after an ``Exception`` only,
so a ``KeyboardInterrupt`` inside the forward would leave the context (saved-tensor hooks, a
compression mode) active for the thread. :class:`ContextForward` replaces ``module.forward`` on
the instance by ``with context: forward(...)`` instead; ``inspect.signature`` still sees the
module's own forward (Trainer and ``generate`` read it), the class and the state_dict are unchanged.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from ..saved import foreign_hooks

__all__ = ["ContextForward", "wrap_forward", "unwrap_forward"]


class ContextForward:
    """``module.forward`` that runs the module's previous forward inside ``with context``. Not entered
    without grad, while compiling, or under foreign saved-tensor hooks (a checkpointed region keeps
    checkpoint's behaviour). ``previous``: a forward set on the instance before (None: the class's).
    ``context = None`` makes the wrapper inert (left in a chain that another library wrapped since)."""

    def __init__(self, module: nn.Module, context, previous: Callable | None = None):
        self.module, self.context, self.previous = module, context, previous

    def _forward(self) -> Callable:
        if self.previous is not None:
            return self.previous
        # functools.partial, not ``type(m).forward.__get__(m)``: Dynamo resolves a bound ``forward`` of a
        # module through the instance (this wrapper again), which recursed without end under torch.compile
        return functools.partial(type(self.module).forward, self.module)

    @property
    def __signature__(self):
        import inspect

        return inspect.signature(self._forward())

    def __call__(self, *args, **kwargs):
        forward = self._forward()
        if (self.context is None or not torch.is_grad_enabled() or torch.compiler.is_compiling()
                or foreign_hooks()):
            return forward(*args, **kwargs)
        with self.context:
            return forward(*args, **kwargs)


def wrap_forward(module: nn.Module, context) -> ContextForward:
    """Set ``module.forward`` to a :class:`ContextForward` around its current forward; returns it."""
    wrapper = ContextForward(module, context, module.__dict__.get("forward"))
    module.__dict__["forward"] = wrapper
    return wrapper


def unwrap_forward(module: nn.Module, wrapper: ContextForward | None) -> None:
    """Undo :func:`wrap_forward` (if something wrapped the forward again since, ``wrapper`` is made inert)."""
    if wrapper is None:
        return
    if module.__dict__.get("forward") is wrapper:
        if wrapper.previous is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = wrapper.previous
    else:
        wrapper.context = None
