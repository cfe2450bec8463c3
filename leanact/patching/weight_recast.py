"""``patch(model, recast_weights=True)``: under autocast, Linear layers keep no 16-bit weight copy.

Under ``torch.autocast`` every ``nn.Linear`` (and transformers' ``Conv1D``, GPT-2's projections)
of an fp32 weight keeps autocast's 16-bit cast of that weight for backward: 2 bytes per
parameter, whatever the batch. With this option (on by default in :func:`leanact.patch`), their
``forward`` becomes a :class:`RecastForward` on the instance (the class, the module object, its
hooks and the state dict are unchanged): when autocast is active at call time (CPU or CUDA, bf16
or fp16), the weight is an fp32 ``nn.Parameter`` (not a DTensor; not a tensor computed in forward
or swapped in by ``functional_call``: keeping that alive to recast it would cost more than its
copy) and autograd will need it, the weight is cast by
:func:`leanact.ops.weight_recast.recast_weight`, which keeps the fp32 parameter (free: it lives
anyway) and casts it again in backward (the same rounding: outputs and gradients are bit-identical
to the unpatched model's). Where nothing observes saves (no meter, strategy or checkpointed
region: a plain training step) a Linear's call is one autograd Function,
:func:`leanact.ops.recast_linear.recast_linear`, which keeps the same as the hooks would (and,
for an input whose fp32 source a norm keeps anyway, that source, its cast shared with the other
Linears reading it: :func:`leanact.recompute.recipes.shared_cast`); GPT-2's ``Conv1D`` likewise.
An input with a producer's recipe or a non-contiguous input gets hooks on its matmul's saved
tensors instead (:func:`leanact.ops.weight_recast.hook_matmul_saves`). Otherwise, and wherever
saved-tensor hooks cannot be pushed (``torch.compile``, ``torch.func``, a checkpointed region),
the module's own forward runs.

Only exact ``nn.Linear`` / ``Conv1D`` modules (and leanact's subclasses marked
``_leanact_plain_linear``: a Linear under autocast) whose forward was not already replaced on the
instance are wrapped (a subclass may override ``forward``; lossy's ``RandomizedLinear`` already
keeps the parameter), and not the language-model heads whose loss leanact fuses (the fused op
keeps the parameter; when it materialises the logits, the head keeps autocast's copy).
``recast_weights=False`` leaves them alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..ops.amp import autocast_dtype
from ..ops.recast_linear import compiled_recast_linear, recast_linear
from ..ops.weight_recast import LOW_DTYPES, hook_matmul_saves, recast_weight
from ..recompute.context_forward import ContextForward, unwrap_forward
from ..recompute.recipes import RecipeTransform, foreign_hooks, has_recipe, shared_cast
from ..saved import unobserved_ambient, with_ambient
from . import hf_head
from .adapter import ATTR

__all__ = ["RecastForward", "apply", "remove", "recast_dtype", "wraps_linears", "NOTE"]

_ATTR = "_leanact_recast_weights"
#: the input dtypes autocast casts (it leaves float64 and integers alone; F.linear then raises, as unpatched)
_AUTOCAST_INPUTS = (torch.float32, torch.float16, torch.bfloat16)
NOTE = "recast_weights: under autocast, {n} Linear layers keep the fp32 weight and recast it in backward"


def _linear(m: nn.Linear, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w, m.bias)


def _conv1d(m: nn.Module, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # transformers.pytorch_utils.Conv1D.forward with the weight given
    out = torch.addmm(m.bias, x.view(-1, x.size(-1)), w)
    return out.view(x.size()[:-1] + (m.nf,))


def _compute_for(m: nn.Module) -> Callable | None:
    t = type(m)
    if t is nn.Linear or getattr(t, "_leanact_plain_linear", False):
        return _linear
    if t.__name__ == "Conv1D" and t.__module__ == "transformers.pytorch_utils":
        return _conv1d
    return None


def _eligible_dtype(weight: torch.Tensor, x: object) -> torch.dtype | None:
    """:func:`recast_dtype` before its compile and foreign-hooks checks (the per-call fast path
    learns those from :func:`leanact.saved.unobserved_ambient`)."""
    if not isinstance(x, torch.Tensor) or not torch.is_grad_enabled():
        return None
    # a Parameter (a weight computed in forward, e.g. by a parametrization, would have to stay alive
    # in fp32 to be recast: more than its copy), plain (not a DTensor shard: FSDP2 / TP keep theirs;
    # an exact nn.Parameter is plain, the common case checked first: this runs per Linear call)
    if type(weight) is not nn.Parameter and (not isinstance(weight, nn.Parameter)
                                             or is_traceable_wrapper_subclass(weight)):
        return None
    if weight.dtype != torch.float32 or not (weight.requires_grad or x.requires_grad):
        return None
    if x.is_cuda:  # (the common case without building device objects: this runs per Linear call)
        if not weight.is_cuda:
            return None
        device = "cuda"
    else:
        device = x.device.type
        if weight.device.type != device:
            return None
    dtype = autocast_dtype(device)
    return dtype if dtype in LOW_DTYPES else None


def recast_dtype(weight: torch.Tensor, x: object) -> torch.dtype | None:
    """The dtype to recast ``weight`` to for a call on ``x`` (None: run the module's own forward)."""
    dtype = _eligible_dtype(weight, x)
    if dtype is None or torch.compiler.is_compiling() or foreign_hooks():
        return None
    return dtype


class RecastForward(ContextForward):
    """``module.forward`` of a Linear / Conv1D that, under autocast, keeps the fp32 weight instead
    of its 16-bit cast (module doc). ``context`` holds the module's computation given the cast
    weight (None: inert, the module's own forward)."""

    same_computation = True  # (the module's own forward's values: leanact.patching.modules.unchanged)

    def __call__(self, *args, **kwargs):
        compute = self.context
        if compute is None or len(args) != 1 or kwargs:
            return self._forward()(*args, **kwargs)
        m, x = self.module, args[0]
        weight = m.weight
        dtype = _eligible_dtype(weight, x)
        if dtype is not None and torch.compiler.is_compiling() and x.dtype in _AUTOCAST_INPUTS and x.dim() >= 1:
            return compiled_recast_linear(x, weight, m.bias, dtype, compute is _conv1d)
        if dtype is not None:
            quiet, transform = unobserved_ambient()  # (quiet: not compiling, no hooks of anyone's)
            if quiet and x.dtype in _AUTOCAST_INPUTS and x.dim() >= 2 and x.is_contiguous() and (
                    transform is None or (type(transform) is RecipeTransform and not has_recipe(x))):
                # nothing observes saves, no producer's recipe for x: one Function keeping the fp32
                # weight and, where x is kept as is anyway (a norm's output), x (leanact.ops.recast_linear)
                share = shared_cast(x, dtype, transform) if transform is not None and weight.requires_grad else None
                return recast_linear(x, weight, m.bias, dtype, share, compute is _conv1d)
            if quiet:  # hooks on the matmul's saved tensors (a producer's output, a strided input), none pushed
                cast = weight.to(dtype=dtype)
                return hook_matmul_saves(compute(m, x, cast), weight, cast, transform)
            if torch.compiler.is_compiling() or foreign_hooks():
                dtype = None
        with with_ambient():  # the autocast recipes, where the model's forward set them (patching.amp)
            if dtype is None:
                return self._forward()(x)
            with recast_weight(weight, dtype) as w:
                return compute(m, x, w)


@dataclass
class _State:
    wrapped: list[tuple[nn.Module, RecastForward]] = field(default_factory=list)


def _fused_heads(model: nn.Module) -> set[int]:
    """ids of the output embeddings whose loss :mod:`leanact.patching.hf_head` fuses (it arms them
    per call through their instance ``forward``; its fused op keeps the parameter already)."""
    return {id(m.get_output_embeddings()) for m in model.modules() if hf_head.ATTR in m.__dict__}


def apply(model: nn.Module, enabled: bool) -> nn.Module:
    """Wrap the eligible Linear / Conv1D modules of ``model`` (module doc); ``enabled=False``: none."""
    if not isinstance(enabled, bool):
        raise TypeError(f"leanact.patch(recast_weights={enabled!r}): use True (default) or False")
    remove(model)
    if not enabled:
        return model
    state = _State()
    heads = _fused_heads(model)
    for m in model.modules():
        compute = _compute_for(m)
        if compute is None or "forward" in m.__dict__ or id(m) in heads:
            continue
        wrapper = RecastForward(m, compute)
        m.__dict__["forward"] = wrapper
        state.wrapped.append((m, wrapper))
    object.__setattr__(model, _ATTR, state)
    run = model.__dict__.get(ATTR)  # (the patch's summary)
    if run is not None and state.wrapped:
        run.summary.notes.append(NOTE.format(n=len(state.wrapped)))
    return model


def wraps_linears(model: nn.Module) -> bool:
    """Whether :func:`apply` wrapped Linear layers of ``model`` (and they are still in place)."""
    state: _State | None = model.__dict__.get(_ATTR)
    return state is not None and bool(state.wrapped)


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply` (no-op when it was not applied)."""
    state: _State | None = model.__dict__.get(_ATTR)
    if state is None:
        return model
    for m, wrapper in state.wrapped:
        unwrap_forward(m, wrapper)
    object.__delattr__(model, _ATTR)
    return model
