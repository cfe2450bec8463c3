"""A BERT-style (post-LN) encoder layer whose GELU, LayerNorm and Dropout classes are swappable.

Built the way Hugging Face's eager BERT layer computes (separate Q/K/V projections, scaled
scores, additive padding mask, softmax, attention dropout, output projection, hidden dropout,
residual + LayerNorm, then FC1 → GELU → FC2 → dropout → residual + LayerNorm), so that the bytes it
keeps with plain torch.nn match REFERENCE.md's HF eager figures, and swapping in leanact's modules
shows what they save.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class ModuleSet:
    """The three module classes an :class:`EncoderLayer` is built from."""

    name: str
    gelu: Callable[[], nn.Module]
    layer_norm: Callable[..., nn.Module]
    dropout: Callable[[float], nn.Module]


TORCH_MODULES = ModuleSet("torch.nn", nn.GELU, nn.LayerNorm, nn.Dropout)


def leanact_modules() -> ModuleSet:
    """leanact's drop-ins for the same three classes."""
    from leanact import nn as lnn

    return ModuleSet("leanact", lnn.GELU, lnn.LayerNorm, lnn.Dropout)


class EncoderLayer(nn.Module):
    def __init__(self, hidden: int = 1024, heads: int = 16, ffn: int | None = None, dropout: float = 0.1,
                 eps: float = 1e-12, modules: ModuleSet = TORCH_MODULES):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not a multiple of the number of heads {heads}.")
        ffn = 4 * hidden if ffn is None else ffn
        self.heads, self.head_dim = heads, hidden // heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.attn_dropout = modules.dropout(dropout)
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_out_dropout = modules.dropout(dropout)
        self.attn_norm = modules.layer_norm(hidden, eps=eps)
        self.fc1 = nn.Linear(hidden, ffn)
        self.act = modules.gelu()
        self.fc2 = nn.Linear(ffn, hidden)
        self.out_dropout = modules.dropout(dropout)
        self.out_norm = modules.layer_norm(hidden, eps=eps)

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        probs = self.attn_dropout(torch.softmax(scores, dim=-1))
        ctx = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, h)
        x = self.attn_norm(self.attn_out_dropout(self.attn_out(ctx)) + x)
        y = self.out_dropout(self.fc2(self.act(self.fc1(x))))
        return self.out_norm(y + x)


class EncoderStack(nn.Module):
    """``layers`` encoder layers in a row (the per-layer figure is the 2-layer minus 1-layer cost)."""

    def __init__(self, layers: int = 1, **kwargs):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(**kwargs) for _ in range(layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, mask)
        return x
