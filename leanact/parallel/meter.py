"""Saved-tensor meter for DTensor-parallel models: counts each rank's local bytes.

Under tensor/sequence parallelism autograd keeps DTensors (e.g. the inputs of Colwise/RowwiseParallel
linears). A DTensor is a wrapper: its ``untyped_storage()`` is not the storage of the local shard
that really holds memory, so :class:`leanact.memory.SavedTensorMeter` would count it at the
*global* size and never deduplicate it against the same local buffer kept by another op.
:class:`ShardedSavedTensorMeter` records the local tensor of every DTensor (and excludes the
local shards of DTensor parameters), so ``total_bytes`` is what this rank keeps.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ..memory import SavedTensorMeter
from ..memory.meter import _storage_key

__all__ = ["ShardedSavedTensorMeter", "local"]


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (no autograd edge), else ``t``."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


class ShardedSavedTensorMeter(SavedTensorMeter):
    """:class:`~leanact.memory.SavedTensorMeter` counting local shards of DTensors (per-rank bytes)."""

    def __init__(self, model=None, exclude=()):
        super().__init__(model, exclude)
        modules = [] if model is None else ([model] if isinstance(model, torch.nn.Module) else list(model))
        for root in modules:
            for p in root.parameters():
                if isinstance(p, DTensor):
                    self._excluded[_storage_key(local(p))] = "parameter"
            for b in root.buffers():
                if isinstance(b, DTensor):
                    self._excluded[_storage_key(local(b))] = "buffer"

    def on_pack(self, original, kept):
        return super().on_pack(local(original), [local(t) for t in kept])
