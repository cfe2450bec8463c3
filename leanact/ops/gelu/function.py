"""The autograd Function: forward keeps ``y`` and the packed branch bits; backward dispatches by
storage dtype (16-bit: :mod:`.tables`; float32: :mod:`.rebuild32`; float64: :mod:`.rebuild64`), or
to the fused Triton kernels on CUDA when enabled (:mod:`leanact.ops.gelu.launchers`), whose self-check
is registered here."""
from __future__ import annotations

import contextlib
import math
import sys

import torch

from ...saved import keeping_output
from .. import fake_rules
from ..bitpack import pack_bits, unpack_bits
from ..transforms import functorch_active
from ..triton.dispatch import register_check
from .buffers import _pack, _slices
from .minimum import _CONSTS, _check, _work_dtype
from .rebuild32 import _backward32, _forward32
from .rebuild64 import _forward_w, _grad_from_output
from . import launchers as _triton
from . import tables as _tables
from .tables import _backward16, _forward16

__all__ = ["gelu", "GeluFunction", "gelu_grad_from_output"]

# -- autograd Function -------------------------------------------------------------------------


def _forward(x: torch.Tensor, approximate: str, with_bits: bool):
    """``(GELU(x), packed bits of x > x* or None)``; ``y`` contiguous, rounded once from the wider
    working precision (16-bit storage: looked up)."""
    fused = _triton.gelu_forward(x, approximate, with_bits)  # CUDA: one kernel (None: this path)
    if fused is not None:
        return fused
    xf = x.reshape(-1)
    n = xf.numel()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    yf = y.view(-1)
    right = None
    if with_bits:
        right = torch.empty((n + 7) // 8 * 8, dtype=torch.uint8, device=x.device)  # 0 or 1
        right[n:] = 0
    slices = _slices(n, x.device)
    if x.dtype in (torch.float16, torch.bfloat16):
        _forward16(xf, yf, right, approximate, slices)
    elif x.dtype == torch.float32:
        _forward32(xf, yf, right, approximate, slices)
    else:
        w = _work_dtype(x.dtype)
        xs = _CONSTS[approximate].xs
        for a, b in slices:
            xw = xf[a:b].to(w)
            if right is not None:
                torch.gt(xw, xs, out=right[a:b])  # in the working precision: the exact side of x*
            yf[a:b] = _forward_w(xw, approximate, True)
    return y, (_pack(right, n) if right is not None else None)


def _backward(y: torch.Tensor, bits: torch.Tensor, grad_y: torch.Tensor, approximate: str) -> torch.Tensor:
    """``grad_y * GELU'(x)`` rebuilt from ``y`` and the packed bits, rounded once to y's dtype."""
    fused = _triton.gelu_backward(y, bits, grad_y, approximate)  # CUDA: one kernel (None: this path)
    if fused is not None:
        return fused
    yf, gf = y.reshape(-1), grad_y.reshape(-1)
    out = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    of = out.view(-1)
    n = yf.numel()
    slices = _slices(n, y.device)
    if n == 0:
        return out
    if y.dtype in (torch.float16, torch.bfloat16):
        _backward16(yf, bits, gf, of, approximate, slices)
    elif y.dtype == torch.float32:
        _backward32(yf, bits, gf, of, approximate, slices)
    else:
        right = unpack_bits(bits, n)
        for a, b in slices:
            # product in the working precision, rounded once on the copy
            of[a:b] = _grad_from_output(yf[a:b], right[a:b], approximate).mul_(gf[a:b])
    return out


def gelu_grad_from_output(y: torch.Tensor, right: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU'(x) rebuilt from ``y = GELU(x)`` and ``right = x > x*``, in ``y``'s dtype.

    What backward computes (for a gradient of ones), exposed for tests and analysis.
    """
    _check(approximate)
    _work_dtype(y.dtype)
    with torch.no_grad():
        bits = pack_bits(right.reshape(-1).to(torch.bool))
        return _backward(y.contiguous(), bits, torch.ones_like(y), approximate)


_NO_DOUBLE_BACKWARD = (
    b"leanact GELU does not support double backward: its gradient is rebuilt from the saved output "
    b"without autograd. Use torch.nn.functional.gelu where second derivatives are needed."
)


class GeluFunction(torch.autograd.Function):
    """``y = GELU(x)`` keeping ``y`` and one bit per element (see the module docstring).

    Double backward is not supported: with ``create_graph=True`` the first-order gradient is
    returned as usual, and differentiating it raises a RuntimeError that says so.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, approximate: str = "none"):
        y, bits = _forward(x, approximate, with_bits=True)
        ctx.approximate = approximate
        ctx.keeps_output = True
        ctx.save_for_backward(y, bits)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        y, bits = ctx.saved_tensors
        if torch.compiler.is_compiling():  # opaque: the partitioner then keeps y itself (below)
            return _gelu_backward_op(y, bits, grad_y, ctx.approximate), None
        create_graph = torch.is_grad_enabled()
        if not create_graph:  # the common case: grad mode is already off (no context to enter)
            return _backward(y, bits, grad_y, ctx.approximate), None
        with torch.no_grad():
            out = _backward(y, bits, grad_y, ctx.approximate)
        if not torch.compiler.is_compiling():
            # Like once_differentiable, but also when grad_y itself does not require grad.
            out = torch._C._functions.DelayedError(_NO_DOUBLE_BACKWARD, 1)(out.requires_grad_())
        return out, None


# Traced while compiling, the backward's reads of y (the 16-bit tables index by its bit pattern, a view
# of another dtype) let AOTAutograd's partitioner keep that view, which the compiler makes a buffer of
# its own, next to y kept by the next Linear: twice y's bytes (measured: GPT-2 and BERT under autocast).
# As a custom op the backward takes y itself, which the model keeps once.

@torch.library.custom_op("leanact::gelu_backward", mutates_args=())
def _gelu_backward_op(y: torch.Tensor, bits: torch.Tensor, grad_y: torch.Tensor, approximate: str) -> torch.Tensor:
    with torch.no_grad():
        return _backward(y, bits, grad_y, approximate)


@_gelu_backward_op.register_fake
def _(y, bits, grad_y, approximate):
    return torch.empty_like(grad_y)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU that keeps only its output and 1 bit per element for backward (exact gradient).

    Same signature and semantics as ``torch.nn.functional.gelu``. Without autograd (no grad mode
    or ``x`` not requiring grad) nothing is kept and no bits are packed. Under ``torch.func``
    transforms this is ``torch.nn.functional.gelu`` (:mod:`leanact.ops.transforms`).
    """
    _check(approximate)
    _work_dtype(x.dtype)
    if functorch_active():  # torch.func: torch's own op (leanact.ops.transforms)
        return torch.nn.functional.gelu(x, approximate=approximate)
    if torch.is_grad_enabled() and x.requires_grad:
        # its output may be the source of an autocast cast (leanact.patching.amp)
        return keeping_output(lambda: GeluFunction.apply(x, approximate))
    return _forward(x, approximate, with_bits=False)[0]


# -- the self-check of the "gelu" kernels ---------------------------------------------------------


def _self_check(device: torch.device, key) -> None:
    """:func:`_forward` and :func:`_backward` through the kernels and the PyTorch path for ``key``
    (dtype, approximation): bitwise in 16 bits (the same tables); in float32 the kernels compute
    in float32 what the PyTorch path rounds once from float64 (:mod:`leanact.ops.gelu.kernels32`),
    so ``y`` may differ by a few ulps and the gradient by a few ulps of itself plus, next to the
    minimum, the width of what the stored output allows (``docs/gelu_bound.md``, section 3)."""
    from ..triton.selfcheck import both, generator, randn, same, ulps_apart

    dtype, mode = key
    gen = generator(device)
    c = _CONSTS[mode]
    if dtype == torch.float32:
        near = c.xs + torch.randn(512, generator=gen, device=device) * 1e-3
        x = torch.cat([torch.randn(4096, generator=gen, device=device) * 4, near])
        xs = (x, x[-4096:])  # a last partial block (masks), then whole blocks (the unmasked kernels)
    else:  # every 16-bit pattern
        xs = (torch.arange(1 << 16, dtype=torch.int32, device=device).to(torch.int16).view(dtype),)
    for x in xs:
        (y, bits), (y0, bits0) = both(lambda: _forward(x, mode, True))
        same(f"GELU ({mode}) branch bits", bits, bits0)
        dy = randn(x.shape, device, dtype, gen)
        dx, dx0 = both(lambda: _backward(y0, bits0, dy, mode))
        if dtype == torch.float32:
            ulps_apart(f"GELU ({mode}) forward", y, y0, _F32_FORWARD_ULPS)
            _within_rebuild_width(f"GELU ({mode}) backward", dx, dx0, dy, x, c)
        else:  # the same tables
            same(f"GELU ({mode}) forward", y, y0)
            same(f"GELU ({mode}) backward", dx, dx0)


#: The float32 kernels' distance from the PyTorch path, with margin (tests/test_triton_kernels.py
#: bounds them to 4.5 ulps from the float64 truth in the forward, 2.5 beyond B(y) in the backward,
#: where the PyTorch path is within 1/2: with the two products by dy, 5.3 ulps of dx at most).
_F32_FORWARD_ULPS = 8
_F32_BACKWARD_ULPS = 6


def _within_rebuild_width(what: str, dx, dx0, dy, x, c) -> None:
    """``|dx - dx0| <= 6 ulp(dx0) + |dy| w(x)``, ``w`` the width of B(y) next to the minimum:
    ``ulp(y*) / |x - x*|`` (f''/f' times the rounding of y), at most ``2 sqrt(c ulp(y*))``."""
    ulp_ys = 2.0 ** (math.floor(math.log2(abs(c.ys))) - 23)  # float32 ulp at y*
    width = torch.clamp(ulp_ys / (x - c.xs).abs(), max=2 * math.sqrt(c.c2 * ulp_ys))
    spacing = torch.nextafter(dx0.abs(), torch.full_like(dx0, float("inf"))) - dx0.abs()
    tol = _F32_BACKWARD_ULPS * spacing + dy.abs() * width
    ok = ((dx - dx0).abs() <= tol) | (dx == dx0) | (dx.isnan() & dx0.isnan())
    bad = int((~ok).sum())
    assert bad == 0, f"{what}: {bad} of {dx.numel()} elements differ from the PyTorch path by more than the bound"


register_check("gelu", _self_check)


# -- on fake tensors (leanact.estimate) ----------------------------------------------------------


def warm_tables(dtype: torch.dtype, approximations) -> None:
    """Build, on real tensors, the lookup tables the backward creates lazily on its first call for
    ``dtype`` and each approximation: building them is value-dependent (boolean-mask indexing,
    ``aten.nonzero``), which ``FakeTensorMode`` cannot run. Cached per process (a few seconds once
    per dtype and approximation)."""
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        for approximate in sorted(approximations):
            x = torch.linspace(-3, 3, 8, dtype=dtype).requires_grad_(True)
            gelu(x, approximate=approximate).sum().backward()


@contextlib.contextmanager
def _fake_rule(run):
    """On fake tensors: the eager slices are sized for the modelled device and only the first two
    run (the outputs and packed bits are allocated whole before the loop and the workspace once
    per call: the allocations and the peak are the full loop's). Modelling CUDA, every table read
    is recorded in ``run.held`` (the device holds one copy of each: workspaces across steps)."""
    slices, table = _slices, _tables._table
    device = torch.device(run.kind)

    def first_slices(n: int, dev: torch.device):
        return slices(n, device)[:2] if fake_rules.faking() else slices(n, dev)

    def recorded(kind, dtype, approximate, dev):
        t = table(kind, dtype, approximate, dev)
        if isinstance(t, torch.Tensor):
            run.held[f"GELU table {kind} {dtype} {approximate}"] = t.untyped_storage().nbytes()
        return t

    with fake_rules.swapped(sys.modules[__name__], _slices=first_slices if run.fewer_iterations else None), \
            fake_rules.swapped(_tables, _table=recorded if run.kind == "cuda" else None):
        yield


fake_rules.register("gelu", rule=_fake_rule)
