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

While hooks are pushed, every tensor any op keeps costs a Python pack and unpack call. A transform
that cares about few ops can be made **ambient** (:class:`ambient`): set for a whole forward, but
active only inside :class:`with_ambient` blocks (the ops whose saves it needs), and told directly by
ops that keep their own output (:func:`keeping_output`). A tensor kept as is that is the output of
the node keeping it is kept detached (as torch keeps saved outputs): a graph that is never
backpropagated is then freed, where ``node -> packed -> tensor -> node`` would be a cycle through
C++ that ``gc.collect()`` cannot break.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import torch

from leanact._local import setting

__all__ = ["foreign_hooks", "SavedTensorTransform", "SavedTensorObserver", "active_transforms", "ambient",
           "with_ambient", "keeping_output", "unobserved_ambient"]

_state = threading.local()
#: the number the next autograd node made on this thread gets (a private torch API: where it is
#: missing, saved outputs are kept as they are, as before)
_sequence_nr = getattr(torch._C._autograd, "_get_sequence_nr", lambda: -1)


_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _stacks() -> tuple[list["SavedTensorTransform"], list["SavedTensorObserver"]]:
    try:
        return _state.stacks
    except AttributeError:
        _state.stacks = ([], [])
        return _state.stacks


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
    for i in range(len(transforms) - 1, -1, -1):  # innermost first
        tr = transforms[i]
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
    if not observers:
        return _Packed(value, owner, _NO_TOKENS, t._version)
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
    ``_track``); a later backward through them raises: what a forward that will never be
    backpropagated keeps is freed at once, while its graph may still be referenced."""
    n = 0
    for ref in packed:
        p = ref()
        if p is not None and p.transform is not _RELEASED:
            p.value, p.transform, p.tokens = None, _RELEASED, []
            n += 1
    return n


_NO_TOKENS: list = []  # shared, never appended to (release() replaces a packed's list)


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
        # what torch.autograd.graph.saved_tensors_hooks does on entry and exit, without making one
        # per call (entered around every Linear of a patched model under autocast)
        _push_hooks(_pack, _unpack)
        self._pipeline_stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        stack = self._pipeline_stack()
        # remove the most recent occurrence of self (contexts are properly nested)
        if stack and stack[-1] is self:
            del stack[-1]
        else:
            for i in range(len(stack) - 1, -1, -1):
                if stack[i] is self:
                    del stack[i]
                    break
        _pop_hooks()


class ambient:  # noqa: N801 - a context manager used like a function
    """``with ambient(transform)``: ``transform`` becomes this thread's ambient transform, active only
    inside :class:`with_ambient` blocks (the ops whose saves it cares about) instead of around every
    op: the saves of all other ops then skip the Python pipeline (each kept tensor costs a Python
    pack and unpack call while hooks are pushed). The previous ambient transform is restored on exit."""

    __slots__ = ("_transform", "_previous")

    def __init__(self, transform: "SavedTensorTransform"):
        self._transform = transform

    def __enter__(self) -> "SavedTensorTransform":
        self._previous = _state.__dict__.get("ambient")
        _state.ambient = self._transform
        return self._transform

    def __exit__(self, *exc) -> None:
        _state.ambient = self._previous


def foreign_hooks() -> bool:
    """Whether torch's innermost saved-tensor hooks are someone else's (e.g. inside a
    ``torch.utils.checkpoint`` region or its recompute), or torch.func transforms (which disable
    saved-tensor hooks altogether) are active. Entering a transform there would shadow them (torch
    applies only the innermost hooks), so leanact's transforms then stay out."""
    if torch._C._are_functorch_transforms_active():
        return True
    top = _top_hooks(False) if _top_hooks is not None else None
    return top is not None and top[0] is not _pack


def unobserved_ambient() -> tuple[bool, "SavedTensorTransform | None"]:
    """``(True, the ambient transform or None)`` when no saved tensor passes through any hooks now
    (no pipeline member active, no saved-tensor hooks pushed, no torch.func transform, grad on, not
    compiling): an op may then give its own saved tensors per-tensor hooks after it ran
    (``register_hooks`` on its node's saved tensors) instead of pushing hooks around it, and nobody
    misses a save. Else ``(False, None)``."""
    stacks = _stacks()
    if (stacks[0] or stacks[1] or not torch.is_grad_enabled() or torch.compiler.is_compiling()
            or torch._C._are_functorch_transforms_active()):
        return False, None
    if _top_hooks is None or _top_hooks(False) is not None:
        return False, None
    return True, _state.__dict__.get("ambient")


class with_ambient:  # noqa: N801 - a context manager used like a function
    """Activate the ambient transform (:class:`ambient`) for the block, where one is set, it is not
    active already, grad is on, nothing compiles and the innermost hooks are leanact's (or none).
    It joins the stack at the bottom, where a transform entered around the whole forward would be:
    transforms entered since (a strategy's offload, compression) still pack first."""

    __slots__ = ("_active",)

    def __enter__(self) -> None:
        tr = _state.__dict__.get("ambient")
        self._active = None
        if tr is None or not torch.is_grad_enabled():
            return
        stack = _stacks()[0]
        if any(t is tr for t in stack) or torch.compiler.is_compiling() or foreign_hooks():
            return
        _push_hooks(_pack, _unpack)
        stack.insert(0, tr)
        self._active = tr

    def __exit__(self, *exc) -> None:
        tr = self._active
        if tr is None:
            return
        self._active = None
        stack = _stacks()[0]
        for i, t in enumerate(stack):
            if t is tr:
                del stack[i]
                break
        _pop_hooks()


def keeping_output(apply: Callable[[], torch.Tensor], output_kept: bool = True) -> torch.Tensor:
    """``apply()``, an op that keeps its own output for backward when ``output_kept`` (a norm or
    GELU keeping its output), run so that the ambient transform (:class:`ambient`) learns what it
    keeps: with no transform active (no strategy, no compression: a plain patched model under
    autocast), no hooks are pushed and the transform is told directly
    (:meth:`SavedTensorTransform.kept_as_is`); otherwise inside :class:`with_ambient`."""
    tr = _state.__dict__.get("ambient")
    if tr is None:
        return apply()
    if not _stacks()[0] and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        if foreign_hooks():
            return apply()  # a checkpointed region: nothing of it is kept (with_ambient stays out too)
        y = apply()
        if output_kept:
            tr.kept_as_is(y)
        return y
    with with_ambient():
        return apply()


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

    def kept_as_is(self, t: torch.Tensor) -> None:
        """Told, as the ambient transform (:func:`keeping_output`), that the op that made ``t``
        keeps it for backward as it is, where no transform is active to see that save."""

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
