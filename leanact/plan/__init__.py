"""``leanact.plan(model, sample_inputs, budget)``: per-layer strategies under a memory budget.

What the budget covers: activation memory on the compute device, i.e. the bytes autograd keeps
for backward during one training step (what the layers keep, plus what the model keeps outside
its layers: embeddings, head, loss), and the transient of one layer while its backward runs
(its recomputed saves, or its offloaded tensors copied back). Not covered: parameters,
gradients, optimizer state, the forward's temporaries, the allocator's fragmentation. See
:mod:`leanact.plan.dp` for the memory model and :mod:`leanact.plan.costs` for the measurement.

This module is callable: ``leanact.plan(...)`` is ``leanact.plan.plan(...)``.
"""
from __future__ import annotations

import re
import sys
import types
from typing import Any, Callable, Iterable

from torch import nn

from leanact.strategies.layers import find_layers
from leanact.strategies.offload import DEFAULT_THRESHOLD
from leanact.strategies.plan import LOSSY, STRATEGIES, Plan

from .costs import LayerCosts, ModelCosts, StrategyCost, measure_costs
from .dp import Solution, min_peak, predict, solve
from .explain import fmt_bytes

__all__ = ["plan", "parse_budget", "InfeasibleBudget", "measure_costs", "predict", "ModelCosts", "LayerCosts",
           "StrategyCost", "Solution", "fmt_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


class InfeasibleBudget(ValueError):
    """No plan meets the budget; ``smallest`` is the smallest budget (bytes) that one meets."""

    def __init__(self, message: str, budget: int, smallest: int, plan: list[str]):
        super().__init__(message)
        self.budget, self.smallest, self.plan = budget, smallest, plan


def parse_budget(budget: str | int | float) -> int:
    """``"10GiB"``, ``"512 MiB"``, ``"1.5GB"``, ``"2e9"`` or a number of bytes → bytes."""
    if isinstance(budget, bool):
        raise TypeError("budget must be bytes (int) or a string such as '10GiB'")
    if isinstance(budget, (int, float)):
        value = budget
    elif isinstance(budget, str):
        m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", budget)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read budget {budget!r}: use bytes or a number with a unit such as '10GiB', "
                             f"'512MiB' or '2GB' (units: {', '.join(u for u in _UNITS if u)})")
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    else:
        raise TypeError(f"budget must be bytes (int) or a string such as '10GiB', got {type(budget).__name__}")
    if value <= 0:
        raise ValueError(f"budget must be positive, got {budget!r}")
    return int(value)


def _default_strategies(device: str, allow_lossy: bool) -> list[str]:
    # On the CPU, "host" memory is the device's: offloading would only add copies.
    names = [s for s in STRATEGIES if allow_lossy or s not in LOSSY]
    return names if device.startswith("cuda") else [s for s in names if not s.startswith("offload")]


def plan(model: nn.Module, sample_inputs: Any, budget: str | int, *, strategies: Iterable[str] | None = None,
         loss_fn: Callable | None = None, allow_lossy: bool = False, layers: list[str] | None = None,
         costs: ModelCosts | None = None, reps: int = 3, time_model: str = "measure",
         offload_threshold: int = DEFAULT_THRESHOLD) -> Plan:
    """Choose a strategy per layer of ``model`` minimising the estimated step time with the
    predicted peak activation memory ≤ ``budget`` (module doc: what it covers).

    ``sample_inputs``: one batch as the model takes it (a dict of keyword arguments, a tuple of
    positional ones, or one tensor), at the batch size and sequence length to plan for.
    ``strategies``: names from :data:`leanact.strategies.STRATEGIES` (default: all; offload ones
    only on CUDA); ``"lean"`` is always measured as the baseline. ``layers``: qualified names
    (default :func:`~leanact.strategies.find_layers`). ``costs``: reuse a previous
    measurement (``plan_obj.costs``). ``time_model``: "measure" (time each layer, best of ``reps``)
    or "flops" (deterministic FLOP count; see :func:`~leanact.plan.costs.measure_costs`). ``loss_fn`` is accepted for the estimator's signature; the
    measurement runs each layer's forward and backward alone, so no loss is needed.
    ``allow_lossy``: also consider the strategies of :data:`leanact.strategies.LOSSY` (saved
    tensors stored in fp8/int8: they change gradients); without it they are never chosen, and
    naming one in ``strategies`` raises.

    Runs one forward of the model and a few forward/backward passes of each distinct layer.
    Any plan already applied to ``model`` is removed. Raises :class:`InfeasibleBudget` with the
    smallest feasible budget when none fits. Returns a :class:`~leanact.strategies.Plan` (not
    applied: call ``.apply(model)``).
    """
    del loss_fn
    if strategies is not None and not allow_lossy:
        strategies = list(strategies)
        lossy = [s for s in strategies if s in LOSSY]
        if lossy:
            raise ValueError(f"strategies {lossy} are lossy (they change gradients): pass allow_lossy=True to use them")
    budget_bytes = parse_budget(budget)
    found = find_layers(model) if layers is None else [(n, model.get_submodule(n)) for n in layers]
    names = [n for n, _ in found]
    if costs is None:
        device = str(next(model.parameters()).device) if any(True for _ in model.parameters()) else "cpu"
        chosen = list(strategies) if strategies is not None else _default_strategies(device, allow_lossy)
        for s in chosen:
            if s not in STRATEGIES:
                raise ValueError(f"unknown strategy {s!r}; choose among {list(STRATEGIES)}")
        measured = list(dict.fromkeys(["lean", *chosen]))
        costs = measure_costs(model, sample_inputs, found, measured, reps=reps, threshold=offload_threshold,
                              time_model=time_model)
    else:
        chosen = list(strategies) if strategies is not None else [
            s for s in costs.layers[0].by_strategy if allow_lossy or s not in LOSSY]
    for layer in costs.layers:
        base = layer.by_strategy["lean"].time
        for c in layer.by_strategy.values():
            c.extra_time = max(0.0, c.time - base)
    allowed = []
    for i in range(len(names)):
        ss = [s for s in chosen if s in costs.layers[i].by_strategy]
        if i == len(names) - 1:  # the last layer's backward starts at once: never offloaded
            ss = [s for s in ss if not s.startswith("offload")]
        allowed.append(ss or ["lean"])
    sol = solve(costs, allowed, budget_bytes)
    if sol is None:
        smallest, best = min_peak(costs, allowed)
        raise InfeasibleBudget(
            f"no plan keeps the activation memory within {fmt_bytes(budget_bytes)} ({budget_bytes:,} bytes): the "
            f"smallest feasible budget is {fmt_bytes(smallest)} ({smallest:,} bytes), with layers {best}. Fix: raise "
            "the budget, lower the batch size or sequence length, or patch the model first (leanact.patch).",
            budget_bytes, smallest, best)
    return Plan(names, sol.choices, costs=costs, budget=budget_bytes, offload_threshold=offload_threshold)


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
