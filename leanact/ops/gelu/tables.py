"""Lookup tables: their cache, and the 16-bit storage (bfloat16, float16) done by lookup.

For 16-bit storage the derivative is a function of the 16-bit pattern of ``y`` and the branch
bit, 2 x 65536 values, computed once per dtype, mode and device with the exact rebuild
(:mod:`.rebuild64`, in float32) into a 512 KiB float32 table; backward is a gather and the
product with the incoming gradient, rounded once. The forward is a 65536-entry table of GELU as
well. The float32 path registers its own tables here (:mod:`.rebuild32`).
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .buffers import _unpack_into, _Workspace
from .minimum import _APPROXIMATE, _THRESHOLDS, _all_patterns
from .rebuild64 import _forward_w, _grad_from_output

# -- lookup tables -----------------------------------------------------------------------------
# Built lazily, once per (kind, dtype, mode, device), outside autograd, and cached. Under
# torch.compile the accessor runs while the graph is traced and its result enters the graph as a
# constant (`assume_constant_result`), so the traced op reads the same table as eager mode. One
# accessor per (kind, dtype, mode), with its own code name: dynamo names the constant after it.

_TABLES: dict[tuple[str, str, str, str], torch.Tensor] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _table(kind: str, dtype: str, approximate: str, device: str) -> torch.Tensor:
    """The cached table ``kind`` (see ``_BUILDERS``) for storage ``dtype`` and mode on ``device``."""
    key = (kind, dtype, approximate, device)
    t = _TABLES.get(key)
    if t is None:
        with torch.no_grad():
            t = _BUILDERS[kind](getattr(torch, dtype), approximate, torch.device(device))
        if type(t) is torch.Tensor:  # a real tensor, not a tracing mode's stand-in: keep it
            _TABLES[key] = t
    return t


def _build_y16(dtype, approximate, device):
    """16-bit storage: GELU of every input pattern, exactly what the working-precision forward
    (``_forward_w`` in float32, rounded once) returns for it."""
    return _forward_w(_all_patterns(dtype, device).to(torch.float32), approximate, False).to(dtype)


def _build_g16(dtype, approximate, device):
    """16-bit storage: the rebuilt derivative (float32, before the product with the incoming
    gradient) for every output pattern, left branch (entries 0..65535) then right branch."""
    y = _all_patterns(dtype, device).repeat(2)
    right = torch.arange(1 << 17, device=device) >= (1 << 16)
    return _grad_from_output(y, right, approximate)


def _build_spread(dtype, approximate, device):
    """Unpacking: entry b is the int64 whose 8 bytes are the bits of b (0 or 1), lowest first."""
    b = torch.arange(256, dtype=torch.int32, device=device)
    bits = (b[:, None] >> torch.arange(8, dtype=torch.int32, device=device)) & 1
    return bits.to(torch.uint8).contiguous().view(torch.int64).view(-1)


_BUILDERS: dict[str, Callable] = {}
_ACCESSORS: dict[tuple[str, str, str], Callable[[str], torch.Tensor]] = {}


def _accessor(kind: str, dtype: str, approximate: str):
    def table(device: str) -> torch.Tensor:
        return _table(kind, dtype, approximate, device)

    name = f"_gelu_table_{kind}_{dtype}_{approximate}"
    table.__code__ = table.__code__.replace(co_name=name)
    table.__name__ = table.__qualname__ = name
    return torch.compiler.assume_constant_result(table)


def register(kind: str, builder: Callable, dtypes: tuple[str, ...], modes: tuple[str, ...] = _APPROXIMATE) -> None:
    """Add table ``kind``: ``builder(dtype, approximate, device)`` makes it; one accessor per storage
    dtype and mode (``_ACCESSORS[kind, dtype, mode](device)``)."""
    _BUILDERS[kind] = builder
    for dtype in dtypes:
        for mode in modes:
            _ACCESSORS[kind, dtype, mode] = _accessor(kind, dtype, mode)


@contextlib.contextmanager
def real_cpu():
    """Build a CPU table with real tensors, whatever dispatch modes are active (``leanact.estimate``'s
    fake tensors and meters): the table is a per-process constant, not part of the step; only its
    copy to the device, made by the caller under those modes, is."""
    with _disable_current_modes(), torch.no_grad():
        yield


#: Chebyshev nodes in [0, 1] of the cubics of the CUDA float32 kernels' tables (:mod:`.slope32`, :mod:`.erfcx32`)
CUBIC_NODES = tuple((1 - math.cos(math.pi * (2 * j + 1) / 8)) / 2 for j in range(4))


def fit_cubics(values: torch.Tensor) -> torch.Tensor:
    """``(cells, 4)`` float64 coefficients ``c0..c3`` (of ``s**0..s**3``) of the cubic through
    ``values`` (``(4, cells)``, at :data:`CUBIC_NODES`) in each cell."""
    s = torch.tensor(CUBIC_NODES, dtype=torch.float64)
    vander = s[:, None] ** torch.arange(4, dtype=torch.float64)  # (nodes, powers)
    return torch.linalg.solve(vander, values).t().contiguous()


register("y16", _build_y16, ("bfloat16", "float16"))
register("g16", _build_g16, ("bfloat16", "float16"))
register("spread", _build_spread, ("uint8",), ("none",))


# -- 16-bit storage: forward and backward by lookup ----------------------------------------------


def _forward16(xf, yf, right, approximate, slices):
    dn = _dtype_name(xf.dtype)
    ytab = _ACCESSORS["y16", dn, approximate](str(xf.device))
    u = _THRESHOLDS[xf.dtype][approximate][1]
    ws = _Workspace(slices[0][1] - slices[0][0], xf.device, {"idx": torch.int32})
    for a, b in slices:
        idx = ws.cut(b - a).idx
        idx.copy_(xf[a:b].view(torch.uint16))  # the pattern
        torch.index_select(ytab, 0, idx, out=yf[a:b])
        if right is not None:
            torch.lt(idx, u, out=right[a:b])


def _backward16(yf, bits, gf, of, approximate, slices):
    dn = _dtype_name(yf.dtype)
    dev = str(yf.device)
    gtab = _ACCESSORS["g16", dn, approximate](dev)
    spread = _ACCESSORS["spread", "uint8", "none"](dev)
    ws = _Workspace(slices[0][1] - slices[0][0], yf.device, {"idx": torch.int32, "g": torch.float32})
    for a, b in slices:
        w = ws.cut(b - a)
        rb = _unpack_into(bits[a // 8:(b + 7) // 8], spread, w)[: b - a]
        w.idx.copy_(yf[a:b].view(torch.uint16)).add_(rb, alpha=1 << 16)
        torch.index_select(gtab, 0, w.idx, out=w.g)
        torch.mul(w.g, gf[a:b], out=of[a:b])  # float32 product, rounded once to the storage dtype
