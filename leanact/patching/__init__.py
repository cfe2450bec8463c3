"""``leanact.patch(model)``: rewire an instantiated model in place to use leanact's lean ops.

* Generic replacements on any ``nn.Module``: ``nn.GELU``, ``nn.LayerNorm``, ``nn.RMSNorm``,
  ``nn.Dropout`` and Hugging Face's GELU activation classes become leanact's drop-ins, built
  around the same Parameter objects (state_dict keys and values unchanged). Hugging Face's
  standard RMSNorm classes (LLaMA family) become a subclass keeping only y and rstd
  (:mod:`leanact.patching.hf_rms_norm`); their SwiGLU MLPs (``LlamaMLP``, ``Qwen2MLP``, ...) a
  subclass keeping only the gate and up projections' outputs (:mod:`leanact.patching.hf_swiglu`).
* Hugging Face models (transformers >= 5) whose attention goes through ``AttentionInterface``:
  the config's attention implementation is set to ``"leanact"`` (see
  :mod:`leanact.patching.attention_hf`).

``leanact.unpatch(model)`` puts the original module objects and attention implementation back.
The summary of what was replaced and what was left (and why) is returned by :func:`summary` and
printed as a table with ``verbose=True``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .. import nn as lnn

from .generic import replacement_for

__all__ = ["patch", "unpatch", "summary", "PatchSummary"]

_ATTR = "_leanact_patch"
_ATTENTION_MODES = ("recompute", "tempo")


@dataclass
class PatchSummary:
    """What :func:`patch` did. ``replaced``/``left``: (qualified name, class, new class / reason)."""

    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    left: list[tuple[str, str, str]] = field(default_factory=list)
    attention: list[tuple[str, str, str]] = field(default_factory=list)  # (model path, before, after/reason)

    def table(self):
        from rich.table import Table

        t = Table(title="leanact.patch")
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
        for path, before, after in self.attention:
            t.add_row(f"attention ({path or 'model'})", before, after)
        return t


@dataclass
class _PatchState:
    summary: PatchSummary
    originals: list[tuple[nn.Module, str, nn.Module]]  # (parent, attribute name, original child)
    attention: list[tuple[object, object, str]]  # (HF model, its config, original implementation)


def _qualname(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _patch_modules(model: nn.Module, summary: PatchSummary, originals: list) -> None:
    def visit(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            qual = _qualname(prefix, name)
            new, reason = replacement_for(child)
            if new is not None:
                parent._modules[name] = new
                originals.append((parent, name, child))
                if type(new).__module__.startswith("leanact.patching.hf_"):
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


def _patch_attention(model: nn.Module, mode: str, summary: PatchSummary, records: list) -> None:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return
    from . import attention_hf

    seen: set[int] = set()
    for path, m in model.named_modules():
        if not isinstance(m, PreTrainedModel) or id(m.config) in seen:
            continue
        seen.add(id(m.config))
        before = m.config._attn_implementation
        if before not in ("eager", "sdpa", None):
            summary.attention.append((path, str(before), f"left: leanact replaces only eager/sdpa, not {before}"))
            continue
        attention_hf.register()
        before = before or "eager"
        m.set_attn_implementation(attention_hf.NAME)
        if m.config._attn_implementation != attention_hf.NAME:
            summary.attention.append((path, before, "left: the model does not use AttentionInterface"))
            continue
        attention_hf.set_config_state(m.config, attention_hf._ConfigState(before, mode))
        records.append((m, m.config, before))
        summary.attention.append((path, before, f"leanact ({mode})"))


def patch(model: nn.Module, *, attention: str | bool = "recompute", verbose: bool = False,
          lossy: str | dict | None = None) -> nn.Module:
    """Rewire ``model`` in place to use leanact's lean ops; returns ``model``.

    ``attention``: "recompute" (default; keeps q, k, v, output and one statistic per row),
    "tempo" (keeps the softmax output instead of recomputing it) or False (leave attention as is).
    ``lossy``: None (default: exact) or approximate options on top, which change gradients: a dict
    such as ``{"fewbit": 2, "randomized_linear": 0.5, "compress": "fp8"}`` or a string such as
    ``"fp8"`` or ``"fewbit=2,compress=fp8"`` (see :mod:`leanact.lossy`).
    Patching an already patched model first unpatches it. Prints nothing unless ``verbose``.
    """
    if attention not in (False, *_ATTENTION_MODES):
        raise ValueError(f"attention must be one of {_ATTENTION_MODES} or False, got {attention!r}")
    if getattr(model, _ATTR, None) is not None:
        unpatch(model)
    summary = PatchSummary()
    originals: list = []
    records: list = []
    _patch_modules(model, summary, originals)
    if attention:
        _patch_attention(model, attention, summary, records)
    object.__setattr__(model, _ATTR, _PatchState(summary, originals, records))
    if lossy:
        from .. import lossy as _lossy

        try:
            _lossy.apply(model, lossy)
        except Exception:
            unpatch(model)  # a bad lossy spec leaves the model as it was
            raise
    if verbose:
        from rich.console import Console

        Console().print(summary.table())
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch`: the original module objects and attention implementations come back."""
    state: _PatchState | None = getattr(model, _ATTR, None)
    if state is None:
        return model
    from .. import lossy as _lossy
    from . import attention_hf

    _lossy.remove(model)  # lossy swaps sit on top of the patch's

    for parent, name, original in reversed(state.originals):
        current = parent._modules.get(name)
        if current is not None:
            original.train(current.training)
        parent._modules[name] = original
    for hf_model, config, before in state.attention:
        attention_hf.set_config_state(config, None)
        hf_model.set_attn_implementation(before)
    object.__delattr__(model, _ATTR)
    return model


def summary(model: nn.Module) -> PatchSummary | None:
    """The :class:`PatchSummary` of a patched model (None if it is not patched)."""
    state = getattr(model, _ATTR, None)
    return None if state is None else state.summary
