"""One composable pipeline over ``torch.autograd.graph.saved_tensors_hooks``.

torch applies only the innermost saved-tensor hooks, so two features built on them (a memory
meter, recompute-from-recipe, offloading, compression) would shadow each other. leanact routes all
of them through this module instead:

* a **transform** (:class:`SavedTensorTransform`) may replace a tensor about to be kept by
  something smaller (a recipe to recompute it, a CPU copy, a compressed copy). The innermost
  active transform that claims a tensor wins; unclaimed tensors are kept as they are.
* an **observer** (:class:`SavedTensorObserver`, e.g. the meter) sees what is finally kept,
  whatever the nesting order, and every unpack.

Every ``with`` of a transform or observer pushes the same pair of torch hooks, so the pipeline
also works when entered inside someone else's hooks (e.g. inside a checkpointed region).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from leanact._local import setting

__all__ = ["SavedTensorTransform", "SavedTensorObserver", "active_transforms"]

_state = threading.local()
#: the number the next autograd node made on this thread gets (a private torch API: where it is
#: missing, saved outputs are kept as they are, as before)
_sequence_nr = getattr(torch._C._autograd, "_get_sequence_nr", lambda: -1)


def _stacks() -> tuple[list["SavedTensorTransform"], list["SavedTensorObserver"]]:
    if not hasattr(_state, "transforms"):
        _state.transforms, _state.observers = [], []
    return _state.transforms, _state.observers


def active_transforms() -> list["SavedTensorTransform"]:
    """Transforms active on this thread, outermost first."""
    return list(_stacks()[0])


class _Packed:
    __slots__ = ("value", "transform", "tokens", "version", "__weakref__")

    def __init__(self, value: Any, transform: "SavedTensorTransform | None", tokens: list[tuple[Any, Any]],
                 version: int):
        self.value = value  # the tensor itself, or what the transform returned
        self.transform = transform
        self.tokens = tokens  # (observer, token) pairs
        self.version = version  # of the tensor kept as is, at pack time


def _check_version(t: torch.Tensor, version: int) -> None:
    # torch skips its own saved-tensor version check when saved_tensors_hooks are active, so the
    # pipeline does it: a tensor kept for backward and modified in place since must raise.
    if t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected version "
            f"{version} instead (checked by leanact's saved-tensor pipeline). Hint: do not modify in "
            "place a tensor that autograd keeps for backward; use an out-of-place op (e.g. x = x + 1)."
        )


def _is_own_output(t: torch.Tensor) -> bool:
    """Whether ``t`` is an output of the autograd node now keeping it: nodes are numbered in the
    order they are made on this thread, and the node keeping a tensor is the newest one."""
    node = t.grad_fn
    return node is not None and node._sequence_nr() == _sequence_nr() - 1


def _pack(t: torch.Tensor) -> _Packed:
    transforms, observers = _stacks()
    value, owner = t, None
    for tr in reversed(transforms):  # innermost first
        packed = tr.pack(t)
        if packed is not None:
            value, owner = packed, tr
            break
    if owner is None and _is_own_output(t):
        # the output of the node that keeps it (exp, leanact's GELU and norms from their output):
        # torch hands a pack hook the tensor with its grad_fn, so keeping it as is would make
        # node -> packed -> t -> node a cycle through C++ that no gc.collect() frees, and a graph
        # that is never backpropagated (an out-of-memory error mid-step, a loss computed with grad
        # on and dropped) would leak. Kept detached instead, as torch itself keeps saved outputs:
        # unpacking re-attaches the node, and detach() shares t's version counter. Inputs stay the
        # tensors themselves (recipes hold them weakly and rely on the graph keeping them).
        value = t.detach()
    kept = [t] if owner is None else owner.kept_tensors(value)
    tokens = [(ob, ob.on_pack(t, kept)) for ob in observers]
    packed = _Packed(value, owner, tokens, t._version)
    for ob in observers:
        ob._track(packed)
    return packed


class _Released:
    """Stands in for the transform of a packed tensor whose graph was released."""

    def unpack(self, _value: Any) -> torch.Tensor:
        raise RuntimeError(
            "leanact: the tensors this graph saved for backward were released after measuring "
            "(SavedTensorMeter.release()); run the forward pass again to backpropagate.")


_RELEASED = _Released()


def release(packed: list) -> int:
    """Drop what each still-alive packed tensor keeps (weak references from an observer's
    ``_track``); a later backward through them raises. Breaks the reference cycle
    node -> packed -> kept output -> its grad_fn node that Python saved-tensor hooks create for
    ops that keep their own output, so a forward that will never be backpropagated is freed."""
    n = 0
    for ref in packed:
        p = ref()
        if p is not None and p.transform is not _RELEASED:
            p.value, p.transform, p.tokens = None, _RELEASED, []
            n += 1
    return n


def _unpack(p: _Packed) -> torch.Tensor:
    for ob, token in p.tokens:
        ob.on_unpack(token)
    if p.transform is None:
        if not getattr(_state, "introspecting", False):
            _check_version(p.value, p.version)
        return p.value
    if getattr(_state, "introspecting", False):
        return torch.empty(0)  # an observer is only looking: do not rebuild (recompute, copy back)
    return p.transform.unpack(p.value)


@contextlib.contextmanager
def introspecting():
    """While active, unpacking a transformed tensor returns an empty placeholder instead of
    rebuilding it (the meter walks the graph this way without triggering recomputation)."""
    with setting(_state, "introspecting", True):
        yield


class _PipelineMember:
    """Context-manager plumbing shared by transforms and observers."""

    def _pipeline_stack(self) -> list:
        raise NotImplementedError

    def __enter__(self):
        cm = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        cm.__enter__()
        self._pipeline_stack().append(self)
        self.__dict__.setdefault("_hook_cms", []).append(cm)
        return self

    def __exit__(self, *exc) -> None:
        stack = self._pipeline_stack()
        # remove the most recent occurrence of self (contexts are properly nested)
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is self:
                del stack[i]
                break
        self._hook_cms.pop().__exit__(*exc)


class SavedTensorTransform(_PipelineMember):
    """Replaces some tensors about to be saved for backward by a smaller representation."""

    def _pipeline_stack(self) -> list:
        return _stacks()[0]

    def pack(self, t: torch.Tensor) -> Any | None:
        """Return a packed representation of ``t``, or None to leave ``t`` to others."""
        raise NotImplementedError

    def unpack(self, packed: Any) -> torch.Tensor:
        """Rebuild the tensor from what :meth:`pack` returned."""
        raise NotImplementedError

    def kept_tensors(self, packed: Any) -> list[torch.Tensor]:
        """Tensors (on any device) that ``packed`` keeps alive, for the meter."""
        return []

    def may_replace(self, t: torch.Tensor) -> bool:
        """Whether :meth:`pack` might replace ``t`` (default: yes). A transform that knows it leaves
        some tensors as they are says so, so that inner transforms may count on them being kept."""
        return True


class SavedTensorObserver(_PipelineMember):
    """Sees every saved tensor and what is finally kept for it."""

    def _pipeline_stack(self) -> list:
        return _stacks()[1]

    def on_pack(self, original: torch.Tensor, kept: list[torch.Tensor]) -> Any:
        """Called at pack time; the return value is handed back to :meth:`on_unpack`."""
        return None

    def on_unpack(self, token: Any) -> None:
        pass

    def _track(self, packed: "_Packed") -> None:
        """Called with every packed object (subclasses may keep weak references to it)."""


@contextlib.contextmanager
def disabled():
    """Temporarily run with no leanact transforms (observers still see packs)."""
    transforms, _ = _stacks()
    saved = list(transforms)
    transforms.clear()
    try:
        yield
    finally:
        transforms[:] = saved
