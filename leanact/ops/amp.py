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

__all__ = ["autocast_dtype", "autocast_off", "no_autocast_backward", "norm_inputs", "keeps_output", "autocast_arg"]


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
        for g in grads:
            if isinstance(g, torch.Tensor):
                device_type = "cuda" if g.is_cuda else g.device.type  # (is_cuda: no device object per call)
                if autocast_dtype(device_type) is not None:
                    with torch.autocast(device_type, enabled=False):
                        return backward(ctx, *grads)
                break
        return backward(ctx, *grads)  # autocast off already (the common case: no context to enter)

    return wrapper


def norm_inputs(x: torch.Tensor, *ts):
    """``(x, *ts)`` cast as autocast casts a norm's arguments: CUDA autocast runs ``layer_norm``
    and ``rms_norm`` in fp32 (its fp32 list: the output is fp32 whatever the input), CPU autocast
    leaves norms to their inputs' dtypes (fp32 residual in, fp32 out). Non-tensors pass through."""
    if not x.is_cuda or autocast_dtype("cuda") is None:
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


_AUTOCAST_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
                   "half": torch.float16}


def autocast_arg(value, where: str) -> torch.dtype | None:
    """Parse an ``autocast=`` argument of ``where`` (e.g. "estimate"): None = autocast's dtype if the
    call is inside ``torch.autocast`` (CUDA first, then CPU), else None; False = None; "bf16" /
    "fp16" (or "bfloat16", "float16", "half") and torch.bfloat16 / torch.float16 = that dtype."""
    if value is None:
        for device_type in ("cuda", "cpu"):
            dtype = autocast_dtype(device_type)
            if dtype in (torch.bfloat16, torch.float16):
                return dtype
        return None
    if value is False:
        return None
    if isinstance(value, torch.dtype) and value in (torch.bfloat16, torch.float16):
        return value
    if isinstance(value, str) and value.lower().removeprefix("torch.") in _AUTOCAST_NAMES:
        return _AUTOCAST_NAMES[value.lower().removeprefix("torch.")]
    raise (ValueError if isinstance(value, (str, torch.dtype)) else TypeError)(
        f"{where}(autocast={value!r}): use \"bf16\" or \"fp16\" (torch.bfloat16 / torch.float16: fp32 weights, "
        f"the forward under torch.autocast), False (no autocast) or None (autocast's dtype if the call is "
        f"inside torch.autocast)")
