"""``AttentionCore``: the parameter-free core of multi-head attention, softmax(QK^T)·V with dropout."""
from __future__ import annotations

import torch
from torch import nn

from ..ops.attention import MODES, attention

__all__ = ["AttentionCore"]


class AttentionCore(nn.Module):
    """``dropout(softmax(q k^T * scale + mask)) @ v`` with ``nn.Dropout``-style train/eval switching.

    Takes q (b, H, s_q, d), k/v (b, Hkv, s_k, d) and returns (b, H, s_q, d), a view of a
    (b, s_q, H, d) buffer, so ``out.transpose(1, 2).reshape(b, s_q, H * d)`` (the output
    projection's input) is a view too. Dropout is active only in training mode.

    What is kept for backward, and why (see :mod:`leanact.ops.attention`):

    * ``mode="recompute"`` (default): q, k, v (the tensors passed in; views of one fused QKV
      buffer count once), the output (which the output projection keeps anyway: same storage), a
      float32 log-sum-exp per query row and an 8-byte dropout seed. Nothing of size s²: backward
      recomputes the scores block by block (one extra QK^T), rebuilds the probabilities from the
      log-sum-exp and regenerates the dropout mask from the seed.
    * ``mode="tempo"``: q, k, v, the softmax output (s² in the input dtype) and the seed; backward
      regenerates the mask and the dropout output. No QK^T recomputation; more memory.
    * no dropout (eval or ``dropout=0``): torch's fused SDPA kernel when it keeps only q, k, v,
      the output and the log-sum-exp, else the recompute path.

    ``block_size``: query rows per block of the recompute path (None: about 2^20 scores a block).
    """

    def __init__(self, dropout: float = 0.0, mode: str = "recompute", block_size: int | None = None):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {dropout}")
        self.dropout, self.mode, self.block_size = dropout, mode, block_size

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        return attention(
            q, k, v, attn_mask, self.dropout, is_causal, scale,
            mode=self.mode, training=self.training, block_size=self.block_size, enable_gqa=enable_gqa,
        )

    def extra_repr(self) -> str:
        return f"dropout={self.dropout}, mode={self.mode!r}, block_size={self.block_size}"
