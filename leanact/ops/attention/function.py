"""Scaled dot-product attention that keeps nothing of size s² for backward (exact gradients).

``attention(q, k, v, ...)`` has the semantics of ``torch.nn.functional.scaled_dot_product_attention``
(bool mask True = attend, or an additive float mask; ``is_causal`` is the top-left triangle and,
unlike SDPA, may come with ``attn_mask``: the triangle is applied on top of the mask, so a per-key
bias such as ALiBi's stays (b, H, 1, s_k);
``enable_gqa``; default scale 1/sqrt(d); rows with every key masked give output 0 and gradient 0,
as torch's math and CPU flash paths do). Dropout masks come from :mod:`leanact.ops.random`:
element (n, h, i, j) of the (b, H, s_q, s_k) probability matrix is kept iff
``keep_mask(seed, ((n*H + h)*s_q + i)*s_k + j, p)``, so they are reproducible and regenerated,
never stored.

What is kept for backward, by path (per call; "mask" = the caller's own mask tensor, if given,
shared by all layers that use it):

* ``mode="recompute"`` (default, flash-style, :class:`~leanact.ops.attention.core.RecomputeAttention`):
  q, k, v (the caller's tensors: views of one fused QKV buffer count once; one that is a lone view of
  a larger storage, such as the value third of a fused QKV whose q and k went through RoPE, is kept
  as a copy of its own, not the whole buffer), the fp32 (fp64 for
  fp64 inputs) log-sum-exp per row (b·H·s_q·4 bytes), the 8-byte seed, the mask. Backward
  recomputes the scores per query block (one extra QK^T matmul), P = exp(S - lse), the block's
  dropout mask, and D = rowsum(P * dP) in fp32: the s x s matrix never exists whole. (The output
  is not kept: the next projection keeps it as its input, in the same storage.)
* ``mode="tempo"`` (dropout > 0 only): q, k, v, the softmax output P (input dtype) and the seed;
  backward recomputes the dropout output P * mask / (1 - p). No mask, no dropout output kept.
* dropout 0 (``dropout_p=0`` or ``training=False``), either mode: the cheapest exact path.
  Without autograd it is ``F.scaled_dot_product_attention``. With autograd it is also SDPA when
  its fused kernel is known to keep only q, k, v, out, lse (see :func:`_sdpa_is_lean`: CPU flash
  kernel in fp32/fp64 for q laid out as (b, s, H, d), no mask / a float mask of q's dtype / a bool mask without
  a query dimension, which SDPA converts to a small float copy), else the recompute path.
* CUDA, dropout > 0, ``mode="recompute"``, no explicit ``seed``/``generator``, eager: SDPA's fused
  kernels (flash / memory-efficient / cuDNN keep q, k, v, out, lse and an RNG state), falling back
  to the recompute path when SDPA picks its math kernel. Masks then come from torch's RNG.

Output layout: the result is a (b, H, s_q, d) view of a (b, s_q, H, d) buffer, so
``out.transpose(1, 2).reshape(b, s_q, H * d)`` (the output projection's input) is a view of the
storage the attention keeps: the projection's saved input costs nothing more. The SDPA dispatch
is restricted to q layouts for which SDPA's output has that layout too.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch._subclasses.fake_tensor import is_fake
import torch.nn.functional as F

from ..amp import autocast_dtype, autocast_off
from ..random import _as_seed, draw_seed
from ..transforms import functorch_active
from .core import RecomputeAttention, TempoAttention, is_segments
from .custom_op import recompute_attention

__all__ = ["attention", "default_block_size", "fake_kernels_of", "MODES", "BLOCK_ELEMENTS"]

MODES = ("recompute", "tempo")
#: Default query block: about this many score elements (4 MiB in fp32) per block.
BLOCK_ELEMENTS = 1 << 20
_SDPA_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# Autograd nodes of SDPA kernels that keep q, k, v, out, lse (+ an RNG state): no s² tensor.
_LEAN_NODES = frozenset(
    f"ScaledDotProduct{n}Backward0"
    for n in ("FlashAttentionForCpu", "FlashAttention", "EfficientAttention", "CudnnAttention")
)


# (device type, names of lean autograd nodes) while fake tensors stand for another device
_FAKE_AS: list[tuple[str, frozenset]] = []


@contextlib.contextmanager
def fake_kernels_of(device_type: str, lean_nodes=()):
    """While active, :func:`attention` takes the path it takes on ``device_type`` for fake tensors,
    and SDPA outputs whose autograd node is named in ``lean_nodes`` count as lean: how
    ``leanact.estimate(device="cuda")`` traces on fake CPU tensors what runs on a GPU (with its own
    model of CUDA's SDPA kernels). Real tensors are unaffected. Left on exit, even on error."""
    _FAKE_AS.append((device_type, frozenset(lean_nodes)))
    try:
        yield
    finally:
        _FAKE_AS.pop()


def _device_type(t: torch.Tensor) -> str:
    """The device whose path ``t`` takes: its own, or the one fake tensors stand for."""
    if _FAKE_AS and is_fake(t):
        return _FAKE_AS[-1][0]
    return t.device.type


def _lean_node(out: torch.Tensor) -> bool:
    name = out.grad_fn.name()
    return name in _LEAN_NODES or bool(_FAKE_AS and is_fake(out) and name in _FAKE_AS[-1][1])


def default_block_size(b: int, h: int, s_q: int, s_k: int) -> int:
    """Query rows per block so that one block of scores has about :data:`BLOCK_ELEMENTS` elements."""
    return max(1, min(s_q, BLOCK_ELEMENTS // max(1, b * h * s_k)))


def _as4d(mask: torch.Tensor | None) -> torch.Tensor | None:
    if mask is None:
        return None
    if mask.dim() > 4:
        raise ValueError(f"attn_mask must have at most 4 dims, got {mask.dim()}")
    return mask[(None,) * (4 - mask.dim())] if mask.dim() < 4 else mask


_HALF = (torch.float16, torch.bfloat16)


def _sdpa_is_lean(q, k, v, mask4) -> bool:
    """Whether SDPA (with autograd, dropout 0) keeps no s² tensor and returns a (b, s, H, d)-layout
    output. Measured (tests/test_attention.py): the CPU flash kernel keeps q, k, v, out, lse (the
    caller's q, k, v, no copies; GQA included); a float mask of q's dtype is kept as is, a bool
    mask is converted to a float copy (kept), hence only bool masks without a query dimension. On
    CUDA, grouped-query attention (fewer key/value heads) runs fused only in the flash kernel
    (fp16/bf16, no mask): otherwise CUDA's SDPA falls back to its math path, which keeps s² scores."""
    if q.dtype not in _SDPA_DTYPES or not (q.dtype == k.dtype == v.dtype):
        return False
    if not torch.compiler.is_compiling() and not torch.backends.cuda.flash_sdp_enabled():  # e.g. sdpa_kernel(MATH)
        return False
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return False
    if mask4 is not None:
        if mask4.requires_grad:
            return False
        if mask4.dtype == torch.bool:
            if mask4.size(2) > 1:
                return False
        elif mask4.dtype != q.dtype:
            return False
    device = _device_type(q)
    if device == "cpu" and torch.compiler.is_compiling():
        return False  # torch.compile decomposes the CPU flash kernel into the composition (keeps s²)
    if device == "cpu":
        # The CPU flash kernel's 16-bit backward loses accuracy (measured: gradients 10x further from
        # fp32 than the eager composition's on a tiny OPT); leanact's core accumulates in fp32.
        return q.dtype in (torch.float32, torch.float64) and q.stride(1) <= q.stride(2)  # (b, s, H, d) layout
    if device != "cuda" or q.dtype == torch.float64:  # no fused fp64 kernels
        return False
    if k.size(1) != q.size(1):  # GQA: only the flash kernel takes it; else CUDA's SDPA runs math (keeps s²)
        return q.dtype in _HALF and mask4 is None and q.size(-1) == v.size(-1) <= 256
    return True  # flash or memory-efficient; checked after the call


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    mode: str = "recompute",
    training: bool = True,
    block_size: int | None = None,
    generator: torch.Generator | None = None,
    seed: torch.Tensor | int | None = None,
    enable_gqa: bool = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) -> dropout -> @ v`` keeping no s² tensor (mode "recompute").

    q (b, H, s_q, d), k (b, Hkv, s_k, d), v (b, Hkv, s_k, dv); returns (b, H, s_q, dv), a view of a
    (b, s_q, H, dv) buffer. ``mode``: "recompute" or "tempo" (see the module docstring for what each
    keeps). ``training=False`` disables dropout. ``block_size``: query rows per block (default
    :func:`default_block_size`). The dropout seed is drawn from ``generator`` (default: the default
    generator of q's device) unless ``seed`` (int or 0-dim int64 tensor) is given: the same seed
    gives the same mask. Double backward is not supported.
    ``softcap`` c > 0: the scores become c·tanh(scores/c) before the mask (Gemma 2's logit
    softcapping). ``sinks`` (H,): one more logit per head in every row's softmax denominator, with no
    value (GPT-OSS's attention sinks; gets a gradient). Either runs the recompute path (in "tempo"
    mode too); with autograd under ``torch.func`` transforms, the plain composition.
    ``segments``: integer segment ids, (b, s) when s_q == s_k (the same ids for queries and keys) or
    (b, s_q + s_k) (the queries' ids, then the keys'): query i attends key j only where the ids are
    equal (packed sequences; give padded keys an id no query has). O(b·s) bytes where a dense mask
    has b·s_q·s_k; not combined with ``attn_mask``. ``window`` w > 0: query i attends keys j > i - w
    only (a sliding window, as Mistral's). Either runs leanact's core.
    """
    low = autocast_dtype(q.device.type)
    if low is not None:  # autocast's policy for SDPA: q, k, v in its low dtype. An additive mask stays as
        # it is (it is added to fp32 scores; an fp32 bias such as T5's loses nothing, as in eager attention)
        def cast(t):
            return t.to(low) if t.is_floating_point() and t.dtype != torch.float64 else t

        with autocast_off(q.device.type):
            return attention(cast(q), cast(k), cast(v), attn_mask, dropout_p, is_causal, scale, mode=mode,
                             training=training, block_size=block_size, generator=generator, seed=seed,
                             enable_gqa=enable_gqa, softcap=softcap, sinks=sinks)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {dropout_p}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("attention expects 4-D q, k, v: (batch, heads, seq, head_dim)")
    b, h, s_q, d = q.shape
    if k.shape[:3] != v.shape[:3] or k.size(0) != b or k.size(-1) != d:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.size(1) != h and not (enable_gqa and h % k.size(1) == 0):
        raise ValueError(f"{h} query heads and {k.size(1)} key/value heads need enable_gqa=True and divisibility")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    p = float(dropout_p) if training else 0.0
    mask4 = _as4d(attn_mask)
    _check_variants(softcap, sinks, h)
    if segments is not None or window is not None:
        segments = _check_segments(segments, window, mask4, b, s_q, k.size(2), q.device)
    grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (mask4 is not None and mask4.requires_grad)
        or (sinks is not None and sinks.requires_grad)
    )
    if grad and not torch.compiler.is_compiling() and not functorch_active():
        q, k, v = _own_storages(q, k, v)
    if softcap is not None or sinks is not None or segments is not None or window is not None:
        return _variant(q, k, v, mask4 if segments is None else segments, p, is_causal, scale, mode, block_size,
                        generator, seed, enable_gqa, softcap, sinks, window)
    eager = not torch.compiler.is_compiling()
    gqa = {"enable_gqa": True} if enable_gqa else {}  # (the keyword needs torch >= 2.5)
    if is_causal and mask4 is not None:  # SDPA refuses both: leanact's core (or the plain composition)
        if functorch_active():
            if p > 0.0:
                raise NotImplementedError("attention with is_causal, attn_mask and dropout under torch.func transforms")
            return compose(q, k, v, mask4, is_causal, scale, enable_gqa=enable_gqa)
        return _core(q, k, v, mask4, p, is_causal, scale, mode, block_size, generator, seed)
    if functorch_active() and p == 0.0:  # torch.func transforms: torch's own op (its memory, its results)
        return F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale=scale, **gqa)
    if p == 0.0 and (not grad or _sdpa_is_lean(q, k, v, mask4)):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale=scale, **gqa)
        if not grad or not eager or _lean_node(out):
            return out
    elif p > 0.0 and eager and _device_type(q) == "cuda" and mode == "recompute" and seed is None and generator is None:
        if _sdpa_is_lean(q, k, v, mask4):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask, p, is_causal, scale=scale, **gqa)
            if not grad or _lean_node(out):
                return out
    return _core(q, k, v, mask4, p, is_causal, scale, mode, block_size, generator, seed)


def _extent(t: torch.Tensor) -> int:
    """Bytes of ``t``'s storage that ``t`` spans."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()


def _own_storages(q, k, v):
    """q, k, v as kept for backward: one that spans less than its storage, which neither of the other two
    shares (the value third of a fused QKV projection whose query and key went through RoPE, as in
    Qwen2-VL's and Qwen2.5-VL's vision blocks), is copied to a storage of its own, so the kernel does not
    keep the whole projection output alive for it (2/3 of it dead); views of one shared buffer (a fused
    QKV kept whole) stay as they are. The copy keeps the (b, s, H, d) layout where the view had it. (A
    storage something else keeps alive anyway costs the copy's bytes more; the values and gradients
    are the same either way.)"""
    ts = [q, k, v]
    if any(type(t) is not torch.Tensor and not is_fake(t) for t in ts):  # (subclasses: their own storages)
        return q, k, v
    for i, t in enumerate(ts):
        storage = t.untyped_storage()
        if storage.nbytes() <= _extent(t) or any(
                o.untyped_storage()._cdata == storage._cdata for j, o in enumerate(ts) if j != i):
            continue
        flat = torch.contiguous_format
        ts[i] = t.transpose(1, 2).clone(memory_format=flat).transpose(1, 2) if _rows_layout(t) else \
            t.clone(memory_format=flat)
    return tuple(ts)


def _rows_layout(t: torch.Tensor) -> bool:
    """Whether ``t`` (b, H, s, d) is laid out as (b, s, H, d) (the layout SDPA's lean dispatch needs)."""
    return t.dim() == 4 and t.stride(1) <= t.stride(2)


def _core(q, k, v, mask4, p, is_causal, scale, mode, block_size, generator, seed):
    """leanact's own paths: :class:`TempoAttention` (mode "tempo" with dropout) or :class:`RecomputeAttention`."""
    b, h, s_q, _ = q.shape
    if p > 0.0:
        seed = draw_seed(q.device, generator) if seed is None else _as_seed(seed, q.device)
    else:
        seed = None
    if mode == "tempo" and p > 0.0:
        out = TempoAttention.apply(q, k, v, mask4, seed, p, is_causal, scale)
    else:
        block = int(block_size) if block_size else default_block_size(b, h, s_q, k.size(2))
        out = _recompute(q, k, v, mask4, seed, p, is_causal, scale, block)
    return out.transpose(1, 2)


def _recompute(*args):
    """:class:`RecomputeAttention` eagerly; its custom op while compiling (opaque to AOTAutograd, which
    would otherwise keep the s² probabilities of the traced backward: :mod:`leanact.ops.attention.custom_op`)."""
    if torch.compiler.is_compiling():
        return recompute_attention(*args)
    return RecomputeAttention.apply(*args)


def _check_segments(segments, window, mask4, b: int, s_q: int, s_k: int, device) -> torch.Tensor | None:
    """``segments`` as the core's (b, s_q + s_k) integer tensor (None stays None); clear errors."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int (query i attends keys j > i - window), got {window!r}")
    if segments is None:
        return None
    if mask4 is not None:
        raise ValueError("attention: give either segments or attn_mask, not both (mark padded keys with a "
                         "segment id that no query has)")
    if not isinstance(segments, torch.Tensor) or segments.is_floating_point() or segments.dtype == torch.bool:
        raise ValueError("segments must be an integer tensor of segment ids, "
                         f"got {getattr(segments, 'dtype', type(segments).__name__)}")
    if segments.device != device:
        raise ValueError(f"segments are on {segments.device}, q on {device}: move them to q's device")
    if segments.dim() == 2 and segments.size(0) == b and s_q == s_k and segments.size(1) == s_q:
        return torch.cat([segments, segments], 1)
    if segments.dim() != 2 or segments.size(0) != b or segments.size(1) != s_q + s_k:
        raise ValueError(f"segments must be (batch, seq) = ({b}, {s_q}) for equal query and key lengths, or "
                         f"({b}, s_q + s_k) = ({b}, {s_q + s_k}), got {tuple(segments.shape)}")
    return segments


def _check_variants(softcap, sinks, h: int) -> None:
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"softcap must be a positive number (scores become c*tanh(s/c)), got {softcap!r}")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.shape != (h,)
                              or not sinks.is_floating_point()):
        raise ValueError(f"sinks must be a floating-point tensor of shape ({h},) (one logit per query head), "
                         f"got {getattr(sinks, 'shape', type(sinks).__name__)}")


def _variant(q, k, v, mask4, p, is_causal, scale, mode, block_size, generator, seed, enable_gqa, softcap, sinks,
             window=None):
    """Softcapped scores, sinks, segment ids or a window: the recompute core (Tempo's for segment ids or
    a window with dropout in mode "tempo"; the plain composition under torch.func)."""
    if functorch_active():
        if p > 0.0:
            raise NotImplementedError("attention with softcap/sinks/segments/window and dropout under torch.func "
                                      "transforms")
        return compose(q, k, v, mask4, is_causal, scale, softcap, sinks, enable_gqa, window)
    seed = (draw_seed(q.device, generator) if seed is None else _as_seed(seed, q.device)) if p > 0.0 else None
    if mode == "tempo" and p > 0.0 and softcap is None and sinks is None:
        return TempoAttention.apply(q, k, v, mask4, seed, p, is_causal, scale, window).transpose(1, 2)
    b, h, s_q, _ = q.shape
    block = int(block_size) if block_size else default_block_size(b, h, s_q, k.size(2))
    softcap = None if softcap is None else float(softcap)
    out = _recompute(q, k, v, mask4, seed, p, is_causal, scale, block, softcap, sinks, window)
    return out.transpose(1, 2)


def dense_mask(segments: torch.Tensor | None, window: int | None, s_q: int, s_k: int,
               device=None) -> torch.Tensor | None:
    """The (b|1, 1, s_q, s_k) bool mask (True = attend) that core ``segments`` (b, s_q + s_k) and a
    ``window`` stand for; None for neither. For references and tests: it has s_q·s_k elements."""
    if segments is None and window is None:
        return None
    allowed = None
    if segments is not None:
        allowed = (segments[:, :s_q, None] == segments[:, None, s_q:]).unsqueeze(1)
        device = segments.device
    if window is not None:
        i, j = torch.arange(s_q, device=device)[:, None], torch.arange(s_k, device=device)[None]
        near = (j > i - window)[None, None]
        allowed = near if allowed is None else allowed & near
    return allowed


def compose(q, k, v, mask4=None, is_causal=False, scale=None, softcap=None, sinks=None, enable_gqa=False,
            window=None):
    """The plain composition (no dropout): keeps the s² probabilities; the reference in tests.
    ``mask4`` may be the core's segment ids (:func:`leanact.ops.attention.core.is_segments`)."""
    if is_segments(mask4) or window is not None:
        dense = dense_mask(mask4 if is_segments(mask4) else None, window, q.size(2), k.size(2), q.device)
        mask4 = dense if mask4 is None or is_segments(mask4) else mask4 & dense
    c = torch.float64 if q.dtype == torch.float64 else torch.float32
    h, hkv = q.size(1), k.size(1)
    if enable_gqa and hkv != h:
        k, v = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    s = (q.to(c) * scale) @ k.to(c).transpose(-1, -2)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask4 is not None:
        s = s.masked_fill(~mask4, -math.inf) if mask4.dtype == torch.bool else s + mask4.to(c)
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.to(c).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], -1)
    m = s.amax(-1, keepdim=True).detach()
    e = (s - m.masked_fill(m == -math.inf, 0.0)).exp()
    rowsum = e.sum(-1, keepdim=True)
    prob = e / rowsum.masked_fill(rowsum == 0, 1.0)
    if sinks is not None:
        prob = prob[..., :-1]
    return (prob @ v.to(c)).to(q.dtype)
