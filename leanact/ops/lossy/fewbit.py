"""Few-bit backward for GELU (erf and tanh forms) and SiLU: an approximate gradient, b bits kept.

Forward is torch's own (``F.gelu`` / ``F.silu``, bitwise). For backward only a ``bits``-bit index
per element is kept (``bits`` in 1..4; bit planes packed with :mod:`leanact.ops.bitpack`:
``bits * ceil(numel / 8)`` bytes), saying which region of x the input fell in; backward returns
``grad * level[index]``, i.e. the true derivative replaced by a piecewise-constant function with
``2**bits`` values. The levels and region borders minimise the L2 error to the true derivative,
weighted by a standard normal input density (Lloyd-Max conditions: each level is the weighted
mean of f' over its region, each x is mapped to the nearest level). They are solved by
``scripts/fewbit_tables.py`` and shipped in :mod:`.fewbit_tables`. f' is not monotonic
(GELU' dips to -0.13 at x = -sqrt 2 and peaks at 1.13 at x = +sqrt 2), so one level may own
several x intervals; the forward maps x to its interval with ``bucketize`` and the interval to
its level with a small lookup.

What it approximates: the activation's derivative (the gradient w.r.t. the activation input is
off by ``grad * (level - f'(x))``; RMS error of the derivative under the standard normal weight
(``sqrt(TABLES[...]["error"])``) 0.196 / 0.089 / 0.044 / 0.022 for 1 / 2 / 3 / 4 bits (GELU; SiLU
0.179 / 0.089 / 0.044 / 0.022), i.e. 29% / 13% / 6.5% / 3.2% of the RMS of GELU'. The output is exact.
NaN inputs get the gradient of the last interval (finite) instead of NaN. Double backward is not
supported (``once_differentiable``).

Rounding of borders: the x dtype's values are compared with the borders rounded *down* to that
dtype, which puts every representable x on the same side as the float64 border would.

On CUDA (unless ``LEANACT_TRITON=0``; :mod:`.launchers`) forward is one Triton kernel:
the index planes, and for contiguous 16-bit x also y, looked up in torch's activation of every
16-bit pattern (torch's CUDA kernel computes each element alike wherever it sits, so y is torch's
bit for bit); float32 y stays torch's kernel. Backward is one kernel (unpack, level, product).
The packed planes and the gradient are bitwise those of the PyTorch path.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from ..backward import once_differentiable
from ..bitpack import pack_bits, packed_nbytes, unpack_bits
from ..transforms import functorch_active
from ..triton.dispatch import register_check
from . import launchers as _triton
from .fewbit_tables import TABLES

__all__ = ["FUNCTIONS", "FewBitFunction", "fewbit_activation", "fewbit_index", "fewbit_derivative",
           "fewbit_packed_nbytes", "table"]

FUNCTIONS = ("gelu", "gelu_tanh", "silu")
_CACHE: dict = {}


def table(function: str, bits: int) -> dict:
    """The shipped table for ``function`` ("gelu", "gelu_tanh", "silu") and ``bits`` (1..4)."""
    if function not in FUNCTIONS:
        raise ValueError(f"few-bit backward supports {FUNCTIONS}, got {function!r}")
    if bits not in (1, 2, 3, 4):
        raise ValueError(f"bits must be 1, 2, 3 or 4 (the index kept per element), got {bits!r}")
    return TABLES[(function, bits)]


def fewbit_packed_nbytes(numel: int, bits: int) -> int:
    """Bytes kept for ``numel`` elements: ``bits`` packed bit planes of ``ceil(numel / 8)`` bytes."""
    return bits * packed_nbytes(numel)


def _borders_below(borders: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """Borders rounded down to ``dtype``: for x of that dtype, ``x > b_down`` iff ``x > b``."""
    exact = torch.tensor(borders, dtype=torch.float64)
    b = exact.to(dtype)
    over = b.double() > exact
    if over.any():
        b = torch.where(over, torch.nextafter(b, torch.full_like(b, -math.inf)), b)
    return b.to(device)


def _cached(key, build):
    """``_CACHE[key]``, built once; tensors made under a fake mode (leanact.estimate) are not kept."""
    hit = _CACHE.get(key)
    if hit is None:
        hit = build()
        if not any(is_fake(t) for t in (hit if isinstance(hit, tuple) else (hit,))):
            _CACHE[key] = hit
    return hit


def _tensors(function: str, bits: int, dtype: torch.dtype, device: torch.device):
    def build():
        t = table(function, bits)
        level_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        return (_borders_below(t["borders"], dtype, device),
                torch.tensor(t["labels"], dtype=torch.uint8, device=device),
                torch.tensor(t["levels"], dtype=torch.float64).to(device=device, dtype=level_dtype))

    return _cached((function, bits, dtype, device), build)


def _y_table(function: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch's activation of every 16-bit pattern of ``dtype`` (the fused forward's lookup table)."""
    def build():
        with torch.no_grad():
            x = torch.arange(1 << 16, dtype=torch.int32, device=device).to(torch.int16).view(dtype)
            return _forward(x, function)

    return _cached(("y", function, dtype, device), build)


def _kernel_forward(x: torch.Tensor, function: str, bits: int):
    """``(y, packed)`` by the Triton kernel (CUDA, enabled; y by torch where the kernel leaves it), or None."""
    def tables():
        borders, labels, _ = _tensors(function, bits, x.dtype, x.device)
        return _cached(("b32", function, bits, x.dtype, x.device), lambda: borders.float()), labels

    fused = _triton.fewbit_forward(x, tables, bits, lambda: _y_table(function, x.dtype, x.device))
    if fused is None:
        return None
    y, packed = fused
    return (_forward(x, function) if y is None else y), packed


def fewbit_index(x: torch.Tensor, function: str, bits: int) -> torch.Tensor:
    """Level index (uint8, shape of ``x``) of every element: the level of x's interval."""
    borders, labels, _ = _tensors(function, bits, x.dtype, x.device)
    return labels[torch.bucketize(x, borders)]


def _pack(index: torch.Tensor, bits: int) -> torch.Tensor:
    planes = [pack_bits(torch.bitwise_and(index, 1 << p) != 0) for p in range(bits)]
    return torch.cat(planes) if bits > 1 else planes[0]


def _unpack(packed: torch.Tensor, bits: int, numel: int, shape) -> torch.Tensor:
    per = packed_nbytes(numel)
    index = torch.zeros(numel, dtype=torch.uint8, device=packed.device)
    for p in range(bits):
        plane = unpack_bits(packed[p * per:(p + 1) * per], numel)
        index.bitwise_or_(plane.to(torch.uint8) << p)
    return index.view(shape)


def fewbit_derivative(x: torch.Tensor, function: str, bits: int) -> torch.Tensor:
    """The piecewise-constant derivative backward uses, at ``x`` (levels' dtype: float32 for
    16-bit ``x``, else ``x.dtype``)."""
    _, _, levels = _tensors(function, bits, x.dtype, x.device)
    return levels[fewbit_index(x, function, bits).long()]


def _forward(x: torch.Tensor, function: str) -> torch.Tensor:
    if function == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if function == "gelu_tanh" else "none")


class FewBitFunction(torch.autograd.Function):
    """``y = f(x)`` (torch's kernel) keeping ``bits`` bits per element (module doc)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, function: str, bits: int):
        ctx.meta = (function, bits, x.shape, x.dtype, x.numel())
        fused = _kernel_forward(x, function, bits)  # CUDA: one kernel (None: the PyTorch path)
        if fused is not None:
            y, packed = fused
        else:
            y, packed = _forward(x, function), _pack(fewbit_index(x.contiguous(), function, bits), bits)
        ctx.save_for_backward(packed)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (packed,) = ctx.saved_tensors
        function, bits, shape, dtype, numel = ctx.meta
        _, _, levels = _tensors(function, bits, dtype, grad.device)
        fused = _triton.fewbit_backward(packed, levels, grad, bits) if grad.numel() == numel else None
        if fused is not None:  # CUDA: one kernel
            return fused, None, None
        d = levels[_unpack(packed, bits, numel, shape).long()]
        return (grad.to(levels.dtype) * d).to(grad.dtype), None, None


def fewbit_activation(x: torch.Tensor, function: str = "gelu", bits: int = 2) -> torch.Tensor:
    """``f(x)`` with a few-bit backward (module doc). ``function``: "gelu", "gelu_tanh", "silu"."""
    table(function, bits)
    if not x.is_floating_point():
        raise TypeError(f"few-bit activations need a floating-point input, got {x.dtype}")
    if torch.is_grad_enabled() and x.requires_grad:
        if functorch_active():
            raise RuntimeError(
                "leanact.lossy few-bit activations cannot run under torch.func transforms (grad, vmap, ...): "
                "their approximate derivative is a custom autograd Function; remove the lossy options "
                "(leanact.lossy.remove(model)) or call the model outside the transform")
        return FewBitFunction.apply(x, function, bits)
    return _forward(x, function)


# -- the self-check of the "fewbit" kernels -------------------------------------------------------


def _self_check(device: torch.device, key) -> None:
    """This op's forward and backward for GELU and SiLU through the kernels and the PyTorch path for
    ``key`` (dtype, bits): bitwise (16-bit y on a CPU: within one ulp; see
    :mod:`leanact.ops.triton.selfcheck`)."""
    from ..triton.selfcheck import both, forward_backward, generator, randn, same, ulps_apart

    dtype, bits = key
    gen = generator(device)
    x, dy = randn((3, 701), device, dtype, gen, 3.0), randn((3, 701), device, dtype, gen)
    for function in ("gelu", "silu"):
        def run(function=function):
            y, (dx, *_) = forward_backward(FewBitFunction, (x, function, bits), dy, (True, False, False))
            return y, dx

        (y, dx), (y0, dx0) = both(run)
        if device.type == "cuda" or dtype == torch.float32:
            same(f"few-bit {function} ({bits} bits) forward", y, y0)
        else:  # 16-bit y is a table of torch's activation, which on a CPU may round a tail element differently
            ulps_apart(f"few-bit {function} ({bits} bits) forward", y, y0, 1)
        same(f"few-bit {function} ({bits} bits) backward", dx, dx0)


register_check("fewbit", _self_check)
