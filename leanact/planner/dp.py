"""The dynamic program over the chain of layers.

Memory model (activations only, bytes on the compute device). Per layer ``i`` and strategy ``s``
(measured, :mod:`.costs`): ``k[i,s]`` bytes kept from the layer's forward until its backward,
and ``T[i,s]`` bytes alive while its backward runs:

* lean: ``k[i,lean]``; selective: ``k[i,s] + k[i,lean]`` (the cache plus the recomputed saves);
  full: ``k[i,lean]`` (+ the input if lean does not keep it); offload: what comes back,
  ``max(k[i,lean], k[i,s] + offloaded[i,s])``; offload+recompute: ``k[i,lean] + input``; the
  ``+tiled_mlp`` variants of full and offload+recompute: the same bounds (tiling lowers them);
* on CUDA, plus the prefetched host copies of layer ``i-1`` if it is offloaded.

A layer's output is the next layer's input: when layer ``i-1`` keeps its output storage and
layer ``i`` keeps its input storage it is counted once. With ``O`` the bytes the model keeps
outside its layers (embeddings, head, loss; held throughout, conservatively) and ``P_j`` the
bytes kept by layers ``0..j-1``, the peak is ``O + max(P_L, max_j P_j + T[j,s_j])``.

The DP runs over layers with state (``P`` in units of ``u`` bytes, rounded up: conservative;
the previous layer's strategy) and minimises the summed extra time (measured time − lean
time) subject to peak ≤ budget; the same DP minimising the peak gives the smallest feasible
budget. ``u`` = (largest possible peak) / 4096, independent of the budget.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .costs import ModelCosts

__all__ = ["Solution", "solve", "min_peak", "predict", "transient"]

_GRID = 4096


@dataclass
class Solution:
    choices: list[str]
    peak: int  # predicted peak activation bytes (exact arithmetic)
    extra_time: float  # predicted extra seconds per step vs lean everywhere


def transient(costs: ModelCosts, i: int, s: str) -> int:
    layer = costs.layers[i]
    c, lean = layer.by_strategy[s], layer.by_strategy["lean"]
    if s == "lean":
        return lean.kept
    if s.startswith("selective:") or s.startswith("lossy:"):  # kept + what backward rebuilds (bound)
        return c.kept + lean.kept
    if s in ("full", "full+tiled_mlp"):  # (+tiled_mlp: the same bound; tiling only lowers the rebuilt saves)
        return lean.kept + (0 if lean.keeps_input else layer.in_bytes)
    if s == "offload":
        return max(lean.kept, c.kept + c.offloaded)
    if s in ("offload+recompute", "offload+recompute+tiled_mlp"):
        return lean.kept + layer.in_bytes
    if s == "tiled_mlp":  # kept + one chunk of the MLP's inside rebuilt: at most what the lean layer keeps
        return max(lean.kept, c.kept)
    raise ValueError(s)


def _shared(costs: ModelCosts, i: int, prev: str | None, s: str) -> int:
    if prev is None or i == 0:
        return 0
    a, b = costs.layers[i - 1].by_strategy[prev], costs.layers[i].by_strategy[s]
    return min(costs.layers[i - 1].out_bytes, costs.layers[i].in_bytes) if a.keeps_output and b.keeps_input else 0


def _prefetch(costs: ModelCosts, i: int, prev: str | None) -> int:
    if prev is None or not prev.startswith("offload") or not costs.device.startswith("cuda"):
        return 0
    return costs.layers[i - 1].by_strategy[prev].offloaded


def predict(costs: ModelCosts, choices: list[str]) -> tuple[int, float, list[int]]:
    """(peak bytes, extra seconds, kept bytes per layer) of ``choices`` under the memory model."""
    prefix, peak, extra, kept = 0, 0, 0.0, []
    prev = None
    for i, s in enumerate(choices):
        c = costs.layers[i].by_strategy[s]
        peak = max(peak, prefix + transient(costs, i, s) + _prefetch(costs, i, prev))
        k = max(0, c.kept - _shared(costs, i, prev, s))
        kept.append(k)
        prefix += k
        extra += c.extra_time
        prev = s
    return costs.outside + max(peak, prefix), extra, kept


def _unit(costs: ModelCosts, allowed: list[list[str]]) -> int:
    worst = costs.outside
    for i, ss in enumerate(allowed):
        worst += max(max(costs.layers[i].by_strategy[s].kept, transient(costs, i, s)) for s in ss)
        worst += max((c.offloaded for c in costs.layers[i].by_strategy.values()), default=0)
    return max(1, math.ceil(worst / _GRID))


def _run(costs: ModelCosts, allowed: list[list[str]], cap: int, u: int, minimise_peak: bool):
    names = sorted({s for ss in allowed for s in ss})
    S = len(names)
    inf = np.inf
    value = np.full((cap + 1, S + 1), inf)
    value[0, S] = 0.0  # column S: "no previous layer"
    backs = []
    for i, ss in enumerate(allowed):
        new = np.full((cap + 1, S + 1), inf)
        back = np.full((cap + 1, S), -1, dtype=np.int64)
        for s in ss:
            j = names.index(s)
            c = costs.layers[i].by_strategy[s]
            step = c.extra_time + (0.0 if s == "lean" else 1e-12)  # ties: prefer no change
            for sp in range(S + 1):
                col = value[:, sp]
                if not np.isfinite(col).any():
                    continue
                prev = None if sp == S else names[sp]
                kk = math.ceil(max(0, c.kept - _shared(costs, i, prev, s)) / u)
                tt = math.ceil((transient(costs, i, s) + _prefetch(costs, i, prev)) / u)
                top = cap - max(kk, tt)  # largest P allowed before this layer
                if top < 0:
                    continue
                src = col[: top + 1]
                if minimise_peak:
                    P = np.arange(top + 1)
                    cand = np.maximum(src, np.maximum(P + tt, P + kk))
                else:
                    cand = src + step
                dst = new[kk: kk + top + 1, j]
                better = cand < dst
                dst[better] = cand[better]
                back[kk: kk + top + 1, j][better] = sp
        backs.append(back)
        value = new
    if minimise_peak:
        final = np.maximum(value[:, :S], np.arange(cap + 1)[:, None])
    else:
        final = value[:, :S]
    if not np.isfinite(final).any():
        return None
    flat = int(np.argmin(final))  # ties: smallest P first (row-major)
    P, j = divmod(flat, S)
    choices = []
    for i in range(len(allowed) - 1, -1, -1):
        s = names[j]
        choices.append(s)
        sp = int(backs[i][P, j])
        prev = None if sp == S else names[sp]
        c = costs.layers[i].by_strategy[s]
        P -= math.ceil(max(0, c.kept - _shared(costs, i, prev, s)) / u)
        j = sp
    return choices[::-1], float(final.flat[flat])


def min_peak(costs: ModelCosts, allowed: list[list[str]]) -> tuple[int, list[str]]:
    """The smallest budget (bytes) any plan meets under the DP's rounding, and that plan."""
    u = _unit(costs, allowed)
    res = _run(costs, allowed, _GRID * 2 + math.ceil(costs.outside / u) + 8, u, True)
    assert res is not None
    choices, peak_units = res
    return (int(peak_units) + math.ceil(costs.outside / u)) * u, choices


def solve(costs: ModelCosts, allowed: list[list[str]], budget: int) -> Solution | None:
    """The plan of least extra time with predicted peak ≤ ``budget``, or None."""
    u = _unit(costs, allowed)
    cap = budget // u - math.ceil(costs.outside / u)
    if cap < 0:
        return None
    cap = min(cap, _GRID * 2 + 8)
    res = _run(costs, allowed, cap, u, False)
    if res is None:
        return None
    choices, _ = res
    peak, extra, _ = predict(costs, choices)
    return Solution(choices, peak, extra)
