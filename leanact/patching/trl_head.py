"""TRL's fused LM head with leanact's backward, for the calls of a patched model that ask for it.

TRL's trainers (1.16 and later) put their own fused head on the policy and the reference
(``trl.trainer.utils.add_fused_lm_head``) and call the model with ``fused_lm_head=True``; that
forward computes per-token log-probabilities with ``trl.kernels.ChunkedLogProbFunction``. A forward
pre-hook on a patched model puts the subclass :mod:`leanact.ops.cross_entropy.trl_logprobs` makes in
its place for the duration of such a call, and a forward hook that runs even when the call raises
puts TRL's back: the forward is TRL's, the backward gives TRL's gradients bit for bit without an
fp32 buffer of the weight's size (1.2 GiB less at Llama-3.2-1B's vocabulary and width in bf16). With
tied embeddings (:mod:`.tied_embedding`) the weight's gradient goes to the embedding's backward; where
the model recomputes its layers (Hugging Face's gradient checkpointing, TRL's default) it is computed
there, late, so that it is not held through the layers' backward (docs/post_training.md). Other calls, calls under
``torch.compile`` and models leanact did not patch run TRL's head as it is. A TRL whose head differs
from the one this backward is written for is left as it is, with one warning naming why.
"""
from __future__ import annotations

import sys
import warnings
from weakref import WeakKeyDictionary

import torch
from torch import nn

from ..ops.cross_entropy.trl_logprobs import compatible, lean_class
from .adapter import ATTR, ModelStep, PatchRun

__all__ = ["install", "remove", "installed", "STEP"]

#: model -> what its pre-hook swapped out in each call running now (None: nothing), innermost last
_SWAPPED: "WeakKeyDictionary[nn.Module, list]" = WeakKeyDictionary()
_WARNED: set[str] = set()


def _lean_head_in(module: nn.Module, args, kwargs):
    if torch.compiler.is_compiling():  # (compiled: TRL's head as it is, and nothing here for dynamo to guard on)
        return None
    utils = sys.modules.get("trl.trainer.utils")
    kernels = sys.modules.get("trl.kernels.chunked_logprob")
    calls = _SWAPPED.setdefault(module, [])
    if kwargs.get("fused_lm_head") is not True or utils is None or kernels is None:
        calls.append(None)
        return None
    current = getattr(utils, "_ChunkedLogProbFunction", None)
    why = compatible(kernels)
    if why is None and current is not kernels.ChunkedLogProbFunction and current not in (
            lean_class(kernels), lean_class(kernels, True)):
        why = f"trl.trainer.utils._ChunkedLogProbFunction is {current!r}, not TRL's ChunkedLogProbFunction"
    if why is not None:
        if why not in _WARNED:
            _WARNED.add(why)
            warnings.warn(f"leanact: TRL's fused LM head runs as it is ({why})", stacklevel=2)
        calls.append(None)
        return None
    calls.append((utils, current))
    utils._ChunkedLogProbFunction = lean_class(kernels, late_weight_grad=_late(module))
    return None


def _late(model: nn.Module) -> bool:
    """Whether the head's weight gradient is computed late (``leanact.patch(late_head_grad=...)``)."""
    late = getattr(getattr(model, ATTR, None), "late_head_grad", None)
    return _checkpointed(model) if late is None else late


def _checkpointed(model: nn.Module) -> bool:
    """Whether the model recomputes its layers in backward (Hugging Face's gradient checkpointing,
    TRL's default): the head's weight gradient is then computed late (module doc)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # (transformers >= 5.24, before)
        if isinstance(getattr(type(model), name, None), property):
            return bool(getattr(model, name))
    return False


def _lean_head_out(module: nn.Module, args, kwargs, output):
    if torch.compiler.is_compiling():
        return None
    calls = _SWAPPED.get(module)
    swapped = calls.pop() if calls else None  # (none: an earlier pre-hook raised before this one ran)
    if swapped is not None:
        utils, original = swapped
        utils._ChunkedLogProbFunction = original
    return None


def install(model: nn.Module) -> None:
    if not installed(model):
        model.register_forward_pre_hook(_lean_head_in, with_kwargs=True)
        model.register_forward_hook(_lean_head_out, with_kwargs=True, always_call=True)


def installed(model: nn.Module) -> bool:
    return any(h is _lean_head_in for h in model._forward_pre_hooks.values())


def remove(model: nn.Module) -> None:
    """Remove both hooks (found by identity: also on deep copies and unpickled models)."""
    for hooks, kw, fn in ((model._forward_pre_hooks, model._forward_pre_hooks_with_kwargs, _lean_head_in),
                          (model._forward_hooks, model._forward_hooks_with_kwargs, _lean_head_out)):
        for key, h in list(hooks.items()):
            if h is fn:
                del hooks[key]
                kw.pop(key, None)
                model._forward_hooks_always_called.pop(key, None)


def _install(model: nn.Module, run: PatchRun) -> None:
    can_generate = getattr(model, "can_generate", None)
    if not (callable(can_generate) and can_generate()):  # TRL's head is for causal and vision-language LMs
        return
    install(model)
    run.summary.notes.append("TRL's fused LM head (calls with fused_lm_head=True): its backward with the "
                             "vocabulary outer, TRL's gradients without an fp32 buffer of the weight's size; "
                             "a tied weight's gradient made in the embedding's backward")


STEP = ModelStep("trl_head", _install, lambda model, run: remove(model))
