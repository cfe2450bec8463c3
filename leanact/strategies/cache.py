"""Hugging Face KV caches, which a measured, estimated or recomputed training step must not use.

Causal LMs create a ``DynamicCache`` on every forward by default (``config.use_cache=True``),
training included. A layer re-run on captured arguments would append to that cache again (the
planner's measurement: a second backward through a freed graph, or attention over stale keys),
and the cache's copies of K and V are not what a training step needs to keep.

The argument's name changed across transformers releases (``layer_past``, ``past_key_value``,
``past_key_values``; from 5.24 on ``cache``, with ``past_key_values`` a deprecated alias), so any
keyword argument that holds a transformers ``Cache`` is dropped too, whatever its name.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn

__all__ = ["CACHE_KWARGS", "is_cache", "caches_off", "strip_caches"]

CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")


def is_cache(x: Any) -> bool:
    """Whether ``x`` is a transformers ``Cache``."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(x).__mro__)


def _configs(model: nn.Module) -> Iterator[Any]:
    seen: set[int] = set()
    stack = [getattr(m, "config", None) for m in model.modules()]
    while stack:
        cfg = stack.pop()
        if cfg is None or id(cfg) in seen or not hasattr(cfg, "to_dict"):
            continue
        seen.add(id(cfg))
        yield cfg
        stack.extend(getattr(cfg, key, None) for key in getattr(cfg, "sub_configs", None) or ())


@contextlib.contextmanager
def caches_off(model: nn.Module, sample_inputs: Any = None) -> Iterator[Any]:
    """While active, every Hugging Face config in ``model`` (sub-configs included) has
    ``use_cache=False``; restored on exit. Yields ``sample_inputs``, with ``use_cache=False`` when
    it is a dict that sets ``use_cache``."""
    saved = [(cfg, cfg.use_cache) for cfg in _configs(model) if getattr(cfg, "use_cache", None)]
    if isinstance(sample_inputs, dict) and sample_inputs.get("use_cache"):
        sample_inputs = {**sample_inputs, "use_cache": False}
    try:
        for cfg, _ in saved:
            cfg.use_cache = False
        yield sample_inputs
    finally:
        for cfg, value in saved:
            cfg.use_cache = value


def strip_caches(args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
    """``(args, kwargs, changed)`` for a layer call without a KV cache: ``use_cache=False``, the
    cache keyword arguments of :data:`CACHE_KWARGS` and any keyword argument holding a ``Cache``
    (transformers >= 5.24 passes it as ``cache=``) None, a ``Cache`` passed positionally None."""
    keys = [k for k in ("use_cache", *CACHE_KWARGS) if kwargs.get(k) not in (None, False)]
    keys += [k for k, v in kwargs.items() if k not in keys and is_cache(v)]
    positions = [i for i, a in enumerate(args) if is_cache(a)]
    if not keys and not positions:
        return args, kwargs, False
    kwargs = {**kwargs, **{k: False if k == "use_cache" else None for k in keys}}
    return tuple(None if i in positions else a for i, a in enumerate(args)), kwargs, True
