"""Dropout that keeps an 8-byte seed for backward instead of a mask.

- :mod:`.function`: the autograd Function, :func:`~.function.dropout` and
  :func:`~.function.dropout_seeded`, :func:`~.function.apply_dropout` (the op without a graph), the
  registration of the kernels' self-check and of the op's fake-tensor rule;
- :mod:`.launchers` and :mod:`.kernels`: the Triton path on CUDA, which also draws the keep-masks
  of :func:`leanact.ops.random.keep_mask_like` and attention's dropout blocks.

This package imports nothing: :mod:`leanact.ops.random` (which :mod:`.function` builds on) calls
:mod:`.launchers`, so the Function is imported from :mod:`.function`.
"""
