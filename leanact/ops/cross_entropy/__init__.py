"""Exact fused linear + cross-entropy: the loss of ``x Wᵀ + b`` without materialising the logits.
Keeps for backward x, W, b and 8 bytes per token (its float32 log-sum-exp and int32 target), or,
with ``grad_in_forward``, the gradients computed in forward (:mod:`.function`).

- :mod:`.function`: the autograd Function, :func:`linear_cross_entropy`, the chunk plan
  (:func:`chunk_rows`, :func:`product_rows` and the fractions they read), the PyTorch reference and
  the registration of the op's fake-tensor rule;
- :mod:`.launchers` (with the kernel's self-check) and :mod:`.kernels`: the Triton path on CUDA.
"""
from .function import (LinearCrossEntropyFunction, chunk_rows, linear_cross_entropy, linear_cross_entropy_reference,
                       product_rows)

__all__ = ["LinearCrossEntropyFunction", "linear_cross_entropy", "linear_cross_entropy_reference", "chunk_rows",
           "product_rows"]
