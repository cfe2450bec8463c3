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
  of a tagged output, unmodified since, with the same shape and dense layout, gets a recipe
  ``src.to(dtype)`` (:func:`cast_recipe`), which the transform then keeps instead (the recipe
  pins ``src``, kept anyway: the cast costs nothing). The casts of one source to one dtype (Q's,
  K's and V's of a norm's output) share one recipe: backward rebuilds the cast once for all of them.

Only casts between floating dtypes of an output whose node is tagged are recognised; everything
else (a cast of a plain tensor kept by nobody, a cast of a parameter, a view's cast) stays as
autocast made it. The rebuild runs with autocast off (the recipe's kernels are explicit).
"""
from __future__ import annotations

import weakref

import torch

__all__ = ["tag_kept", "cast_recipe"]

_TAG = "_leanact_kept"
_SHARED = "_leanact_cast_recipes"  # on a tagged node: {dtype: weakref to the recipe of that cast of its output}


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


def _source(c: torch.Tensor) -> torch.Tensor | None:
    """The tagged, unmodified tensor ``c`` is a plain cast of, if any."""
    gf = c.grad_fn
    if gf is None or type(gf).__name__ != "ToCopyBackward0":
        return None
    nexts = gf.next_functions
    if len(nexts) != 1 or nexts[0][0] is None:
        return None
    node, nr = nexts[0]
    tag = getattr(node, _TAG, None)
    if tag is None:
        return None
    ref, version, out_nr = tag
    src = ref()
    if src is None or out_nr != nr or src._version != version or src.grad_fn is not node:
        return None
    if src.shape != c.shape or src.stride() != c.stride() or src.device != c.device:
        return None
    return src


def _cast(dtype: torch.dtype):
    def fn(src: torch.Tensor) -> torch.Tensor:
        return src.to(dtype)

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
    node = src.grad_fn
    shared = getattr(node, _SHARED, None)
    if shared is None:
        shared = {}
        try:
            setattr(node, _SHARED, shared)
        except (AttributeError, TypeError, RuntimeError):
            pass
    ref = shared.get(c.dtype)
    r = ref() if ref is not None else None
    if r is None:
        r = make_recipe("cast", _cast(c.dtype), (src,), c)
        if r is not None:
            shared[c.dtype] = weakref.ref(r)
    return r
