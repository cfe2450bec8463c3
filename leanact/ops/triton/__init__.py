"""Triton kernels for the lean ops on CUDA tensors (one fused kernel per op and direction).

The ops (:mod:`leanact.ops.dropout`, ``.layer_norm``, ``.rms_norm``, ``.gelu``,
:func:`leanact.ops.random.keep_mask_like`, ``.gated_mlp`` through :mod:`.gated`, ``.fewbit`` and
the 8-bit compression of :mod:`leanact.lossy` through :mod:`.lossy`) ask the dispatch functions
first and fall back to their PyTorch path; ``LEANACT_TRITON=0`` turns the kernels off. Before an
op's kernel first runs on a device it is checked there against the PyTorch path
(:mod:`.selfcheck`); one that fails to build or disagrees warns and leaves its op on the PyTorch
path. Importing this package does not import Triton: :mod:`.kernels` is loaded on the first CUDA
call. See docs/triton.md.
"""
from .dispatch import available, enabled, forced, use_kernels, verified

__all__ = ["available", "enabled", "forced", "use_kernels", "verified"]
