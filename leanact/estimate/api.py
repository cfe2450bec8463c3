"""``leanact.estimate``: the memory of one training step, predicted on fake tensors."""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

from leanact.ops import fake_rules
from leanact.ops.amp import autocast_arg
from leanact.strategies.cache import caches_off
from leanact.strategies.offload import prefetch_as_cuda

from .cuda_kernels import cuda_kernels
from .cuda_runtime import BlasUse, runtime_bytes, target
from .fake import DATA_DEPENDENT, RealIntegerOps, build_fake, causal_skip_on_fake, fake_copy, fake_inputs, new_mode
from .layers import group_by_layer, layer_names
from .result import Estimate
from .step import CUDA_BLOCK, StepMemory, run_step

__all__ = ["estimate", "estimate_config", "CUDA_NOTES"]

#: loops of leanact's ops whose iterations allocate alike run only those that set the peak on fake
#: tensors (:attr:`leanact.ops.fake_rules.FakeRun.fewer_iterations`); the tests compare with all
_FEWER_ITERATIONS = True

REAL_FLOATS_NOTE = ("the model reads the values of its floating-point inputs (Idefics3's check for all-zero "
                    "padding images): those that need no gradient were kept real, and what the model computes "
                    "from them alone ran for real: counted where kept for backward, not in the peak's "
                    "temporaries (for one image's pixels: tens of MiB)")

CUDA_NOTES = [
    "cuda predicted from a CPU trace: a CPU-only torch can create fake cuda tensors but aborts the process "
    "(c10::Error, no device guard) when autograd records one, so the trace runs on fake CPU tensors",
    "every storage is rounded up to 512 bytes (CUDA caching allocator; torch.cuda.max_memory_allocated)",
    "optimizer uses foreach=True (torch's CUDA default; its step temporaries are counted)",
    "plain dropout and SDPA follow CUDA's kernels (leanact.estimate.cuda_kernels): dropout keeps a bool mask; "
    "SDPA runs flash (fp16/bf16, no attn_mask: keeps q, k, v, out, an fp32 logsumexp (b, heads, s) and the RNG "
    "state), else memory-efficient (masks, fp32: + the bias in q's dtype, logsumexp padded to 32 rows), else math; "
    "an Ampere or newer GPU assumed",
    "leanact's dropout, GELU and norms allocate what their Triton kernels allocate on CUDA (outputs, and the "
    "norms' backward partial sums: (4 x SMs, n) float32; with LEANACT_TRITON=0 set where the estimate runs: "
    "their PyTorch path's temporaries)",
    "held across steps and counted in every step (workspaces): a cuBLAS workspace per thread that runs matmuls "
    "(forward: the caller's thread; backward: autograd's; CUBLAS_WORKSPACE_CONFIG, default 32 MiB from Hopper "
    "on), cuBLASLt's where its bias epilogue runs (1 MiB before torch 2.12, shared after), leanact's GELU "
    "lookup tables on the device (leanact.estimate.cuda_runtime); GPU modelled: the current CUDA device, "
    "else compute capability 9.0 with 132 SMs (H100 SXM / H200)",
    "per_layer and saved are the meter's exact storage bytes (not rounded); peak and totals are rounded",
    "offload strategies: their host buffers are counted apart (Estimate.host), the copies back to the device "
    "as device memory; in backward each offloaded layer's copies are prefetched while the layer after it runs "
    "(leanact.strategies.offload, as on CUDA)",
    "not modelled: cuDNN workspaces, the caching allocator's counting of a reused block that is up to 1 MiB "
    "larger than asked as a whole (a few MiB to tens of MiB in max_memory_allocated), fragmentation "
    "(reserved > allocated: leanact.estimate.maximize keeps a reserve for it), the CUDA context",
]


def _resolve_plan(model: nn.Module, strategy_or_plan: Any):
    if strategy_or_plan is None:
        return None
    if isinstance(strategy_or_plan, str):
        try:
            from leanact.strategies import uniform
        except ImportError as e:  # pragma: no cover - until leanact.strategies ships
            raise ValueError("strategy names need leanact.strategies; pass a Plan object instead") from e
        return uniform(model, strategy_or_plan)
    if hasattr(strategy_or_plan, "apply") and hasattr(strategy_or_plan, "remove"):
        return strategy_or_plan
    raise TypeError(f"strategy_or_plan must be None, a strategy name or a Plan (with .apply/.remove), "
                    f"got {type(strategy_or_plan).__name__}")


def _device_kind(device: Any, model: nn.Module) -> str:
    if device is None:
        p = next(model.parameters(), None)
        device = p.device if p is not None else "cpu"
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda", "meta"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return "cpu" if kind == "meta" else kind


_DTYPE_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
                "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
                "fp64": torch.float64, "float64": torch.float64, "double": torch.float64}


def _dtype_arg(dtype: Any) -> torch.dtype | None:
    """``dtype=``: None, a floating ``torch.dtype`` or a name such as "bf16", "fp16", "fp32"."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower().removeprefix("torch.")]
    raise (ValueError if isinstance(dtype, (str, torch.dtype)) else TypeError)(
        f"estimate(dtype={dtype!r}): use a floating torch.dtype (e.g. torch.bfloat16) or one of "
        f"{', '.join(repr(n) for n in _DTYPE_NAMES)}")


def _size_arg(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"estimate({name}={value!r}): {name} must be a positive integer (or None: the sample's)")
    if value < 1:
        raise ValueError(f"estimate({name}={value!r}): {name} must be a positive integer (or None: the sample's)")


def _position_limit(model: nn.Module) -> tuple[int, str] | None:
    """The longest sequence ``model``'s learned position embeddings allow, and the table's name
    (None without such a table: rotary, relative or no positions)."""
    best = None
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(m, nn.Embedding) and ("position" in leaf or leaf == "wpe"):
            offset = int(getattr(m, "offset", 0) or 0)  # OPT / BART tables start after 2 reserved rows
            if m.padding_idx is not None:  # RoBERTa: positions start after the padding index
                offset = max(offset, m.padding_idx + 1)
            if best is None or m.num_embeddings - offset < best[0]:
                best = (m.num_embeddings - offset, name)
    return best


def _check_sizes(model: nn.Module, batch: Any, seq: Any) -> None:
    _size_arg("batch", batch)
    _size_arg("seq", seq)
    limit = _position_limit(model) if seq is not None else None
    if limit is not None and seq > limit[0]:
        raise ValueError(f"estimate(seq={seq}): {type(model).__name__} has {limit[0]} positions ({limit[1]}); "
                         f"use seq={limit[0]} or less")


def _dtype_of(model: nn.Module) -> torch.dtype:
    p = next((p for p in model.parameters() if p.is_floating_point()), None)
    return p.dtype if p is not None else torch.float32


def _layers(model: nn.Module) -> list[str]:
    try:
        from leanact.strategies.layers import find_layers
    except ImportError:
        return layer_names(model)
    try:
        return [n for n, _ in find_layers(model)]
    except ValueError:
        return []


def _result(mem: StepMemory, model: nn.Module, kind: str, dtype: torch.dtype, notes: list[str],
            autocast: torch.dtype | None = None, runtime: dict[str, int] | None = None) -> Estimate:
    layers = _layers(model)
    act = mem.after_forward.get("Activation", 0)
    accounted = sum(mem.at_peak.get(k, 0) for k in ("Parameter", "Buffer", "Optstate", "Activation", "Gradient",
                                                    "Workspace"))
    return Estimate(
        device=kind, dtype=str(dtype).replace("torch.", ""),
        per_layer=group_by_layer(mem.saved_by_module, layers), saved_by_module=dict(mem.saved_by_module),
        per_layer_alive=group_by_layer(mem.alive_by_module, layers, exact_only=True),
        activations=act, saved=mem.saved, params=mem.params, buffers=mem.buffers, grads=mem.grads,
        optimizer_state=mem.optimizer_state, temporaries=mem.peak - accounted, peak=mem.peak,
        at_peak=mem.at_peak, notes=notes, weight_copies=mem.weight_copies,
        autocast=None if autocast is None else str(autocast).replace("torch.", ""),
        workspaces=mem.at_peak.get("Workspace", 0), workspace_items=dict(runtime or {}), host=mem.host)


def _run(fake_model: nn.Module, fake_in: Any, plan: Any, kind: str, dtype: torch.dtype, real_of: dict,
         mode, optimizer: Any, loss_fn: Callable | None, autocast: torch.dtype | None = None,
         keep_output: bool = False, context_parallel: int | None = None, real_integers: bool = False,
         forward: Callable | None = None, externals: tuple[nn.Module, ...] = (), around: Any = None,
         real_floats: bool = False) -> Estimate:
    notes = list(CUDA_NOTES) if kind == "cuda" else []
    if real_floats:
        notes.append(REAL_FLOATS_NOTE)
    fake_model.train()
    for m in (fake_model, *externals):
        fake_rules.warm(m, dtype)
        if autocast is not None and autocast != dtype:  # the lean ops then also see autocast's dtype
            fake_rules.warm(m, autocast)
    own_pool = getattr(plan, "pool", None)
    if own_pool is not None:  # the estimate's host buffers in a pool of its own, never the user's
        plan.pool = type(own_pool)(own_pool.limit)
    if plan is not None:
        try:
            plan.apply(fake_model)
        except BaseException:
            if own_pool is not None:
                plan.pool = own_pool
            raise
    if context_parallel is not None:  # one rank's step; the collectives allocate their results
        from leanact.parallel.context import SimulatedGroup, context_parallel as split

        split(fake_model, SimulatedGroup(context_parallel))
    cuda = kind == "cuda"
    blas = BlasUse() if cuda else None
    run = fake_rules.FakeRun(kind, sms=target().sms if cuda else 0, real_of=real_of,
                             fewer_iterations=_FEWER_ITERATIONS)
    try:
        kernels = cuda_kernels() if cuda else contextlib.nullcontext()
        prefetch = prefetch_as_cuda() if cuda else contextlib.nullcontext()
        with prefetch, fake_rules.rules(run), causal_skip_on_fake(), kernels, \
                caches_off(fake_model, fake_in) as fake_in, mode, \
                (RealIntegerOps() if real_integers else contextlib.nullcontext()), \
                (blas if cuda else contextlib.nullcontext()), (around or contextlib.nullcontext()):
            mem = run_step(fake_model, fake_in, optimizer=optimizer, loss_fn=loss_fn,
                           block=CUDA_BLOCK if cuda else 1, foreach=True if cuda else None,
                           autocast=autocast, keep_output=keep_output, forward=forward, externals=externals)
    finally:
        if plan is not None:
            plan.remove(fake_model)
        if own_pool is not None:
            plan.pool = own_pool
    runtime = runtime_bytes(blas, run.held, CUDA_BLOCK).items if cuda else {}
    _add_held(mem, sum(runtime.values()))
    return _result(mem, fake_model, kind, dtype, notes, autocast, runtime)


def _add_held(mem: StepMemory, held: int) -> None:
    """Memory allocated before the step and kept through it (CUDA workspaces) adds to every moment of
    the step: to the peak and to its breakdown, as "Workspace"."""
    if held:
        mem.peak += held
        mem.at_peak = {**mem.at_peak, "Workspace": held, "Total": mem.at_peak.get("Total", 0) + held}


def _ranks_arg(ranks) -> None:
    if ranks is not None and (isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1):
        raise ValueError(f"context_parallel must be a number of ranks >= 1 (or None), got {ranks!r}")


def estimate(model: nn.Module, sample_inputs: Any, strategy_or_plan: Any = None, device: Any = None, *,
             dtype: torch.dtype | None = None, optimizer: Any = "adamw", loss_fn: Callable | None = None,
             batch: int | None = None, seq: int | None = None, autocast: Any = None,
             keep_output: bool = False, context_parallel: int | None = None) -> Estimate:
    """Predict the memory of one training step of ``model`` without running it for real.

    The model (real or already fake; patched or not; never modified) is copied with fake weights,
    ``strategy_or_plan`` (None, a name for ``leanact.strategies.uniform`` or a Plan) is applied to
    the copy, and one step -- forward + loss, backward, ``optimizer`` step ("adamw", "sgd", None or
    a callable) -- runs on fake tensors under torch's ``MemTracker``. The model output is released
    before backward, as Hugging Face's ``Trainer`` and most loops do (they keep the loss only);
    ``keep_output=True`` holds it (the logits) through backward. ``sample_inputs``: dict of
    keyword arguments or tuple (real or fake tensors), resized to ``batch`` / ``seq`` if given.
    ``dtype`` casts weights and floating inputs. ``device="cuda"`` models CUDA from the CPU trace
    (see :data:`CUDA_NOTES`). ``loss_fn(out, inputs)``: default the model's ``.loss``.
    ``dtype`` also takes a name ("bf16", "fp16", "fp32", "bfloat16", ...). Hugging Face KV caches
    are off for the step (``use_cache=False``: training does not read them; restored after).
    ``autocast``: "bf16" / "fp16" (or torch.bfloat16 / torch.float16) runs the forward and the loss
    under ``torch.autocast`` of that dtype (fp32 weights: mixed precision); None (default) does so
    when the call itself is inside ``torch.autocast`` (CPU or CUDA), with its dtype; False never.
    ``context_parallel=P``: one rank's step of :func:`leanact.parallel.context_parallel` over P ranks
    (a patched model; ``seq`` is the whole sequence, each rank runs s/P tokens; the all-to-alls'
    buffers are counted, nothing is sent).
    Bad arguments (``batch=0``, ``seq`` beyond the model's learned positions, ...) raise first.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    dtype = _dtype_arg(dtype)
    autocast = autocast_arg(autocast, "estimate")
    _check_sizes(model, batch, seq)
    _ranks_arg(context_parallel)
    kind = _device_kind(device, model)

    def run(real_integers: bool, real_floats: bool) -> Estimate:
        mode = new_mode()
        fake_model, real_of = fake_copy(model, mode, dtype)
        fake_in = fake_inputs(sample_inputs, mode, batch=batch, seq=seq, dtype=dtype, real_integers=real_integers,
                              real_floats=real_floats)
        plan = _resolve_plan(fake_model, strategy_or_plan)
        return _run(fake_model, fake_in, plan, kind, dtype or _dtype_of(fake_model), real_of, mode, optimizer,
                    loss_fn, autocast, keep_output, context_parallel, real_integers, real_floats=real_floats)

    return _with_real_integers_if_read(run)


def _with_real_integers_if_read(run: Callable[[bool, bool], Estimate]) -> Estimate:
    """``run(False, False)``; where the model reads the values of its inputs (a vision-language model's
    token ids and image grid), again with the integer inputs real (:class:`~.fake.RealIntegerOps`); where
    it reads its floating inputs too (Idefics3's check for all-zero padding images), with every input
    that needs no gradient real."""
    for real_integers, real_floats in ((False, False), (True, False)):
        try:
            return run(real_integers, real_floats)
        except DATA_DEPENDENT:
            pass
    try:
        return run(True, True)
    except DATA_DEPENDENT as e:
        raise ValueError("leanact.estimate: the model reads values computed from its weights or from inputs that "
                         f"need a gradient ({e.func if hasattr(e, 'func') else e}), which a fake trace does not "
                         "have; measure a real step instead (leanact.estimate.measure)") from e


def estimate_config(build: Callable[[], nn.Module] | Any, sample_inputs: Any, strategy_or_plan: Any = None,
                    device: Any = "cpu", *, model_class: type | None = None, patch: bool | str = False,
                    dtype: torch.dtype | None = None, optimizer: Any = "adamw", loss_fn: Callable | None = None,
                    batch: int | None = None, seq: int | None = None, autocast: Any = None,
                    keep_output: bool = False, context_parallel: int | None = None) -> Estimate:
    """Like :func:`estimate` for a model that is never built for real: ``build()`` (or
    ``model_class(build)`` when ``build`` is a config) runs under ``FakeTensorMode``. ``patch``:
    True / "recompute" / "tempo" applies ``leanact.patch`` to the fake model first. Norm weights
    are assumed at their default initialisation (γ = 1, β = 0) for leanact's value-dependent choice.
    """
    if model_class is not None:
        config, build = build, (lambda: model_class(config))
    if not callable(build):
        raise TypeError("estimate_config needs a callable returning the model, or a config with model_class=...")
    dtype = _dtype_arg(dtype)
    autocast = autocast_arg(autocast, "estimate_config")
    _size_arg("batch", batch)
    _size_arg("seq", seq)
    _ranks_arg(context_parallel)
    kind = "cpu" if device is None else _device_kind(device, nn.Module())
    mode = new_mode()
    fake_model = build_fake(build, mode, dtype)
    _check_sizes(fake_model, batch, seq)
    if patch:
        from leanact.patching import patch as patch_model

        patch_model(fake_model, attention="recompute" if patch is True else patch)

    def run(real_integers: bool, real_floats: bool) -> Estimate:
        fake_in = fake_inputs(sample_inputs, mode, batch=batch, seq=seq, dtype=dtype, real_integers=real_integers,
                              real_floats=real_floats)
        plan = _resolve_plan(fake_model, strategy_or_plan)
        return _run(fake_model, fake_in, plan, kind, dtype or _dtype_of(fake_model), {}, mode, optimizer, loss_fn,
                    autocast, keep_output, context_parallel, real_integers, real_floats=real_floats)

    return _with_real_integers_if_read(run)
