"""Sequence-parallel norms that run leanact's lean norm ops on the local sequence shard.

:class:`LocalSequenceParallel` is torch's :class:`~torch.distributed.tensor.parallel.SequenceParallel`
style (the norm's parameters become replicated DTensors, its input a ``Shard(seq_dim)`` DTensor)
with one change: the module's own forward runs inside
:func:`~torch.distributed.tensor.experimental.local_map` on plain local tensors. leanact's norms
are custom autograd Functions (``leanact.ops.norms.layer_norm``, ``rms_norm``, the lean HF RMSNorm) that
read their weight from the module and save plain tensors (y and rstd) for backward, so they are
given the local shard of x and the local copies of the replicated weight and bias. What is kept
for backward is then exactly what the single-device op keeps, for the s/t rows of the shard.

The parameter gradients come back as ``Partial()`` DTensors (each rank's sum over its own rows),
the same placement torch's own DTensor layer_norm backward gives under SequenceParallel; the
optimizer step (or ``grad.full_tensor()``) reduces them, so every rank applies the full gradient.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import local_map
from torch.distributed.tensor.parallel import SequenceParallel

__all__ = ["LocalSequenceParallel"]


def _run_with_parameters(module: nn.Module, names: list[str], forward, x, params):
    """``forward(module, x)`` with ``module._parameters[n]`` temporarily set to the local tensors."""
    saved = {n: module._parameters[n] for n in names}
    try:
        for n, p in zip(names, params):
            module._parameters[n] = p
        return forward(module, x)
    finally:
        module._parameters.update(saved)


class LocalSequenceParallel(SequenceParallel):
    """``SequenceParallel`` whose module forward sees local shards (for custom autograd Functions).

    The module must take one input tensor, sharded on ``sequence_dim``, and return one tensor of
    the same sharding (norms, dropout-free elementwise modules).
    """

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        names = [n for n, p in module.named_parameters(recurse=False)]
        forward = type(module).forward
        seq = Shard(self.sequence_sharding[0].dim)

        def local_fn(x, *params):
            return _run_with_parameters(module, names, forward, x, params)

        mapped = local_map(
            local_fn,
            out_placements=[seq],
            in_placements=([seq],) + ([Replicate()],) * len(names),
            in_grad_placements=([seq],) + ([Partial()],) * len(names),
            device_mesh=device_mesh,
        )

        def sharded_forward(x: torch.Tensor) -> torch.Tensor:
            return mapped(x, *(module._parameters[n] for n in names))

        module.forward = sharded_forward  # instance attribute: the class (and its other instances) unchanged
        module._leanact_local_sp = True
        return module
