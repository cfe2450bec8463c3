"""The models the parts build and step: the Llama-3.2-1B geometry ("llama-1b-like"), BERT-Large
(``benchmarks/gpu_bert_large.py``), a training step, and the ``steps`` and ``profile`` parts'
builders (each makes its model, optimizer and batch and returns its step).
"""
from __future__ import annotations

import dataclasses

from .common import Recorder, bench_module, dev, size, sync
from .liger import AttributeSwap, liger_llama_patch


def bert_module():
    """``benchmarks/gpu_bert_large.py`` (BERT-Large's build, step and batch search) as a module."""
    return bench_module("gpu_bert_large")


def llama_model(attn: str):
    """The Llama-3.2-1B geometry with ``attn`` attention (the run's sizes), on the run's device, in training mode."""
    import torch
    import transformers

    from leanact.models.geometries import GEOMETRIES

    g = GEOMETRIES["llama-1b-like"]
    g = dataclasses.replace(g, kwargs={**g.kwargs, **size("llama")})
    torch.manual_seed(0)
    with torch.device(dev()):
        model = getattr(transformers, g.model_cls)(g.make_config(attn=attn, dropout=0.0))
    return model.train()


def train_step(model, opt, inputs: dict, autocast: bool):
    """``step()``: forward on ``inputs`` (under bf16 autocast with ``autocast``), backward, ``opt.step()``."""
    import torch

    def step() -> None:
        with torch.autocast(dev(), dtype=torch.bfloat16, enabled=autocast):
            loss = model(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _adamw(model):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev() == "cuda")


def compiled(rec: Recorder, label: str, model, backend: str | None, mode: str | None = None):
    """``model`` as torch.compile's module (``backend`` None: the model itself; ``mode``, e.g.
    ``"reduce-overhead"``: CUDA graphs), its compile time noted at its first step (:func:`first_step_noted`)."""
    import torch

    if backend is None:
        return model
    rec.note(f"{label}: torch.compile(model, backend={backend!r}" + (f", mode={mode!r})" if mode else ")"))
    return torch.compile(model, backend=backend, mode=mode)


def first_step_noted(rec: Recorder, label: str, step):
    """``step`` after running it once and noting how long that first step took (with torch.compile:
    tracing and compiling included)."""
    import time

    t0 = time.perf_counter()
    step()
    sync()
    rec.note(f"{label}: first step (tracing and compiling included) {time.perf_counter() - t0:.1f} s")
    return step


def llama_builders(rec: Recorder, batch: int, seq: int, backend: str | None = None) -> list:
    """(label, build) of the steps part's Llama modes: HF sdpa, Liger (when it imports), leanact; each
    build makes its model with the same seed, fused AdamW and the same batch, and returns its step.
    ``backend``: each model under torch.compile with it (the compiled part), its compile time noted."""
    import torch

    import leanact

    def train(model, label="model"):
        torch.manual_seed(1)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=dev())
        step = train_step(compiled(rec, label, model, backend), _adamw(model), dict(input_ids=ids, labels=ids), True)
        return step if backend is None else first_step_noted(rec, label, step)

    def hf():
        return train(llama_model("sdpa"), "HF sdpa")

    def lean():
        return train(leanact.patch(llama_model("sdpa")), "leanact")

    builders = [("HF sdpa", hf)]
    patch, what = liger_llama_patch()
    if patch is None:
        rec.note(f"no Liger row: {what}")
    else:
        def liger():
            from transformers.models.llama import modeling_llama

            swap, (how, fn) = AttributeSwap(modeling_llama), patch
            if how == "before":
                swap.capture(fn)
                with swap.active():
                    model = llama_model("sdpa")
            else:
                model = llama_model("sdpa")
                swap.capture(lambda: fn(model))
            kinds = {}
            for mod in model.modules():
                if type(mod).__name__.startswith("Liger"):
                    kinds[type(mod).__name__] = kinds.get(type(mod).__name__, 0) + 1
            rec.note(f"Liger: {what}; it rebound {swap.describe()} (in place only while its model builds and steps); "
                     f"its model has {', '.join(f'{n} {k}' for k, n in kinds.items()) or 'no Liger modules'}")
            with swap.active():
                step = train(model, "Liger")

            def liger_step():
                with swap.active():
                    step()

            return liger_step

        builders.append(("Liger", liger))
    builders.append(("leanact", lean))
    return builders


def bert_builders(rec: Recorder, batch: int, seq: int, backend: str | None = None) -> list:
    """(label, build) of the steps part's BERT-Large modes: HF sdpa, leanact (Liger has no BERT patch);
    ``backend``: as :func:`llama_builders` (then without the last, host-time mode)."""
    import torch

    import leanact

    gb = bert_module()
    rec.note("BERT-Large: no Liger row (Liger-Kernel has no BERT patch)")

    def build(options: dict | None, mode: str | None = None):
        model = gb.build("sdpa", None, "bf16", "autocast", seq, dev(), **size("bert"))
        if options is not None:
            leanact.patch(model, **options)
        torch.manual_seed(1)
        label = ("HF sdpa" if options is None else "leanact") + (f", {mode}" if mode else "")
        step = train_step(compiled(rec, label, model, backend, mode), _adamw(model),
                          gb.make_batch(batch, seq, model.config.vocab_size, dev()), True)
        return step if backend is None else first_step_noted(rec, label, step)

    if backend is not None:
        modes = [("HF sdpa", lambda: build(None)), ("leanact", lambda: build({}))]
        if backend == "inductor" and dev() == "cuda":  # CUDA graphs: the host-bound part of the step gone
            ro = "reduce-overhead"
            modes += [(f"HF sdpa, {ro}", lambda: build(None, ro)), (f"leanact, {ro}", lambda: build({}, ro))]
        return modes

    # the last mode: without the two autocast memory savings, whose saved-tensor hooks cost host time
    # (benchmarks/host_stub.py): what they cost a host-bound step, and what they save
    fast = dict(cast_recipes=False, recast_weights=False)
    return [("HF sdpa", lambda: build(None)), ("leanact", lambda: build({})),
            ("leanact, cast_recipes=False, recast_weights=False", lambda: build(fast))]
