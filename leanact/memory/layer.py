"""Per-layer activation cost: (model with 2 layers) − (model with 1 layer), as in REFERENCE.md."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .meter import SavedTensorMeter

__all__ = ["LayerCost", "measure_layer_cost"]


@dataclass
class LayerCost:
    """Bytes one layer keeps for backward, with a per-op breakdown and the B/sbh figure."""

    bytes: int
    by_op: "OrderedDict[str, int]"
    s: int
    b: int
    h: int
    #: of ``bytes``, autocast's 16-bit weight copies (batch-independent; see SavedTensorMeter.weight_copy_bytes)
    weight_copies: int = 0

    @property
    def per_sbh(self) -> float:
        """Bytes per s·b·h (REFERENCE.md's B/sbh)."""
        return self.bytes / (self.s * self.b * self.h)


def _measure(model: nn.Module, inputs: tuple) -> SavedTensorMeter:
    meter = SavedTensorMeter(model, exclude=[t for t in inputs if isinstance(t, torch.Tensor)])
    with meter:
        out = model(*inputs)
    meter.attribute(out)
    meter.release()  # no backward will run: free the graph now (see SavedTensorMeter.release)
    return meter


def measure_layer_cost(build: Callable[[int], nn.Module], inputs: Callable[[], tuple[Any, ...]],
                       s: int, b: int, h: int) -> LayerCost:
    """Saved bytes of one layer: ``build(2)`` minus ``build(1)`` run on ``inputs()``.

    ``build(n)`` returns a model with ``n`` layers (same seed and settings otherwise). Inputs are
    excluded from the count. The difference removes what the model keeps outside its layers.
    """
    one, two = _measure(build(1), inputs()), _measure(build(2), inputs())
    ops: OrderedDict[str, int] = OrderedDict()
    for op in list(two.by_op()) + list(one.by_op()):
        ops[op] = two.by_op().get(op, 0) - one.by_op().get(op, 0)
    return LayerCost(two.total_bytes - one.total_bytes, ops, s, b, h,
                     two.weight_copy_bytes - one.weight_copy_bytes)
