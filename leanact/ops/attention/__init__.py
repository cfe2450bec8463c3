"""Scaled dot-product attention that keeps nothing of size s² for backward (exact gradients): q, k,
v, one log-sum-exp per row and the 8-byte dropout seed (flash-style recompute), or the
probabilities' output-based form of Tempo (``mode="tempo"``).

- :mod:`.function`: :func:`attention` (SDPA's semantics; which path, what each keeps), the
  composition it is checked against (:func:`compose`);
- :mod:`.core`: the two autograd Functions and their blocked kernels, the op's fake-tensor rule;
- :mod:`.custom_op`: the recompute core as a ``torch.library`` op, for ``torch.compile``.
"""
from .function import BLOCK_ELEMENTS, MODES, attention, compose, default_block_size, fake_kernels_of

__all__ = ["attention", "default_block_size", "fake_kernels_of", "compose", "MODES", "BLOCK_ELEMENTS"]
