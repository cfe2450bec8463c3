"""What every Triton kernel module of leanact builds on: rounded stores, exact loads, bit packing,
rounding to a 16-bit dtype, the launch options and the elementwise grid.

The kernel modules (in each op's folder: ``leanact.ops.<op>.kernels``; GELU's
:mod:`leanact.ops.gelu.kernels16` and :mod:`leanact.ops.gelu.kernels32`) import these;
:mod:`.dispatch` loads this module by name on the first kernel call, so whether it imports is
whether Triton works here.

Everything here runs under ``TRITON_INTERPRET=1`` on CPU tensors too (the tests do that), so it
uses only what both the interpreter and the compiler support: no libdevice, no inline asm. The
interpreter converts float32 to bfloat16 by truncation, so there bfloat16 results are rounded to
nearest even with integer operations (:func:`_store`, :func:`_round`); compiled, by the hardware's
round-to-nearest-even conversion: the same values. No kernel uses float64 (1/2 to 1/64 of float32's
rate on GPUs; tests/test_triton_ptx.py checks the compiled code).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import cdiv

#: Launch options: contraction into FMAs allowed (the norms) or not (kernels whose rounding sequence
#: must be the interpreter's or torch's). Always explicit: recent Triton warns when it is left to its default.
FUSED, UNFUSED = {"enable_fp_fusion": True}, {"enable_fp_fusion": False}

# -- shared helpers --------------------------------------------------------------------------------


@triton.jit
def _store(ptr, v, mask):
    """Store the float32 ``v`` into ``ptr``'s dtype, rounded once to nearest even (compiled: the
    hardware conversion, ``cvt.rn``; interpreted: integer operations, as the interpreter truncates
    to bfloat16)."""
    if ptr.dtype.element_ty == tl.bfloat16 and _INTERPRETED:
        u = v.to(tl.float32).to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(v != v, 0x7FC0, r)
        tl.store(ptr, r.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_f32(ptr, mask):
    """``ptr``'s values as float32, exactly (interpreted, bfloat16 through its bits: the interpreter's
    own conversion loses bfloat16 subnormals)."""
    if ptr.dtype.element_ty == tl.bfloat16 and _INTERPRETED:
        bits = tl.load(ptr, mask=mask, other=0.0).to(tl.uint16, bitcast=True).to(tl.uint32)
        return (bits << 16).to(tl.float32, bitcast=True)
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


#: Whether these kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` when this module was
#: imported: ``triton.jit`` made interpreted functions then).
_INTERPRETED = tl.constexpr(type(_store).__name__ == "InterpretedFunction")


@triton.jit
def _pack8(bit, BLOCK: tl.constexpr):
    """``BLOCK`` 0/1 int32 values -> ``BLOCK // 8`` bytes, bit ``i % 8`` of byte ``i // 8`` = value i."""
    b = tl.reshape(bit, (BLOCK // 8, 8))
    return tl.sum(b << tl.arange(0, 8)[None, :], axis=1).to(tl.uint8)


@triton.jit
def _unpack1(bits_ptr, offs, mask):
    """The packed bit of each element index ``offs`` (int32 0/1)."""
    byte = tl.load(bits_ptr + offs // 8, mask=mask, other=0).to(tl.int32)
    return (byte >> (offs % 8).to(tl.int32)) & 1


@triton.jit
def _lerp01(start, end, w):
    """``torch.lerp(start, end, w)`` for weights 0 or 1 (exact selections; inf/nan as torch)."""
    return tl.where(w < 0.5, start + w * (end - start), end - (end - start) * (1.0 - w))


def _grid(n: int, block: int):
    return (cdiv(n, block),)


# -- rounding to a 16-bit dtype in float32 ----------------------------------------------------------


@triton.jit
def _round(v, KIND: tl.constexpr):
    """float32 ``v`` rounded to nearest even in the dtype of code ``KIND`` (0 float32, 1 bfloat16,
    2 float16), returned as float32: a value the kernel does not store but torch would have (the
    dropout output, the residual sum)."""
    if KIND == 1:
        if _INTERPRETED:  # (the interpreter truncates to bfloat16: integer operations, as in _store)
            u = v.to(tl.uint32, bitcast=True)
            r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
            return tl.where(v != v, v, r.to(tl.float32, bitcast=True))
        return v.to(tl.bfloat16).to(tl.float32)
    elif KIND == 2:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def _round_as(v, ptr):
    """float32 ``v`` rounded to nearest even in ``ptr``'s element dtype, returned as float32."""
    if ptr.dtype.element_ty == tl.bfloat16:
        return _round(v, 1)
    elif ptr.dtype.element_ty == tl.float16:
        return _round(v, 2)
    else:
        return v


#: dtype -> the code :func:`_round` takes
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
