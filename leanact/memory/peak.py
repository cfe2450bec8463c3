"""The peak of the memory an operation allocates, on any device, fake tensors included."""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["NewStoragePeak"]


class NewStoragePeak(TorchDispatchMode):
    """``with NewStoragePeak() as p: ...``: ``p.peak`` is the most bytes of storages created inside the
    block alive at once, ``p.live`` those still alive at its end. Views of existing storages (e.g.
    ``W.t()``) and outputs written into an input (``out=``, in-place ops) are not new memory. Unlike
    ``torch.cuda.max_memory_allocated`` it needs no device and sees exactly the block's own
    allocations (no allocator rounding or caching)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._sizes: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self._sizes and key not in inputs:
                    self._sizes[key] = storage.nbytes()
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key)
        return out
