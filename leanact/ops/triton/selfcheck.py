"""Self-checks of the ops' Triton kernels: run before an op's kernel first runs on a device.

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
caller's graph, and a backward call from the check's thread would wait on it forever. The 8-bit compression registers its
check in :mod:`leanact.lossy.compress` (its PyTorch path lives there).
"""
from __future__ import annotations

from typing import Callable

import torch

from .dispatch import forced, register_check

__all__ = ["same", "no_worse", "both", "generator", "forward_backward"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def generator(device: torch.device) -> torch.Generator:
    """A generator on ``device`` with a fixed seed (the caller's random state is left alone)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(0x1EA4AC7)
    return gen


def _randn(shape, device, dtype, gen, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)


class _Ctx:
    """Stands for autograd's ``ctx`` so that a Function's forward and backward run as plain calls."""

    def __init__(self, *needs: bool):
        self.needs_input_grad = needs

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def forward_backward(function, args: tuple, dy: torch.Tensor, needs: tuple):
    """``(output, gradients)`` of an autograd Function's forward and backward, called directly
    (no graph, no engine; see the module doc)."""
    ctx = _Ctx(*needs)
    with torch.no_grad():
        y = function.forward(ctx, *args)
        grads = function.backward(ctx, dy)
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


def _ulps_apart(what: str, got: torch.Tensor, ref: torch.Tensor, ulps: int) -> None:
    """Elementwise at most ``ulps`` representable values apart (NaN equals NaN)."""
    equal = (got == ref) | (got.isnan() & ref.isnan())
    off = ~equal
    if bool(off.any()):
        a, b = got[off], ref[off]
        spacing = torch.nextafter(b.abs(), torch.full_like(b, float("inf"))) - b.abs()
        assert bool(((a - b).abs() <= ulps * spacing).all()), (
            f"{what}: {int(off.sum())} elements differ from the PyTorch path, some by more than {ulps} ulp")


# -- dropout (float dtypes: the dropout kernel; int64, the seed's: the mask kernels) ----------------


def _check_dropout(device: torch.device, key) -> None:
    from ..dropout import _SeededDropout
    from ..random import keep_mask, keep_mask_like
    from . import dispatch

    gen = generator(device)
    seed = torch.tensor(-4242424242, device=device)
    if key in _FLOATS:
        x, dy = _randn((3, 701), device, key, gen), _randn((3, 701), device, key, gen)

        def run():
            y, (dx, *_) = forward_backward(_SeededDropout, (x, seed, 0.3, False), dy, (True, False, False, False))
            return y, dx

        (y, dx), (y0, dx0) = both(run)
        same("dropout forward", y, y0)
        same("dropout backward", dx, dx0)
        return
    for p, offset in ((0.1, 0), (0.5, (1 << 32) - 1000)):
        got, ref = both(lambda: keep_mask_like(seed, (5, 333), p, device=device, offset=offset))
        same(f"dropout keep-mask (p={p})", got, ref)
    starts = torch.tensor([0, 97, 5000, (1 << 33) + 3], device=device)
    with forced("on"):
        rows = dispatch.keep_mask_rows(seed, starts, 1100, 0.2)
    assert rows is not None, "dropout keep-mask rows: the kernel did not run"
    index = starts[:, None] + torch.arange(1100, device=device)
    same("dropout keep-mask rows", rows, keep_mask(seed, index, 0.2))


# -- GELU from output ------------------------------------------------------------------------------


def _check_gelu(device: torch.device, key) -> None:
    from ..gelu import function as G

    dtype, mode = key
    gen = generator(device)
    if dtype == torch.float32:
        near = G._CONSTS[mode].xs + torch.randn(512, generator=gen, device=device) * 1e-3
        x = torch.cat([torch.randn(4096, generator=gen, device=device) * 4, near])
    else:  # every 16-bit pattern
        x = torch.arange(1 << 16, dtype=torch.int32, device=device).to(torch.int16).view(dtype)
    (y, bits), (y0, bits0) = both(lambda: G._forward(x, mode, True))
    same(f"GELU ({mode}) branch bits", bits, bits0)
    dy = _randn(x.shape, device, dtype, gen)
    dx, dx0 = both(lambda: G._backward(y0, bits0, dy, mode))
    if dtype == torch.float32:  # float64 erfc implementations differ by ~1e-16: one float32 rounding, rarely
        _ulps_apart(f"GELU ({mode}) forward", y, y0, 1)
        _ulps_apart(f"GELU ({mode}) backward", dx, dx0, 1)
    else:  # the same tables
        same(f"GELU ({mode}) forward", y, y0)
        same(f"GELU ({mode}) backward", dx, dx0)


# -- LayerNorm / RMSNorm from output ---------------------------------------------------------------


def _norm_inputs(device, dtype, n: int):
    gen = generator(device)
    x = _randn((2, 7, n), device, dtype, gen, 2.0)
    w = (torch.rand(n, generator=gen, device=device) + 0.5).to(dtype)
    b = _randn(n, device, dtype, gen, 0.1)
    dy = _randn((2, 7, n), device, dtype, gen)
    return x, w, b, dy


def _check_norm(rms: bool) -> Callable:
    def check(device: torch.device, key) -> None:
        from ..layer_norm import LayerNormFromOutput
        from ..rms_norm import RMSNormFunction

        dtype, n = key, 600
        x, w, b, dy = _norm_inputs(device, dtype, n)
        for from_output in ((True, False) if rms else (True,)):
            def run(x=x, w=w, b=b, dy=dy):
                if rms:
                    y, grads = forward_backward(RMSNormFunction, (x, w, (n,), None, from_output), dy,
                                                (True, True, False, False, False))
                else:
                    y, grads = forward_backward(LayerNormFromOutput, (x, w, b, (n,), 1e-5), dy,
                                                (True, True, True, False, False))
                return [y, *grads[: 2 if rms else 3]]

            got, ref = both(run)
            truth = run(*(t.double() for t in (x, w, b, dy)))  # float64: the PyTorch path
            name = "RMSNorm" if rms else "LayerNorm"
            for what, a, r, t in zip(("y", "dx", "dweight", "dbias"), got, ref, truth):
                no_worse(f"{name} (from output: {from_output}) {what}", a, r, t)
    return check


# -- gated MLP act(g) * u ----------------------------------------------------------------------------


def _check_gated(device: torch.device, key) -> None:
    from .. import gated_mlp as M
    from . import gated

    dtype, kind = key
    gen = generator(device)
    g, u, dh = (_randn((2, 3, 600), device, dtype, gen, 3.0) for _ in range(3))
    h, h0 = both(lambda: M._act_mul(kind, g, u))
    gd, ud, hd = (t.double() for t in (g, u, dh))
    a64 = M.gated_act(kind, gd)
    no_worse(f"gated MLP ({kind}) forward", h, h0, a64 * ud)
    with forced("on"):
        fused = gated.glu_backward(g, u, dh, kind, True, True, True)
    assert fused is not None, f"gated MLP ({kind}) backward: the kernel did not run"
    a = M.gated_act(kind, g)
    ref = (M._act_grad(kind, dh * u, g), dh * a, a * u)
    truth = (M._act_grad(kind, hd * ud, gd), hd * a64, a64 * ud)
    for what, x, r, t in zip(("dg", "du", "h"), fused, ref, truth):
        no_worse(f"gated MLP ({kind}) backward {what}", x, r, t)


# -- few-bit activations ----------------------------------------------------------------------------


def _check_fewbit(device: torch.device, key) -> None:
    from ..fewbit import FewBitFunction

    dtype, bits = key
    gen = generator(device)
    x, dy = _randn((3, 701), device, dtype, gen, 3.0), _randn((3, 701), device, dtype, gen)
    for function in ("gelu", "silu"):
        def run(function=function):
            y, (dx, *_) = forward_backward(FewBitFunction, (x, function, bits), dy, (True, False, False))
            return y, dx

        (y, dx), (y0, dx0) = both(run)
        if device.type == "cuda" or dtype == torch.float32:
            same(f"few-bit {function} ({bits} bits) forward", y, y0)
        else:  # 16-bit y is a table of torch's activation, which on a CPU may round a tail element differently
            _ulps_apart(f"few-bit {function} ({bits} bits) forward", y, y0, 1)
        same(f"few-bit {function} ({bits} bits) backward", dx, dx0)


register_check("dropout", _check_dropout)
register_check("gelu", _check_gelu)
register_check("layer_norm", _check_norm(rms=False))
register_check("rms_norm", _check_norm(rms=True))
register_check("gated_mlp", _check_gated)
register_check("fewbit", _check_fewbit)
