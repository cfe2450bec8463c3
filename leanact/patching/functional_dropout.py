"""``torch.nn.functional.dropout`` calls inside patched modeling code keep a seed, not a mask.

Hugging Face modeling files (BART, Whisper, mBART, ...) call ``nn.functional.dropout`` on hidden
states in their layers' forward; torch keeps a mask of the input's size for each such call. There
is no module to swap, so :func:`install` wraps the forward of every module whose own forward calls
it (:class:`~leanact.recompute.context_forward.ContextForward`: a ``with`` block in one frame, so
the override is left even on ``KeyboardInterrupt``) in :class:`_Scope`, which enters a thread-local
``TorchFunctionMode`` sending those calls to :func:`leanact.ops.dropout.function.dropout` (keeps one 8-byte
seed; the mask is regenerated from it in backward). Only training calls with ``0 < p``, grad enabled
and an input that requires grad are redirected; eval, ``no_grad``, ``p == 0``, inputs without grad
and calls under someone else's saved-tensor hooks (a checkpointed region, whose recompute runs
outside the forward) run torch's own dropout. The random stream differs from torch's (the masks are
drawn from leanact's counter-based hash), as with the swapped ``nn.Dropout`` modules.
"""
from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..ops.dropout.function import dropout as lean_dropout
from ..recompute.context_forward import ContextForward, unwrap_forward, wrap_forward
from ..recompute.recipes import foreign_hooks
from .hf_head import remove_mode
from .adapter import ModelStep, PatchRun

__all__ = ["DropoutState", "calls_functional_dropout", "install", "uninstall", "active", "STEP"]

_DROPOUT = torch.nn.functional.dropout
_local = threading.local()


@dataclass
class DropoutState:
    """Per patch: the classes whose forward was wrapped and the calls redirected so far."""

    classes: list[str] = field(default_factory=list)
    lean_calls: int = 0
    torch_calls: int = 0  # training calls with grad that ran torch's dropout (e.g. under checkpointing)


def _lean_call(x, p, training, inplace) -> bool:
    return (training and 0.0 < p <= 1.0 and isinstance(x, torch.Tensor) and x.is_floating_point()
            and x.requires_grad and torch.is_grad_enabled() and not foreign_hooks())


class _Mode(TorchFunctionMode):
    """Sends ``torch.nn.functional.dropout`` training calls to leanact's seeded dropout."""

    def __init__(self, state: DropoutState):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _DROPOUT:
            bound = inspect.signature(_DROPOUT).bind(*args, **kwargs)
            bound.apply_defaults()
            x, p, training, inplace = (bound.arguments[k] for k in ("input", "p", "training", "inplace"))
            if _lean_call(x, p, training, inplace):
                self.state.lean_calls += 1
                return lean_dropout(x, p, True, inplace)
            if training and p > 0 and torch.is_grad_enabled() and getattr(x, "requires_grad", False):
                self.state.torch_calls += 1
        return func(*args, **kwargs)


def active() -> bool:
    """Whether the override is active on this thread."""
    return bool(getattr(_local, "stack", None)) and any(m is not None for m in _local.stack)


class _Scope:
    """The context a wrapped forward runs in: enters the mode unless an outer scope already did.
    ``peft_root``: the patched model itself, whose scope enters the mode only once PEFT has been
    applied to it (``get_peft_model`` sets its ``peft_config``): LoRA's ``nn.Dropout`` modules created
    after patching then keep a seed too."""

    def __init__(self, state: DropoutState, peft_root: nn.Module | None = None):
        self.state, self.peft_root = state, peft_root

    def __enter__(self):
        stack = _local.__dict__.setdefault("stack", [])
        wanted = self.peft_root is None or "peft_config" in self.peft_root.__dict__
        if self.peft_root is not None and wanted and not self.__dict__.get("adopted"):
            from .peft_lora import adopt

            adopt(self.peft_root)  # lean MLPs into which PEFT put LoRA layers call them
            self.adopted = True
        mode = None if active() or not wanted else _Mode(self.state)
        if mode is not None:
            mode.__enter__()
        stack.append(mode)
        return self

    def __exit__(self, *exc):
        mode = _local.stack.pop()
        # Ours only: a mode entered inside the forward and left after it (the fused loss's window,
        # :mod:`leanact.patching.hf_head`) may still be above it.
        if mode is not None and mode in torch.overrides._get_current_function_mode_stack():
            remove_mode(mode)
        return False


def calls_functional_dropout(m: nn.Module) -> bool:
    """Whether a Hugging Face module's own forward calls ``nn.functional.dropout`` / ``F.dropout``
    (read from the names its code uses)."""
    t = type(m)
    if not t.__module__.startswith("transformers.models."):
        return False
    code = getattr(inspect.unwrap(t.forward), "__code__", None)
    names = set(code.co_names) if code is not None else set()
    return "dropout" in names and bool(names & {"functional", "F"})


def install(model: nn.Module) -> DropoutState | None:
    """Wrap the forward of every module of ``model`` that calls functional dropout, and ``model``'s own
    when it is a Hugging Face model (for PEFT applied after patching); None if nothing was wrapped."""
    state = DropoutState()
    for m in model.modules():
        if calls_functional_dropout(m) and not _wrapped(m):
            wrap_forward(m, _Scope(state))
            if type(m).__name__ not in state.classes:
                state.classes.append(type(m).__name__)
    if not _wrapped(model) and hasattr(model, "config") and type(model).__module__.startswith("transformers."):
        wrap_forward(model, _Scope(state, peft_root=model))
        return state
    return state if state.classes else None


def _wrapped(m: nn.Module) -> ContextForward | None:
    """The :class:`_Scope` wrapper in ``m``'s chain of instance forwards (None: not wrapped)."""
    f = m.__dict__.get("forward")
    while isinstance(f, ContextForward):
        if isinstance(f.context, _Scope):
            return f
        f = f.previous
    return None


def uninstall(model: nn.Module) -> None:
    """Remove the wrappers (found by type: also on deep copies and unpickled models)."""
    for m in model.modules():
        w = _wrapped(m)
        if w is not None:
            unwrap_forward(m, w)


def _install(model: nn.Module, run: PatchRun) -> None:
    run.summary.functional_dropout = install(model)


STEP = ModelStep("functional_dropout", _install, lambda model, run: uninstall(model))
