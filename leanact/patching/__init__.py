"""``leanact.patch(model)``: rewire an instantiated model in place to use leanact's lean ops.

* Generic replacements on any ``nn.Module``: ``nn.GELU``, ``nn.LayerNorm``, ``nn.RMSNorm``,
  ``nn.Dropout`` and Hugging Face's GELU activation classes become leanact's drop-ins, built
  around the same Parameter objects (state_dict keys and values unchanged). Hugging Face's
  RMSNorms (LLaMA's, OLMo 2's, Gemma's ``(1 + w)``, T5's, Cohere's bias-free LayerNorm) become a
  subclass keeping only y and rstd (:mod:`leanact.patching.hf_rms_norm`); their gated MLPs (SwiGLU,
  GeGLU; separate or fused gate/up) a subclass keeping only the gate and up projections' outputs
  (:mod:`leanact.patching.hf_swiglu`); their MoE experts a subclass keeping only each routed
  token's gate/up outputs (:mod:`leanact.patching.hf_moe`); CLIP's ``fc1 → QuickGELU → fc2`` MLP
  a subclass keeping only fc1's output (:mod:`leanact.patching.hf_fc_mlp`; a ``QuickGELUActivation``
  elsewhere becomes :class:`~leanact.patching.modules.PatchedQuickGELU`, keeping its input). These
  are recognised from their structure and forward, not their class names.
* Hugging Face models (transformers >= 5) whose attention goes through ``AttentionInterface``:
  the config's attention implementation is set to ``"leanact"`` (see
  :mod:`leanact.patching.attention_hf`).
* Bloom's and Falcon's attention (ALiBi or rotary, written in the modeling code): a subclass whose
  scores -> softmax -> dropout -> @ v go through leanact's attention core
  (:mod:`leanact.patching.hf_alibi`).
* Hugging Face's RoPE rotation of q and k (``apply_rotary_pos_emb`` of Llama's form, in most
  decoder models): one Triton kernel per tensor and direction on CUDA, bitwise the original
  (:mod:`leanact.patching.hf_rotary`; with ``attention=False`` left as is).
* Hugging Face language-model heads (``*ForCausalLM``, ``*LMHeadModel``, ``*ForMaskedLM`` with an
  ``nn.Linear`` output embedding): in training mode with labels and autograd, the loss runs through
  leanact's fused linear + cross-entropy and ``logits`` come back None (:mod:`leanact.patching.hf_head`;
  ``fused_loss=False`` or :func:`keep_logits` to keep them).
* Under ``torch.autocast`` the model's forward runs inside a recipe transform: autocast's 16-bit
  casts of tensors leanact keeps in fp32 anyway (norm outputs) are rebuilt in backward instead of
  kept (:mod:`leanact.patching.amp`).
* ``torch.nn.functional.dropout`` calls in Hugging Face modeling code (BART, Whisper, ...): keep a
  seed instead of a mask in training (:mod:`leanact.patching.functional_dropout`).

``leanact.unpatch(model)`` puts the original module objects and attention implementation back.
The summary of what was replaced and what was left (and why) is returned by :func:`summary` and
printed as a table with ``verbose=True``. An attention implementation set after patching
(``model.set_attn_implementation("sdpa")``) is respected: the summary then reports leanact's attention
off for that model, and its next forward warns once.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from . import weight_recast
from .adapter import ATTR, PatchRun
from .hf_head import keep_logits
from .hf_residual_norm import PATCHED_CHILDREN
from .registry import MODEL_STEPS
from .patch_summary import PatchSummary

__all__ = ["patch", "unpatch", "summary", "PatchSummary", "register_option", "keep_logits"]

_ATTENTION_MODES = ("recompute", "tempo")


@dataclass(frozen=True)
class _Option:
    apply: Callable[[nn.Module, Any], nn.Module]
    remove: Callable[[nn.Module], nn.Module]


#: Options of :func:`patch` provided by packages above this one (``lossy=``: :mod:`leanact.lossy`),
#: registered by them when imported, so that patching imports nothing above it.
_OPTIONS: dict[str, _Option] = {}


def register_option(name: str, apply: Callable[[nn.Module, Any], nn.Module],
                    remove: Callable[[nn.Module], nn.Module]) -> None:
    """Let ``patch(model, name=value)`` call ``apply(model, value)`` after patching, and
    ``unpatch(model)`` call ``remove(model)`` before undoing the patch (its swaps sit on top)."""
    _OPTIONS[name] = _Option(apply, remove)


def _option(name: str) -> _Option:
    try:
        return _OPTIONS[name]
    except KeyError:
        raise RuntimeError(f"leanact.patch({name}=...) needs leanact.{name}, which registers it when imported: "
                           f"import leanact (or leanact.{name}) first") from None


_PATCHED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # modules given to patch()


def _check_module(fn: str, model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"leanact.{fn}(model): model must be a torch.nn.Module, got {type(model).__name__} "
                        f"{model!r:.60}; pass the model object itself, e.g. leanact.{fn}(model)")


def _check_not_inside_patched(model: nn.Module) -> None:
    for root in list(_PATCHED):
        if root is not model and getattr(root, ATTR, None) is not None and any(m is model for m in root.modules()):
            raise ValueError(f"leanact.unpatch(model): this {type(model).__name__} is part of a patched "
                             f"{type(root).__name__}, and unpatch undoes a whole patch: call leanact.unpatch on "
                             f"the {type(root).__name__} given to leanact.patch")


def patch(model: nn.Module, *, attention: str | bool = "recompute", verbose: bool = False,
          lossy: str | dict | None = None, fused_loss: bool = True, recast_weights: bool = True,
          cast_recipes: bool = True, late_head_grad: bool | None = None) -> nn.Module:
    """Rewire ``model`` in place to use leanact's lean ops; returns ``model``.

    ``attention``: "recompute" (default; keeps q, k, v, output and one statistic per row),
    "tempo" (keeps the softmax output instead of recomputing it) or False (leave attention as is).
    ``lossy``: None (default: exact) or approximate options on top, which change gradients: a dict
    such as ``{"fewbit": 2, "randomized_linear": 0.5, "compress": "fp8"}`` or a string such as
    ``"fp8"`` or ``"fewbit=2,compress=fp8"`` (see :mod:`leanact.lossy`).
    ``fused_loss``: True (default) = Hugging Face language models given ``labels`` in training mode
    under autograd compute their loss with leanact's fused linear + cross-entropy and return
    ``logits=None``
    (:mod:`leanact.patching.hf_head`); False = leave the head and loss as they are.
    ``recast_weights``: True (default) = under ``torch.autocast``, ``nn.Linear`` and GPT-2's
    ``Conv1D`` keep their fp32 weight (a parameter, free) instead of autocast's 16-bit copy of it and
    cast it again in backward: 2 bytes per parameter less, gradients bit-identical
    (:mod:`leanact.patching.weight_recast`); False = keep autocast's copies.
    ``cast_recipes``: True (default) = under ``torch.autocast``, the 16-bit casts autocast makes of a
    kept fp32 tensor (a norm's output, cast again for Q, K, V and the MLP) are not kept but rebuilt
    in backward (:mod:`leanact.patching.amp`); False = keep autocast's casts (2 bytes per element
    per source more, less host time per step: no saved-tensor hooks for them). With both False a
    patched model under autocast keeps what its lean ops keep and autocast's copies, as HF does.
    ``late_head_grad``: where the head's weight is tied to the input embedding, TRL's fused head
    (:mod:`leanact.patching.trl_head`) can compute that weight's gradient in the embedding's backward,
    at the end, instead of holding it through the layers' backward: less peak memory, one more matmul
    of the head's size per step. None (default) = when the model recomputes its layers (gradient
    checkpointing, TRL's default); True = always; False = never (the gradient is still handed to the
    embedding, not added by autograd).
    Patching an already patched model first unpatches it. Prints nothing unless ``verbose``.
    """
    _check_module("patch", model)
    if not isinstance(cast_recipes, bool):
        raise TypeError(f"leanact.patch(cast_recipes={cast_recipes!r}): use True (default) or False")
    if late_head_grad is not None and not isinstance(late_head_grad, bool):
        raise TypeError(f"leanact.patch(late_head_grad={late_head_grad!r}): use None (default: under gradient "
                        "checkpointing), True or False")
    if attention not in (False, *_ATTENTION_MODES):
        raise ValueError(f"attention must be one of {_ATTENTION_MODES} or False, got {attention!r}")
    if getattr(model, ATTR, None) is not None:
        unpatch(model)
    _PATCHED.add(model)
    run = PatchRun(attention, bool(fused_loss), cast_recipes, late_head_grad)
    object.__setattr__(model, ATTR, run)
    try:
        for step in MODEL_STEPS:
            run.step = step.name
            run.installed.append(step.name)
            step.install(model, run)
        if lossy:
            _option("lossy").apply(model, lossy)
        _option("recast_weights").apply(model, recast_weights)  # after lossy: it wraps plain Linears only
    except BaseException:
        unpatch(model)  # a bad option (or an interrupt) leaves the model as it was
        raise
    if verbose:
        from rich.console import Console

        Console().print(run.summary.table())
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch`: the original module objects and attention implementations come back.
    ``model`` must be the module given to :func:`patch`: a submodule of it raises ValueError."""
    _check_module("unpatch", model)
    run: PatchRun | None = getattr(model, ATTR, None)
    if run is None:
        _check_not_inside_patched(model)
        return model
    for option in _OPTIONS.values():  # lossy swaps sit on top of the patch's
        option.remove(model)
    for step in reversed(MODEL_STEPS):
        if step.name not in run.installed:
            continue  # (patch stopped before this step: an error or an interrupt)
        if step.uninstall is not None:
            step.uninstall(model, run)
        for name, parent, attr, original in reversed([s for s in run.swaps if s[0] == step.name]):
            current = parent._modules.get(attr)
            if current is not None:
                original.train(current.training)
                _keep_children(original, current)
            parent._modules[attr] = original
    object.__delattr__(model, ATTR)
    return model


register_option("recast_weights", weight_recast.apply, weight_recast.remove)


def _keep_children(original: nn.Module, current: nn.Module) -> None:
    """Children set on a replacement since patching (PEFT's LoRA layers inserted, or merged back by
    ``merge_and_unload``) stay when the original module comes back."""
    if current is original or not isinstance(current, type(original)):
        return
    own = current.__dict__.get(PATCHED_CHILDREN, {})  # the lean children the replacement was made with
    for k, c in current._modules.items():
        if k in original._modules and original._modules[k] is not c and own.get(k) is not c:
            original._modules[k] = c


def summary(model: nn.Module) -> PatchSummary | None:
    """The :class:`PatchSummary` of a patched model (None if it is not patched)."""
    run = getattr(model, ATTR, None)
    return None if run is None else run.summary.refresh()
