"""Autocast's casts of kept tensors, kept as recipes.

Under ``torch.autocast`` a Linear (or any low-precision op) casts its input itself: the cast is a
fresh 16-bit tensor made inside the op, which the op keeps for its weight gradient. When the input
is an fp32 tensor that some op keeps anyway (a norm's output, kept by the norm for its backward:
the residual stream is fp32 under autocast), the cast is a second copy, 2 more bytes per element
beside the 4 of the original, once per consumer (Q, K and V each cast it again).

A cast is a pure function of its source, so it can be rebuilt exactly: ``src.to(dtype)`` runs the
same conversion kernel (round to nearest even) and gives the bitwise same tensor. While a
:class:`~leanact.recompute.recipes.RecipeTransform` is active:

* every tensor kept as is that is the output of a custom autograd Function (a leanact norm or
  GELU keeping its output) is *tagged* on its autograd node, weakly (:func:`tag_kept`);
* a tensor about to be kept (or the tensor it is a view of) whose autograd node is a ``_to_copy``
  of a tagged output (or of a reshape of the whole contiguous output: GPT-2's ``Conv1D`` flattens
  its input first), unmodified since, with the same shape and dense layout, gets a recipe
  ``src.to(dtype)`` (:func:`cast_recipe`), which the transform then keeps instead (the recipe
  pins ``src``, kept anyway: the cast costs nothing). The casts of one source to one dtype and
  shape (Q's, K's and V's of a norm's output) share one recipe: backward rebuilds the cast once for
  all of them.

Only casts between floating dtypes of an output whose node is tagged are recognised; everything
else (a cast of a plain tensor kept by nobody, a cast of a parameter, a partial view's cast) stays
as autocast made it. The rebuild runs with autocast off (the recipe's kernels are explicit).

Where nothing observes saves, a patched Linear keeps the tagged tensor itself and shares its cast
in backward through a :class:`SharedCast` (:func:`cast_share`) instead: the same bytes kept.
"""
from __future__ import annotations

import weakref

import torch

__all__ = ["tag_kept", "is_kept", "cast_recipe", "SharedCast", "cast_share"]

_TAG = "_leanact_kept"
_SHARED = "_leanact_cast_recipes"  # on a tagged node: {(dtype, shape): weakref to the recipe of that cast}
_SHARES = "_leanact_shared_casts"  # on a tagged node: {dtype: the SharedCast of its output}


def tag_kept(t: torch.Tensor) -> None:
    """Remember on ``t``'s autograd node (a custom Function's) that ``t`` is kept as is, at its
    current version: a later cast of ``t`` can then be rebuilt from it."""
    gf = t.grad_fn
    if gf is None or t._base is not None or not t.is_floating_point() or not isinstance(
            gf, torch.autograd.function.BackwardCFunction):
        return
    try:
        setattr(gf, _TAG, (weakref.ref(t), t._version, t.output_nr))
    except (AttributeError, TypeError, RuntimeError):
        pass


def is_kept(t: torch.Tensor) -> bool:
    """Whether ``t`` itself was tagged kept as is (:func:`tag_kept`) and is unmodified since."""
    gf = t.grad_fn
    tag = getattr(gf, _TAG, None) if gf is not None else None
    return tag is not None and tag[0]() is t and t._version == tag[1]


_VIEW_NODES = ("ViewBackward0", "UnsafeViewBackward0")


def _source(c: torch.Tensor) -> torch.Tensor | None:
    """The tagged, unmodified tensor ``c`` is a plain cast of (or a cast of a reshape of: GPT-2's
    ``Conv1D`` flattens its input before its ``addmm``), if any."""
    gf = c.grad_fn
    if gf is None or type(gf).__name__ != "ToCopyBackward0":
        return None
    nexts = gf.next_functions
    if len(nexts) != 1 or nexts[0][0] is None:
        return None
    node, nr = nexts[0]
    viewed = type(node).__name__ in _VIEW_NODES
    if viewed:
        nexts = node.next_functions
        if len(nexts) != 1 or nexts[0][0] is None:
            return None
        node, nr = nexts[0]
    tag = getattr(node, _TAG, None)
    if tag is None:
        return None
    ref, version, out_nr = tag
    src = ref()
    if src is None or out_nr != nr or src._version != version or src.grad_fn is not node or src.device != c.device:
        return None
    if viewed:  # a view of the whole contiguous tensor: its elements in the same order
        return src if src.numel() == c.numel() and src.is_contiguous() else None
    return src if src.shape == c.shape and src.stride() == c.stride() else None


def _node_dict(node, name: str) -> dict | None:
    """The dict stored on autograd ``node`` as ``name``, made on first use (None: the node takes no attributes)."""
    d = getattr(node, name, None)
    if d is None:
        d = {}
        try:
            setattr(node, name, d)
        except (AttributeError, TypeError, RuntimeError):
            return None
    return d


def _cast(dtype: torch.dtype, shape: torch.Size):
    def fn(src: torch.Tensor) -> torch.Tensor:
        c = src.to(dtype)
        return c if c.shape == shape else c.view(shape)

    return fn


def cast_recipe(t: torch.Tensor, make_recipe) -> object | None:
    """If ``t`` (or its base) is a cast of a tagged kept tensor, ``make_recipe(name, fn, inputs, c)``
    for the cast ``c`` (the recipe then describes ``c``'s storage; ``t`` may be a view of it)."""
    c = t if t._base is None else t._base
    src = _source(c)  # (first: most saved tensors are no cast, and this says so from their node alone)
    if src is None or not c.is_floating_point() or not c.is_contiguous() or c.storage_offset() != 0:
        return None
    if c.untyped_storage().nbytes() != c.numel() * c.element_size():
        return None
    if not src.is_floating_point() or src.dtype == c.dtype:
        return None
    # Q, K and V each cast the same norm output: one recipe serves the three casts (bitwise the same
    # tensor), rebuilt once in backward for all of them (held weakly on the source's node)
    shared = _node_dict(src.grad_fn, _SHARED)
    if shared is None:
        shared = {}
    key = (c.dtype, c.shape)
    ref = shared.get(key)
    r = ref() if ref is not None else None
    if r is None:
        r = make_recipe("cast", _cast(c.dtype, c.shape), (src,), c)
        if r is not None:
            shared[key] = weakref.ref(r)
    return r


class SharedCast:
    """``src.to(dtype)`` of one kept tensor ``src`` for the backwards of the Linears that read it (Q,
    K and V of a norm's output; :mod:`leanact.ops.recast_linear`, which keeps ``src`` itself):
    rebuilt by the first backward that takes it, dropped after the last of its ``users`` (counted
    again for a further backward, ``retain_graph=True``). A user whose backward never runs leaves
    it cached until the graph is freed, as a :class:`~leanact.recompute.recipes.Recipe`'s cache."""

    __slots__ = ("dtype", "users", "_left", "_cast", "_counts")

    def __init__(self, dtype: torch.dtype, counts):
        self.dtype, self.users, self._left, self._cast, self._counts = dtype, 0, 0, None, counts

    def take(self, src: torch.Tensor) -> torch.Tensor:
        c = self._cast
        if c is None or c.shape != src.shape:
            c = self._cast = src.to(dtype=self.dtype)  # (the forward's cast: the same kernel, bitwise)
            self._counts["recompute"] += 1
            self._counts["recompute:cast"] += 1
        self._left -= 1
        if self._left <= 0:
            self._cast, self._left = None, self.users
        return c


def cast_share(x: torch.Tensor, dtype: torch.dtype, counts) -> SharedCast | None:
    """A new user of the :class:`SharedCast` of ``x`` to ``dtype``, where ``x`` is a floating tensor of
    another dtype kept as is by its producer (:func:`is_kept`); else None. ``counts``: a Counter
    (``claimed`` here; ``recompute``, ``recompute:cast`` at rebuilds)."""
    if x.dtype == dtype or not x.is_floating_point() or not is_kept(x):
        return None
    shares = _node_dict(x.grad_fn, _SHARES)
    if shares is None:
        return None
    share = shares.get(dtype)
    if share is None:
        share = shares[dtype] = SharedCast(dtype, counts)
    share.users += 1
    share._left += 1
    counts["claimed"] += 1
    return share
