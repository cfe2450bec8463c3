"""Triton kernels for the lean ops on CUDA tensors (one fused kernel per op and direction).

The ops ask their launchers first and fall back to their PyTorch path. Each op's folder holds its
launchers and kernels (``leanact.ops.<op>.launchers``, e.g. :mod:`leanact.ops.norms.launchers`):
dropout (with the keep-masks of :func:`leanact.ops.random.keep_mask_like` and attention's dropout),
the norms, GELU, the gated MLP, the fused cross-entropy, the rotary embedding and the few-bit and
8-bit pack/unpack (:mod:`leanact.ops.lossy`). This package holds what they share: :mod:`.dispatch`
(the switches, the launch and the self-check machinery, which imports none of them),
:mod:`.launch`, :mod:`.selfcheck`, :mod:`.common` (what every kernel module builds on), :mod:`.hash`
and :mod:`.math32`; ``LEANACT_TRITON=0`` turns the kernels off. Before an op's
kernel first runs on a device it is checked there against the PyTorch path by the check its op
registered (built from :mod:`.selfcheck`); one that fails to build or disagrees warns and leaves
its op on the PyTorch path. Importing this package does not import Triton: :mod:`.common` is loaded
on the first CUDA call. See docs/triton.md.
"""
from .dispatch import available, enabled, forced, use_kernels, verified

__all__ = ["available", "enabled", "forced", "use_kernels", "verified"]
