"""Depth scaling: a deep model's step predicted from two shallow ones.

When a model's L layers are alike (:func:`alike_layers`: one class, the same parameters, the same
settings but their index) and every layer gets the same strategy, each layer adds the same bytes
to every moment of the step: a moment's bytes are an affine function of L (parameters, gradients,
optimizer state and what the layers keep grow by one layer's worth per layer). The peak, the
largest of these moments, is then a convex piecewise-affine function of L, and where one moment
sets the peak at two shallow depths and at L the line through the two shallow estimates gives the
deep one exactly:

    peak(L) = peak(b) + (L − b) · (peak(b) − peak(a))     (host memory likewise)

with (a, b) = (1, 2) (:data:`DEPTHS`), or (3, 4) for the offloading strategies
(:data:`OFFLOAD_DEPTHS`): offload moves every layer's input but the last layer's and, in backward,
copies a layer's tensors back while the layer after it runs, so its moments come in three kinds --
first, middle and last layer -- and both shallow models must have all three (at depth 2 another
moment may set the peak: measured on a 64-wide Llama at 16,384 tokens, the line through depths 2
and 3 is 26 KB above the 6-layer peak; through 3 and 4 it is exact). Without offload every layer
does the same (the recompute strategies keep each layer's input; the last layer's backward sets
the peak at any depth): on the Llama-3.2-1B geometry the lines through (1, 2), (2, 3) and (3, 4)
agree to the byte for the five other candidates at 4,096, 65,536 and 1,048,576 tokens.

An estimate costs time in proportion to the layers it traces, so two estimates of 1 and 2 layers
cost about a fifth of one of 16 layers and a tenth of one of 32. :func:`leanact.plan(maximize=...)
<leanact.estimate.maximize.maximize>` searches with these and confirms its answer with estimates
of the whole model, so nothing it returns rests on the line.

The shallow models are the model itself with its layer list cut to its first entries for the
duration of one estimate (:func:`shallow`; the list is restored on leaving, even on an error or a
``KeyboardInterrupt``). Nothing else of the model changes.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Callable, Iterator

from torch import nn

__all__ = ["DEPTHS", "OFFLOAD_DEPTHS", "depths_for", "alike_layers", "shallow", "Scaled", "scaled"]

#: The two shallow depths the line goes through (module doc).
DEPTHS = (1, 2)
#: ... for a strategy that offloads: a first, a middle and a last layer at each depth.
OFFLOAD_DEPTHS = (3, 4)
_SCALARS = (bool, int, float, str, type(None))
_INDEX = re.compile(r"(^|_)(idx|index|id|number|num)$")  # a layer's own index: layer_idx, layer_number, ...


def _signature(layer: nn.Module, index: int) -> list:
    """What makes one layer like another: each submodule's class, its own parameters and buffers
    (shape, dtype, trainable) and its plain settings, the layer's own index (HF's ``layer_idx``)
    left out."""
    sig = []
    for name, m in layer.named_modules():
        params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters(recurse=False))
        buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers(recurse=False))
        settings = tuple(sorted((k, v) for k, v in vars(m).items() if isinstance(v, _SCALARS)
                                and not (type(v) is int and v == index and _INDEX.search(k))))
        sig.append((name, type(m), params, buffers, settings))
    return sig


def depths_for(strategy: str | None) -> tuple[int, int]:
    """The shallow depths for ``strategy`` on every layer (module doc)."""
    return OFFLOAD_DEPTHS if strategy is not None and "offload" in strategy else DEPTHS


def alike_layers(model: nn.Module) -> nn.ModuleList | None:
    """The list holding ``model``'s layers (:func:`leanact.strategies.find_layers`) when there are
    more than 5 and all are alike (:func:`_signature`); None otherwise (layers that alternate, such
    as Gemma 2's sliding and global ones, or too few to gain anything)."""
    from leanact.strategies.layers import find_layers

    try:
        found = find_layers(model)
    except ValueError:
        return None
    if len(found) <= OFFLOAD_DEPTHS[1] + 1:
        return None
    parent = found[0][0].rpartition(".")[0]
    container = model.get_submodule(parent) if parent else model
    if not isinstance(container, nn.ModuleList) or len(container) != len(found):
        return None
    first = _signature(found[0][1], 0)
    if any(_signature(layer, i) != first for i, (_, layer) in enumerate(found[1:], 1)):
        return None
    return container


@contextlib.contextmanager
def shallow(layers: nn.ModuleList, depth: int) -> Iterator[None]:
    """``layers`` holds only its first ``depth`` entries inside the block (restored on exit)."""
    if not 1 <= depth <= len(layers):
        raise ValueError(f"shallow(depth={depth}): between 1 and the {len(layers)} layers")
    kept = layers._modules
    try:
        layers._modules = type(kept)((k, kept[k]) for k in list(kept)[:depth])
        yield
    finally:
        layers._modules = kept


@dataclass(frozen=True)
class Scaled:
    """A deep step's ``peak`` and ``host`` bytes from the line through two shallow estimates."""

    peak: int
    host: int


def scaled(estimate_at: Callable[[], object], layers: nn.ModuleList, depths: tuple[int, int] = DEPTHS) -> Scaled:
    """The depth-``len(layers)`` step from ``estimate_at()`` (an :class:`~leanact.estimate.Estimate`
    of the model as it is when called) run at the two ``depths`` (module doc; :func:`depths_for`)."""
    a, b = depths
    if not 1 <= a < b < len(layers):
        raise ValueError(f"scaled: depths {depths} must increase and stay below the {len(layers)} layers")
    with shallow(layers, a):
        ea = estimate_at()
    with shallow(layers, b):
        eb = estimate_at()
    extra = len(layers) - b
    return Scaled(eb.peak + extra * (eb.peak - ea.peak), eb.host + extra * (eb.host - ea.host))
