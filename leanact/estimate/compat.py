"""Running leanact's own ops faithfully on fake tensors (used by :func:`leanact.estimate`).

What differs under ``FakeTensorMode`` and how each is handled (all swaps are scoped to a context
manager and restored on exit; the owners' files are not modified):

* ``leanact.ops.norms.verdict.from_output_ok`` (imported by ``ops.rms_norm`` and
  ``patching.hf_rms_norm`` too) decides from the values of γ, β whether to keep y or x:
  ``bool(ok.all())`` raises ``DataDependentOutputException`` on fake weights. :func:`value_decisions`
  answers with the real weight's decision, or True for config-built models and meta weights (γ = 1, β = 0).
* leanact's GELU backward builds lookup tables lazily with boolean-mask indexing (``aten.nonzero``:
  ``DynamicOutputShapeException``): :func:`warm_lean_caches` builds them on real tensors first.
* (Recompute recipes accept fake tensors natively: ``leanact.recompute.recipes`` treats a
  ``FakeTensor`` as a plain tensor, so a fake step keeps what a real step keeps.)
* leanact's seeded dropout and attention-core dropout take their generic (CUDA-like) path on fake
  tensors -- the eager CPU path reads the seed as Python ints -- which allocates per-element int64
  indices: :func:`cpu_dropout_allocations` allocates like the eager CPU path instead.
* leanact's GELU works through a tensor in slices with one workspace (:mod:`leanact.ops.gelu.buffers`),
  and its attention core through query blocks writing into outputs allocated up front: every full
  slice or block allocates the same temporaries, and an iteration's are freed during the next (when
  its variables are reassigned), so the peak is that of two consecutive iterations.
  :func:`fewer_slices` runs the first two GELU slices (sized for the modelled device), the last
  three attention blocks (the largest: causal blocks grow; the last one may be ragged) and the
  first two and the last tiles of each loop of the fused linear + cross-entropy on fake tensors:
  the same peak, in a fraction of the time.
* Hugging Face builds a causal mask for fake inputs where it passes ``is_causal=True`` for real
  ones (no padding mask; it cannot rule out packed sequences): :func:`causal_skip_on_fake`.
* On CUDA leanact's ops run Triton kernels (:mod:`leanact.ops.triton`) that allocate their outputs
  only: :func:`triton_allocations` makes the ops on fake tensors allocate exactly that.
* The fused linear + cross-entropy reads the tensors' device (the CPU for fake ones) to choose its
  matmuls: 16-bit tiles in fp32 on a CPU without native 16-bit GEMM, and the fp32 sum of 16-bit
  products through ``addmm(..., out_dtype=)`` where the device has it (CUDA; not torch's CPU, where a
  16-bit product is made and added); :func:`device_matmuls` makes it choose as on the modelled device.
"""
from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

__all__ = ["value_decisions", "warm_lean_caches", "fewer_slices", "cpu_dropout_allocations", "warm_cpu_dropout",
           "triton_allocations", "causal_skip_on_fake", "device_matmuls"]


@contextlib.contextmanager
def value_decisions(real_of: dict[int, torch.Tensor]):
    """While active, ``from_output_ok`` (leanact's norms) answers for fake weights without reading
    values: the real weight's answer when known (``real_of``), else True. Every module that
    imported the function by name gets the wrapper; all are restored on exit."""
    from leanact.ops.norms import verdict as ln

    original = ln.from_output_ok

    def wrapper(weight, bias, n, dtype, max_ratio=ln.DEFAULT_MAX_RATIO, offset=False):
        if not any(t is not None and is_fake(t) for t in (weight, bias)):
            return original(weight, bias, n, dtype, max_ratio, offset)
        real = [None if t is None else real_of.get(id(t)) for t in (weight, bias)]
        if any(t is not None and (r is None or r.device.type == "meta") for t, r in zip((weight, bias), real)):
            return True  # built from a config, or meta weights (no values): default initialisation
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            return original(real[0], real[1], n, dtype, max_ratio, offset)

    patched = [m for m in list(sys.modules.values())
               if m is not None and getattr(m, "__name__", "").startswith("leanact")
               and getattr(m, "from_output_ok", None) is original]
    for m in patched:
        m.from_output_ok = wrapper
    try:
        yield
    finally:
        for m in patched:
            m.from_output_ok = original


def warm_lean_caches(model: nn.Module, dtype: torch.dtype) -> None:
    """Build, on real tensors, the lookup tables leanact's GELU backward creates lazily on first
    use: building them is value-dependent (boolean-mask indexing, ``aten.nonzero``), which
    ``FakeTensorMode`` cannot run. Cached per process (a few seconds once per dtype and mode)."""
    from leanact.nn import GELU
    from leanact.ops.gelu import gelu

    modes = {m.approximate for m in model.modules() if isinstance(m, GELU)}
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        for approximate in sorted(modes):
            x = torch.linspace(-3, 3, 8, dtype=dtype).requires_grad_(True)
            gelu(x, approximate=approximate).sum().backward()


def _faking() -> bool:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(m, torch._subclasses.fake_tensor.FakeTensorMode) for m in _get_current_dispatch_mode_stack())


@contextlib.contextmanager
def fewer_slices(kind: str):
    """While a fake mode is active: leanact's GELU runs the first two of its eager slices, sized
    for device ``kind`` ("cpu" or "cuda"), and its attention core the last three query blocks. Their
    outputs (and the GELU's packed bits) are allocated whole before the loops and the workspaces
    once per call, so the allocations and the peak are those of the full loops; the values (fake)
    are not computed anyway."""
    from leanact.ops import attention_core
    from leanact.ops import linear_cross_entropy as lce
    from leanact.ops.gelu import function

    slices, starts, tiles = function._slices, attention_core._block_starts, lce._starts

    def first_slice(n: int, device: torch.device):
        return slices(n, torch.device(kind))[:2] if _faking() else slices(n, device)

    def last_blocks(s_q: int, block: int):
        return starts(s_q, block)[-3:] if _faking() else starts(s_q, block)

    def some_tiles(n: int, step: int):
        every = tiles(n, step)
        return sorted({*every[:2], every[-1]}) if _faking() and len(every) > 3 else every

    function._slices, attention_core._block_starts, lce._starts = first_slice, last_blocks, some_tiles
    try:
        yield
    finally:
        function._slices, attention_core._block_starts, lce._starts = slices, starts, tiles


@contextlib.contextmanager
def cpu_dropout_allocations():
    """While active, leanact's seeded dropout (``leanact.ops.dropout._apply``) and attention-core
    dropout (``leanact.ops.attention_core._Dropper``) on fake CPU tensors allocate what their eager
    CPU paths allocate (the output / bool mask and one block of int64 hash words) instead of the
    element-wise int64 indices and hashes of their generic path -- the one fake tensors take, as
    CUDA does. The eager paths read the seed as Python ints, which fake tensors do not have."""
    from leanact.ops import dropout as dmod
    from leanact.ops import random as rmod
    from leanact.ops.random import CHUNK

    held: dict[int, torch.Tensor] = {}

    def _hold_real_slice(get_cache):
        # The eager paths slice per-process int64 caches; MemTracker counts a cache's storage at
        # its first slice in the step and never frees it. Do the same: build the cache for real if
        # missing, slice it under the fake mode and keep the slice alive until the estimate ends.
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            cache = get_cache()
            cache = cache._base if cache._base is not None else cache
        if id(cache) not in held:
            held[id(cache)] = cache[:1]

    original = dmod._apply

    def apply(x, seed, p, inplace):
        if not is_fake(x) or x.device.type != "cpu" or x.numel() <= CHUNK:
            return original(x, seed, p, inplace)
        out = x if inplace and x.is_contiguous() else torch.empty(x.shape, dtype=x.dtype)
        # per block: the bool mask, the int32 indices and one int32 temporary of the hash rounds
        block = [torch.empty(CHUNK, dtype=torch.bool), torch.empty(CHUNK, dtype=torch.int32),
                 torch.empty(CHUNK, dtype=torch.int32)]
        del block
        key = (CHUNK, torch.int32)
        _hold_real_slice(lambda: rmod._BASE.get(key) if key in rmod._BASE
                         else rmod._BASE.setdefault(key, torch.arange(CHUNK, dtype=torch.int32)))
        if out is not x and inplace:
            return x.copy_(out)
        return out

    from leanact.ops import attention_core as amod

    original_call = amod._Dropper.__call__

    def dropper_call(self, i0, i1, kend):
        bh, s_q, s_k = self.dims
        if self.fast or not is_fake(self.seed) or self.device.type != "cpu" or bh * s_q * s_k >= 1 << 31:
            return original_call(self, i0, i1, kend)
        rows = i1 - i0
        n, length = (bh, rows * s_k) if kend == s_k else (bh * rows, kend)
        out = torch.empty((n, length), dtype=torch.bool)
        # the (bh, rows) start indices, then per block the column indices and the hash words
        tmp = [torch.empty((bh, rows), dtype=torch.int64), torch.empty((bh, rows), dtype=torch.int32),
               torch.empty(min(n * length, CHUNK), dtype=torch.int32),
               torch.empty(min(n * length, CHUNK), dtype=torch.int32)]
        del tmp
        _hold_real_slice(lambda: amod._arange(min(length, CHUNK)))
        return out.view(torch.uint8).view(-1, rows, kend)

    dmod._apply, amod._Dropper.__call__ = apply, dropper_call
    try:
        yield
    finally:
        dmod._apply, amod._Dropper.__call__ = original, original_call


def warm_cpu_dropout() -> None:
    """Create leanact's per-process CPU dropout caches (int64 aranges of CHUNK elements, in
    ``leanact.ops.random`` and ``leanact.ops.attention_core``) before a measured step, so that the
    measurement does not depend on whether an earlier step created them."""
    from leanact.functional import dropout
    from leanact.ops.attention_core import _arange
    from leanact.ops.random import CHUNK

    dropout(torch.ones(CHUNK + 1), 0.5)
    _arange(CHUNK)


@contextlib.contextmanager
def triton_allocations():
    """While active, leanact's ops (dropout, attention-core dropout blocks, GELU, LayerNorm and
    RMSNorm from output, the gated MLP's act(g)·u, few-bit activations, 8-bit compression) on fake
    tensors allocate what their Triton kernels allocate on CUDA -- outputs, the norms' per-program
    partial sums (4 programs per SM of the modelled GPU for LayerNorm, 2 for RMSNorm,
    :func:`leanact.estimate.cuda_runtime.target`: (4·SMs, n) or (2·SMs, n) float32 each for dγ and
    dβ) -- instead of the temporaries of their PyTorch path
    (per-element int64 hash words, the GELU rebuild's slices, the norms' float32 copies); the kept
    tensors are the same either way. Nothing changes under ``LEANACT_TRITON=0`` (set it where the
    estimate runs when the GPU will run with it): the GPU then runs the PyTorch path too."""
    from leanact.ops.triton import dispatch

    from .cuda_runtime import target

    if not dispatch.enabled():
        yield
        return
    sms = target().sms
    from leanact.ops.norms import launchers as norms

    owners = [norms]
    saved = [(m, m._programs) for m in owners]

    def cuda_programs_of(programs):
        def cuda_programs(rows: int, device: torch.device, per_sm: int | None = None) -> int:
            # fake tensors sit on the CPU: the norms' backward shares its rows among per_sm (by default
            # PROGRAMS_PER_SM) programs per SM of the modelled GPU, each with one float32 partial row of
            # dγ (and dβ), as on the device
            if not _faking():
                return programs(rows, device, per_sm)
            return max(1, min(rows, (norms.PROGRAMS_PER_SM if per_sm is None else per_sm) * sms))
        return cuda_programs

    for m, programs in saved:
        m._programs = cuda_programs_of(programs)
    try:
        with dispatch.use_kernels(dispatch.SHAPES_ONLY, strict=True, fake=True):
            yield
    finally:
        for m, programs in saved:
            m._programs = programs


@contextlib.contextmanager
def causal_skip_on_fake():
    """While active, Hugging Face's mask builder treats fake ``position_ids`` as one sequence per
    row (not packed), as it finds for real ones: ``masking_utils.find_packed_sequence_indices``
    cannot read fake values and reports packing, which makes it build and keep a (b, 1, s, s) mask
    where the real step passes SDPA ``is_causal=True`` (no padding mask; on CUDA the flash
    kernel). Packed sequences given as ``position_ids`` are therefore not modelled."""
    try:
        from transformers import masking_utils as mu
    except ImportError:  # pragma: no cover - transformers is optional
        yield
        return
    original = getattr(mu, "find_packed_sequence_indices", None)
    if original is None:  # pragma: no cover - other transformers versions
        yield
        return

    def packed(position_ids, *args, **kwargs):
        if isinstance(position_ids, torch.Tensor) and is_fake(position_ids):
            return None
        return original(position_ids, *args, **kwargs)

    mu.find_packed_sequence_indices = packed
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = original


_CPU_FP32_ADDMM: list[bool] = []  # whether this torch's CPU addmm takes out_dtype (probed once)


def _cpu_fp32_addmm() -> bool:
    if not _CPU_FP32_ADDMM:
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            a = torch.ones(2, 2, dtype=torch.bfloat16)
            try:
                torch.addmm(torch.zeros(2, 2), a, a, out_dtype=torch.float32, out=torch.zeros(2, 2))
                _CPU_FP32_ADDMM.append(True)
            except (RuntimeError, NotImplementedError, TypeError):
                _CPU_FP32_ADDMM.append(False)
    return _CPU_FP32_ADDMM[0]


@contextlib.contextmanager
def device_matmuls(kind: str):
    """While a fake mode is active, the fused linear + cross-entropy multiplies as it does on device
    ``kind``, not as the fake tensors' CPU device would: its tiles' matmul dtype ("cuda": the compute
    dtype, whatever the host CPU; "cpu": this CPU's choice), and its fp32 accumulation of 16-bit
    products (``addmm`` with ``out_dtype`` into the fp32 sum where the device has it -- CUDA; this
    CPU if it does -- else fp32 products of upcast copies, one chunk at a time). The
    fused loss itself remembers a failed ``out_dtype`` call per device type, which would make the
    estimate depend on what ran before it in the process."""
    from leanact.ops import linear_cross_entropy as lce

    saved = {name: getattr(lce, name) for name in ("_matmul_dtype", "_accumulate_mm_") if hasattr(lce, name)}

    def matmul_dtype(cdtype, device):
        return cdtype if _faking() and kind == "cuda" else saved["_matmul_dtype"](cdtype, device)

    def accumulate_mm_(out, a, b, step=None):
        if not (_faking() and is_fake(out)) or a.dtype == out.dtype:
            return saved["_accumulate_mm_"](out, a, b, step)
        if kind == "cuda":
            return  # cuBLAS accumulates the 16-bit product into the fp32 sum itself: nothing allocated
            # (and fake addmm with out_dtype fails in some torch versions: 2.11 decomposes it as
            # addmm(self, mat1, mat2, beta, alpha), taking out_dtype for beta)
        if _cpu_fp32_addmm():
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
        else:
            lce._upcast_accumulate_mm_(out, a, b, step)

    if "_matmul_dtype" in saved:
        lce._matmul_dtype = matmul_dtype
    if "_accumulate_mm_" in saved:
        lce._accumulate_mm_ = accumulate_mm_
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(lce, name, fn)
