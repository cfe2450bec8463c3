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

import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .. import nn as lnn

from . import amp, attention_hf, functional_dropout, hf_alibi, hf_head, hf_rotary, peft_lora, training_cache
from . import weight_recast
from .generic import replacement_for
from .hf_residual_norm import PATCHED_CHILDREN
from .hf_head import keep_logits
from .modules import PatchedQuickGELU

__all__ = ["patch", "unpatch", "summary", "PatchSummary", "register_option", "keep_logits"]

_ATTR = "_leanact_patch"
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


@dataclass
class PatchSummary:
    """What :func:`patch` did. ``replaced``/``left``: (qualified name, class, new class / reason)."""

    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    left: list[tuple[str, str, str]] = field(default_factory=list)
    attention: list[tuple[str, str, str]] = field(default_factory=list)  # (model path, before, after/reason)
    #: model path -> run-time state; its ``fallbacks`` name the features (softcap, sinks, position_bias,
    #: ...) for which calls went to the original implementation instead of leanact's core.
    attention_states: dict = field(default_factory=dict, repr=False, compare=False)
    notes: list[str] = field(default_factory=list)  # whole-model changes (e.g. no KV cache in training)
    loss: list[tuple[str, str, str]] = field(default_factory=list)  # (model path, head, after/reason)
    #: model path -> :class:`leanact.patching.hf_head.HeadState`: fused calls so far and the operations
    #: for which the logits had to be materialised (the model's own loss then).
    loss_states: dict = field(default_factory=dict, repr=False, compare=False)
    #: model path -> (config set to leanact's attention, its row as patched; None: no row, a composite's top)
    attention_configs: dict = field(default_factory=dict, repr=False, compare=False)
    #: ``torch.nn.functional.dropout`` calls in modeling code (:mod:`leanact.patching.functional_dropout`):
    #: the classes whose forward calls it and how many calls kept a seed so far; None: no such class.
    functional_dropout: "functional_dropout.DropoutState | None" = field(default=None, compare=False)

    def functional_dropout_row(self) -> tuple[str, str, str] | None:
        """(what, was, now) for the table: the wrapped classes and the calls redirected so far."""
        st = self.functional_dropout
        if st is None or not (st.classes or st.lean_calls or st.torch_calls):
            return None
        now = f"leanact seed: {st.lean_calls} calls so far"
        if st.torch_calls:
            now += f"; [yellow]torch's mask[/] for {st.torch_calls} (checkpointed or transformed regions)"
        where = ", ".join(st.classes) or "modules added after patching (PEFT)"
        return f"functional dropout in {where}", "F.dropout (mask)", now

    def attention_off(self) -> dict[str, str]:
        """model path -> the implementation set since patching where it is no longer leanact's (module doc)."""
        return {p: str(c._attn_implementation) for p, (c, _) in self.attention_configs.items()
                if c._attn_implementation != attention_hf.NAME}

    def refresh(self) -> "PatchSummary":
        """Bring the attention rows up to date with the configs (:meth:`attention_off`); returns self."""
        off = self.attention_off()
        for i, (path, before, _) in enumerate(self.attention):
            if path in self.attention_configs:
                now = f"left: {_off(off[path])}" if path in off else self.attention_configs[path][1]
                self.attention[i] = (path, before, now)
        return self

    def attention_fallbacks(self) -> dict[str, set]:
        """model path -> features seen so far that sent attention calls back to the original implementation."""
        return {p: set(st.fallbacks) for p, st in self.attention_states.items() if st.fallbacks}

    def left_in_layers(self) -> list[str]:
        """What was left inside the model's repeated layers (paths with a layer index), by name:
        "attention" if its row says left or calls fell back, then the classes of the modules left
        (RoPE tables excepted: built without autograd, they keep nothing); [] when nothing was."""
        import re

        self.refresh()
        out = []
        if any(after.startswith("left") for _, _, after in self.attention) or self.attention_fallbacks():
            out.append("attention")
        for name, cls, _ in self.left:
            if re.search(r"\.\d+(\.|$)", name) and not cls.endswith("RotaryEmbedding") and cls not in out:
                out.append(cls)
        return out

    def to_dict(self) -> dict:
        """Plain data (no markup) for JSON: every row of :meth:`table` by kind."""
        from rich.text import Text

        plain = lambda rows: [[Text.from_markup(x).plain for x in r] for r in rows]  # noqa: E731
        row = self.refresh().functional_dropout_row()
        return {"replaced": plain(self.replaced), "left": plain(self.left), "attention": plain(self.attention),
                "attention_fallbacks": {p: sorted(f) for p, f in self.attention_fallbacks().items()},
                "attention_off": self.attention_off(),
                "loss": plain(self.loss), "notes": list(self.notes),
                "functional_dropout": None if row is None else plain([row])[0],
                "left_in_layers": self.left_in_layers()}

    def table(self):
        """A rich Table of the replacements, what was left and why, and attention (``print()`` shows it)."""
        from leanact._format import text_table

        self.refresh()
        t = text_table(title="leanact.patch")
        for col in ("module", "was", "now / why left"):
            t.add_column(col)
        groups: dict[tuple[str, str, str], list[str]] = {}
        for name, old, new in self.replaced:
            groups.setdefault(("replaced", old, new), []).append(name)
        for name, old, why in self.left:
            groups.setdefault(("left", old, why), []).append(name)
        for (kind, old, what), names in groups.items():
            label = names[0] if len(names) == 1 else f"{len(names)} modules, e.g. {names[0]}"
            t.add_row(label, old, what if kind == "replaced" else f"[yellow]left[/]: {what}")
        fallbacks = self.attention_fallbacks()
        for path, before, after in self.attention:
            if path in fallbacks and not after.startswith("left"):
                after += f"; [yellow]{before}[/] for calls with {', '.join(sorted(fallbacks[path]))}"
            t.add_row(f"attention ({path or 'model'})", before, after)
        for path, before, after in self.loss:
            st = self.loss_states.get(path)
            if st is not None and st.fallbacks:
                after += f"; [yellow]logits materialised[/] for {', '.join(sorted(st.fallbacks))}"
            t.add_row(f"loss ({path or 'model'})", before, after)
        if (row := self.functional_dropout_row()) is not None:
            t.add_row(*row)
        for note in self.notes:
            t.add_row("model", "", note)
        return t


@dataclass
class _PatchState:
    summary: PatchSummary
    originals: list[tuple[nn.Module, str, nn.Module]]  # (parent, attribute name, original child)
    attention: list[tuple[object, str]]  # (config, original implementation)
    amp_forward: object = None  # the forward wrapper of leanact.patching.amp (recipes under autocast)
    warned_off: dict = field(default_factory=dict)  # model path -> implementation warned about (_warn_off)


def _off(implementation: str) -> str:
    """Why a patched config's attention is not leanact's (summary row and warning)."""
    return (f"set to {implementation} after patching: leanact's attention is off (leanact.patch(model) or "
            f"model.set_attn_implementation(\"{attention_hf.NAME}\") brings it back)")


def _warn_off(model: nn.Module, args) -> None:
    """Forward pre-hook: warn once for each config set to another implementation after patching."""
    state = model.__dict__.get(_ATTR)
    if state is None or torch.compiler.is_compiling():
        return
    off = state.summary.attention_off()
    new = {p: i for p, i in off.items() if state.warned_off.get(p) != i}
    if new:  # one warning for the parts of a composite model
        state.warned_off.update(new)
        parts = ", ".join(p for p in new if p)
        where = type(model).__name__ + (f" ({parts})" if parts else "")
        warnings.warn(f"leanact: the attention of {where} was {_off(' / '.join(sorted(set(new.values()))))}",
                      stacklevel=5)
    for path in [p for p in state.warned_off if p not in off]:  # back on: warn again at the next change
        del state.warned_off[path]


def _remove_warn_off(model: nn.Module) -> None:
    for key, hook in list(model._forward_pre_hooks.items()):
        if hook is _warn_off:
            del model._forward_pre_hooks[key]


def _qualname(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _patch_modules(model: nn.Module, summary: PatchSummary, originals: list) -> None:
    def visit(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            qual = _qualname(prefix, name)
            new, reason = peft_lora.replacement_through_lora(child, replacement_for)
            if new is not None:
                parent._modules[name] = new
                originals.append((parent, name, child))
                for k, c in new._modules.items():  # PEFT LoRA layers kept as children: their dropouts
                    if c is not None and peft_lora.is_lora_layer(c):
                        visit(c, _qualname(qual, k))
                if (type(new).__module__.startswith(("leanact.patching.hf_", "leanact.patching.peft_"))
                        or isinstance(new, PatchedQuickGELU)):
                    label = f"leanact.patching.{type(new).__name__}"
                else:
                    label = (f"leanact.nn.{'GELU' if isinstance(new, lnn.GELU) else type(new).__name__}"
                             + (f"({new.approximate!r})" if hasattr(new, "approximate") else ""))
                summary.replaced.append((qual, type(child).__name__, label))
                continue
            if reason is not None:
                summary.left.append((qual, type(child).__name__, reason))
            visit(child, qual)

    visit(model, "")


def _configs(model: nn.Module) -> list:
    """Every attention-bearing config object of the model (each module's ``config`` and, recursively,
    their sub-configs: a composite model's text/vision/decoder parts), in a stable order."""
    found: dict[int, object] = {}

    def add(cfg) -> None:
        if cfg is None or id(cfg) in found or not hasattr(cfg, "_attn_implementation"):
            return
        found[id(cfg)] = cfg
        for key in getattr(cfg, "sub_configs", None) or {}:
            add(getattr(cfg, key, None))

    for m in model.modules():
        add(getattr(m, "config", None))
    return list(found.values())


def _variants(config, modules) -> str:
    """The attention variants the core runs for this config (shown in the summary)."""
    found = []
    if getattr(config, "attn_logit_softcapping", None) is not None:
        found.append("logit softcap")
    if getattr(config, "sliding_window", None) and "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        found.append("sliding windows")
    if any("sinks" in m._parameters for m in modules):
        found.append("attention sinks")
    return "".join(f", {f}" for f in found)


def _set_implementation(config, name: str) -> None:
    """Set one config's implementation without touching its sub-configs (the models read it per call)."""
    if hasattr(config, "_attn_implementation_internal"):
        config._attn_implementation_internal = name
    else:  # pragma: no cover - older config layouts
        config._attn_implementation = name


def _patch_alibi(model: nn.Module, mode: str, summary: PatchSummary, originals: list):
    """Swap Bloom's / Falcon's attention modules for their lean subclass; the shared
    :class:`~leanact.patching.hf_alibi.AlibiState`, or None when none was swapped."""
    state = hf_alibi.AlibiState(mode)
    found = False
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent._modules.items()):
            if child is None or not hf_alibi.is_hf_alibi_attention(child):
                continue
            qual = _qualname(prefix, name)
            new, reason = hf_alibi.hf_alibi_replacement(child, state)
            if new is None:
                if reason is not None:
                    summary.left.append((qual, type(child).__name__, reason))
                continue
            parent._modules[name] = new
            originals.append((parent, name, child))
            summary.replaced.append((qual, type(child).__name__, f"leanact.patching.{type(new).__name__}"))
            found = True
    return state if found else None


def _alibi_row(config, mode: str) -> str:
    kind = "ALiBi" if getattr(config, "alibi", config.model_type == "bloom") else "rotary"
    return f"leanact ({mode}, {kind}; Hugging Face's attention code around leanact's core)"


def _patch_attention(model: nn.Module, mode: str, summary: PatchSummary, records: list, alibi=None) -> None:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return
    configs = _configs(model)
    before = {id(c): c._attn_implementation for c in configs}
    eligible = [c for c in configs if before[id(c)] in ("eager", "sdpa", None)]
    if not eligible:
        for c in configs:
            summary.attention.append((_config_path(model, c), str(before[id(c)]),
                                      f"left: leanact replaces only eager/sdpa, not {before[id(c)]}"))
        return
    attention_hf.register()
    for m in model.modules():  # the outermost models; set_attn_implementation reaches their sub-configs
        if (isinstance(m, PreTrainedModel) and m.config._attn_implementation != attention_hf.NAME
                and not (alibi is not None and hf_alibi.has_lean(m))):  # (Bloom/Falcon: no AttentionInterface)
            m.set_attn_implementation(attention_hf.NAME)
    states = {}
    for c in configs:
        was, now = before[id(c)], c._attn_implementation
        path = _config_path(model, c)
        if was not in ("eager", "sdpa", None):
            if now != was:
                _set_implementation(c, was)
            summary.attention.append((path, str(was), f"left: leanact replaces only eager/sdpa, not {was}"))
        elif now != attention_hf.NAME and alibi is not None:
            summary.attention.append((path, str(was or "eager"), _alibi_row(c, mode)))
            summary.attention_states[path] = alibi
        elif now != attention_hf.NAME:
            summary.attention.append((path, str(was or "eager"), "left: the model does not use AttentionInterface"))
        else:
            was = was or "eager"
            users = [m for m in model.modules() if getattr(m, "config", None) is c]
            state = attention_hf._ConfigState(was, mode)
            states[id(c)] = state
            attention_hf.set_config_state(c, state)
            records.append((c, was))
            attention_hf.accept_output_attentions(c, was)
            summary.attention_states[path] = state
            row = None
            if any(not isinstance(m, PreTrainedModel) for m in users):  # (a composite's top config has no layers)
                row = f"leanact ({mode}{_variants(c, users)})"
                summary.attention.append((path, was, row))
            summary.attention_configs[path] = (c, row)
    for m in model.modules():  # the state travels with the modules (deepcopy, pickle)
        state = states.get(id(getattr(m, "config", None)))
        if state is not None:
            m.__dict__[attention_hf.ATTR] = state


def _config_path(model: nn.Module, config) -> str:
    """Where a config lives: the first module using it, or its sub-config key."""
    for path, m in model.named_modules():
        if getattr(m, "config", None) is config:
            return path
    top = getattr(model, "config", None)
    for key in getattr(top, "sub_configs", None) or {}:
        if getattr(top, key, None) is config:
            return f"config.{key}"
    return "?"


def _patch_head(model: nn.Module, summary: PatchSummary, enabled: bool) -> None:
    """Install the fused loss on the outermost Hugging Face language models of ``model``."""
    inside: list[nn.Module] = []
    for path, m in model.named_modules():
        if not hf_head.eligible_class(m) or any(any(c is m for c in o.modules()) for o in inside):
            continue
        inside.append(m)
        head = m.get_output_embeddings()
        head_name = next((n for n, c in m.named_modules() if c is head), "?") if head is not None else "-"
        before = f"{head_name} ({type(head).__name__}) + cross_entropy"
        reason = hf_head.head_reason(m) if enabled else "fused_loss=False"
        if reason is not None:
            summary.loss.append((path, before, f"left: {reason}"))
            continue
        summary.loss_states[path] = hf_head.install(m, path)
        summary.loss.append((path, before, "leanact fused linear + cross-entropy (training with labels; "
                                           "logits None)"))


_PATCHED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # modules given to patch()


def _check_module(fn: str, model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"leanact.{fn}(model): model must be a torch.nn.Module, got {type(model).__name__} "
                        f"{model!r:.60}; pass the model object itself, e.g. leanact.{fn}(model)")


def _check_not_inside_patched(model: nn.Module) -> None:
    for root in list(_PATCHED):
        if root is not model and getattr(root, _ATTR, None) is not None and any(m is model for m in root.modules()):
            raise ValueError(f"leanact.unpatch(model): this {type(model).__name__} is part of a patched "
                             f"{type(root).__name__}, and unpatch undoes a whole patch: call leanact.unpatch on "
                             f"the {type(root).__name__} given to leanact.patch")


def patch(model: nn.Module, *, attention: str | bool = "recompute", verbose: bool = False,
          lossy: str | dict | None = None, fused_loss: bool = True, recast_weights: bool = True,
          cast_recipes: bool = True) -> nn.Module:
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
    Patching an already patched model first unpatches it. Prints nothing unless ``verbose``.
    """
    _check_module("patch", model)
    if not isinstance(cast_recipes, bool):
        raise TypeError(f"leanact.patch(cast_recipes={cast_recipes!r}): use True (default) or False")
    if attention not in (False, *_ATTENTION_MODES):
        raise ValueError(f"attention must be one of {_ATTENTION_MODES} or False, got {attention!r}")
    if getattr(model, _ATTR, None) is not None:
        unpatch(model)
    _PATCHED.add(model)
    summary = PatchSummary()
    originals: list = []
    records: list = []
    _patch_modules(model, summary, originals)
    if attention:
        alibi = _patch_alibi(model, attention, summary, originals)
        _patch_attention(model, attention, summary, records, alibi)
    _patch_head(model, summary, bool(fused_loss))
    if peft_lora.install_upcasts(model):
        summary.notes.append("PEFT LoRA adapters wider than their input: lora_A casts it and keeps the input, "
                             "not a copy")
    summary.functional_dropout = functional_dropout.install(model)
    if training_cache.install(model):
        summary.notes.append("use_cache=False for training calls (train mode, grad on): no KV cache kept")
    if attention and (ropes := hf_rotary.install(model)):
        summary.notes.append(hf_rotary.NOTE.format(n=ropes))
    object.__setattr__(model, _ATTR, _PatchState(summary, originals, records,
                                                 amp.install(model) if cast_recipes else None))
    if summary.attention_configs:
        model.register_forward_pre_hook(_warn_off)
    try:
        if lossy:
            _option("lossy").apply(model, lossy)
        _option("recast_weights").apply(model, recast_weights)  # after lossy: it wraps plain Linears only
    except Exception:
        unpatch(model)  # a bad option leaves the model as it was
        raise
    if verbose:
        from rich.console import Console

        Console().print(summary.table())
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch`: the original module objects and attention implementations come back.
    ``model`` must be the module given to :func:`patch`: a submodule of it raises ValueError."""
    _check_module("unpatch", model)
    state: _PatchState | None = getattr(model, _ATTR, None)
    if state is None:
        _check_not_inside_patched(model)
        return model
    for option in _OPTIONS.values():  # lossy swaps sit on top of the patch's
        option.remove(model)
    amp.remove(model, getattr(state, "amp_forward", None))

    for parent, name, original in reversed(state.originals):
        current = parent._modules.get(name)
        if current is not None:
            original.train(current.training)
            _keep_children(original, current)
        parent._modules[name] = original
    for config, before in state.attention:
        attention_hf.set_config_state(config, None)
        attention_hf.release_config(config)
        _set_implementation(config, before)
    _remove_warn_off(model)
    for m in model.modules():
        m.__dict__.pop(attention_hf.ATTR, None)
    training_cache.remove(model)
    hf_rotary.uninstall(model)
    peft_lora.uninstall_upcasts(model)
    functional_dropout.uninstall(model)
    hf_head.uninstall(model)
    object.__delattr__(model, _ATTR)
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
    state = getattr(model, _ATTR, None)
    return None if state is None else state.summary.refresh()
