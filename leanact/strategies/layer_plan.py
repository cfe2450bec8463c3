"""A per-layer choice of strategy, applied to a model in place."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from . import recompute
from .cache import strip_caches
from .layers import find_layers
from .offload import DEFAULT_THRESHOLD, HostPool, OffloadTransform
from .tiled import TiledMLP, find_mlp

__all__ = ["LOSSY", "STRATEGIES", "Plan", "uniform", "remove", "describe"]

STRATEGIES: dict[str, str] = {
    "lean": "no change: the layer keeps what its (patched or plain) ops keep",
    "selective:attention": "SAC: keep linear, norm and activation outputs; recompute the attention core",
    "selective:pointwise": "SAC: keep linear and fused-attention outputs; recompute pointwise ops and norms",
    "selective:norms": "SAC: keep linear, fused-attention and activation outputs; recompute norms",
    "offload": "copy what the layer keeps (>= threshold bytes) to host memory; copy back in backward",
    "offload+recompute": "keep the layer inputs only, offloaded to host memory; recompute the layer",
    "full": "keep the layer inputs only; recompute the whole layer in backward",
    "tiled_mlp": "run the MLP over chunks of the sequence; keep none of its inside, recompute it per chunk in backward",
    "full+tiled_mlp": "keep the layer inputs only; recompute the layer in backward, its MLP over chunks of the "
                      "sequence",
    "offload+recompute+tiled_mlp": "keep the layer inputs only, offloaded to host memory; recompute the layer in "
                                   "backward, its MLP over chunks of the sequence",
    "lossy:fp8": "LOSSY (opt-in): what the layer keeps stored as fp8 e4m3 + a scale per 128 elements",
    "lossy:int8": "LOSSY (opt-in): what the layer keeps stored as int8 (stochastic rounding) + scales",
}
#: Strategies that change gradients: the planner uses them only with ``allow_lossy=True``.
LOSSY = frozenset(n for n in STRATEGIES if n.startswith("lossy:"))
_ATTR = "_leanact_plan"


def describe(name: str) -> str:
    """What a layer keeps under strategy ``name`` (ValueError naming the choices for an unknown name)."""
    _check_name(name)
    return STRATEGIES[name]


def _check_name(name: str) -> None:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {list(STRATEGIES)}")


class _Wrapped:
    """Replaces ``layer.forward`` (an instance attribute; the class and state_dict are untouched)."""

    def __init__(self, layer: nn.Module, strategy: str, transform: OffloadTransform | None,
                 mlp_chunk: int | None = None, explain: Callable | None = None):
        self.layer, self.strategy, self.transform = layer, strategy, transform
        self.tiled = None
        if strategy.endswith("tiled_mlp"):
            if find_mlp(layer) is None:
                _warn_once(f"tiled:{type(layer).__name__}", f"leanact: tiled_mlp: {type(layer).__name__} has no `mlp` "
                           "child nor a feed_forward_chunk method; the layer runs as 'lean'")
            else:
                self.tiled = TiledMLP(layer, mlp_chunk)
        self.had_instance_forward = "forward" in layer.__dict__
        self.original: Callable = layer.__dict__.get("forward") or type(layer).forward.__get__(layer)
        self.policy = recompute.policy(strategy.split(":", 1)[1]) if strategy.startswith("selective:") else None
        self.compress = None
        if strategy in LOSSY:
            from leanact.lossy.compress import CompressTransform

            # fp32 too: softmax statistics are marked exact and per-row statistics (last dim 1) skipped.
            self.compress = CompressTransform(strategy.split(":", 1)[1],
                                              dtypes=(torch.bfloat16, torch.float16, torch.float32))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn, s = self.original, self.strategy
        if not torch.is_grad_enabled() or s in ("lean", "tiled_mlp"):  # (tiled_mlp: the MLP's own forward tiles)
            return fn(*args, **kwargs)
        if self.compress is not None:
            with self.compress:
                return fn(*args, **kwargs)
        if s != "offload":
            args, kwargs = _no_cache(self.layer, args, kwargs)
        if s in ("full", "full+tiled_mlp"):
            return recompute.run_full(fn, args, kwargs)
        if self.policy is not None:
            return recompute.run_selective(fn, args, kwargs, self.policy)
        tr = self.transform
        with tr:
            out = fn(*args, **kwargs) if s == "offload" else recompute.run_full(fn, args, kwargs)
        tr.end_forward()
        return out


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=4)


def _no_cache(layer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A recomputed layer must not write a KV cache (the replay would append a second time), as
    in Hugging Face's gradient checkpointing: ``use_cache=False``, no past key values (a
    transformers ``Cache`` passed positionally becomes None too)."""
    args, kwargs, changed = strip_caches(args, kwargs)
    if not changed:
        return args, kwargs
    name = type(layer).__name__
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"leanact: a recomputed {name} must not write a KV cache; it is called without one "
                      "(as Hugging Face's gradient checkpointing does). Pass use_cache=False to silence this.",
                      stacklevel=3)
    return args, kwargs


@dataclass
class _Applied:
    plan: "Plan"
    wrapped: list[_Wrapped] = field(default_factory=list)


class Plan:
    """Per layer (qualified module name) one strategy name of :data:`STRATEGIES`.

    ``apply(model)`` installs it in place (each layer's ``forward`` is wrapped; parameters, buffers
    and state_dict are unchanged; works on patched and unpatched models; applying again replaces
    the previous plan); ``remove(model)`` restores. ``costs`` (measured costs), ``budget`` and
    ``explain`` (the function rendering :meth:`explain`'s table from them), all set by the planner
    (:func:`leanact.plan`), feed :meth:`explain`. Offloaded layers share one host pool.
    """

    def __init__(self, layers: list[str], choices: list[str], *, costs: Any = None, budget: int | None = None,
                 offload_threshold: int = DEFAULT_THRESHOLD, pool: HostPool | None = None,
                 mlp_chunk: int | None = None, explain: Callable | None = None):
        layers, choices = list(layers), list(choices)
        if len(layers) != len(choices):
            raise ValueError(f"Plan needs one strategy per layer: got {len(layers)} layers and {len(choices)} choices")
        if len(set(layers)) != len(layers):
            raise ValueError("Plan: a layer is named twice")
        for c in choices:
            _check_name(c)
        self.layers, self.choices = layers, choices
        self.costs, self.budget = costs, budget
        self._explain = explain
        self.offload_threshold = offload_threshold
        self.mlp_chunk = mlp_chunk  # tokens per chunk of "tiled_mlp" (None: leanact.strategies.tiled.DEFAULT_MLP_CHUNK)
        self.pool = pool if pool is not None else HostPool()

    def __repr__(self) -> str:
        return f"Plan({dict(zip(self.layers, self.choices))})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plan) and (self.layers, self.choices) == (other.layers, other.choices)

    def apply(self, model: nn.Module) -> nn.Module:
        remove(model)
        mods = []
        for name in self.layers:
            try:
                mods.append(model.get_submodule(name))
            except AttributeError as e:
                raise ValueError(f"Plan names layer {name!r}, which {type(model).__name__} does not have") from e
        applied = _Applied(self)
        previous: OffloadTransform | None = None
        for mod, choice in zip(mods, self.choices):
            tr = None
            if choice.startswith("offload"):
                tr = OffloadTransform(self.pool, self.offload_threshold)
                tr.previous = previous  # backward runs layers in reverse: prefetch the one before
                previous = tr
            w = _Wrapped(mod, choice, tr, self.mlp_chunk)
            mod.forward = w
            applied.wrapped.append(w)
        object.__setattr__(model, _ATTR, applied)
        return model

    def remove(self, model: nn.Module) -> nn.Module:
        return remove(model)

    def explain(self, title: str | None = None):
        """A rich Table: per layer the strategy, estimated bytes kept and extra time (when the
        plan comes from :func:`leanact.plan`), with totals and the budget; ``print()`` shows it."""
        from leanact._format import text_table

        if self.costs is not None and self._explain is not None:  # the planner's table of its measured costs
            return self._explain(self, title)
        tab = text_table(title=title or "leanact plan")
        tab.add_column("layer")
        tab.add_column("strategy")
        tab.add_column("what it keeps")
        for name, c in zip(self.layers, self.choices):
            tab.add_row(name, c, STRATEGIES[c])
        return tab


def uniform(model: nn.Module, name: str, *, offload_threshold: int = DEFAULT_THRESHOLD,
            mlp_chunk: int | None = None) -> Plan:
    """Every layer of ``model`` (:func:`find_layers`) with strategy ``name``. The last layer is
    never offloaded (its backward starts right away): ``offload`` → ``lean``,
    ``offload+recompute`` → ``full`` and ``offload+recompute+tiled_mlp`` → ``full+tiled_mlp`` there."""
    _check_name(name)
    layers = [n for n, _ in find_layers(model)]
    choices = [name] * len(layers)
    last = {"offload": "lean", "offload+recompute": "full", "offload+recompute+tiled_mlp": "full+tiled_mlp"}
    if name in last:
        choices[-1] = last[name]
    return Plan(layers, choices, offload_threshold=offload_threshold, mlp_chunk=mlp_chunk)


def remove(model: nn.Module) -> nn.Module:
    """Remove the plan applied to ``model`` (if any): every layer's forward comes back."""
    applied: _Applied | None = getattr(model, _ATTR, None)
    if applied is None:
        return model
    for w in applied.wrapped:
        if w.tiled is not None:
            w.tiled.remove()
        if w.had_instance_forward:
            w.layer.forward = w.original
        else:
            w.layer.__dict__.pop("forward", None)
    object.__delattr__(model, _ATTR)
    return model


def applied_plan(model: nn.Module) -> Plan | None:
    """The plan currently applied to ``model``."""
    applied = getattr(model, _ATTR, None)
    return None if applied is None else applied.plan
