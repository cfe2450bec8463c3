"""Per-layer costs of each strategy, from a short measurement.

The model runs one forward on the sample inputs (under the meter) to record what it keeps outside
its layers and each layer's inputs. Then every layer runs alone on its recorded inputs once per
strategy: the meter gives the device bytes the layer keeps (its storages counted once, host
copies of offload apart), whether it keeps its input / output storage (shared with the
neighbouring layers), and forward+backward is timed. Layers with the same class, parameter
shapes and input shapes are measured once.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torch.utils.flop_counter import FlopCounterMode

from leanact.memory import SavedTensorMeter
from leanact.strategies.cache import caches_off, strip_caches
from leanact.strategies.offload import split_kept
from leanact.strategies.layer_plan import Plan, applied_plan, remove

FLOP_RATE = 1e11  # nominal FLOP/s of the "flops" time model
COPY_RATE = 1e10  # nominal bytes/s of offload copies in the "flops" time model

__all__ = ["FLOP_RATE", "COPY_RATE", "StrategyCost", "LayerCosts", "ModelCosts", "measure_costs", "call_model",
           "tensors_in"]


@dataclass
class StrategyCost:
    kept: int  # device bytes the layer keeps until its backward (its storages counted once)
    offloaded: int  # bytes kept in host buffers
    time: float  # seconds, forward + backward of the layer alone
    keeps_input: bool  # whether the kept storages include the layer's input storage
    keeps_output: bool  # ... its output storage
    extra_time: float = 0.0  # time - time of "lean" (>= 0)
    transient: int = 0  # device bytes of the layer while its backward runs (see planner doc)


@dataclass
class LayerCosts:
    name: str
    in_bytes: int
    out_bytes: int
    by_strategy: dict[str, StrategyCost] = field(default_factory=dict)


@dataclass
class ModelCosts:
    layers: list[LayerCosts]
    outside: int  # bytes the model keeps outside its layers (embeddings, head, loss)
    device: str

    def cost(self, i: int, s: str) -> StrategyCost:
        return self.layers[i].by_strategy[s]


def tensors_in(obj: Any) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_leaves(obj.to_tuple() if hasattr(obj, "to_tuple") else obj)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def call_model(model: nn.Module, sample_inputs: Any) -> Any:
    if isinstance(sample_inputs, dict):
        return model(**sample_inputs)
    if isinstance(sample_inputs, (tuple, list)):
        return model(*sample_inputs)
    return model(sample_inputs)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _fresh(obj: Any) -> Any:
    """Inputs for a layer run alone: tensors that needed grad become fresh leaves needing grad."""
    def f(x):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            return x.detach().clone().requires_grad_(True)
        return x
    return torch.utils._pytree.tree_map(f, obj)


def _first_float(obj: Any) -> torch.Tensor | None:
    for t in tensors_in(obj):
        if t.is_floating_point():
            return t
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure_one(model: nn.Module, name: str, layer: nn.Module, args: tuple, kwargs: dict, strategy: str,
                 reps: int, threshold: int, time_model: str) -> StrategyCost:
    plan = Plan([name], [strategy], offload_threshold=threshold)
    plan.apply(model)
    try:
        a, k = _fresh(args), _fresh(kwargs)
        x = _first_float((a, k))
        meter = SavedTensorMeter(model)
        with meter:
            out = layer(*a, **k)
        split = split_kept(meter)
        y = _first_float(out)
        keys = {r.storage_key for r in meter.counted()}
        keeps_in = x is not None and _storage_key(x) in keys
        keeps_out = y is not None and _storage_key(y) in keys
        out_bytes = y.untyped_storage().nbytes() if y is not None else 0
        device = y.device if y is not None else torch.device("cpu")
        meter.release()  # no backward runs through this forward: free its graph
        del out, y, meter
        if time_model == "flops":
            a, k = _fresh(args), _fresh(kwargs)
            with FlopCounterMode(display=False) as fc:
                o = _first_float(layer(*a, **k))
                if o is not None and o.requires_grad:
                    o.backward(torch.ones_like(o))
            seconds = fc.get_total_flops() / FLOP_RATE + 2 * split.offloaded / COPY_RATE
            return StrategyCost(split.device, split.offloaded, seconds, keeps_in, keeps_out), out_bytes
        times = []
        for rep in range(reps + 1):
            a, k = _fresh(args), _fresh(kwargs)
            _sync(device)
            t0 = time.perf_counter()
            o = _first_float(layer(*a, **k))
            if o is not None and o.requires_grad:
                o.backward(torch.ones_like(o))
            _sync(o.device if o is not None else torch.device("cpu"))
            if rep:  # the first run warms up
                times.append(time.perf_counter() - t0)
        return StrategyCost(split.device, split.offloaded, min(times), keeps_in, keeps_out), out_bytes
    finally:
        remove(model)


def _signature(layer: nn.Module, args: tuple, kwargs: dict) -> tuple:
    params = tuple((n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters())
    ins = tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensors_in((args, kwargs)))
    return (type(layer), params, ins)


def measure_costs(model: nn.Module, sample_inputs: Any, layers: list[tuple[str, nn.Module]], strategies: list[str],
                  *, reps: int = 3, threshold: int, time_model: str = "measure") -> ModelCosts:
    """Measure :class:`ModelCosts` of ``layers`` under each of ``strategies`` (module doc).

    ``time_model``: ``"measure"`` (forward+backward of the layer alone, best of ``reps`` after a
    warm-up run) or ``"flops"`` (deterministic: FLOPs of forward+backward counted by torch's
    FlopCounterMode, recomputation included, at :data:`FLOP_RATE`, plus offload copies, out and
    back, at :data:`COPY_RATE`; memory-bound recomputation counts as free).

    Hugging Face KV caches are off while measuring (:func:`~leanact.strategies.cache.caches_off`).
    A plan applied to ``model`` is set aside while measuring and applied again afterwards."""
    if time_model not in ("measure", "flops"):
        raise ValueError(f"time_model must be 'measure' or 'flops', got {time_model!r}")
    # the measurement runs backward passes and draws random numbers: leave no trace of them
    grads = {p: p.grad for p in model.parameters()}
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    previous = applied_plan(model)
    try:
        with caches_off(model, sample_inputs) as inputs:
            return _measure_costs(model, inputs, layers, strategies, reps, threshold, time_model)
    finally:
        remove(model)
        if previous is not None:
            previous.apply(model)
        for p, g in grads.items():
            p.grad = g
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _measure_costs(model, sample_inputs, layers, strategies, reps, threshold, time_model) -> ModelCosts:
    remove(model)
    captured: dict[str, tuple[tuple, dict]] = {}
    hooks = []
    for name, layer in layers:
        def pre(mod, args, kwargs, name=name):
            captured.setdefault(name, strip_caches(args, kwargs)[:2])
        hooks.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
    meter = SavedTensorMeter(model)
    try:
        with meter:
            out = call_model(model, sample_inputs)
    finally:
        for h in hooks:
            h.remove()
    missing = [n for n, _ in layers if n not in captured]
    if missing:
        raise ValueError(f"layers {missing} did not run on the sample inputs; the planner needs every layer to run")
    prefixes = tuple(f"{n}." for n, _ in layers)
    names = {n for n, _ in layers}
    outside: dict[int, int] = {}
    for r in meter.counted():
        if r.module not in names and not r.module.startswith(prefixes):
            outside[r.storage_key] = r.counted_bytes
    device = _first_float(out)
    device = str(device.device) if device is not None else "cpu"
    meter.release()  # no backward runs through this forward: free its graph
    del out, meter

    cache: dict[tuple, dict[str, StrategyCost]] = {}
    result = []
    for name, layer in layers:
        args, kwargs = captured[name]
        x = _first_float((args, kwargs))
        in_bytes = x.untyped_storage().nbytes() if x is not None else 0
        sig = _signature(layer, args, kwargs)
        if sig not in cache:
            measured = {s: _measure_one(model, name, layer, args, kwargs, s, reps, threshold, time_model)
                        for s in strategies}
            cache[sig] = ({s: c for s, (c, _) in measured.items()}, next(iter(measured.values()))[1])
        by, out_bytes = cache[sig]
        lc = LayerCosts(name, in_bytes, out_bytes, {s: StrategyCost(**vars(c)) for s, c in by.items()})
        result.append(lc)
    return ModelCosts(result, sum(outside.values()), device)
