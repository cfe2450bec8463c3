"""The planner, ``leanact.plan(model, sample_inputs, budget)``: per-layer strategies under a memory budget.

What the budget covers: activation memory on the compute device, i.e. the bytes autograd keeps
for backward during one training step (what the layers keep, plus what the model keeps outside
its layers: embeddings, head, loss), and the transient of one layer while its backward runs
(its recomputed saves, or its offloaded tensors copied back). Not covered: parameters,
gradients, optimizer state, the forward's temporaries, the allocator's fragmentation. See
:mod:`leanact.planner.dp` for the memory model and :mod:`leanact.planner.costs` for the measurement.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from leanact._format import parse_size
from leanact.ops.amp import autocast_arg
from leanact.strategies.layers import find_layers
from leanact.strategies.offload import DEFAULT_THRESHOLD
from leanact.strategies.layer_plan import LOSSY, STRATEGIES, Plan

from .costs import LayerCosts, ModelCosts, StrategyCost, measure_costs
from .dp import Solution, min_peak, predict, solve
from .explain import explain_table, fmt_bytes

__all__ = ["plan", "parse_budget", "InfeasibleBudget", "measure_costs", "predict", "ModelCosts", "LayerCosts",
           "StrategyCost", "Solution", "fmt_bytes", "register_maximizer"]

# plan(maximize=...) runs leanact.estimate, a higher layer: it registers itself here when imported.
_MAXIMIZER: list[Callable] = []


def register_maximizer(fn: Callable) -> None:
    """Set the function behind ``plan(maximize=...)`` (``leanact.estimate.maximize.maximize``)."""
    _MAXIMIZER[:] = [fn]


class InfeasibleBudget(ValueError):
    """No plan meets the budget; ``smallest`` is the smallest budget (bytes) that one meets."""

    def __init__(self, message: str, budget: int, smallest: int, plan: list[str]):
        super().__init__(message)
        self.budget, self.smallest, self.plan = budget, smallest, plan


def parse_budget(budget: str | int | float) -> int:
    """``"10GiB"``, ``"512 MiB"``, ``"1.5GB"``, ``"2e9"`` or a whole number of bytes → bytes (at
    least 1). Raises ValueError / TypeError naming the value and the fix for anything else
    (``inf``, ``nan``, ``"0.5"``, fractional bytes, ``"1.2.3"``)."""
    return parse_size(budget, "budget")


def _check_int(name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"plan({name}={value!r}): {name} must be an integer >= {least}")
    if value < least:
        raise ValueError(f"plan({name}={value!r}): {name} must be an integer >= {least}")


def _named_layers(model: nn.Module, layers: Any) -> list[tuple[str, nn.Module]]:
    """``[(name, module)]`` for ``plan(layers=...)``, checked before any work."""
    if not isinstance(layers, (list, tuple)) or not layers or not all(isinstance(n, str) for n in layers):
        raise TypeError(f"plan(layers={layers!r}): give a non-empty list of qualified module names, e.g. "
                        "[n for n, _ in leanact.strategies.find_layers(model)]")
    if len(set(layers)) != len(layers):
        raise ValueError(f"plan(layers={layers!r}) names a layer twice: give each layer once")
    found = []
    for n in layers:
        try:
            found.append((n, model.get_submodule(n)))
        except AttributeError:
            raise ValueError(f"plan(layers=[..., {n!r}, ...]): {type(model).__name__} has no submodule {n!r}; use "
                             "names from model.named_modules(), e.g. leanact.strategies.find_layers(model)") from None
    return found


def _default_strategies(device: str, allow_lossy: bool) -> list[str]:
    # On the CPU, "host" memory is the device's: offloading would only add copies. The "+tiled_mlp"
    # variants of the recompute strategies lower the whole step's peak at long sequences (what
    # maximize= searches), not the activation bound this planner uses: named explicitly only.
    names = [s for s in STRATEGIES if (allow_lossy or s not in LOSSY) and not s.endswith("+tiled_mlp")]
    return names if device.startswith("cuda") else [s for s in names if not s.startswith("offload")]


def plan(model: nn.Module, sample_inputs: Any, budget: str | int, *, strategies: Iterable[str] | None = None,
         loss_fn: Callable | None = None, allow_lossy: bool = False, layers: list[str] | None = None,
         costs: ModelCosts | None = None, reps: int = 3, time_model: str = "measure",
         offload_threshold: int = DEFAULT_THRESHOLD, autocast: Any = None, maximize: str | None = None,
         device: Any = "cuda", dtype: Any = None, host_budget: str | int | None = None,
         context_parallel: int | None = None) -> Plan:
    """Choose a strategy per layer of ``model`` minimising the estimated step time with the
    predicted peak activation memory ≤ ``budget`` (module doc: what it covers).

    ``sample_inputs``: one batch as the model takes it (a dict of keyword arguments, a tuple of
    positional ones, or one tensor), at the batch size and sequence length to plan for.
    ``strategies``: names from :data:`leanact.strategies.STRATEGIES` (default: all but the
    ``+tiled_mlp`` variants of the recompute strategies; offload ones only on CUDA); ``"lean"`` is
    always measured as the baseline. ``layers``: qualified names (default
    :func:`~leanact.strategies.find_layers`). ``costs``: reuse a previous measurement
    (``plan_obj.costs``). ``time_model``: "measure" (time each layer, best of ``reps``) or "flops"
    (deterministic FLOP count; see :func:`~leanact.planner.costs.measure_costs`). ``loss_fn`` is
    accepted for the estimator's signature; the measurement runs each layer's forward and backward
    alone, so no loss is needed.
    ``allow_lossy``: also consider the strategies of :data:`leanact.strategies.LOSSY` (saved
    tensors stored in fp8/int8: they change gradients); without it they are never chosen, and
    naming one in ``strategies`` raises.
    ``autocast``: "bf16" / "fp16" (torch.bfloat16 / torch.float16) measures the layers under
    ``torch.autocast`` of that dtype (fp32 weights, mixed precision: autocast's 16-bit weight copies
    are counted where the layers keep them); None (default) uses the autocast active at the call, if
    any; False measures without autocast.

    Runs one forward of the model and a few forward/backward passes of each distinct layer, with
    Hugging Face KV caches off (``use_cache=False`` for the measurement only). A plan already
    applied to ``model`` stays applied: it is set aside while measuring and re-applied. Bad
    arguments raise ValueError / TypeError before any work. Raises :class:`InfeasibleBudget` with
    the smallest feasible budget when none fits. Returns a :class:`~leanact.strategies.Plan` (not
    applied: call ``.apply(model)``, which replaces the plan applied before).

    ``maximize="seq"`` (or ``"batch"``): instead, the longest sequence (largest batch) whose
    *whole* training step -- parameters, gradients, AdamW state, activations, temporaries -- fits
    ``budget`` on ``device`` (default "cuda"; ``dtype`` casts the weights), predicted by
    :func:`leanact.estimate` on fake tensors (nothing runs for real; any model size). Every layer
    gets the same strategy, the one that reaches the largest size (``strategies``: candidates,
    default :data:`leanact.estimate.maximize.CANDIDATES`); the plan's ``maximized``
    (:class:`~leanact.estimate.maximize.Maximized`) holds the size, the estimate there and what
    each candidate reached. On CUDA the candidates include offloading every layer's input to
    pinned host memory (``maximized.host`` says how much); ``host_budget`` (a size) bounds it.
    ``context_parallel=P``: the sequence shared by P ranks (:func:`leanact.parallel.context_parallel`;
    budgets per rank, the model patched).
    """
    if maximize is not None:
        return _maximize(model, sample_inputs, budget, maximize, strategies, loss_fn, device, dtype, host_budget,
                         context_parallel)
    if context_parallel is not None:
        raise ValueError("plan(context_parallel=...) goes with maximize='seq' or 'batch'")
    del loss_fn
    if not isinstance(model, nn.Module):
        raise TypeError(f"plan(model=...) must be a torch.nn.Module, got {type(model).__name__}: pass the model")
    budget_bytes = parse_budget(budget)
    amp = autocast_arg(autocast, "plan")
    _check_int("reps", reps, 1)
    _check_int("offload_threshold", offload_threshold, 0)
    if time_model not in ("measure", "flops"):
        raise ValueError(f"plan(time_model={time_model!r}): use 'measure' (time each layer) or 'flops' (count FLOPs)")
    if strategies is not None:
        strategies = list(strategies)
        unknown = [s for s in strategies if s not in STRATEGIES]
        if unknown:
            raise ValueError(f"plan(strategies=...): unknown strategies {unknown}; choose among {list(STRATEGIES)}")
        lossy = [s for s in strategies if s in LOSSY]
        if lossy and not allow_lossy:
            raise ValueError(f"strategies {lossy} are lossy (they change gradients): pass allow_lossy=True to use them")
    found = find_layers(model) if layers is None else _named_layers(model, layers)
    names = [n for n, _ in found]
    if costs is None:
        device = str(next(model.parameters()).device) if any(True for _ in model.parameters()) else "cpu"
        chosen = strategies if strategies is not None else _default_strategies(device, allow_lossy)
        measured = list(dict.fromkeys(["lean", *chosen]))
        with torch.autocast(torch.device(device).type, dtype=amp, enabled=amp is not None):
            costs = measure_costs(model, sample_inputs, found, measured, reps=reps, threshold=offload_threshold,
                                  time_model=time_model)
    else:
        chosen = strategies if strategies is not None else [
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
    return Plan(names, sol.choices, costs=costs, budget=budget_bytes, offload_threshold=offload_threshold,
                explain=explain_table)


def _maximize(model, sample_inputs, budget, what, strategies, loss_fn, device, dtype, host_budget=None,
              context_parallel=None) -> Plan:
    if what not in ("seq", "batch"):
        raise ValueError(f"plan(maximize={what!r}): use 'seq' (the longest sequence) or 'batch' (the largest batch)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"plan(model=...) must be a torch.nn.Module, got {type(model).__name__}: pass the model")
    budget_bytes = parse_budget(budget)
    if not _MAXIMIZER:  # pragma: no cover - leanact/__init__ imports leanact.estimate
        raise RuntimeError("plan(maximize=...) needs leanact.estimate: `import leanact.estimate` first")
    found = _MAXIMIZER[0](model, sample_inputs, budget_bytes, what, strategies=None if strategies is None else
                          list(strategies), device=device, dtype=dtype, loss_fn=loss_fn,
                          host_budget=None if host_budget is None else parse_budget(host_budget),
                          context_parallel=context_parallel)
    found.plan.maximized = found
    return found.plan

