"""Autograd Functions that keep less for backward (the lowest layer of leanact).

One folder per op, holding its autograd Function and PyTorch path and, where it has them, its
Triton launchers and kernels, the registration of their self-check and its fake-tensor rule:
:mod:`.dropout`, :mod:`.norms` (LayerNorm, RMSNorm, dropout + add + LayerNorm), :mod:`.gelu`,
:mod:`.gated_mlp`, :mod:`.moe`, :mod:`.attention`, :mod:`.cross_entropy` (fused linear +
cross-entropy), :mod:`.rotary` and :mod:`.lossy` (the approximate ops behind :mod:`leanact.lossy`).

Shared by the ops: :mod:`.triton` (the kernels' switch, launch, fallback and self-check machinery
and the helpers every kernel module builds on), :mod:`.fake_rules` (the ops' behaviour on fake
tensors, for :mod:`leanact.estimate`), :mod:`.random` (the counter-based generator),
:mod:`.bitpack`, :mod:`.backward` (``once_differentiable``), :mod:`.transforms` (``torch.func``),
:mod:`.amp` (the autocast policy), :mod:`.row_chunks`, :mod:`.cpu_gemm`, and the autocast weight
recasts :mod:`.weight_recast` and :mod:`.recast_linear`. The functional API collecting the ops is
:mod:`leanact.functional`.
"""
