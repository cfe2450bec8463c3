"""The longest sequence (or largest batch) whose whole training step fits a memory budget, and the
plan that reaches it: ``leanact.plan(model, inputs, "80GiB", maximize="seq")``.

For each candidate strategy (applied to every layer: :func:`leanact.strategies.uniform`) the step's
predicted peak -- parameters, gradients, optimizer state, activations, temporaries: the whole
:func:`leanact.estimate` -- is searched for the largest size that fits (:func:`.fit.largest_fitting`:
fits in s, then checked by estimates on either side of the answer). The strategy that
reaches the largest size wins; among equals, the cheapest in time (the order of
:data:`CANDIDATES`). On CUDA the candidates include ``offload+recompute+tiled_mlp``: every layer's
input (but the last layer's) in pinned host memory, which the estimate counts apart
(``Estimate.host``; ``host_budget`` bounds it). What the head keeps (the fused linear +
cross-entropy of a patched model, or the logits) is part of the estimate.

**Depth scaling.** When the model's layers are alike (:func:`.depth.alike_layers`: Llama, Qwen,
GPT-2, BERT and most others; not Gemma 2's alternating ones), each candidate is searched with the
line through estimates of the model cut to 1 and 2 layers, 3 and 4 for the offloading strategies
(:mod:`.depth`: exact wherever one moment of the step sets the peak at these depths and the whole
model's; an estimate's time grows with the layers it traces), each search starting at the size
where the candidate before it stopped. Then the candidate that reached furthest is estimated on
the whole model at its answer: when that estimate equals the line's to the byte, the answer
stands (the line was exact there; the next size, over the budget by the line, is not estimated
again), else the search goes on with whole-model estimates from there. So is every other
candidate whose line reached as far as the confirmed best. The answer, its estimate and the plan
always come from the whole model; ``Maximized.confirmed`` names the candidates whose reach is the
whole model's, the others' in ``by_strategy`` are the line's. ``depth_scaling=False`` searches
every candidate with whole-model estimates (several times slower:
``python benchmarks/long_context.py --plan-times --whole``).

**The reserve.** A step whose predicted peak (``torch.cuda.max_memory_allocated``: the bytes of
live tensors and the runtime's workspaces) equals the budget still runs out of memory: the caching
allocator holds memory it cannot hand out (free pieces of segments too small for the next large
request: reserved > allocated), measured at 1.5% of an 80 GiB budget and 6% of a 16 GiB one
(docs/benchmarks.md, "Measurements behind the library's constants"). On CUDA the search therefore
fits ``budget − reserve``: :func:`reserve_for` is
``max(RESERVE_FRACTION · budget, min(RESERVE_MIN, budget / 8))`` -- 2% of the budget, at least
1 GiB (1.6 GiB at 80 GiB, 1 GiB at 16 GiB), and at most an eighth of budgets under 8 GiB.
``reserve=`` overrides it (0: none). The budget is what PyTorch may reserve: on a GPU of its own,
the card's memory less the CUDA context (several hundred MiB; ``torch.cuda.mem_get_info()`` tells).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from .api import _position_limit, estimate
from .depth import alike_layers, depths_for, scaled
from .fit import largest_fitting
from .result import Estimate

__all__ = ["CANDIDATES", "Maximized", "maximize", "step_estimate", "strategy_plan", "reserve_for",
           "RESERVE_FRACTION", "RESERVE_MIN"]

#: Candidate strategies, cheapest in time first (ties go to the earlier); offload ones on CUDA only.
CANDIDATES = ("lean", "selective:attention", "tiled_mlp", "full", "full+tiled_mlp", "offload+recompute+tiled_mlp")
SEQ_MULTIPLE = 128  # sequences are searched in multiples of this many tokens
RESERVE_FRACTION = 0.02  # of the budget, kept free for the caching allocator on CUDA (module doc)
RESERVE_MIN = 1 << 30  # at least this much (an eighth of the budget below 8 GiB)


def reserve_for(budget: int, device: Any = "cuda") -> int:
    """Bytes of ``budget`` the search leaves free for the caching allocator (module doc): on CUDA
    ``max(RESERVE_FRACTION · budget, min(RESERVE_MIN, budget // 8))``; 0 on the CPU (no caching
    allocator)."""
    import torch

    if torch.device(device).type != "cuda":
        return 0
    return max(int(RESERVE_FRACTION * budget), min(RESERVE_MIN, budget // 8))


@dataclass
class Maximized:
    """What :func:`maximize` found: ``value`` (the longest sequence or largest batch, 0 if nothing
    fits) reached with ``strategy`` on every layer (``plan``), the estimate there, and the value
    each candidate reached (``by_strategy``: from whole-model estimates for the candidates named in
    ``confirmed``, from the depth-scaled line for the others; module doc). ``reserve``: the bytes of
    ``budget`` left free for the caching allocator; the estimate's peak is at most ``limit`` =
    ``budget - reserve``. ``host``: the pinned host memory the plan's offload needs (0 without
    offload)."""

    what: str
    value: int
    strategy: str
    plan: Any
    estimate: Estimate | None
    budget: int
    by_strategy: dict[str, int] = field(default_factory=dict)
    reserve: int = 0
    confirmed: tuple[str, ...] = ()

    @property
    def host(self) -> int:
        return self.estimate.host if self.estimate is not None else 0

    @property
    def limit(self) -> int:
        """The most the predicted peak may be: ``budget - reserve``."""
        return self.budget - self.reserve

    def __repr__(self) -> str:
        return (f"Maximized({self.what}={self.value}, strategy={self.strategy!r}, "
                f"peak={self.estimate.peak if self.estimate else None}, budget={self.budget}, "
                f"reserve={self.reserve}" + (f", host={self.host}" if self.host else "") + ")")


def _sizes(sample_inputs: Any) -> tuple[int, int]:
    import torch

    ref = next((t for t in torch.utils._pytree.tree_leaves(sample_inputs)
                if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    if ref is None:
        raise ValueError("maximize needs a sample input with at least 2 dimensions (batch, seq, ...)")
    return ref.shape[0], ref.shape[1]


def strategy_plan(model: nn.Module, strategy: str, tokens: int):
    """``strategy`` on every layer; ``tiled_mlp`` in at most 16 chunks of at least the default size
    (``tokens``: batch · sequence), so a long sequence's estimate stays quick."""
    from leanact.strategies import uniform
    from leanact.strategies.tiled import DEFAULT_MLP_CHUNK

    chunk = max(DEFAULT_MLP_CHUNK, -(-tokens // 16)) if strategy.endswith("tiled_mlp") else None
    return uniform(model, strategy, mlp_chunk=chunk)


def step_estimate(model: nn.Module, sample_inputs: Any, strategy: str, what: str, n: int, **options) -> Estimate:
    """The estimate of one step with ``strategy`` on every layer ("lean": the model as is) at
    sequence (``what="seq"``) or batch ``n``; ``options``: :func:`leanact.estimate`'s keywords."""
    b0, s0 = _sizes(sample_inputs)
    sizes = dict(seq=n, batch=b0) if what == "seq" else dict(batch=n, seq=s0)
    ranks = options.get("context_parallel") or 1
    plan = None if strategy == "lean" else strategy_plan(model, strategy, sizes["seq"] * sizes["batch"] // ranks)
    return estimate(model, sample_inputs, plan, options.pop("device", "cuda"), **options, **sizes)


def maximize(model: nn.Module, sample_inputs: Any, budget: int, what: str = "seq", *,
             strategies: list[str] | None = None, device: Any = "cuda", dtype: Any = None, optimizer: Any = "adamw",
             loss_fn: Callable | None = None, multiple: int | None = None, limit: int | None = None,
             keep_output: bool = False, reserve: int | None = None, host_budget: int | None = None,
             context_parallel: int | None = None, depth_scaling: bool = True) -> Maximized:
    """The largest ``what`` ("seq": sequence length at the sample's batch; "batch": batch at the
    sample's sequence length) whose whole step fits ``budget`` bytes on ``device`` (module doc),
    less ``reserve`` bytes kept free for the caching allocator (None: :func:`reserve_for`, 2% of
    the budget and at least 1 GiB on CUDA, 0 on the CPU).
    ``multiple``: search in multiples of this (default 128 tokens for "seq", 1 for "batch");
    ``limit``: the largest size considered (default: the model's learned positions for "seq").
    ``device``, ``dtype``, ``optimizer``, ``loss_fn``, ``keep_output``, ``context_parallel`` (ranks
    sharing each sequence; the budgets are per rank): as :func:`leanact.estimate`.
    ``strategies``: the candidates (default :data:`CANDIDATES`, without the offload ones on the
    CPU, where host memory is the device's). ``host_budget``: the most pinned host memory an
    offloading candidate may need (bytes; None: no bound). ``depth_scaling``: search with the line
    through two shallow estimates and confirm with the whole model (module doc; used only when the
    layers are alike); False: whole-model estimates throughout."""
    from leanact.strategies import STRATEGIES

    if what not in ("seq", "batch"):
        raise ValueError(f"maximize={what!r}: use 'seq' (the longest sequence) or 'batch' (the largest batch)")
    import torch

    on_cuda = torch.device(device).type == "cuda"
    names = list([s for s in CANDIDATES if on_cuda or not s.startswith("offload")] if strategies is None
                 else strategies)
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown or not names:
        raise ValueError(f"maximize: strategies {unknown or names} unknown; choose among {list(STRATEGIES)}")
    if reserve is None:
        reserve = reserve_for(budget, device)
    if isinstance(reserve, bool) or not isinstance(reserve, int) or not 0 <= reserve <= budget:
        raise ValueError(f"maximize: reserve must be a number of bytes between 0 and the budget ({budget}), "
                         f"got {reserve!r}")
    if host_budget is not None and (isinstance(host_budget, bool) or not isinstance(host_budget, int)
                                    or host_budget < 0):
        raise ValueError(f"maximize: host_budget must be a number of bytes >= 0 or None, got {host_budget!r}")
    b0, s0 = _sizes(sample_inputs)
    multiple = multiple or (SEQ_MULTIPLE if what == "seq" else 1)
    if context_parallel and what == "seq" and multiple % context_parallel:
        raise ValueError(f"maximize: with context_parallel={context_parallel} the sequence is searched in multiples "
                         f"of a multiple of {context_parallel}; got multiple={multiple}")
    if limit is None and what == "seq":
        found = _position_limit(model)
        limit = found[0] if found else None

    opts = dict(device=device, dtype=dtype, optimizer=optimizer, loss_fn=loss_fn, keep_output=keep_output,
                context_parallel=context_parallel)

    def peak(strategy: str, n: int) -> Estimate:
        return step_estimate(model, sample_inputs, strategy, what, n, **opts)

    def search(cost: Callable[[int], int], start: int | None = None, known: dict[int, int] | None = None
               ) -> tuple[int, dict[int, int]]:
        return largest_fitting(cost, limit_bytes, probes=(1, 128, 1024) if what == "seq" else (1, 2, 4),
                               multiple=multiple, limit=limit, degree=2 if what == "seq" else 1, start=start,
                               known=known)

    def whole(strategy: str, start: int | None = None, line: dict[int, int] | None = None
              ) -> tuple[int, Estimate | None]:
        found_at: dict[int, Estimate] = {}

        def cost(n: int) -> int:
            found_at[n] = peak(strategy, n)
            if host_budget is not None and found_at[n].host > host_budget:
                return budget + 1  # does not fit: too much host memory
            return found_at[n].peak

        known = {}
        if line is not None and start:  # the line's answer: the whole model's cost there, then maybe done
            known[start] = cost(start)
            if known[start] == line[start] <= limit_bytes < line.get(start + multiple, -1):
                return start, found_at[start]  # the line is exact at its answer: the next size is over
        value = search(cost, start, known)[0]
        return value, found_at.get(value)

    limit_bytes = budget - reserve
    layers = alike_layers(model) if depth_scaling else None
    reached: dict[str, int] = {}
    if layers is None:  # every candidate searched with estimates of the whole model
        results = {s: whole(s) for s in names}
        reached = {s: v for s, (v, _) in results.items()}
        value, strategy = max((v, -names.index(s)) for s, v in reached.items())
        strategy = names[-strategy]
        est, confirmed = results[strategy][1], tuple(names)
    else:  # the line through two shallow estimates (module doc); the winner confirmed whole
        start, lines = None, {}
        for strategy in names:  # each search starts where the one before ended (its cost grows there)
            def line(n: int, strategy=strategy) -> int:
                got = scaled(lambda: peak(strategy, n), layers, depths_for(strategy))
                return budget + 1 if host_budget is not None and got.host > host_budget else got.peak
            reached[strategy], lines[strategy] = search(line, start)
            start = reached[strategy] or None
        confirmed, best = (), (-1, names[0], None)
        for strategy in sorted(names, key=lambda s: (-reached[s], names.index(s))):
            if reached[strategy] < best[0] or (reached[strategy] == best[0]
                                               and names.index(strategy) > names.index(best[1])):
                break  # cannot win (where the peak is convex in the depth, the line reaches at least as far)
            value, est = whole(strategy, reached[strategy], lines[strategy])
            reached[strategy], confirmed = value, (*confirmed, strategy)
            if value > best[0] or (value == best[0] and names.index(strategy) < names.index(best[1])):
                best = (value, strategy, est)
        value, strategy, est = best
    plan = strategy_plan(model, strategy, value * (b0 if what == "seq" else s0))
    plan.budget = budget
    return Maximized(what, value, strategy, plan, est, budget, reached, reserve, confirmed)
