"""Keep a recipe instead of a cheap producer's output.

A *producer* (:mod:`leanact.recompute.producers`: a norm, an activation, a seeded dropout) keeps
its own input for its own exact backward anyway. Its output ``y`` is usually kept a second time
by the next op (a Linear keeps its input for the weight gradient; Q, K and V keep it three times,
one storage). While a :class:`RecipeTransform` is active, a producer registers a :class:`Recipe`
for ``y``: weak references to the tensors ``y`` is rebuilt from (the producer's input, a seed, γ
and β) with their ``_version`` at that moment, and a function rebuilding ``y`` with the very same
kernel (so the rebuilt tensor is bitwise equal to ``y``). When a later op saves ``y`` or any view
of it (same storage, same dtype, ``y`` not modified in place since), the transform keeps, instead
of ``y``:

    the recipe + strong references to its input tensors ("pins")

and the meter counts the pins, which are the very storages the producer keeps for itself: the
consumer's copy of ``y`` costs nothing. In backward, the first unpack rebuilds ``y`` once; every
other consumer of the same recipe (Q, K, V) is served the cached tensor (views are rebuilt with
``as_strided``); when every live consumer has been served (or the producer's own backward runs,
or the graph is freed), the cache is dropped. A second backward (``retain_graph=True``) simply
rebuilds again. If the original ``y`` is still alive and unmodified at unpack time, it is served
directly (no recompute).

Chains: a recipe input that is itself a registered output (or a view of one) is referenced
lazily through that output's recipe. Linear → GELU → Dropout → Linear therefore keeps the GELU
input (kept by the GELU for its own backward) and two seeds: the second Linear's copy of the
dropout output is rebuilt as dropout(gelu(u), seed).

Policy: a tensor is replaced by its recipe only when every tensor the recipe pins is kept for
backward anyway (it went through this pipeline kept as is, e.g. saved by the producer itself, or
is an ``nn.Parameter``), so the transform never keeps more than without it. Example: a dropout
applied to a plain Linear output (kept by nobody) leaves the next Linear keeping the dropout
output as usual; so does a dropout of a tensor that is alive but not saved (a model input).

Safety: every pinned tensor's ``_version`` is compared at unpack time; a change raises torch's
"modified by an inplace operation" error naming the leanact recipe. The registry holds only weak
references to outputs and recipe inputs (a recipe pins nothing until a consumer claims it), and
entries vanish with the output; nothing survives the graph. Gradients of gradients work: under
``create_graph=True`` the rebuild runs with grad mode on, from the original inputs.

Modifying ``y`` itself in place after a consumer saved it does not raise (torch would): the
consumer gets the value ``y`` had when it was saved, which is what its gradient needs.

With other transforms: a tensor kept as is by this transform but possibly replaced by another
kind of transform active outside it (offload, compression) does not count as kept, so no recipe
pins it (a pin would keep the original alive next to the offloaded copy).

Not covered: inside ``torch.compile`` regions producers do not register recipes (the compiled
graph's saved tensors pass through the pipeline as ordinary tensors; AOTAutograd's partitioner
decides what is kept there). The registry is process-wide (not per thread).
"""
from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from typing import Any, Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from leanact.saved import SavedTensorTransform, _stacks, active_transforms, disabled, foreign_hooks

from .casts import SharedCast, cast_recipe, cast_share, tag_kept
from .context_forward import unwrap_forward, wrap_forward

__all__ = ["Recipe", "RecipeTransform", "register", "release", "is_active", "has_recipe", "shared_cast",
           "foreign_hooks", "scope", "counters", "reset_counters", "cached_bytes", "live_recipes"]

_REGISTRY: dict[int, "Recipe"] = {}  # storage key of a live produced output -> its recipe
_KEPT: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()  # kept as-is
_CACHED: "weakref.WeakSet[Recipe]" = weakref.WeakSet()  # recipes holding a rebuilt tensor
_ALL: "weakref.WeakSet[Recipe]" = weakref.WeakSet()
_COUNTS: Counter = Counter()


def counters() -> dict[str, int]:
    """Event counts: ``registered``, ``claimed`` (saves replaced by a recipe), ``recompute`` and
    ``recompute:<producer>`` (outputs rebuilt), ``served_alive`` (original output still alive)."""
    return dict(_COUNTS)


def reset_counters() -> None:
    """Set every event count of :func:`counters` back to zero."""
    _COUNTS.clear()


def cached_bytes() -> int:
    """Bytes of rebuilt outputs currently cached (0 between steps)."""
    return sum(r._cache.untyped_storage().nbytes() for r in list(_CACHED) if r._cache is not None)


def live_recipes() -> int:
    """Recipes still alive (referenced by a live output or a not-yet-freed graph)."""
    return len(_ALL)


def _key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except Exception:  # sparse, nested, some subclasses
        return None


def is_active() -> bool:
    """Whether a :class:`RecipeTransform` is active on this thread (outside compiled regions)."""
    if torch.compiler.is_compiling():
        return False
    return any(isinstance(tr, RecipeTransform) for tr in active_transforms())


class _Leaf:
    """A recipe input tensor: weak reference (strong for tiny ones: seeds, whose aliases saved by
    the producer may not keep this very object alive) + version when the recipe was made."""

    __slots__ = ("ref", "version")

    def __init__(self, t: torch.Tensor):
        self.ref = (lambda: t) if t.numel() <= 8 else weakref.ref(t)
        self.version = t._version


class _Link:
    """A recipe input that is (a view of) another recipe's output: rebuilt lazily."""

    __slots__ = ("recipe", "size", "stride", "offset")

    def __init__(self, recipe: "Recipe", t: torch.Tensor):
        self.recipe, self.size, self.stride, self.offset = recipe, t.size(), t.stride(), t.storage_offset()


# Plain tensors only (a subclass may not share storage semantics); fake tensors are plain tensors
# for this purpose, so that leanact.estimate's fake step keeps what a real step keeps.
_OUTPUT_TYPES = (torch.Tensor, FakeTensor)
_FIND_TYPES = (torch.Tensor, nn.Parameter, FakeTensor)


def _find(t: torch.Tensor) -> "Recipe | None":
    """The recipe of the live, unmodified output that ``t`` is (a view of), if any."""
    if not _REGISTRY or type(t) not in _FIND_TYPES or t.layout != torch.strided:
        return None
    key = _key(t)
    r = _REGISTRY.get(key)
    if r is None:
        return None
    y = r.out_ref()
    if y is None or _key(y) != key or t.dtype != r.dtype or t._version != r.out_version:
        return None
    return r


class Recipe:
    """How to rebuild one producer output: ``fn(*inputs)`` (see module doc).

    ``inputs`` may hold tensors (kept weakly here, pinned by consumers that claim the output),
    outputs of other recipes (referenced lazily) and constants (passed through).
    """

    __slots__ = ("name", "fn", "inputs", "out_ref", "out_version", "dtype", "shape", "device_type", "_cache",
                 "_users", "_served", "_activated", "__weakref__")

    def __init__(self, name: str, fn: Callable[..., torch.Tensor], inputs: tuple, y: torch.Tensor):
        self.name, self.fn = name, fn
        self.inputs = tuple(self._entry(a) for a in inputs)
        self.out_version, self.dtype, self.shape, self.device_type = y._version, y.dtype, y.shape, y.device.type
        self._cache: torch.Tensor | None = None
        self._users: weakref.WeakSet = weakref.WeakSet()  # who will unpack: claims and parent recipes
        self._served: weakref.WeakSet = weakref.WeakSet()
        self._activated = False
        key = _key(y)

        def _gone(_ref, key=key):
            r = _REGISTRY.get(key)
            if r is not None and r.out_ref() is None:
                del _REGISTRY[key]

        self.out_ref = weakref.ref(y, _gone)
        _REGISTRY[key] = self
        _ALL.add(self)

    @staticmethod
    def _entry(a: Any):
        if not isinstance(a, torch.Tensor):
            return a
        r = _find(a)
        return _Link(r, a) if r is not None else _Leaf(a)

    # -- pack side ---------------------------------------------------------------------------
    def pins(self, out: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor] | None:
        """Input tensors (this recipe's and its links', by id) if all are alive, unmodified and
        kept for backward anyway; else None."""
        out = {} if out is None else out
        for e in self.inputs:
            if isinstance(e, _Leaf):
                t = e.ref()
                if t is None or t._version != e.version:
                    return None
                if not isinstance(t, nn.Parameter):
                    k = _key(t)
                    if k is None or _KEPT.get(k) is None:
                        return None
                out[id(t)] = t
            elif isinstance(e, _Link) and e.recipe.pins(out) is None:
                return None
        return out

    def add_user(self, user: Any) -> None:
        self._users.add(user)
        if not self._activated:  # first claim: linked recipes will be asked for by this one
            self._activated = True
            for e in self.inputs:
                if isinstance(e, _Link):
                    e.recipe.add_user(self)

    # -- unpack side -------------------------------------------------------------------------
    def _alive_output(self) -> torch.Tensor | None:
        y = self.out_ref()
        return y if y is not None and y._version == self.out_version else None

    def _arg(self, e: Any) -> Any:
        if isinstance(e, _Leaf):
            t = e.ref()
            if t is None:  # cannot happen while a claim pins it; defensive
                raise RuntimeError(f"leanact recipe for {self.name}: an input was freed before backward")
            if t._version != e.version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: [{t.type()} {list(t.shape)}], which is an input of the leanact recipe for "
                    f"{self.name}, is at version {t._version}; expected version {e.version} instead. Hint: the "
                    f"{self.name} output was not saved; leanact keeps this tensor to rebuild it in backward.")
            return t
        if isinstance(e, _Link):
            full = e.recipe.materialize(self)
            return full.as_strided(e.size, e.stride, e.offset)
        return e

    def materialize(self, requester: Any) -> torch.Tensor:
        """The full output (contiguous, offset 0), rebuilt at most once per backward."""
        y = self._alive_output()
        if y is not None:
            _COUNTS["served_alive"] += 1
            return y
        if self._cache is None:
            args = [self._arg(e) for e in self.inputs]
            # the rebuild's own saves (create_graph only) stay plain; kernels run as in forward
            with disabled(), _no_autocast(self.device_type):
                full = self.fn(*args)
            if full.shape != self.shape or full.dtype != self.dtype:
                raise RuntimeError(f"leanact recipe for {self.name} rebuilt {full.dtype}{list(full.shape)}, "
                                   f"expected {self.dtype}{list(self.shape)}")
            if not full.is_contiguous() or full.storage_offset() != 0:
                full = full.clone(memory_format=torch.contiguous_format)
            self._cache = full
            _CACHED.add(self)
            _COUNTS["recompute"] += 1
            _COUNTS[f"recompute:{self.name}"] += 1
        full = self._cache
        self._served.add(requester)
        # every requester is a user (a claim, or a parent recipe once it has users of its own), and
        # both sets lose their dead members alike: all live users served <=> as many served as users
        if len(self._served) >= len(self._users):
            self.drop_cache()
        return full

    def drop_cache(self) -> None:
        self._cache = None
        self._served = weakref.WeakSet()
        _CACHED.discard(self)

    def __repr__(self) -> str:
        return f"Recipe({self.name}, {self.dtype}{list(self.shape)})"


def _no_autocast(device_type: str):
    """Producers run their kernels outside autocast policies (they cast explicitly), so does the rebuild."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.autocast(device_type, enabled=False)
    except (RuntimeError, ValueError):
        pass
    return contextlib.nullcontext()


def register(y: torch.Tensor, name: str, fn: Callable[..., torch.Tensor], *inputs: Any) -> Recipe | None:
    """Register ``fn(*inputs)`` as the recipe of the fresh output ``y`` (no-op unless a
    :class:`RecipeTransform` is active, ``y`` needs grad and is a plain contiguous tensor owning
    its storage). ``fn`` must rebuild ``y`` bitwise (same kernels). Returns the recipe or None."""
    if not y.requires_grad or not is_active() or type(y) not in _OUTPUT_TYPES or y.layout != torch.strided:
        return None
    if not y.is_contiguous() or y.storage_offset() != 0 or y.untyped_storage().nbytes() != y.numel() * y.element_size():
        return None
    r = Recipe(name, fn, inputs, y)
    if y.grad_fn is not None:  # the producer's backward drops the cache (safety net)
        try:
            y.grad_fn._leanact_recipe = weakref.ref(r)
        except (AttributeError, TypeError):
            pass
    _COUNTS["registered"] += 1
    return r


def release(ctx: Any) -> None:
    """Call at the start of a producer's backward: nobody downstream needs the rebuilt output now."""
    ref = getattr(ctx, "_leanact_recipe", None)
    r = ref() if ref is not None else None
    if r is not None and r._cache is not None:
        r.drop_cache()


def has_recipe(t: torch.Tensor) -> bool:
    """Whether ``t`` is (a view of) a live, unmodified output with a registered recipe."""
    return _find(t) is not None


def shared_cast(x: torch.Tensor, dtype: torch.dtype, transform: "RecipeTransform") -> SharedCast | None:
    """For a Linear about to read ``x`` under autocast to ``dtype`` and keep it for its weight's
    gradient, while ``transform`` is this thread's ambient recipes: the cast of ``x`` shared with the
    other readers of ``x`` (:class:`~leanact.recompute.casts.SharedCast`) where ``x`` is kept as is
    anyway, the Linear then keeping ``x`` (a claim: counted as :meth:`RecipeTransform.pack` counts
    its own); else None (the Linear keeps the cast)."""
    share = cast_share(x, dtype, _COUNTS)
    if share is not None:
        transform.claimed += 1
    return share


class _Claim:
    """What the transform keeps for a claimed tensor: recipe, view geometry, pinned inputs."""

    __slots__ = ("recipe", "size", "stride", "offset", "pins", "__weakref__")

    def __init__(self, recipe: Recipe, t: torch.Tensor, pins: tuple[torch.Tensor, ...]):
        self.recipe, self.pins = recipe, pins
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


class RecipeTransform(SavedTensorTransform):
    """Saved-tensor transform keeping producers' recipes instead of their outputs (module doc).

    Use as a context manager around a forward (or :func:`scope` on a module). Kept for a claimed
    tensor: the recipe's input tensors (already kept by the producer: the meter counts them once).
    ``claimed`` counts the saves this instance replaced.
    """

    def __init__(self):
        self.claimed = 0

    def pack(self, t: torch.Tensor) -> _Claim | None:
        if torch.compiler.is_compiling():
            return None
        r = _find(t)
        if r is None:
            r = cast_recipe(t, Recipe)  # autocast's cast of a kept tensor (leanact.recompute.casts)
        if r is not None:
            pins = r.pins()
            if pins is not None:
                claim = _Claim(r, t, tuple(pins.values()))
                r.add_user(claim)
                for p in claim.pins:
                    k = _key(p)
                    if k is not None:
                        _KEPT[k] = p
                self.claimed += 1
                _COUNTS["claimed"] += 1
                return claim
        k = _key(t)
        if k is not None and not self._outer_others(t):
            _KEPT[k] = t
            tag_kept(t)
        return None

    def _outer_others(self, t: torch.Tensor) -> bool:
        """Whether another kind of transform active outside this one may still replace ``t``
        (offload; compress, for the dtypes it compresses), so ``t`` is not known to be kept as is."""
        stack = _stacks()[0]
        if self not in stack:
            return False
        inner = len(stack) - 1 - stack[::-1].index(self)  # the innermost entry of this one: the one packing
        for i in range(inner):
            tr = stack[i]
            if not isinstance(tr, RecipeTransform) and tr.may_replace(t):
                return True
        return False

    def kept_as_is(self, t: torch.Tensor) -> None:
        """As :meth:`pack` records a tensor it leaves kept as is (the source of a later cast)."""
        k = _key(t)
        if k is not None:
            _KEPT[k] = t
            tag_kept(t)

    def unpack(self, claim: _Claim) -> torch.Tensor:
        full = claim.recipe.materialize(claim)
        return full.as_strided(claim.size, claim.stride, claim.offset)

    def kept_tensors(self, claim: _Claim) -> list[torch.Tensor]:
        return list(claim.pins)


class _ScopeHandle:
    """Returned by :func:`scope`: ``remove()`` (or leaving a ``with`` block) puts the forward back."""

    def __init__(self, transform: RecipeTransform, module: nn.Module, wrapper):
        self.transform, self._module, self._wrapper = transform, module, wrapper

    def remove(self) -> None:
        unwrap_forward(self._module, self._wrapper)
        self._wrapper = None

    def __enter__(self) -> "_ScopeHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def scope(module: nn.Module, transform: RecipeTransform | None = None) -> _ScopeHandle:
    """Activate a :class:`RecipeTransform` around every forward of ``module``: ``module.forward`` runs
    inside ``with transform`` in one frame (:class:`~leanact.recompute.context_forward.ContextForward`),
    so no exception, KeyboardInterrupt included, leaves it active; the class and state_dict are
    unchanged. Not entered without grad, while compiling, or under foreign saved-tensor hooks
    (:func:`foreign_hooks`: a checkpointed region keeps checkpoint's behaviour).

    Recipes matter only where producers run (leanact.nn.fused's ``Recipe*`` modules, LeanMLP,
    LayerNormLinears or the functions of :mod:`leanact.recompute.producers`).
    """
    tr = transform if transform is not None else RecipeTransform()
    return _ScopeHandle(tr, module, wrap_forward(module, tr))
