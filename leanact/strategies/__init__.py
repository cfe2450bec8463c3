"""Per-layer memory strategies beyond the exact lean ops: selective and full recompute, CPU offload.

``Plan(layers, choices).apply(model)`` / ``uniform(model, "full")`` / ``remove(model)``; the
layers are found by :func:`find_layers`. Strategy names: :data:`STRATEGIES`. The planner choosing
them under a memory budget is :func:`leanact.plan` (:mod:`leanact.planner`).
"""
from .layers import find_layers
from .offload import (DEFAULT_THRESHOLD, HostMemoryError, HostPool, KeptSplit, OffloadTransform, is_host_copy,
                      is_host_copy_key, split_kept)
from .layer_plan import LOSSY, STRATEGIES, Plan, applied_plan, describe, remove, uniform
from .recompute import PRESETS, policy

__all__ = ["LOSSY", "DEFAULT_THRESHOLD", "HostMemoryError", "HostPool", "KeptSplit", "OffloadTransform", "PRESETS",
           "Plan", "STRATEGIES", "applied_plan", "describe", "find_layers", "is_host_copy", "is_host_copy_key",
           "policy", "remove", "split_kept", "uniform"]
