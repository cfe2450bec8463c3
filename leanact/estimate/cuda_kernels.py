"""CUDA's kernels for plain PyTorch ops on the fake CPU trace of ``leanact.estimate(device="cuda")``.

The trace runs on fake CPU tensors (:mod:`leanact.estimate.api`), so without this module an
unpatched model would keep what the CPU kernels keep. While :func:`cuda_kernels` is active (entered
with ``with``: nothing leaks if the step raises):

* ``F.dropout`` (training, 0 < p < 1) runs ``torch.native_dropout`` -- CUDA's fused kernel, which
  keeps a **bool mask** (1 byte per element); the CPU's ``dropout`` keeps a mask in the input's
  dtype (2 or 4 bytes).
* ``F.scaled_dot_product_attention`` picks the kernel CUDA's dispatcher picks
  (:func:`sdpa_kernel`; flash before memory-efficient before math, an Ampere or newer GPU assumed)
  and allocates and keeps what that kernel does (:class:`FusedAttention`):

  - **flash** (fp16/bf16, no ``attn_mask``, head dim ≤ 256; GQA through ``enable_gqa``): keeps
    q, k, v, out, the fp32 log-sum-exp (b, heads, s_q) and the RNG state (a (2,) and a () 8-byte
    tensor on the device). Backward allocates dq, dk, dv, an fp32 (b, heads, ⌈s_q⌉₁₂₈) row sum
    and an fp32 dq accumulator (b, ⌈s_q⌉₁₂₈, heads, ⌈d⌉₃₂) (GQA: dk, dv first at the query heads'
    count, then summed).
  - **memory-efficient** (fp32/fp16/bf16, masks allowed, as many key/value heads as query heads):
    keeps q, k, v, the additive bias (a bool mask becomes a new tensor of q's dtype, its rows
    padded to 16 elements when not aligned), out and the fp32 log-sum-exp (b, heads, ⌈s_q⌉₃₂);
    its RNG seed and offset live in host memory. Backward allocates dq, dk, dv and an fp32
    (b, heads, s_q) row sum.
  - **math** (anything else, e.g. fp32 with ``enable_gqa``): torch's composite
    ``_scaled_dot_product_attention_math`` (the same ops on both devices; its attention dropout
    given a bool mask, as CUDA's fused dropout keeps).

Not modelled: the kernels' scratch workspaces beyond those named, cuDNN attention (chosen only
when asked for).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from leanact.ops.amp import autocast_dtype
from leanact.ops.attention import fake_kernels_of

__all__ = ["cuda_kernels", "FusedAttention", "sdpa_kernel"]

_HALF = (torch.float16, torch.bfloat16)


def _ceil(n: int, m: int) -> int:
    return -(-n // m) * m


def sdpa_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask, enable_gqa: bool = False) -> str:
    """The kernel CUDA's SDPA dispatcher picks: "flash", "efficient" or "math"."""
    d, dv = q.shape[-1], v.shape[-1]
    dense = q.dim() == 4 and k.dim() == 4 and v.dim() == 4
    same_heads = dense and k.shape[1] == q.shape[1] and v.shape[1] == q.shape[1]
    if not dense:
        return "math"
    gqa_ok = same_heads or (enable_gqa and q.shape[1] % k.shape[1] == 0)
    if q.dtype in _HALF and attn_mask is None and d == dv and d <= 256 and gqa_ok:
        return "flash"
    align = 8 if q.dtype in _HALF else 4
    if q.dtype in (torch.float32, *_HALF) and same_heads and d % align == 0 and dv % align == 0:
        return "efficient"
    return "math"


def _bias(mask: torch.Tensor, q: torch.Tensor, s_k: int) -> torch.Tensor:
    """The memory-efficient kernel's additive bias: a bool mask becomes a new tensor of q's dtype
    (-inf where False); rows whose strides are not multiples of 16 are copied into padded rows."""
    if mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=q.dtype)
        bias.masked_fill_(mask.logical_not(), float("-inf"))
    else:
        bias = mask
    if any(st % 16 for st, n in zip(bias.stride()[:-1], bias.shape[:-1]) if n > 1):
        padded = torch.empty((*bias.shape[:-1], _ceil(bias.shape[-1], 16)), dtype=bias.dtype)
        padded[..., :bias.shape[-1]].copy_(bias)
        bias = padded[..., :bias.shape[-1]]
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], s_k)


class FusedAttention(torch.autograd.Function):
    """What CUDA's flash / memory-efficient SDPA kernel allocates and keeps (module doc), on fake
    tensors: the values are not computed (the trace has none)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, kernel: str):
        b, h, s_q, _ = q.shape
        out = torch.empty((b, s_q, h, v.shape[-1]), dtype=q.dtype).transpose(1, 2)
        if kernel == "flash":
            lse = torch.empty((b, h, s_q), dtype=torch.float32)
            rng = (torch.empty(2, dtype=torch.int64), torch.empty((), dtype=torch.int64))
        else:
            lse = torch.empty((b, h, _ceil(s_q, 32)), dtype=torch.float32)
            rng = ()
        ctx.kernel, ctx.has_bias = kernel, bias is not None
        ctx.save_for_backward(q, k, v, out, lse, *rng, *((bias,) if bias is not None else ()))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors[:3]
        b, h, s_q, d = q.shape
        dq = torch.empty_like(q)
        if ctx.kernel == "flash":
            rows = torch.empty((b, h, _ceil(s_q, 128)), dtype=torch.float32)
            acc = torch.empty((b, _ceil(s_q, 128), h, _ceil(d, 32) if d <= 192 else 256), dtype=torch.float32)
            if k.shape[1] != h:  # GQA: dk, dv at the query heads' count, then summed over each group
                dk_all = torch.empty((b, h, k.shape[2], d), dtype=k.dtype)
                dv_all = torch.empty((b, h, v.shape[2], v.shape[-1]), dtype=v.dtype)
                del rows, acc
                dk, dv = torch.empty_like(k), torch.empty_like(v)
                del dk_all, dv_all
            else:
                dk, dv = torch.empty_like(k), torch.empty_like(v)
                del rows, acc
        else:
            rows = torch.empty((b, h, s_q), dtype=torch.float32)
            dk, dv = torch.empty_like(k), torch.empty_like(v)
            del rows
        return dq, dk, dv, None, None


def _sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    low = autocast_dtype(q.device.type)  # the trace's autocast: SDPA is on autocast's 16-bit list
    if low is not None:
        q, k, v = (t.to(low) if t.is_floating_point() else t for t in (q, k, v))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(low)
    kernel = sdpa_kernel(q, k, v, attn_mask, enable_gqa)
    if kernel == "math":
        mask = None
        if dropout_p > 0:
            heads = q.shape[:-2]
            mask = torch.empty((*heads, q.shape[-2], k.shape[-2]), dtype=torch.bool)
        return torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, attn_mask, dropout_p, is_causal, mask, scale=scale, enable_gqa=enable_gqa)[0]
    bias = _bias(attn_mask, q, k.shape[2]) if attn_mask is not None else None
    return FusedAttention.apply(q, k, v, bias, kernel)


def _fake(t) -> bool:
    return isinstance(t, torch.Tensor) and torch._subclasses.fake_tensor.is_fake(t)


@contextlib.contextmanager
def cuda_kernels():
    """While active, ``F.dropout`` and ``F.scaled_dot_product_attention`` on fake tensors allocate and
    keep what CUDA's kernels do (module doc); real tensors run unchanged. The two functions are
    swapped in ``torch.nn.functional`` (a function mode would not reach the recomputation of
    ``torch.utils.checkpoint``, which runs inside backward) and restored on exit."""
    sdpa, dropout = F.scaled_dot_product_attention, F.dropout

    def cuda_sdpa(query, *args, **kwargs):
        return _sdpa(query, *args, **kwargs) if _fake(query) else sdpa(query, *args, **kwargs)

    def cuda_dropout(input, p=0.5, training=True, inplace=False):
        if not (_fake(input) and training and 0 < p < 1 and input.is_floating_point()):
            return dropout(input, p, training, inplace)
        out = torch.native_dropout(input, p, True)[0]
        return input.copy_(out) if inplace else out

    F.scaled_dot_product_attention, F.dropout = cuda_sdpa, cuda_dropout
    try:
        with fake_kernels_of("cuda", lean_nodes=("FusedAttentionBackward",)):
            yield
    finally:
        F.scaled_dot_product_attention, F.dropout = sdpa, dropout
