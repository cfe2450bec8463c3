"""`leanact profile`: activation memory and step time of a Hugging Face model, unpatched vs leanact.

Four modes of one model (same random weights): HF eager attention, HF sdpa attention,
``leanact.patch(attention="recompute")`` and ``leanact.patch(attention="tempo")``.

Memory (what autograd keeps for backward, counted by :class:`leanact.memory.SavedTensorMeter`:
storages deduplicated, parameters and the input batch excluded) is measured on models built with 1
and 2 layers, as :func:`leanact.memory.measure_layer_cost` does, each at batch 1 and batch 2:

* per layer = cost(2 layers) − cost(1 layer);
* non-layer part (embeddings, head, logits, loss) = cost(1 layer) − per layer;
* whole model at batch b = L · per layer + non-layer part, each affine in b:
  cost(b) = cost(1) + (b − 1) · (cost(2) − cost(1)).

Nearly everything a model keeps is a per-sample activation (linear in b). A few bytes are the
same whatever the batch (e.g. BERT's token-type ids, broadcast over the batch, and the loss's
scalar total weight: 258 B for BERT in bf16), hence the affine form, exact for both; tests check
it against direct measurements of the full L-layer model at other batch sizes. B/sbh and the
per-op breakdown are at batch 1. Parameters, gradients and optimizer state are not activation
memory and are not counted.

``--autocast bf16|fp16``: fp32 weights, every forward (and the timed steps) under ``torch.autocast``
of that dtype, as mixed-precision training runs. The meter then also reports, per layer, the
16-bit weight copies autocast's matmuls keep (batch-independent, in the layer's bytes;
``leanact.patch`` keeps none: it recasts the weights in backward).

Time: forward+backward of the 1-layer model (head and loss included, so the ratios are diluted
relative to a deep model) at the chosen batch and sequence, modes interleaved step by step so
that drifts in machine load hit all alike; medians of ``repeats`` steps after one warm-up step.
"""
from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from leanact._format import compact_table, format_bytes, format_in, unit_for
from leanact.memory import SavedTensorMeter
from leanact.models.geometries import Geometry, resolve
from leanact.ops.cpu_gemm import native_16bit_gemm

from .roles import role_of

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def default_dtype() -> str:
    """bf16 where this CPU multiplies bf16 natively (AVX512-BF16, AMX), else fp32: elsewhere a bf16
    step can take tens of times an fp32 one (:mod:`leanact.ops.cpu_gemm`)."""
    return "bf16" if native_16bit_gemm(torch.bfloat16) else "fp32"


#: Printed when :func:`default_dtype` picks fp32.
FP32_NOTE = ("leanact profile: fp32, as this CPU has no native bf16 matrix multiply (AVX512-BF16 or AMX), "
             "where a bf16 step can take 70x an fp32 one; --dtype bf16 profiles bf16 anyway")
AUTOCAST = ("bf16", "fp16")  # --autocast: fp32 weights, the forward under torch.autocast
DEFAULT_MODEL = "bert-base"
# (label, HF attention implementation, leanact.patch attention mode or None for unpatched)
MODES: list[tuple[str, str, str | None]] = [
    ("HF eager", "eager", None),
    ("HF sdpa", "sdpa", None),
    ("leanact recompute", "sdpa", "recompute"),
    ("leanact tempo", "sdpa", "tempo"),
]


@dataclass
class ProfileConfig:
    model: str = DEFAULT_MODEL
    seq: int | None = None  # None: the geometry's default
    batch: int | None = None
    dtype: str = "bf16"
    dropout: float | None = None  # None: the config's own dropout
    repeats: int | None = None  # 0: skip timing
    budget: int | None = None  # bytes of activation memory for the largest-batch column
    seed: int = 0
    autocast: str | None = None  # "bf16" / "fp16": fp32 weights (dtype "fp32"), forward under torch.autocast
    context_parallel: int | None = None  # ranks sharing each sequence in the --budget longest-sequence search

    def __post_init__(self) -> None:
        if self.autocast is not None:
            if self.autocast not in AUTOCAST:
                raise ValueError(f"autocast={self.autocast!r}: use one of {AUTOCAST}")
            if self.dtype != "fp32":
                raise ValueError(f"--autocast {self.autocast} runs fp32 weights under torch.autocast: "
                                 f"drop --dtype {self.dtype} (or use --dtype fp32)")

    def resolved(self, geo: Geometry) -> "ProfileConfig":
        """A copy with the geometry's defaults filled in."""
        return ProfileConfig(self.model, self.seq or geo.seq, self.batch or geo.batch, self.dtype, self.dropout,
                             geo.repeats if self.repeats is None else self.repeats, self.budget, self.seed,
                             self.autocast, self.context_parallel)

    def amp(self):
        """The autocast context of the forwards (a no-op without ``autocast``)."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=DTYPES[self.autocast])

    @property
    def precision(self) -> str:
        return self.dtype if self.autocast is None else f"fp32 + {self.autocast} autocast"


@dataclass
class ModeResult:
    name: str
    bytes_per_layer: int  # at batch 1
    per_sbh: float
    non_layer_bytes: int  # at batch 1
    by_op: dict[str, int]  # per layer, at batch 1
    by_role: dict[str, int]  # per layer, at batch 1, by :data:`leanact.cli.roles.ROLES`
    per_sample_bytes: int  # whole model: bytes added by each sample of the batch
    fixed_bytes: int  # whole model: bytes that do not depend on the batch
    activation_bytes: int = 0  # whole model at the chosen batch
    layer_bytes: int = 0  # one layer at the chosen batch
    step_ms: float | None = None
    step_ratio: float | None = None
    max_batch: int | None = None  # under the budget (activations only)
    step_max_batch: int | None = None  # under the budget, the whole training step (leanact.estimate, CUDA)
    weight_copies: int = 0  # per layer: autocast's 16-bit weight copies (batch-independent; in bytes_per_layer)
    #: leanact modes: ``PatchSummary.to_dict()`` of the patched 1-layer model (what was left and why)
    summary: dict | None = None
    label: str = ""  # the name shown; "(partial: ... left)" when leanact left parts of the layer

    def __post_init__(self):
        self.label = self.label or self.name

    def activation_at(self, batch: int) -> int:
        """Whole-model activation bytes at ``batch``."""
        return self.fixed_bytes + batch * self.per_sample_bytes


@dataclass
class ProfileResult:
    config: ProfileConfig
    geometry: dict
    modes: list[ModeResult] = field(default_factory=list)
    plan: str | None = None  # the planner's explanation (or why it is not shown), with --budget
    longest: dict | None = None  # with --budget: the longest sequence whose step fits (longest_sequence)

    def to_dict(self) -> dict:
        return {"config": asdict(self.config), "geometry": self.geometry,
                "modes": [asdict(m) for m in self.modes], "plan": self.plan, "longest": self.longest}


def _cost(model: torch.nn.Module, inputs: dict) -> tuple[int, dict[str, int], dict[str, int]]:
    """(bytes kept for backward, bytes by autograd op, bytes by role) of one forward; its graph is
    then released (:meth:`SavedTensorMeter.release`: no backward needed to free it)."""
    return _measure(model, inputs)[:3]


def _measure(model: torch.nn.Module, inputs: dict, amp=None) -> tuple[int, dict[str, int], dict[str, int], int]:
    """:func:`_cost` and, last, the bytes of autocast's weight copies in it; the forward under
    ``amp`` (an autocast context) if given."""
    meter = SavedTensorMeter(model, exclude=[t for t in inputs.values() if isinstance(t, torch.Tensor)])
    with meter, (amp or contextlib.nullcontext()):
        out = model(**inputs)
    meter.attribute(out)
    meter.release()
    roles: dict[str, int] = {}
    for r in meter.counted():
        role = role_of(r.module, r.op)
        roles[role] = roles.get(role, 0) + r.counted_bytes
    return meter.total_bytes, dict(meter.by_op()), roles, meter.weight_copy_bytes


def _difference(two: dict[str, int], one: dict[str, int]) -> dict[str, int]:
    """``two - one`` key by key (keys of ``two`` first), zeros left out."""
    out: OrderedDict[str, int] = OrderedDict()
    for key in list(two) + list(one):
        if two.get(key, 0) - one.get(key, 0):
            out[key] = two.get(key, 0) - one.get(key, 0)
    return dict(out)


def mode_model(base: torch.nn.Module, attn: str, lean: str | None) -> torch.nn.Module:
    """A copy of ``base`` (same weights) with attention ``attn``, patched by leanact if ``lean``."""
    from leanact.patching import patch

    model = copy.deepcopy(base)
    model.set_attn_implementation(attn)
    if lean is not None:
        patch(model, attention=lean)
    return model.train()


def _step(model: torch.nn.Module, inputs: dict, amp=None) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with amp or contextlib.nullcontext():
        loss = model(**inputs).loss
    loss.backward()
    return time.perf_counter() - t0


def steps_total(cfg: ProfileConfig) -> int:
    """Progress units of :func:`run_profile`: 2 memory measurements + (1 + repeats) steps per mode."""
    return len(MODES) * (2 + ((1 + cfg.repeats) if cfg.repeats else 0))


def run_profile(cfg: ProfileConfig, progress: Callable[[int, str], None] | None = None) -> ProfileResult:
    """Measure every mode; ``progress(advance, what)`` is called after each unit of work."""
    geo = resolve(cfg.model)
    cfg = cfg.resolved(geo)
    geo.check_seq(cfg.seq)
    tick = progress or (lambda n, what: None)
    dtype = DTYPES[cfg.dtype]
    h, layers = geo.hidden, geo.layers
    bases = {n: geo.build(n, "eager", dtype, cfg.dropout, cfg.seq, cfg.seed) for n in (1, 2)}
    samples = {b: geo.batch_inputs(b, cfg.seq, dtype, cfg.seed + 1) for b in (1, 2)}
    result = ProfileResult(cfg, dict(name=geo.name, model_class=geo.model_cls, hidden=h, layers=layers,
                                     heads=geo.heads, vocab=geo.vocab,
                                     dropout=geo.dropout_probabilities(cfg.dropout)))
    timed: list[torch.nn.Module] = []
    for label, attn, lean in MODES:
        costs: dict[tuple[int, int], tuple[int, dict[str, int], dict[str, int], int]] = {}
        summary = None
        for n in (1, 2):
            model = mode_model(bases[n], attn, lean)
            for b in (1, 2):
                costs[n, b] = _measure(model, samples[b], cfg.amp())
            tick(1, f"memory: {label}, {n} layer{'s' * (n > 1)}")
            if n == 1 and lean is not None:
                summary = _summary(model)
            if n == 1 and cfg.repeats:
                timed.append(model)
        total = {key: c[0] for key, c in costs.items()}
        layer = {b: total[2, b] - total[1, b] for b in (1, 2)}
        whole = {b: layers * layer[b] + total[1, b] - layer[b] for b in (1, 2)}
        ops = _difference(costs[2, 1][1], costs[1, 1][1])
        roles = _difference(costs[2, 1][2], costs[1, 1][2])
        m = ModeResult(label, layer[1], layer[1] / (cfg.seq * h), total[1, 1] - layer[1], ops, roles,
                       per_sample_bytes=whole[2] - whole[1], fixed_bytes=2 * whole[1] - whole[2],
                       summary=summary, label=honest_label(label, summary))
        m.activation_bytes = m.activation_at(cfg.batch)
        m.layer_bytes = layer[1] + (cfg.batch - 1) * (layer[2] - layer[1])
        m.weight_copies = costs[2, 1][3] - costs[1, 1][3]
        if cfg.budget is not None:
            m.max_batch = max_batch(cfg.budget, m.fixed_bytes, m.per_sample_bytes)
            m.step_max_batch = step_max_batch(geo, cfg, attn, lean)
        result.modes.append(m)
    del bases
    if cfg.repeats:
        _time_modes(result, timed, geo.batch_inputs(cfg.batch, cfg.seq, dtype, cfg.seed + 2), cfg.repeats, tick,
                    cfg)
    return result


def _summary(model: torch.nn.Module) -> dict | None:
    from leanact.patching import summary

    s = summary(model)
    return None if s is None else s.to_dict()


def honest_label(name: str, summary: dict | None) -> str:
    """``name``, or ``"<name> (partial: BloomGelu left)"`` when leanact left parts of the layer."""
    left = (summary or {}).get("left_in_layers") or []
    return f"{name} (partial: {', '.join(left)} left)" if left else name


def render_summary(result: ProfileResult):
    """What leanact left in the model and why (``leanact.summary`` of the first leanact mode), as a
    rich Table for under the profile table; None when nothing was left."""
    s = next((m.summary for m in result.modes if m.summary is not None), None)
    if s is None:
        return None
    rows = [(name, cls, why) for name, cls, why in s["left"]]
    rows += [(f"attention ({path or 'model'})", was, now) for path, was, now in s["attention"]
             if now.startswith("left")]
    rows += [(f"attention ({path or 'model'})", "", f"original attention for calls with {', '.join(f)}")
             for path, f in s["attention_fallbacks"].items()]
    rows += [(f"loss ({path or 'model'})", head, now) for path, head, now in s["loss"] if now.startswith("left")]
    if s["functional_dropout"] is not None:
        rows.append(tuple(s["functional_dropout"]))
    if not rows:
        return None
    tab = compact_table("Left by leanact (leanact.summary), and why", "")
    for col in ("module", "class", "why / now"):
        tab.add_column(col, no_wrap=False)
    groups: dict[tuple[str, str], list[str]] = {}
    for name, cls, why in rows:
        groups.setdefault((cls, why), []).append(name)
    for (cls, why), names in groups.items():
        tab.add_row(names[0] if len(names) == 1 else f"{len(names)}, e.g. {names[0]}", cls, why)
    return tab


def _time_modes(result: ProfileResult, models: list, inputs: dict, repeats: int, tick, cfg: ProfileConfig) -> None:
    times: list[list[float]] = [[] for _ in models]
    for r in range(1 + repeats):  # round 0 is the warm-up
        for i, model in enumerate(models):
            t = _step(model, inputs, cfg.amp())
            if r:
                times[i].append(t)
            tick(1, f"timing: {result.modes[i].name}" + (f", step {r}/{repeats}" if r else ", warm-up"))
    base = statistics.median(times[0])
    for m, ts in zip(result.modes, times):
        med = statistics.median(ts)
        m.step_ms, m.step_ratio = med * 1e3, med / base


def max_batch(budget: int, fixed: int, per_sample: int) -> int:
    """Largest b with fixed + b · per_sample ≤ budget (0 if not even one sample fits)."""
    if per_sample <= 0:
        raise ValueError(f"per-sample activation bytes must be positive, got {per_sample}")
    return max((budget - fixed) // per_sample, 0)


def step_max_batch(geo: Geometry, cfg: ProfileConfig, attn: str, lean: str | None) -> int:
    """The largest batch whose whole training step -- parameters, gradients, AdamW state,
    activations, temporaries (Trainer protocol) -- fits ``cfg.budget`` on a CUDA device, predicted by
    ``leanact.estimate(device="cuda")`` on a meta-device model of the full geometry (no memory),
    searched as ``leanact.plan(maximize="batch")`` searches (depth-scaled, confirmed on the whole
    model; no reserve: the budget as given)."""
    from leanact.estimate.maximize import maximize

    dtype = DTYPES[cfg.dtype]
    with torch.device("meta"):
        base = geo.build(geo.layers, "eager", dtype, cfg.dropout, cfg.seq, cfg.seed)
    model = mode_model(base, attn, lean)
    inputs = geo.batch_inputs(1, cfg.seq, dtype, cfg.seed + 1)
    return maximize(model, inputs, cfg.budget, "batch", strategies=["lean"], device="cuda", reserve=0).value


#: The strategies ``--budget``'s longest-sequence search tries (every layer the same).
LONGEST_CANDIDATES = ("lean", "full+tiled_mlp", "offload+recompute+tiled_mlp")


def longest_sequence(cfg: ProfileConfig) -> dict | None:
    """The longest sequence (at ``cfg.batch``, in multiples of 128 tokens, up to the model's learned
    positions) whose whole training step fits ``cfg.budget`` on a CUDA device, for the
    ``leanact.patch``'ed model of the full geometry on the meta device, with the best of
    :data:`LONGEST_CANDIDATES` on every layer (``leanact.plan(maximize="seq")``, which keeps the
    caching allocator's reserve free): ``{"seq", "strategy", "peak", "host", "reserve",
    "by_strategy"}``; ``host``: the pinned host memory the offload needs. None for image models."""
    from leanact.estimate.maximize import maximize
    from leanact.patching import patch

    geo = resolve(cfg.model)
    if geo.is_image:
        return None
    cfg = cfg.resolved(geo)
    dtype = DTYPES[cfg.dtype]
    with torch.device("meta"):  # (the config's own positions: the search may go past cfg.seq)
        model = patch(geo.build(geo.layers, "sdpa", dtype, cfg.dropout, None, cfg.seed)).train()
    ranks = cfg.context_parallel
    found = maximize(model, geo.batch_inputs(cfg.batch, cfg.seq, dtype, cfg.seed + 1), cfg.budget, "seq",
                     strategies=list(LONGEST_CANDIDATES), device="cuda", context_parallel=ranks,
                     multiple=None if ranks is None else math.lcm(128, ranks))
    peak = found.estimate.peak if found.estimate is not None else 0
    return {"seq": found.value, "strategy": found.strategy, "peak": peak, "host": found.host,
            "reserve": found.reserve, "by_strategy": dict(found.by_strategy)}


def longest_text(longest: dict, cfg: ProfileConfig) -> str:
    """One line saying what :func:`longest_sequence` found."""
    if longest["seq"] == 0:
        return f"longest sequence: none fits {format_bytes(cfg.budget)} at batch {cfg.batch}"
    host = f", {format_bytes(longest['host'])} pinned host memory" if longest["host"] else ""
    ranks = f" on each of {cfg.context_parallel} ranks (context parallelism)" if cfg.context_parallel else ""
    return (f"longest sequence whose step fits {format_bytes(cfg.budget)}{ranks} on CUDA (batch {cfg.batch}, "
            f"leanact.patch + "
            f"{longest['strategy']} on every layer): {longest['seq']:,} tokens (GPU peak "
            f"{format_bytes(longest['peak'])}{host}; {format_bytes(longest['reserve'])} left for the allocator)")


def planner_explanation(cfg: ProfileConfig):
    """The planner's ``Plan.explain()`` for the unpatched (sdpa) model under ``cfg.budget``.

    Returns (renderable or None, note). leanact.planner is optional: without it the note says so.
    The planner's errors (an infeasible budget included) propagate: the CLI reports them and exits 1.
    """
    try:
        from leanact.planner import plan
    except ImportError:
        return None, "planner not shown: leanact.planner is not available in this installation"
    geo = resolve(cfg.model)
    cfg = cfg.resolved(geo)
    dtype = DTYPES[cfg.dtype]
    model = geo.build(geo.layers, "sdpa", dtype, cfg.dropout, cfg.seq, cfg.seed)
    explained = plan(model, geo.batch_inputs(cfg.batch, cfg.seq, dtype, cfg.seed + 2), cfg.budget,
                     autocast=DTYPES[cfg.autocast] if cfg.autocast else False).explain()
    return explained, f"plan for the unpatched model under {format_bytes(cfg.budget)}"


def dropout_label(result: ProfileResult) -> str:
    """``dropout 0.1`` (every probability of the config), ``dropout 0.0-0.1`` or ``no dropout``."""
    values = result.geometry.get("dropout") or []
    if not values:
        return "no dropout"
    return f"dropout {values[0]}" if len(values) == 1 else f"dropout {min(values)}-{max(values)}"


def render(result: ProfileResult):
    """A rich Table, one row per mode; it fits 80 columns (units in the headers, legend in the caption)."""
    cfg, g = result.config, result.geometry
    title = (f"{g['name']} ({g['model_class']}: h={g['hidden']}, L={g['layers']}, a={g['heads']}"
             f"{', vocab ' + str(g['vocab']) if g['vocab'] else ''}), s={cfg.seq}, b={cfg.batch}, {cfg.precision}, "
             f"{dropout_label(result)}, random weights")
    timing = (f"step: fwd+bwd of the 1-layer model, median of {cfg.repeats}, modes interleaved." if cfg.repeats
              else "step: not timed (--repeats 0).")
    budget = ("" if cfg.budget is None else
              f" max b act: the largest batch whose total fits {format_bytes(cfg.budget)}; max b step: whose "
              "whole training step (weights, grads, AdamW, activations, temporaries) does on CUDA (leanact.estimate).")
    copies = (" copies: autocast's 16-bit weight copies one layer keeps (batch-independent; in B/sbh and "
              "layer)." if cfg.autocast else "")
    tab = compact_table(title, (
        "B/sbh: bytes one layer keeps for backward / (s·b·h), parameters excluded (2-layer minus 1-layer "
        f"model). layer, outside (embeddings, head, loss), total (whole model): at b={cfg.batch}.{budget} "
        f"{timing} vs eager: relative to HF eager.{copies}"))
    modes, layers = result.modes, g["layers"]
    outside = [m.activation_bytes - layers * m.layer_bytes for m in modes]
    memory = {"layer": [m.layer_bytes for m in modes], "outside": outside,
              "total": [m.activation_bytes for m in modes]}
    if cfg.autocast:
        memory = {"copies": [m.weight_copies for m in modes], **memory}
    units = {name: unit_for(values) for name, values in memory.items()}
    tab.add_column("mode", justify="left", no_wrap=False)
    tab.add_column("B/sbh", justify="right", no_wrap=True)
    tab.add_column("vs\neager", justify="right", no_wrap=True)
    for name, (unit, _) in units.items():
        tab.add_column(f"{name}\n{unit}", justify="right", no_wrap=True)
    if cfg.budget is not None:
        tab.add_column("max b\nact", justify="right", no_wrap=True)
        tab.add_column("max b\nstep", justify="right", no_wrap=True)
    tab.add_column("step\nms", justify="right", no_wrap=True)
    tab.add_column("vs\neager", justify="right", no_wrap=True)
    eager = modes[0]
    for i, m in enumerate(modes):
        row = [m.label, f"{m.per_sbh:.2f}", f"{m.bytes_per_layer / eager.bytes_per_layer:.2f}x"]
        row += [format_in(values[i], units[name][1]) for name, values in memory.items()]
        if cfg.budget is not None:
            row += [f"{m.max_batch}", f"{m.step_max_batch}"]
        row += ["-", "-"] if m.step_ms is None else [f"{m.step_ms:.0f}", f"{m.step_ratio:.2f}x"]
        tab.add_row(*row, style="bold" if m.name == "leanact recompute" else None)
    return tab


def render_ops(result: ProfileResult):
    """A rich Table: per-layer B/sbh by autograd op, one column per mode (fits 80 columns)."""
    cfg = result.config
    sbh = cfg.seq * result.geometry["hidden"]
    tab = compact_table("Kept per layer by autograd op (B/sbh)", "")
    tab.add_column("autograd op")
    for m in result.modes:
        tab.add_column(m.name.replace(" ", "\n", 1), justify="right", no_wrap=True)
    ops: list[str] = []
    for m in result.modes:
        ops += [op for op in m.by_op if op not in ops]
    for op in ops:
        tab.add_row(op, *[f"{m.by_op[op] / sbh:.2f}" if m.by_op.get(op) else "-" for m in result.modes])
    tab.add_section()
    tab.add_row("total", *[f"{m.per_sbh:.2f}" for m in result.modes], style="bold")
    return tab
