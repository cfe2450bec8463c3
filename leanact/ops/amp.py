"""Autocast policy for leanact's autograd Functions.

A Function's kernels cast explicitly and accumulate in fp32 themselves, so they run with autocast
switched off, in forward and in backward alike: otherwise autocast would re-cast their internal
matmuls in forward (when the forward runs inside ``torch.autocast``) and not in backward (when
``loss.backward()`` runs outside it), or the reverse, and the two passes would disagree. The
inputs are cast beforehand the way autocast would cast the torch op the Function replaces.
"""
from __future__ import annotations

import contextlib
import functools

import torch

__all__ = ["autocast_dtype", "autocast_off", "no_autocast_backward", "norm_inputs", "keeps_output"]


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The low-precision dtype of autocast active for ``device_type`` now, or None."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (RuntimeError, ValueError):  # a device type autocast does not know
        pass
    return None


def autocast_off(device_type: str):
    """A context that switches autocast off for ``device_type`` if it is on (a no-op otherwise)."""
    if autocast_dtype(device_type) is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def no_autocast_backward(backward):
    """Decorator for a Function's ``backward(ctx, grad, ...)``: run it with autocast off for the
    device of the first gradient (``loss.backward()`` is often called inside the autocast block)."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        g = next((t for t in grads if isinstance(t, torch.Tensor)), None)
        if g is None:
            return backward(ctx, *grads)
        with autocast_off(g.device.type):
            return backward(ctx, *grads)

    return wrapper


def norm_inputs(x: torch.Tensor, *ts):
    """``(x, *ts)`` cast as autocast casts a norm's arguments: CUDA autocast runs ``layer_norm``
    and ``rms_norm`` in fp32 (its fp32 list: the output is fp32 whatever the input), CPU autocast
    leaves norms to their inputs' dtypes (fp32 residual in, fp32 out). Non-tensors pass through."""
    if x.device.type != "cuda" or autocast_dtype("cuda") is None:
        return (x, *ts)
    return tuple(t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in (x, *ts))


def keeps_output(x: torch.Tensor) -> bool:
    """Whether ``x`` (or the tensor it is a view of) is kept for backward by the leanact op that made
    it (a norm or GELU keeping its output: its autograd node says ``keeps_output``). A consumer that
    would keep ``x`` itself then adds nothing; one keeping something else instead adds that."""
    base = x if x._base is None else x._base
    node = base.grad_fn
    return (isinstance(node, torch.autograd.function.BackwardCFunction) and base.output_nr == 0
            and bool(getattr(node, "keeps_output", False)))
