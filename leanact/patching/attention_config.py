"""The attention step of :func:`leanact.patch`: each Hugging Face config whose implementation is eager
or sdpa is set to ``"leanact"`` (:mod:`leanact.patching.attention_hf`, through ``AttentionInterface``);
Bloom's and Falcon's, written in the modeling code, are swapped before (:mod:`leanact.patching.hf_alibi`).
An implementation set after patching is respected: the summary reports it, the next forward warns once.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from . import attention_hf, hf_alibi
from .adapter import ATTR, ModelStep, PatchRun
from .patch_summary import off_reason

__all__ = ["STEP"]


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


def _alibi_row(config, mode: str) -> str:
    kind = "ALiBi" if getattr(config, "alibi", config.model_type == "bloom") else "rotary"
    return f"leanact ({mode}, {kind}; Hugging Face's attention code around leanact's core)"


def install(model: nn.Module, run: PatchRun) -> None:
    """Set every eligible config of ``model`` to leanact's attention (module doc); rows in the summary."""
    if not run.attention:
        return
    mode, summary, alibi = run.attention, run.summary, run.state.get("alibi")
    records = run.state.setdefault("attention", [])
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
    if summary.attention_configs:
        model.register_forward_pre_hook(_warn_off)


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


def _warn_off(model: nn.Module, args) -> None:
    """Forward pre-hook: warn once for each config set to another implementation after patching."""
    run = model.__dict__.get(ATTR)
    if run is None or torch.compiler.is_compiling():
        return
    off = run.summary.attention_off()
    warned = run.state.setdefault("warned_off", {})  # model path -> implementation warned about
    new = {p: i for p, i in off.items() if warned.get(p) != i}
    if new:  # one warning for the parts of a composite model
        warned.update(new)
        parts = ", ".join(p for p in new if p)
        where = type(model).__name__ + (f" ({parts})" if parts else "")
        warnings.warn(f"leanact: the attention of {where} was {off_reason(' / '.join(sorted(set(new.values()))))}",
                      stacklevel=5)
    for path in [p for p in warned if p not in off]:  # back on: warn again at the next change
        del warned[path]


def _remove_warn_off(model: nn.Module) -> None:
    for key, hook in list(model._forward_pre_hooks.items()):
        if hook is _warn_off:
            del model._forward_pre_hooks[key]


def uninstall(model: nn.Module, run: PatchRun) -> None:
    """Give every config patched by :func:`install` its implementation back."""
    for config, before in run.state.get("attention", ()):
        attention_hf.set_config_state(config, None)
        attention_hf.release_config(config)
        _set_implementation(config, before)
    _remove_warn_off(model)
    for m in model.modules():
        m.__dict__.pop(attention_hf.ATTR, None)


STEP = ModelStep("attention", install, uninstall)
