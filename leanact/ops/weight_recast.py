"""Matmuls of fp32 weights under autocast without keeping autocast's 16-bit weight copy.

Under ``torch.autocast`` a Linear casts its fp32 weight to the low dtype and the matmul keeps that
cast for backward (``dX = dY W``): 2 bytes per parameter, whatever the batch, a second copy of
the model. The cast is a pure function of the parameter, so it can be kept as a recipe instead:

* :func:`recast_weight` yields ``weight.to(dtype)``; while it is active, every tensor saved for
  backward that is that cast (or a view of it, e.g. the ``Wᵀ`` an ``addmm`` keeps) is kept as a
  reference to the fp32 parameter, which lives anyway and costs nothing, plus the view's geometry.
  Backward casts the parameter again: the same rounding, so the gradients are bit-identical.
* :func:`linear` is ``F.linear`` under autocast with that recipe for the weight (the input and the
  bias are cast by autocast as usual; what the matmul keeps of the input is unchanged).

The parameter's ``_version`` is checked at unpack: modifying the weight in place between forward
and backward raises torch's "modified by an inplace operation" error (autocast's copy would have
hidden the change; the recipe must not read the new value silently). Gradients of gradients work:
under ``create_graph=True`` the recast runs with grad mode on, from the parameter.

The recipe lives in :mod:`leanact.saved`'s pipeline as the innermost transform of the call, so the
meter sees nothing kept for the copy and outer transforms (recipes, offload, compression) never
see it. Callers skip it where saved-tensor hooks cannot be pushed (``torch.compile``, ``torch.func``
transforms, someone else's hooks such as a checkpointed region): autocast's own path then runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..saved import SavedTensorTransform, _check_version
from .amp import autocast_dtype

__all__ = ["RecastWeight", "recast_weight", "linear", "hook_matmul_saves", "LOW_DTYPES"]

LOW_DTYPES = (torch.bfloat16, torch.float16)


class RecastWeight(SavedTensorTransform):
    """Keeps the views of one cast ``weight.to(dtype)`` saved for backward as a recipe: the
    parameter itself (version checked at unpack) and the view's size, stride and offset."""

    def __init__(self, weight: torch.Tensor, cast: torch.Tensor):
        self.weight, self.dtype = weight, cast.dtype  # (not the cast: packed saves hold this transform)
        self._key = cast.untyped_storage()._cdata
        self._version = weight._version

    def pack(self, t: torch.Tensor):
        if t.dtype != self.dtype or t.untyped_storage()._cdata != self._key:
            return None
        return tuple(t.shape), t.stride(), t.storage_offset()

    def unpack(self, packed) -> torch.Tensor:
        _check_version(self.weight, self._version)
        size, stride, offset = packed
        return self.weight.to(dtype=self.dtype).as_strided(size, stride, offset)


class recast_weight:  # noqa: N801 - used as a function: ``with recast_weight(w, dtype) as cast``
    """``with recast_weight(weight, dtype) as cast``: ``cast`` is ``weight.to(dtype)`` (a fresh copy);
    what ops inside the block save of it is kept as a recipe on ``weight`` (module doc). Leaving the
    block cannot leave the hooks pushed. (A class, not a generator: entered around every Linear.)"""

    __slots__ = ("_transform", "_cast")

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        self._cast = weight.to(dtype, copy=True)
        self._transform = RecastWeight(weight, self._cast)

    def __enter__(self) -> torch.Tensor:
        self._transform.__enter__()
        cast, self._cast = self._cast, None  # the caller's only: freed as soon as the op is done with it
        return cast

    def __exit__(self, *exc) -> None:
        self._transform.__exit__(*exc)


#: autograd nodes of a Linear's matmul and the names of its saved (input, weight): aten's linear
#: (CompositeImplicitAutograd, the same on every device) is ``addmm`` with a bias, ``mm`` without, on
#: the input flattened to 2-D, then a view back (GPT-2's Conv1D: ``addmm`` and a view)
_MATMUL_SAVES = {"AddmmBackward0": ("_saved_mat1", "_saved_mat2"), "MmBackward0": ("_saved_self", "_saved_mat2")}
_VIEW_NODES = ("ViewBackward0", "UnsafeViewBackward0")
#: node type -> (input name, weight name, their raw SavedVariable names), None for a view node, or
#: absent: another node (learned per type on first sight: this runs per Linear call)
_NODE_KINDS: dict[type, tuple[str, str, str, str] | None] = {}


def _node_kind(node) -> tuple[str, str, str, str] | None | bool:
    t = type(node)
    kind = _NODE_KINDS.get(t, False)
    if kind is False:
        name = t.__name__
        names = _MATMUL_SAVES.get(name)
        if names is not None:
            kind = _NODE_KINDS[t] = (*names, "_raw" + names[0], "_raw" + names[1])
        elif name in _VIEW_NODES:
            kind = _NODE_KINDS[t] = None
    return kind


def hook_matmul_saves(y: torch.Tensor, weight: torch.Tensor, cast: torch.Tensor,
                      transform: SavedTensorTransform | None = None) -> torch.Tensor:
    """``y``, just made by a matmul of ``cast`` (``weight.to(dtype)``: an ``F.linear``, or an ``addmm``
    as GPT-2's Conv1D), after giving the tensors its node saved per-tensor hooks (``register_hooks``)
    that keep what :func:`recast_weight` keeps for the cast (the parameter and the view's geometry)
    and what ``transform`` (the ambient cast recipes) keeps for the input: the same as pushing hooks
    around the op, with one Python call per tensor replaced and none per tensor left, and no hooks to
    push and pop. Only where nothing observes saves (:func:`leanact.saved.unobserved_ambient`). A node
    of another kind (never seen: aten's linear is ``addmm`` with a bias, ``mm`` without, on the input
    flattened to 2-D, then a view back, on every device) keeps what it saved, as autocast would."""
    node = y.grad_fn
    if node is None:
        return y
    kind = _node_kind(node)
    if kind is None:  # a view back to the input's shape: the matmul is its input's node
        node = node.next_functions[0][0]
        kind = _node_kind(node) if node is not None else False
    if not kind:
        return y
    input_name, weight_name, raw_input, raw_weight = kind
    kept_weight = getattr(node, weight_name)  # (None where not saved)
    if kept_weight is not None:
        recast = RecastWeight(weight, cast)
        packed = recast.pack(kept_weight)
        if packed is not None:
            getattr(node, raw_weight).register_hooks(lambda _t, p=packed: p, recast.unpack)
    if transform is not None:
        kept_input = getattr(node, input_name)
        if kept_input is not None:
            claim = transform.pack(kept_input)
            if claim is not None:
                getattr(node, raw_input).register_hooks(lambda _t, c=claim: c, transform.unpack)
    return y


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear`` whose weight is cast to ``dtype`` (default: autocast's dtype for the input's
    device, if active) and kept for backward as a recipe on ``weight`` instead of as a copy. Without
    ``dtype`` and outside autocast it is ``F.linear``. The input and bias are cast to ``dtype`` as
    autocast casts them (under autocast, autocast itself does it)."""
    if dtype is None:
        dtype = autocast_dtype(input.device.type)
        if dtype is None:
            return F.linear(input, weight, bias)
    elif autocast_dtype(input.device.type) != dtype:
        input = input.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    with recast_weight(weight, dtype) as w:
        return F.linear(input, w, bias)
