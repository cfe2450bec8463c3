"""``leanact.nn.TransformerEncoderLayer``: torch's encoder layer keeping ≈ 20 bytes per s·b·h.

A subclass of ``torch.nn.TransformerEncoderLayer`` (same constructor arguments, attributes and
state_dict keys: swap the class name, keep the checkpoint) whose training forward is assembled
from leanact's exact lean pieces, under a :class:`~leanact.recompute.RecipeTransform`:

* Q, K, V from the fused in-projection are views of one buffer, kept once by the attention core
  (:func:`leanact.ops.attention.attention`, ``mode="recompute"``): it keeps q, k, v, the output
  (whose (b, s, h) view is the out-projection's saved input) and one log-sum-exp per row; the
  s×s probabilities and dropout masks are recomputed / regenerated in backward.
* LayerNorms keep their input + statistics; their output (the next projection's input) is a recipe
  rebuilt in backward (Norm→Linear fusion, no division by γ).
* linear1 → activation → dropout → linear2 keeps linear1's output only; the activation and dropout
  outputs are rebuilt inside linear2's backward (lean MLP). Dropouts keep 8-byte seeds.

Per layer that is Q, K, V (6) + attention output (2) + two LayerNorm inputs (4) + linear1 output
(8) = 20 B/sbh in 16-bit, plus per-row statistics: REFERENCE.md's exact floor.

Without autograd (inference, ``torch.no_grad``) the layer runs torch's own forward unchanged.
Custom activation callables other than relu/gelu (function or module) are called as they are
(their output is then kept by linear2 as in torch).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from leanact.ops.attention import attention
from leanact.recompute import producers
from leanact.recompute.recipes import RecipeTransform, foreign_hooks

__all__ = ["TransformerEncoderLayer"]

_ACTIVATIONS = {F.relu: "relu", F.gelu: "gelu", F.silu: "silu"}
# Converted attention masks, cached per (src_mask, key_padding_mask) so that the layers of a stack
# share (and keep) one converted mask instead of one each.
# id(anchor mask) -> (weakref to it, key, converted mask); dead entries are dropped on insert.
_MASKS: dict[int, tuple] = {}


def _activation_kind(act) -> str | None:
    if act in _ACTIVATIONS:
        return _ACTIVATIONS[act]
    if isinstance(act, nn.GELU):
        return "gelu" if act.approximate == "none" else "gelu_tanh"
    if isinstance(act, nn.ReLU):
        return "relu"
    if isinstance(act, nn.SiLU):
        return "silu"
    return None


def _to_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch.nn's convention (bool True = masked out, or additive float) → additive float."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def _convert(src_mask, kpm, b: int, heads: int, s: int, dtype, causal: bool = False) -> torch.Tensor | None:
    """torch.nn masks → one mask in SDPA's convention (bool True = attend, or additive float)."""
    if causal:
        src_mask = torch.ones(s, s, dtype=torch.bool, device=kpm.device).triu_(1)
    if src_mask is not None:
        if src_mask.dim() == 3:  # (b*heads, s, s)
            src_mask = src_mask.view(b, heads, s, s)
        elif src_mask.dim() == 2:
            src_mask = src_mask.view(1, 1, s, s)
        else:
            raise ValueError(f"src_mask must be (s, s) or (batch*heads, s, s), got {tuple(src_mask.shape)}")
    if kpm is not None:
        if kpm.shape != (b, s):
            raise ValueError(f"src_key_padding_mask must be (batch, seq) = {(b, s)}, got {tuple(kpm.shape)}")
        kpm = kpm.view(b, 1, 1, s)
    masks = [m for m in (src_mask, kpm) if m is not None]
    if not masks:
        return None
    if all(m.dtype == torch.bool for m in masks):
        out = ~masks[0]
        for m in masks[1:]:
            out = out & ~m
        return out
    out = _to_additive(masks[0], dtype)
    for m in masks[1:]:
        out = out + _to_additive(m, dtype)
    return out


def _cached_mask(src_mask, kpm, b, heads, s, dtype, causal: bool = False):
    """The converted mask, shared by every layer that receives the same mask tensors (``causal``:
    combine the padding mask with the causal triangle, built once and cached on ``kpm``)."""
    anchor = src_mask if src_mask is not None else kpm
    if anchor is None:
        return None
    key = (id(src_mask), getattr(src_mask, "_version", None), id(kpm), getattr(kpm, "_version", None), b, heads, s,
           dtype, causal)
    hit = _MASKS.get(id(anchor))
    if hit is not None and hit[0]() is anchor and hit[1] == key:
        return hit[2]
    for k in [k for k, v in _MASKS.items() if v[0]() is None]:
        del _MASKS[k]
    converted = _convert(src_mask, kpm, b, heads, s, dtype, causal)
    _MASKS[id(anchor)] = (weakref.ref(anchor), key, converted)
    return converted


class TransformerEncoderLayer(nn.TransformerEncoderLayer):
    """Drop-in for ``torch.nn.TransformerEncoderLayer`` keeping ≈ 20 B/sbh for backward.

    Extra keyword-only arguments: ``attention_mode`` ("recompute": keeps no s² tensor; "tempo":
    keeps the softmax output and regenerates the dropout mask) and ``block_size`` (query rows per
    attention block; default: about 1 Mi scores per block).
    """

    def __init__(self, *args, attention_mode: str = "recompute", block_size: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.attention_mode = attention_mode
        self.block_size = block_size

    def forward(self, src: torch.Tensor, src_mask: torch.Tensor | None = None,
                src_key_padding_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        needs_grad = torch.is_grad_enabled() and (src.requires_grad or any(p.requires_grad for p in self.parameters()))
        if not needs_grad or foreign_hooks():
            return super().forward(src, src_mask, src_key_padding_mask, is_causal)
        x = src if self.self_attn.batch_first else src.transpose(0, 1)
        b, s, _ = x.shape
        if is_causal:
            src_mask = None  # the hint says src_mask is the causal mask: use the implicit one
        causal_and_padding = is_causal and src_key_padding_mask is not None
        if causal_and_padding:
            is_causal = False  # one combined mask, built once per padding mask (see _cached_mask)
        mask = _cached_mask(src_mask, src_key_padding_mask, b, self.self_attn.num_heads, s, x.dtype,
                            causal_and_padding)
        with RecipeTransform():
            if self.norm_first:
                x = x + self._lean_sa(self._norm(x, self.norm1), mask, is_causal)
                x = x + self._lean_ff(self._norm(x, self.norm2))
            else:
                x = self._norm(x + self._lean_sa(x, mask, is_causal), self.norm1)
                x = self._norm(x + self._lean_ff(x), self.norm2)
        return x if self.self_attn.batch_first else x.transpose(0, 1)

    @staticmethod
    def _norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
        return producers.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)

    def _dropout(self, x: torch.Tensor, module: nn.Dropout) -> torch.Tensor:
        return producers.dropout(x, module.p, self.training)

    def _lean_sa(self, x: torch.Tensor, mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        attn = self.self_attn
        b, s, h = x.shape
        heads = attn.num_heads
        qkv = F.linear(x, attn.in_proj_weight, attn.in_proj_bias)
        q, k, v = qkv.view(b, s, 3, heads, h // heads).permute(2, 0, 3, 1, 4).unbind(0)
        o = attention(q, k, v, mask, attn.dropout, is_causal, mode=self.attention_mode, training=self.training,
                      block_size=self.block_size)
        o = attn.out_proj(o.transpose(1, 2).reshape(b, s, h))
        return self._dropout(o, self.dropout1)

    def _lean_ff(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear1(x)
        kind = _activation_kind(self.activation)
        a = producers.activation(h, kind) if kind is not None else self.activation(h)
        y = self.linear2(self._dropout(a, self.dropout))
        return self._dropout(y, self.dropout2)
