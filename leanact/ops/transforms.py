"""leanact's ops under ``torch.func`` transforms (``grad``, ``vmap``, ``jvp``, ``jacrev``, ...).

Inside a transform, tensors are functorch wrappers without storage (``data_ptr`` and
``untyped_storage`` raise), saved-tensor hooks are disabled, and a custom autograd Function would
need ``setup_context`` plus vmap and jvp rules. leanact's lean ops therefore run torch's own ops
there (the same values as the unpatched model, keeping what torch keeps), and the value checks
that decide between a lean path and its fallback read the wrapped tensors' values through
:func:`unwrap`.
"""
from __future__ import annotations

import torch

__all__ = ["functorch_active", "is_wrapped", "unwrap"]


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform is active on this thread (traceable by torch.compile)."""
    return torch._C._are_functorch_transforms_active()


def is_wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a functorch wrapper (GradTrackingTensor, BatchedTensor, ...)."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def unwrap(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``t``'s values (all functorch wrappers removed; under ``vmap`` it
    has the batch dimensions too). ``t`` itself when it is not wrapped."""
    while is_wrapped(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t
