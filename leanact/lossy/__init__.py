"""Opt-in approximate strategies: they change gradients, so nothing here is ever on by default.

``leanact.lossy.apply(model, lossy=...)`` rewires a model in place; ``remove(model)`` undoes it.
Options (a dict, or a string such as ``"fp8"`` or ``"fewbit=2,randomized_linear=0.5,compress=fp8"``):

* ``"fewbit": bits`` (1..4, or a dict ``{"bits": 2}``): GELU (erf, tanh) and SiLU modules keep a
  ``bits``-bit index per element instead of their input / output. *Approximates* the
  activation's derivative by a piecewise-constant function with 2**bits levels (optimal in L2
  under a standard normal input weight; :mod:`leanact.ops.lossy.fewbit`). Output exact.
* ``"randomized_linear": ρ`` (0 < ρ <= 1, or a dict ``{"ratio": ρ, "block": 2048, "modules":
  predicate(name, module)}``): ``nn.Linear`` modules inside the model's layer stacks (modules
  under an ``nn.ModuleList``, weights not tied to an embedding; or those ``modules`` selects) keep
  ``R X`` (ρ·N of the N token rows) and a seed instead of their input. *Approximates* the weight
  gradient by an unbiased random estimate; input and bias gradients stay exact
  (:mod:`leanact.ops.lossy.randomized_linear`).
* ``"compress": "fp8" | "int8"`` (or a dict of :class:`CompressTransform` arguments): every
  eligible saved 16-bit tensor is kept in 8 bits with per-block scales (fp8 e4m3: round to
  nearest, relative error <= 2**-4; int8: stochastic rounding, unbiased). *Approximates* every
  gradient that reads a saved activation (:mod:`leanact.lossy.compress`). Active only inside the
  model's forward: ``model.forward`` is a :class:`CompressedForward` while the option is applied
  (same signature), which enters the transform with ``with``, so no exception can leave it on.

Where each pays off (BERT-Large bf16 layer, ``benchmarks/approx.py``): ``leanact.patch`` keeps
20.6 B/sbh, + ``compress="fp8"`` 10.9. A few-bit activation pays only when the next layer does not
keep the activation's output anyway (leanact's exact GELU keeps 1 bit plus that shared output), i.e.
with a randomized next Linear; a randomized Linear pays only where nobody else keeps its input (in
a patched BERT the norms keep the Q/K/V and FFN-in inputs and attention keeps the out-projection
input, so randomizing those adds R·X: 29.6 B/sbh with every Linear randomized).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from .compress import CompressTransform, keep_exact
from ..ops.lossy.randomized_linear import DEFAULT_BLOCK
from ..patching import register_option
from ..recompute.context_forward import ContextForward, unwrap_forward, wrap_forward
from .modules import FewBitActivation, RandomizedLinear

__all__ = ["apply", "remove", "parse", "state", "LossyState", "CompressTransform", "CompressedForward",
           "FewBitActivation", "RandomizedLinear", "keep_exact", "OPTIONS"]

OPTIONS = ("fewbit", "randomized_linear", "compress")
_ATTR = "_leanact_lossy"


def parse(lossy: Any) -> dict[str, dict]:
    """Normalise a ``lossy`` spec to ``{option: {argument: value}}`` (raises on anything unknown)."""
    if lossy in (None, False, "", {}):
        return {}
    if isinstance(lossy, str):
        spec: dict[str, Any] = {}
        for part in (p.strip() for p in lossy.split(",") if p.strip()):
            key, _, value = part.partition("=")
            key = key.strip()
            if key in ("fp8", "int8") and not value:
                key, value = "compress", key
            elif key not in OPTIONS:
                raise ValueError(f"unknown lossy option {key!r}; use {OPTIONS} (e.g. 'fewbit=2,compress=fp8') "
                                 "or 'fp8'/'int8'")
            if key in spec:
                raise ValueError(f"lossy={lossy!r} sets {key} twice ({spec[key]!r} and {value.strip() or True!r}): "
                                 f"keep one, e.g. lossy={part!r}")
            spec[key] = value.strip() if value else True
        lossy = spec
    if not isinstance(lossy, dict):
        raise TypeError(f"lossy must be a dict or a string, got {type(lossy).__name__}")
    out: dict[str, dict] = {}
    for key, value in lossy.items():
        if key not in OPTIONS:
            raise ValueError(f"unknown lossy option {key!r}; expected one of {OPTIONS}")
        if value in (None, False):
            continue
        if key == "fewbit":
            args = value if isinstance(value, dict) else {"bits": 2 if value is True else int(value)}
        elif key == "randomized_linear":
            args = value if isinstance(value, dict) else {"ratio": 0.5 if value is True else float(value)}
        else:
            args = value if isinstance(value, dict) else {"format": "fp8" if value is True else str(value)}
        out[key] = dict(args)
    return out


@dataclass
class LossyState:
    """What :func:`apply` did: the options, the swaps ``(parent, name, original)`` and hooks."""

    options: dict[str, dict]
    swaps: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)
    replaced: list[tuple[str, str, str]] = field(default_factory=list)  # (name, was, now)
    transform: CompressTransform | None = None
    handles: list = field(default_factory=list)
    forward: "CompressedForward | None" = None  # set as model.forward while compress is applied


def _activation_function(m: nn.Module) -> str | None:
    """'gelu' / 'gelu_tanh' / 'silu' for the activation modules few-bit backward covers."""
    from .. import nn as lnn
    from ..patching.modules import hook_kinds

    if hook_kinds(m):  # a replacement would not fire them
        return None
    t = type(m)
    if t is nn.GELU or isinstance(m, lnn.GELU):
        return "gelu_tanh" if m.approximate == "tanh" else "gelu"
    if t is nn.SiLU:
        return "silu"
    if t.__module__ == "transformers.activations":
        if t.__name__ == "SiLUActivation":
            return "silu"
        from ..patching.generic import hf_activation

        new, _ = hf_activation(m)
        if new is not None:
            return "gelu_tanh" if new.approximate == "tanh" else "gelu"
    return None


def _in_layer_stack(model: nn.Module) -> Callable[[str, nn.Module], bool]:
    """Default Linear selection: under an nn.ModuleList (or everywhere if there is none), weight
    not tied to an embedding."""
    stacked: set[int] = set()
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            stacked.update(id(x) for x in m.modules())
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return lambda name, m: (not stacked or id(m) in stacked) and id(m.weight) not in tied


def _swap_modules(model: nn.Module, state: LossyState) -> None:
    from ..patching.hf_swiglu import LeanHFSwiGLU
    from ..patching.modules import hook_kinds

    fewbit, rl = state.options.get("fewbit"), state.options.get("randomized_linear")
    select = None
    if rl is not None:
        select = rl.get("modules") or _in_layer_stack(model)

    def visit(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            qual = f"{prefix}.{name}" if prefix else name
            new = None
            if fewbit is not None and name == "act_fn" and isinstance(parent, LeanHFSwiGLU):
                pass  # the lean SwiGLU keeps g and u only; a few-bit SiLU would add silu(g) and the product
            elif fewbit is not None and (fn := _activation_function(child)) is not None:
                new = FewBitActivation(fn, int(fewbit.get("bits", 2)))
                new.train(child.training)
            elif rl is not None and type(child) is nn.Linear and select(qual, child) and not hook_kinds(child):
                new = RandomizedLinear.from_linear(child, float(rl.get("ratio", 0.5)),
                                                   int(rl.get("block", DEFAULT_BLOCK)))
            if new is not None:
                parent._modules[name] = new
                state.swaps.append((parent, name, child))
                state.replaced.append((qual, type(child).__name__, repr(new)))
            else:
                visit(child, qual)

    visit(model, "")


# ``model.forward`` while the ``compress`` option is applied: the model's own forward called inside
# ``with transform`` (one frame), so no exception -- KeyboardInterrupt included -- can leave
# compression on for the thread.
CompressedForward = ContextForward


def _compress_forward(model: nn.Module, state: LossyState) -> None:
    args = dict(state.options["compress"])
    tr = state.transform = CompressTransform(args.pop("format", "fp8"), **args)
    # Around the whole forward: outside every transform entered inside it (recipes of the lean
    # modules; a recipe scope on the model itself is outside it, but CompressTransform leaves
    # tensors an active RecipeTransform keeps as recipes to it), so tensors kept as recipes are
    # not compressed, the rest are.
    state.forward = wrap_forward(model, tr)


def _restore_forward(model: nn.Module, state: LossyState) -> None:
    unwrap_forward(model, state.forward)


def apply(model: nn.Module, lossy: Any) -> nn.Module:
    """Apply the lossy options ``lossy`` (module doc) to ``model`` in place; returns ``model``.

    Applying again first removes what was applied. Modules are replaced around the same
    Parameter objects (state dict unchanged); ``remove(model)`` puts the originals back.
    """
    options = parse(lossy)
    remove(model)
    if not options:
        return model
    state = LossyState(options)
    _swap_modules(model, state)
    if "compress" in options:
        _compress_forward(model, state)
    object.__setattr__(model, _ATTR, state)
    return model


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply` (no-op on a model without lossy options)."""
    state: LossyState | None = getattr(model, _ATTR, None)
    if state is None:
        return model
    for parent, name, original in reversed(state.swaps):
        current = parent._modules.get(name)
        if current is not None:
            original.train(current.training)
        parent._modules[name] = original
    for h in state.handles:
        h.remove()
    _restore_forward(model, state)
    object.__delattr__(model, _ATTR)
    return model


def state(model: nn.Module) -> LossyState | None:
    """The :class:`LossyState` of a model with lossy options applied (None otherwise)."""
    return getattr(model, _ATTR, None)


register_option("lossy", apply, remove)  # leanact.patch(model, lossy=...) and unpatch go through these
