"""How leanact's ops behave on fake tensors: the one interface between the ops and leanact.estimate.

leanact.estimate runs a training step on fake tensors (``FakeTensorMode``: shapes, dtypes and
allocations, no values) to predict its memory. Some of the ops cannot run there as they run on real
tensors (a decision read from the values of γ, β; a lookup table built by boolean indexing), and
some would allocate there otherwise than on the device the estimate models (fake tensors sit on the
CPU, where the CUDA path's Triton kernels do not run). Each op says here what it does instead, next
to its own code, and the estimator enters every rule without knowing any op's insides:

- :func:`register` ``(name, rule=..., warm=..., prepare=...)``, called by the op's module when it
  is imported: ``rule(run)`` a context manager in force around the fake step (``run``: the
  :class:`FakeRun`), ``warm(model, dtype)`` run on real tensors before it (caches the op builds
  lazily with operations fake tensors cannot run), ``prepare()`` run before a *measured* real step
  (per-process caches created first, so that the measurement does not depend on what ran before);
- :func:`rules` enters every registered rule, :func:`warm` and :func:`prepare` call every warm-up;
- :func:`faking`: whether a fake mode is active now (a rule changes nothing outside one);
  :func:`swapped`: how a rule replaces functions of its own op for the block; :func:`hold_slice`:
  how it counts a per-process cache it slices.

The Triton kernels' rule is registered here (:func:`_triton_kernels`): on fake tensors modelling
CUDA every op's launchers allocate what the kernels allocate.

A rule changes what the op allocates, never what it keeps for backward: the estimate's saved bytes
are the op's own.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch

__all__ = ["FakeRun", "register", "rules", "warm", "prepare", "faking", "hold_slice", "swapped"]


@dataclass
class FakeRun:
    """What the rules of one fake step know: the device modelled, the real tensors behind the fake
    ones, and where the ops report what they hold on the device across steps."""

    #: "cpu" or "cuda": the device whose kernels the estimate models
    kind: str
    #: multiprocessors of the modelled GPU (``kind == "cuda"``)
    sms: int = 0
    #: id(fake tensor) -> the real tensor it was made from (absent: built from a config or on meta)
    real_of: dict = field(default_factory=dict)
    #: loops whose iterations allocate alike run only the iterations that set the peak (the first
    #: two, the last ones): the same allocations and peak in a fraction of the time
    fewer_iterations: bool = True
    #: what the ops hold on the device across steps, filled while the rules are in force: what
    #: (e.g. "GELU table g16 bfloat16 none") -> bytes
    held: dict = field(default_factory=dict)
    #: the slices of per-process caches kept alive until the estimate ends (:func:`hold_slice`)
    cache_slices: dict = field(default_factory=dict, repr=False)


@dataclass
class _Entry:
    rule: Callable[[FakeRun], ContextManager] | None
    warm: Callable[[torch.nn.Module, torch.dtype], None] | None
    prepare: Callable[[], None] | None


_REGISTRY: dict[str, _Entry] = {}


def register(name: str, *, rule: Callable[[FakeRun], ContextManager] | None = None,
             warm: Callable[[torch.nn.Module, torch.dtype], None] | None = None,
             prepare: Callable[[], None] | None = None) -> None:
    """Register (or replace) the fake-tensor behaviour of the op ``name`` (module doc)."""
    _REGISTRY[name] = _Entry(rule, warm, prepare)


@contextlib.contextmanager
def rules(run: FakeRun):
    """Every registered rule in force (entered in the order of registration, left in reverse)."""
    with contextlib.ExitStack() as stack:
        for entry in list(_REGISTRY.values()):
            if entry.rule is not None:
                stack.enter_context(entry.rule(run))
        yield run


def warm(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Run every op's warm-up for ``model`` computing in ``dtype``, on real tensors."""
    for entry in list(_REGISTRY.values()):
        if entry.warm is not None:
            entry.warm(model, dtype)


def prepare() -> None:
    """Create every op's per-process caches before a measured step."""
    for entry in list(_REGISTRY.values()):
        if entry.prepare is not None:
            entry.prepare()


def faking() -> bool:
    """Whether a ``FakeTensorMode`` is active in this thread now."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(m, torch._subclasses.fake_tensor.FakeTensorMode) for m in _get_current_dispatch_mode_stack())


@contextlib.contextmanager
def swapped(owner, **values):
    """For the block, ``owner``'s attributes (an op's module, a class of it) named by ``values`` set
    to them, then restored; a value None leaves its attribute as it is. How a rule replaces a
    function of its own op."""
    values = {k: v for k, v in values.items() if v is not None}
    saved = {k: getattr(owner, k) for k in values}
    for k, v in values.items():
        setattr(owner, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(owner, k, v)


def hold_slice(run: FakeRun, get_cache: Callable[[], torch.Tensor]) -> None:
    """For an op that slices a per-process cache (an int64 arange of its CPU path): build the cache
    on real tensors if missing, slice it under the fake mode and keep the slice alive until the
    estimate ends, as the memory tracker counts a cache's storage at its first slice in the step and
    never frees it."""
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        cache = get_cache()
        cache = cache._base if cache._base is not None else cache
    if id(cache) not in run.cache_slices:
        run.cache_slices[id(cache)] = cache[:1]


@contextlib.contextmanager
def _triton_kernels(run: FakeRun):
    """Modelling CUDA, every op's Triton launchers run on fake tensors and allocate what their
    kernels allocate there (outputs, partial sums), instead of the temporaries of the PyTorch path;
    nothing changes under ``LEANACT_TRITON=0`` (the GPU then runs the PyTorch path too)."""
    from .triton import dispatch

    if run.kind != "cuda" or not dispatch.enabled():
        yield
        return
    with dispatch.use_kernels(dispatch.SHAPES_ONLY, strict=True, fake=True):
        yield


register("triton kernels", rule=_triton_kernels)
