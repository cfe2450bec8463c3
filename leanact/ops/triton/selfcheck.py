"""What the self-checks of the ops' Triton kernels are made of: run before an op's kernel first
runs on a device.

Each op registers its check with :func:`.dispatch.register_check` where its PyTorch path lives
(:mod:`leanact.ops.dropout.function`, :mod:`leanact.ops.gelu.function`, :mod:`leanact.ops.norms.layer_norm`,
:mod:`leanact.ops.norms.rms_norm`, :mod:`leanact.ops.norms.dropout_add_norm`, :mod:`leanact.ops.gated_mlp.function`,
:mod:`leanact.ops.rotary.function`, :mod:`leanact.ops.lossy.fewbit`, :mod:`leanact.lossy.compress`;
:mod:`leanact.ops.cross_entropy.launchers` next to its launcher), built from the helpers here, which
import nothing but :mod:`.dispatch`.

Each check runs its op on small inputs (several programs' worth, sizes that are not multiples of
the block, so the masked tails run too) twice on the device -- through the kernel
(``forced("on")``) and through the PyTorch path (``forced("off")``) -- and raises
``AssertionError`` where they disagree: bitwise where the math is the same (dropout masks, table
lookups, bit packing, few-bit activations), elsewhere no further from a float64 truth than a small
multiple of the PyTorch path's own distance plus one unit in the last place of the largest value.
That is a guard against a kernel that compiles to something wrong on an untested GPU or Triton
release, not a test of the documented bounds (the test suite's job). :mod:`.dispatch` runs them
in a thread of their own; inputs come from local generators. The checks never enter autograd's
engine (the ops' ``forward`` and ``backward`` are called as plain functions with a stand-in
``ctx``): a check can start inside a backward pass, where the engine's CUDA thread is busy with the
caller's graph, and a backward call from the check's thread would wait on it forever.
"""
from __future__ import annotations

from typing import Callable

import torch

from .dispatch import forced

__all__ = ["FLOATS", "same", "no_worse", "ulps_apart", "both", "generator", "randn", "forward_backward"]

#: The dtypes the kernels take (a check's key is one of them, or a tuple starting with one).
FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def generator(device: torch.device) -> torch.Generator:
    """A generator on ``device`` with a fixed seed (the caller's random state is left alone)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(0x1EA4AC7)
    return gen


def randn(shape, device, dtype, gen, scale: float = 1.0) -> torch.Tensor:
    """Normal samples from ``gen`` times ``scale``, rounded to ``dtype``."""
    return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)


class _Ctx:
    """Stands for autograd's ``ctx`` so that a Function's forward and backward run as plain calls."""

    def __init__(self, *needs: bool):
        self.needs_input_grad = needs

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def set_materialize_grads(self, value: bool):
        self.materialize_grads = value


def forward_backward(function, args: tuple, dy: torch.Tensor | tuple, needs: tuple):
    """``(output, gradients)`` of an autograd Function's forward and backward, called directly
    (no graph, no engine; see the module doc); ``dy``: a tuple for a Function of several outputs."""
    ctx = _Ctx(*needs)
    with torch.no_grad():
        y = function.forward(ctx, *args)
        grads = function.backward(ctx, *dy) if isinstance(dy, tuple) else function.backward(ctx, dy)
    return y, grads


def both(run: Callable):
    """``(run() through the kernels, run() through the PyTorch path)``."""
    with forced("off"):
        ref = run()
    with forced("on"):
        got = run()
    return got, ref


def same(what: str, got: torch.Tensor | None, ref: torch.Tensor | None) -> None:
    """Bitwise equal (NaN equals NaN), same dtype and shape."""
    if got is None or ref is None:
        assert got is None and ref is None, f"{what}: one path returned None"
        return
    assert got.shape == ref.shape and got.dtype == ref.dtype, (
        f"{what}: {tuple(got.shape)} {got.dtype} from the kernel, {tuple(ref.shape)} {ref.dtype} from the PyTorch path")
    if got.dtype == torch.float8_e4m3fn:
        got, ref = got.view(torch.uint8), ref.view(torch.uint8)
    equal = got == ref
    if got.is_floating_point():
        equal |= got.isnan() & ref.isnan()
    bad = int((~equal).sum())
    assert bad == 0, f"{what}: {bad} of {got.numel()} elements differ from the PyTorch path (expected bitwise equal)"


def no_worse(what: str, got: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor, factor: float = 4.0) -> None:
    """``max|got - truth| <= factor * max|ref - truth| + 2 ulp(max|truth|)`` in ``ref``'s dtype."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, (
        f"{what}: {tuple(got.shape)} {got.dtype} from the kernel, {tuple(ref.shape)} {ref.dtype} from the PyTorch path")
    truth = truth.double()
    err = (got.double() - truth).abs().max().item()
    err_ref = (ref.double() - truth).abs().max().item()
    floor = 2 * torch.finfo(ref.dtype).eps * truth.abs().max().item()
    assert err <= factor * err_ref + floor, (
        f"{what}: the kernel is {err:.3g} from float64 (the PyTorch path: {err_ref:.3g}; allowed "
        f"{factor:g}x that + {floor:.3g})")


def ulps_apart(what: str, got: torch.Tensor, ref: torch.Tensor, ulps: int) -> None:
    """Elementwise at most ``ulps`` representable values apart (NaN equals NaN)."""
    equal = (got == ref) | (got.isnan() & ref.isnan())
    off = ~equal
    if bool(off.any()):
        a, b = got[off], ref[off]
        spacing = torch.nextafter(b.abs(), torch.full_like(b, float("inf"))) - b.abs()
        assert bool(((a - b).abs() <= ulps * spacing).all()), (
            f"{what}: {int(off.sum())} elements differ from the PyTorch path, some by more than {ulps} ulp")
