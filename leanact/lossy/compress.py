"""Compressed saved activations: keep chosen saved tensors in 8 bits with per-block scales.

:class:`CompressTransform` is a :class:`leanact.saved.SavedTensorTransform`: while it is active,
each eligible tensor autograd saves is replaced by

* ``format="fp8"``: float8 e4m3 values (``torch.float8_e4m3fn``, round to nearest) of
  ``x / scale``, ``scale = absmax(block) / 448``: relative error <= 2**-4 per element in e4m3's
  normal range, absolute <= 2**-10 * scale below it;
* ``format="int8"``: int8 values of ``x / scale`` with stochastic rounding (``floor(v + u)``,
  u uniform in [0, 1), drawn from a private generator: the global RNG is not touched),
  ``scale = absmax(block) / 127``: unbiased, absolute error < scale per element;

plus one float32 scale per ``block`` consecutive elements: ``n + 4 * ceil(n / block)`` bytes
instead of ``n * element_size``. Backward decompresses to the original dtype and shape. On CUDA
(unless ``LEANACT_TRITON=0``) compression (after int8's ``torch.rand``) and decompression are one
Triton kernel each, bitwise the same values and scales (:mod:`leanact.ops.lossy.launchers`; checked
against the PyTorch path below on first use, :func:`_self_check`).

What it approximates: every gradient that reads a compressed tensor (a Linear's weight gradient
reads its input, attention's backward reads q, k, v and its output, a norm or GELU rebuilt from
its output reads that output...). Non-finite values make their block decompress to NaN.

Deduplication: the whole storage is compressed, once per storage and version: several ops
keeping one tensor (or views of it: Q/K/V of a fused projection, a reshape) share one copy, and
each unpack returns its view (``as_strided``) of the decompressed storage (one decompression per
backward while the decompressed storage is alive).

Left as they are: tensors an active :class:`~leanact.recompute.RecipeTransform` keeps as a recipe
(inside or outside this transform: an exact recipe beats a compressed copy), parameters and tensors
whose storage is a parameter's, leaves requiring grad, non-floating or non-strided tensors, dtypes
outside ``dtypes`` (default: 16-bit floats, so the float32 statistics leanact's ops keep next to
16-bit activations (attention log-sum-exp, norm rstd) stay exact), storages smaller than
``min_numel`` elements, tensors whose last dimension is 1, tensors marked with :func:`keep_exact`,
and anything ``select(t)`` returns False for.

In-place safety: a tensor saved and modified in place afterwards raises at backward as torch
does, when the tensor (or any view object that was saved) is still alive at backward, or when it
was saved again after the modification. A modification followed by freeing every reference is
not detected (the compressed copy then still holds the values saved, which is what the gradient
needs).
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Iterable

import torch
from torch import nn

from leanact.ops.lossy import launchers as _triton
from leanact.ops.triton import dispatch as _dispatch
from leanact.recompute import recipes
from leanact.saved import SavedTensorTransform

__all__ = ["CompressTransform", "compress", "decompress", "compressed_nbytes", "keep_exact", "FORMATS"]

FORMATS = ("fp8", "int8")
_QMAX = {"fp8": 448.0, "int8": 127.0}
EXACT_ATTR = "_leanact_exact"


def keep_exact(*tensors: torch.Tensor) -> None:
    """Mark tensors (e.g. softmax statistics) that no compressing transform may touch."""
    for t in tensors:
        setattr(t, EXACT_ATTR, True)


def compressed_nbytes(numel: int, block: int) -> int:
    """Bytes kept for ``numel`` elements: one byte each plus a float32 scale per block."""
    return numel + 4 * math.ceil(numel / block)


def _check_format(format: str) -> str:
    if format not in FORMATS:
        raise ValueError(f"compression format must be one of {FORMATS}, got {format!r}")
    return format


def compress(flat: torch.Tensor, format: str, block: int, generator: torch.Generator | None = None):
    """``(values, scales)`` of a 1-D floating tensor (module doc)."""
    _check_format(format)
    n = flat.numel()
    nb = math.ceil(n / block)
    u = None
    if format == "int8":  # drawn first: the kernel and the PyTorch path round with the same u
        u = torch.rand(nb * block, generator=generator, device=flat.device, dtype=torch.float32)
    fused = _triton.compress_8bit(flat, format == "fp8", block, _QMAX[format], u)  # CUDA: one kernel
    if fused is not None:
        return fused
    x = flat.float()
    if nb * block != n:
        x = torch.cat([x, x.new_zeros(nb * block - n)])
    x = x.view(nb, block)
    amax = x.abs().amax(dim=1)
    # amax / qmax correctly rounded on every device, as the kernel's div_rn: the divisor is a tensor
    # on amax's device (CUDA divides by a Python number as a product with its float32 reciprocal,
    # ATen's div_true_kernel_cuda: for 448 another rounding in about half the blocks)
    scales = amax.div_(amax.new_full((), _QMAX[format]))
    inv = torch.where(scales > 0, scales.reciprocal(), torch.zeros_like(scales)).unsqueeze(1)
    v = x.mul(inv)
    if format == "fp8":
        q = v.to(torch.float8_e4m3fn)
    else:
        q = v.add_(u.view(nb, block)).floor_().clamp_(-127, 127).to(torch.int8)
    q = q.view(-1)
    if nb * block != n:
        q = q[:n].clone()
    return q, scales


def _self_check(device: torch.device, key) -> None:
    """The Triton kernels' self-check (:mod:`leanact.ops.triton.selfcheck`): ``compress`` and
    ``decompress`` of one dtype and format through the kernels and this module's PyTorch path,
    bitwise (int8: the same uniforms, from two generators seeded alike)."""
    from leanact.ops.triton.selfcheck import both, generator, same

    dtype, format = key
    x = (torch.randn(2 * 1000 + 37, generator=generator(device), device=device) * 3).to(dtype)
    x[256:512] = 0  # one block of zeros (scale 0); the last block is partial
    (q, s), (q0, s0) = both(lambda: compress(x, format, 256, generator=generator(device)))
    same(f"{format} compression values", q, q0)
    same(f"{format} compression scales", s, s0)
    out, out0 = both(lambda: decompress(q0, s0, dtype, 256))
    same(f"{format} decompression", out, out0)


_dispatch.register_check("compress", _self_check)


def decompress(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, block: int) -> torch.Tensor:
    """Inverse of :func:`compress` (1-D, ``dtype``)."""
    fused = _triton.decompress_8bit(values, scales, dtype, block)  # CUDA: one kernel
    if fused is not None:
        return fused
    n = values.numel()
    full = n // block
    out = torch.empty(n, dtype=dtype, device=values.device)
    if full:
        out[: full * block].view(full, block).copy_(
            values[: full * block].view(full, block).float() * scales[:full, None])
    if full * block != n:
        out[full * block:].copy_(values[full * block:].float() * scales[full])
    return out


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _kept_as_recipe(t: torch.Tensor) -> bool:
    """Whether an active RecipeTransform (inside or outside this one) keeps ``t`` as a recipe: left to
    it, so that compression never replaces an exact recipe, whatever the nesting order."""
    return recipes.is_active() and recipes._find(t) is not None


class _Entry:
    """One compressed storage (shared by every save of it at this version)."""

    __slots__ = ("values", "scales", "dtype", "version", "source", "stale", "_full", "__weakref__")

    def __init__(self, values, scales, dtype, version, source):
        self.values, self.scales, self.dtype, self.version = values, scales, dtype, version
        # the view's base (alive while any view of it is): tells a reused storage address apart
        self.source = weakref.ref(source if source._base is None else source._base)
        self.stale = False
        self._full = lambda: None

    def full(self, block: int) -> torch.Tensor:
        t = self._full()
        if t is None:
            t = decompress(self.values, self.scales, self.dtype, block)
            self._full = weakref.ref(t)
        return t


class _Handle:
    __slots__ = ("entry", "size", "stride", "offset", "version", "ref")

    def __init__(self, entry: _Entry, t: torch.Tensor):
        self.entry, self.size, self.stride, self.offset = entry, t.size(), t.stride(), t.storage_offset()
        self.version, self.ref = t._version, weakref.ref(t)


def _modified_error(shape, version_now: int | None, version: int) -> RuntimeError:
    now = "has been modified since" if version_now is None else f"is at version {version_now}"
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{list(shape)}] {now}; expected version {version} instead (checked by leanact's compressed "
        "saved activations). Hint: do not modify in place a tensor that autograd keeps for backward; use an "
        "out-of-place op (e.g. x = x + 1).")


class CompressTransform(SavedTensorTransform):
    """Keep eligible saved tensors in fp8 / int8 with per-block scales (module doc).

    ``format``: "fp8" or "int8"; ``block``: elements per scale; ``min_numel``: smaller storages
    are kept as they are; ``dtypes``: which floating dtypes to compress; ``select``: optional
    predicate on the tensor; ``seed``: of the private generator for int8's stochastic rounding.
    ``compressed`` counts the storages compressed, ``reused`` the saves served by one of them.
    """

    def __init__(self, format: str = "fp8", *, block: int = 128, min_numel: int = 4096,
                 dtypes: Iterable[torch.dtype] = (torch.bfloat16, torch.float16),
                 select: Callable[[torch.Tensor], bool] | None = None, seed: int = 0):
        self.format = _check_format(format)
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive int (elements per scale), got {block!r}")
        self.block, self.min_numel, self.select = block, min_numel, select
        self.dtypes = tuple(dtypes)
        bad = [d for d in self.dtypes if not d.is_floating_point]
        if bad:
            raise ValueError(f"dtypes must be floating-point dtypes, got {bad}")
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._live: "weakref.WeakValueDictionary[int, _Entry]" = weakref.WeakValueDictionary()
        self.compressed = 0
        self.reused = 0

    def __getstate__(self) -> dict:
        """Pickling (``torch.save(model)``): the settings and counters; not the per-run caches
        (compressed storages of graphs alive now, generators) nor entered contexts."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_live", "_generators")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._generators, self._live = {}, weakref.WeakValueDictionary()

    def _generator(self, device: torch.device) -> torch.Generator:
        g = self._generators.get(device)
        if g is None:
            g = self._generators[device] = torch.Generator(device)
            g.manual_seed(self.seed)
        return g

    def eligible(self, t: torch.Tensor) -> bool:
        """Whether ``t`` would be compressed (module doc lists what is left as is)."""
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.dtype not in self.dtypes:
            return False
        if isinstance(getattr(t, "_base", None), nn.Parameter) or (t.is_leaf and t.requires_grad):
            return False
        if getattr(t, EXACT_ATTR, False) or t.dim() == 0 or t.shape[-1] == 1 or torch.compiler.is_compiling():
            return False
        nbytes = t.untyped_storage().nbytes()
        if nbytes % t.element_size() or nbytes // t.element_size() < self.min_numel:
            return False
        return self.select is None or bool(self.select(t))

    def may_replace(self, t: torch.Tensor) -> bool:
        """Only eligible tensors: the rest (fp32 ones by default) are kept as they are, so inner
        recipes may pin them (a consumer's copy is then rebuilt, not kept a second time)."""
        return self.eligible(t)

    def pack(self, t: torch.Tensor) -> Any | None:
        if not self.eligible(t) or _kept_as_recipe(t):
            return None
        key = _key(t)
        entry = self._live.get(key)
        if entry is not None:
            src = entry.source()
            if src is None or _key(src) != key or entry.dtype != t.dtype:
                entry = None  # storage freed and its address reused, or reinterpreted
            elif t._version != entry.version:
                entry.stale = True  # modified in place since it was saved: its saves must raise
                entry = None
        if entry is None:
            with torch.no_grad():
                n = t.untyped_storage().nbytes() // t.element_size()
                flat = t.detach().as_strided((n,), (1,), 0)
                q, scales = compress(flat, self.format, self.block, self._generator(t.device))
            entry = _Entry(q, scales, t.dtype, t._version, t)
            self._live[key] = entry
            self.compressed += 1
        else:
            self.reused += 1
        return _Handle(entry, t)

    def unpack(self, h: _Handle) -> torch.Tensor:
        src = h.ref()
        if src is not None and src._version != h.version:
            raise _modified_error(h.size, src._version, h.version)
        if h.entry.stale:
            raise _modified_error(h.size, None, h.version)
        return h.entry.full(self.block).as_strided(h.size, h.stride, h.offset)

    def kept_tensors(self, h: _Handle) -> list[torch.Tensor]:
        return [h.entry.values, h.entry.scales]
