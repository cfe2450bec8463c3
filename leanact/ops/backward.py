"""``once_differentiable`` for leanact's autograd Functions, without its cost on the common path.

torch's decorator enters ``torch.no_grad()`` around every backward, then wraps the results so that
a double backward raises. The autograd engine already runs a backward with grad mode off unless
``create_graph=True``; there the context manager only costs host time (a few microseconds per
call, per op and layer). This wrapper calls the backward directly when grad mode is off and
hands it to torch's decorator otherwise: the same results and the same error on double backward.
"""
from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable as _torch_once_differentiable

__all__ = ["once_differentiable"]


def once_differentiable(backward):
    """torch's ``once_differentiable``, skipped where it would change nothing (grad mode off)."""
    guarded = _torch_once_differentiable(backward)

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if not torch.is_grad_enabled():
            return backward(ctx, *grads)
        return guarded(ctx, *grads)

    return wrapper
