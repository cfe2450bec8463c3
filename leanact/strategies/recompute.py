"""Recompute strategies on ``torch.utils.checkpoint`` (non-reentrant).

* ``full``: keep the layer's inputs only; the whole forward runs again in backward.
* ``selective:<preset>``: torch's selective activation checkpoint (SAC) with a policy over aten
  ops: outputs of the ops the preset names are cached in forward (``MUST_SAVE``), every other op
  runs again in backward (``PREFER_RECOMPUTE``). Kept: the layer inputs + the cached outputs.

  ============================  ===============================================================
  preset                        outputs kept (all other ops are recomputed)
  ============================  ===============================================================
  ``selective:attention``       linear projections (mm, addmm, conv), norms (layer/rms/group/
                                batch norm, rsqrt), activations (gelu, silu, relu, tanh,
                                sigmoid, dropout): Megatron's choice, the attention core
                                (bmm, softmax, SDPA kernels) and cheap arithmetic are recomputed
  ``selective:pointwise``       linear projections and fused attention kernels (SDPA): every
                                pointwise op, norm, softmax and unfused attention bmm recomputed
  ``selective:norms``           linear projections, SDPA kernels and activations: norms and
                                cheap arithmetic recomputed
  ============================  ===============================================================

  Views and in-place ops are never cached (they allocate nothing / would mutate a cache entry).
  leanact's own attention core (a blockwise custom autograd Function) is built from bmm and
  in-place writes, so under every preset it is recomputed.

Dropout: checkpoint stashes and restores the RNG state (``preserve_rng_state=True``), so the
recomputed forward draws the same masks (torch's and leanact's seeded dropout alike).

Inside a checkpointed layer leanact's recipe scopes stay out (checkpoint's hooks are innermost).
SAC's cache is not a saved tensor, so after the forward the cached tensors are reported to the
observers of :mod:`leanact.saved` (the meter counts them like any kept tensor).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from leanact.saved import _stacks

__all__ = ["PRESETS", "policy", "run_full", "run_selective"]

_LINEAR = {"mm", "addmm", "_addmm_activation", "convolution", "_convolution", "cudnn_convolution",
           "mkldnn_convolution"}
_SDPA = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
         "_flash_attention_forward", "_efficient_attention_forward", "_scaled_dot_product_fused_attention_overrideable"}
_NORM = {"native_layer_norm", "_fused_rms_norm", "native_group_norm", "native_batch_norm",
         "_native_batch_norm_legit", "_native_batch_norm_legit_no_training", "rsqrt"}
_ACT = {"gelu", "silu", "relu", "tanh", "sigmoid", "native_dropout", "hardtanh", "elu", "leaky_relu", "mish"}

PRESETS: dict[str, frozenset[str]] = {
    "attention": frozenset(_LINEAR | _NORM | _ACT),
    "pointwise": frozenset(_LINEAR | _SDPA),
    "norms": frozenset(_LINEAR | _SDPA | _ACT),
}


def policy(preset: str) -> Callable:
    """The SAC policy function of ``preset`` (one of :data:`PRESETS`)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown selective preset {preset!r}; choose one of {sorted(PRESETS)}")
    keep = PRESETS[preset]

    def policy_fn(ctx, op, *args, **kwargs):
        if isinstance(op, torch._ops.OpOverload) and not op.is_view and not op._schema.is_mutable:
            if op._opname in keep:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    policy_fn.preset = preset
    return policy_fn


def run_full(fn: Callable, args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` keeping only its inputs for backward."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def run_selective(fn: Callable, args: tuple, kwargs: dict, policy_fn: Callable) -> Any:
    """``fn(*args, **kwargs)`` under SAC with ``policy_fn``; reports the cached tensors to the
    saved-tensor observers (the meter)."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    modes = []

    def context_fn():
        fwd, rec = create_selective_checkpoint_contexts(policy_fn)
        modes.append(fwd)
        return fwd, rec

    out = checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn, **kwargs)
    if modes:
        _report(modes[0].storage)
    return out


def _cached_tensors(storage: dict) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for per_call in storage.values():
        for entry in per_call.values():
            for leaf in torch.utils._pytree.tree_leaves(entry):
                val = getattr(leaf, "val", None)
                if isinstance(val, torch.Tensor):
                    out.append(val)
    return out


def cached_bytes(storage: dict) -> int:
    """Bytes of distinct storages in a SAC cache."""
    seen: dict[int, int] = {}
    for t in _cached_tensors(storage):
        seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _report(storage: dict) -> None:
    observers = list(_stacks()[1])
    if not observers:
        return
    for t in _cached_tensors(storage):
        for ob in observers:
            ob.on_pack(t, [t])
