"""Keep the sequence shard, not the all-gathered input, of the column-parallel linears.

With sequence parallelism the attention and the MLP start with an all-gather of the s/t-row
shard to s rows, and the column-parallel linears (q/k/v, fc1/gate/up) keep that full-sequence
input for their weight gradient: per rank, 2 x s·b·h elements per layer that do not shrink with t.
Megatron keeps the shard instead and all-gathers it again in backward. :class:`RegatherTransform`
does the same through leanact's saved-tensor pipeline (:mod:`leanact.saved`): when autograd saves
a DTensor whose local buffer is a registered all-gather output, it keeps the shard (already kept
by the norm that produced it, so it costs nothing) and, in backward, rebuilds the full tensor
with ``DTensor.redistribute`` (one all-gather, the same collective order on every rank).

It is active only during the forward of the parallelized model (entered by a forward pre-hook on
the model, left by its forward hook), outside any checkpointed region: inside a
``torch.utils.checkpoint`` region checkpoint's own hooks are innermost and nothing is kept anyway.
Gathers that run while it is inactive (a checkpoint's recompute in backward) are not registered.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..memory.meter import _storage_key
from ..saved import SavedTensorTransform

__all__ = ["RegatherTransform"]


class RegatherTransform(SavedTensorTransform):
    """Keeps (shard, mesh, dim, shape) for saved DTensors that are registered all-gather outputs."""

    def __init__(self) -> None:
        self.gathered: dict[int, tuple[torch.Tensor, object, int]] = {}
        self.active = 0

    def start(self) -> None:
        if self.active == 0:
            self.gathered.clear()
            self.__enter__()
        self.active += 1

    def stop(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.gathered.clear()
            self.__exit__(None, None, None)

    def register(self, full: torch.Tensor, shard: torch.Tensor, mesh, dim: int) -> None:
        """``full`` (local tensor) was all-gathered from ``shard`` along ``dim`` over ``mesh``."""
        if self.active and torch.is_grad_enabled():
            self.gathered[_storage_key(full)] = (shard, mesh, dim)

    def pack(self, t: torch.Tensor):
        if not self.gathered or not isinstance(t, DTensor) or any(not p.is_replicate() for p in t.placements):
            return None
        with torch.no_grad():
            loc = t.to_local()
        entry = self.gathered.get(_storage_key(loc))
        if entry is None:
            return None
        shard, mesh, dim = entry
        if not loc.is_contiguous() or loc.numel() != shard.numel() * mesh.size() or loc.storage_offset() != 0:
            return None  # a strided or partial view of the gathered buffer: keep it as is
        return shard, mesh, dim, tuple(t.shape), shard._version

    def unpack(self, packed) -> torch.Tensor:
        shard, mesh, dim, shape, version = packed
        if shard._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"the sequence shard {list(shard.shape)} kept to re-gather a linear's input is at version "
                f"{shard._version}; expected version {version} (checked by leanact.parallel.regather). Hint: do not "
                "modify in place the output of a sequence-parallel norm; use an out-of-place op.")
        with torch.no_grad():
            full = DTensor.from_local(shard.detach(), mesh, [Shard(dim)], run_check=False).redistribute(
                mesh, [Replicate()])
            return full.reshape(shape)

    def kept_tensors(self, packed) -> list[torch.Tensor]:
        return [packed[0]]
