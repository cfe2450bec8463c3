"""Tensor-parallel styles for GPT-2's transformers ``Conv1D`` projections and fused q|k|v.

``Conv1D`` computes ``y = x @ W + b`` with ``W`` of shape (in, out): the transpose of
``nn.Linear``'s. torch's Colwise/RowwiseParallel accept only ``nn.Linear`` / ``nn.Embedding``, so:

* :class:`Conv1DColwise`: ``W`` ``Shard(1)``, ``b`` ``Shard(0)`` (c_fc); input replicated, output
  the rank's columns. With ``fused=3`` (c_attn, output ``q | k | v``) each of the 3 column blocks is
  split t ways: ``W`` and ``b`` are ``_StridedShard(dim, split_factor=3)`` DTensors, whose local
  shard on rank r is ``[q_r | k_r | v_r]`` (heads r*H/t ... of each), so ``full_tensor()`` and the
  state_dict are the single-process parameters. The matmul runs on that local shard viewed as a
  plain ``Shard(1)`` DTensor (no communication; DTensor still all-reduces the input's gradient).
* :class:`Conv1DRowwise`: ``W`` ``Shard(0)``, ``b`` replicated (c_proj); input sharded on its last
  dim, the partial sums all-reduced (``Replicate``) or reduce-scattered (``Shard(1)``).
* :class:`GPT2AttentionStyle`: sets the attention module's ``split_size`` / ``num_heads`` /
  ``embed_dim`` to the local h/t, H/t, h/t (it splits the local c_attn output with ``split_size``
  and shapes heads as ``view(..., -1, head_dim)``), then applies an inner style (the sequence gather).

Nothing extra is kept for backward: the projections keep their input as the Linear styles do.
"""
from __future__ import annotations

import types
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["Conv1DColwise", "Conv1DRowwise", "GPT2AttentionStyle", "is_conv1d"]


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (``pytorch_utils.Conv1D``: weight (nx, nf), bias (nf,))."""
    t = type(module)
    return t.__name__ == "Conv1D" and t.__module__ == "transformers.pytorch_utils"


def _check(style: str, module: nn.Module) -> None:
    if not is_conv1d(module):
        raise TypeError(f"{style} applies to transformers' Conv1D (GPT-2 projections), got {type(module).__name__}; "
                        "use torch's ColwiseParallel / RowwiseParallel for nn.Linear")


def _param(module: nn.Module, name: str, mesh, placement, src) -> None:
    p = getattr(module, name)
    module.register_parameter(name, nn.Parameter(distribute_tensor(p, mesh, [placement], src_data_rank=src),
                                                 requires_grad=p.requires_grad))


def _as_shard(p: DTensor, dim: int) -> DTensor:
    """The local shard of ``p`` as a ``Shard(dim)`` DTensor (differentiable, no communication)."""
    return DTensor.from_local(p.to_local(), p.device_mesh, [Shard(dim)], run_check=False)


def _fused_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Conv1D's forward on the local ``[q_r | k_r | v_r]`` columns (``x``: a replicated DTensor)."""
    y = torch.addmm(_as_shard(module.bias, 0), x.view(-1, x.size(-1)), _as_shard(module.weight, 1))
    return y.view(*x.shape[:-1], module.nf)


class Conv1DColwise(ColwiseParallel):
    """Column-parallel ``Conv1D``; ``fused=k``: the output is k equal blocks, each split t ways."""

    def __init__(self, *, fused: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.fused = fused

    def _partition(self, name, module, mesh):
        k = self.fused
        _param(module, "weight", mesh, _StridedShard(1, split_factor=k) if k > 1 else Shard(1), self.src_data_rank)
        _param(module, "bias", mesh, _StridedShard(0, split_factor=k) if k > 1 else Shard(0), self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check(type(self).__name__, module)
        t, k = device_mesh.size(), self.fused
        if module.nf % (k * t):
            raise ValueError(f"{type(self).__name__}: {module.nf} output features in {k} fused blocks do not split "
                             f"{t} ways; use a tensor-parallel size dividing {module.nf // k}")
        if k > 1:  # instance attribute (a bound method: deepcopy rebinds it); the class is unchanged
            module.forward = types.MethodType(_fused_forward, module)
        return distribute_module(
            module, device_mesh, self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Conv1DRowwise(RowwiseParallel):
    """Row-parallel ``Conv1D``: weight ``Shard(0)`` (its input features), bias replicated."""

    def _partition(self, name, module, mesh):
        _param(module, "weight", mesh, Shard(0), self.src_data_rank)
        _param(module, "bias", mesh, Replicate(), self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check(type(self).__name__, module)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class GPT2AttentionStyle(ParallelStyle):
    """Makes a GPT-2 attention module work on its local heads; then applies ``inner`` (or nothing)."""

    def __init__(self, inner: ParallelStyle | None = None):
        super().__init__()
        self.inner = inner

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        t = device_mesh.size()
        missing = [a for a in ("split_size", "num_heads", "embed_dim", "head_dim") if not hasattr(module, a)]
        if missing or getattr(module, "is_cross_attention", False):
            raise ValueError(f"leanact.parallel: {type(module).__name__} is not a GPT-2 self-attention module "
                             f"(missing {missing} or cross-attention)")
        if module.num_heads % t:
            raise ValueError(f"leanact.parallel: {module.num_heads} attention heads do not divide by the "
                             f"tensor-parallel size {t}")
        module.num_heads //= t
        module.split_size //= t
        module.embed_dim //= t
        return self.inner._apply(module, device_mesh) if self.inner is not None else module
