"""`leanact layers`: bytes kept for backward and step time, plain torch.nn vs leanact modules.

Builds the BERT-style encoder layer of :mod:`leanact.models.encoder` twice on the CPU (same
weights): once from torch.nn's GELU/LayerNorm/Dropout and once from leanact's drop-ins, measures
what one layer keeps for backward (2-layer minus 1-layer model, per autograd op) and the
forward+backward time of each, interleaved in one run.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from leanact._format import compact_table
from leanact.memory import LayerCost, measure_layer_cost
from leanact.models import TORCH_MODULES, EncoderStack, ModuleSet, leanact_modules

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


@dataclass
class ProfileConfig:
    hidden: int = 1024
    heads: int = 16
    seq: int = 512
    batch: int = 1
    dtype: str = "bf16"
    dropout: float = 0.1
    repeats: int = 10  # 0: memory only
    seed: int = 0


@dataclass
class ModeResult:
    name: str
    bytes_per_layer: int
    per_sbh: float
    by_op: dict[str, int]
    step_ms: float | None = None  # None: not timed (repeats 0)
    step_ratio: float | None = None


@dataclass
class ProfileResult:
    config: ProfileConfig
    modes: list[ModeResult] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"config": asdict(self.config), "modes": [asdict(m) for m in self.modes]}


def _build(cfg: ProfileConfig, modules: ModuleSet, layers: int) -> EncoderStack:
    torch.manual_seed(cfg.seed)  # same weights for every module set
    model = EncoderStack(layers, hidden=cfg.hidden, heads=cfg.heads, dropout=cfg.dropout, modules=modules)
    return model.to(DTYPES[cfg.dtype]).train()


def _inputs(cfg: ProfileConfig) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed + 1)
    return (torch.randn(cfg.batch, cfg.seq, cfg.hidden, generator=g).to(DTYPES[cfg.dtype]),)


def _step(model: EncoderStack, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    model(x).float().square().mean().backward()
    return time.perf_counter() - t0


def run_profile(cfg: ProfileConfig, progress=None) -> ProfileResult:
    """Measure both module sets; ``progress(advance)`` is called once per timed step if given."""
    if cfg.hidden % cfg.heads:
        raise ValueError(f"--hidden {cfg.hidden} must be a multiple of --heads {cfg.heads}.")
    sets = [TORCH_MODULES, leanact_modules()]
    costs: list[LayerCost] = [
        measure_layer_cost(lambda n, m=m: _build(cfg, m, n), lambda: _inputs(cfg), cfg.seq, cfg.batch, cfg.hidden)
        for m in sets
    ]
    result = ProfileResult(cfg)
    for m, cost in zip(sets, costs):
        result.modes.append(ModeResult(m.name, cost.bytes, cost.per_sbh, dict(cost.by_op)))
    if cfg.repeats:
        _time(cfg, sets, result, progress)
    return result


def _time(cfg: ProfileConfig, sets: list[ModuleSet], result: ProfileResult, progress) -> None:
    models = [_build(cfg, m, 1) for m in sets]
    x = _inputs(cfg)[0].requires_grad_()
    times: list[list[float]] = [[] for _ in sets]
    for _ in range(2):  # warm-up
        for model in models:
            _step(model, x)
    for _ in range(cfg.repeats):  # interleaved, so drifts in machine load hit both alike
        for i, model in enumerate(models):
            times[i].append(_step(model, x))
            if progress is not None:
                progress(1)
    base = statistics.median(times[0])
    for mode, ts in zip(result.modes, times):
        med = statistics.median(ts)
        mode.step_ms, mode.step_ratio = med * 1e3, med / base


def render(result: ProfileResult):
    """A rich Table: bytes per layer per autograd op, B/sbh, step time (fits 80 columns)."""
    cfg = result.config
    sbh = cfg.seq * cfg.batch * cfg.hidden
    timing = (f"time: fwd+bwd of one layer, median of {cfg.repeats}, modes interleaved" if cfg.repeats
              else "time: not measured (--repeats 0)")
    tab = compact_table(f"Kept for backward per encoder layer (h={cfg.hidden}, a={cfg.heads}, s={cfg.seq}, "
                         f"b={cfg.batch}, {cfg.dtype}, dropout {cfg.dropout}, CPU)",
                         f"bytes: kept for backward; B/sbh: bytes / (s·b·h). {timing}.")
    tab.add_column("autograd op")
    for m in result.modes:
        tab.add_column(f"{m.name}\nbytes", justify="right", no_wrap=True)
        tab.add_column("\nB/sbh", justify="right", no_wrap=True)
    ops: list[str] = []
    for m in result.modes:
        ops += [op for op, n in m.by_op.items() if n and op not in ops]
    for op in ops:
        row = [op]
        for m in result.modes:
            n = m.by_op.get(op, 0)
            row += [f"{n:,}" if n else "-", f"{n / sbh:.2f}" if n else "-"]
        tab.add_row(*row)
    tab.add_section()
    total = ["total per layer"]
    for m in result.modes:
        total += [f"{m.bytes_per_layer:,}", f"{m.per_sbh:.2f}"]
    tab.add_row(*total, style="bold")
    ratio = ["vs torch.nn"]
    for m in result.modes:
        ratio += [f"{m.bytes_per_layer / result.modes[0].bytes_per_layer:.3f}x", ""]
    tab.add_row(*ratio)
    tab.add_section()
    step = ["time (median)"]
    for m in result.modes:
        step += ["-", "-"] if m.step_ms is None else [f"{m.step_ms:.1f} ms", f"{m.step_ratio:.2f}x"]
    tab.add_row(*step)
    return tab
