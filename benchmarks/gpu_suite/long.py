"""The ``long`` part (only when named): long context, measured against ``leanact.estimate``.

1. Recompute against offload, Llama-3.2-1B geometry: ``full+tiled_mlp`` and
   ``offload+recompute+tiled_mlp`` at each of ``long_overlap``'s lengths (target: offload ≤ 1.10x from
   the length where its copies fit under compute; the rows say where that starts), each measured peak
   and host memory against the prediction.
2. The planner's edge, for each of ``long_edges`` (model, cap GiB, sequence): the longest sequence
   predicted to fit the cap with ``offload+recompute+tiled_mlp`` runs under that cap
   (``torch.cuda.set_per_process_memory_fraction``; target: no OOM, peak within 3% of the prediction,
   host memory as predicted); then 10% more tokens, which the prediction must refuse (peak above the
   cap less the allocator's reserve), forced: it must run out of memory.
"""
from __future__ import annotations

from .common import Recorder, attempt, dev, empty_cache, size, smoke, step_time

STRATEGY = "offload+recompute+tiled_mlp"


def _model(which: str, device=None):
    """The patched model, bf16 weights (built in bf16: the 8B geometry's fp32 weights would not fit a
    24 GiB cap), on ``device`` (default the run's): "1b" (Llama-3.2-1B geometry, full fine-tuning) or
    "8b-lora" (Llama-3.1-8B geometry, frozen base, bf16 LoRA r=16 on every linear layer)."""
    import dataclasses

    import torch
    import transformers

    import leanact
    from leanact.models.geometries import GEOMETRIES

    g = GEOMETRIES["llama-1b-like" if which == "1b" else "llama-8b-like"]
    if smoke():
        g = dataclasses.replace(g, kwargs={**g.kwargs, **size("llama")})
    torch.manual_seed(0)
    with torch.device(device or dev()):
        model = transformers.AutoModelForCausalLM.from_config(g.make_config(attn="sdpa", dropout=0.0),
                                                              dtype=torch.bfloat16)
    if which != "1b":
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"),
                                    autocast_adapter_dtype=False)
    return leanact.patch(model.train())


def _predicted(which: str, seq: int):
    """leanact.estimate of one step of ``which`` at ``seq`` tokens with the strategy (a meta-device model)."""
    import torch

    from leanact.estimate.maximize import step_estimate

    model = _model(which, "meta")
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return step_estimate(model, dict(input_ids=ids, labels=ids), STRATEGY, "seq", seq,
                         device="cpu" if smoke() else "cuda")


def _long_run(which: str, strategy: str, seq: int, steps: int = 2) -> tuple[float, float, object, int]:
    """(median seconds per step, peak bytes (NaN on the CPU), leanact.estimate of the step, host bytes
    the offload pool held) of ``which`` with ``strategy`` on every layer (MLP chunks as
    leanact.plan(maximize=...) sets them), batch 1, AdamW."""
    import torch

    from leanact.estimate.maximize import step_estimate, strategy_plan

    model = _model(which)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device=dev())
    inputs = dict(input_ids=ids, labels=ids)
    est = step_estimate(model, inputs, strategy, "seq", seq, device="cpu" if smoke() else "cuda")
    plan = strategy_plan(model, strategy, seq)
    plan.apply(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, foreach=True)
    from .models import train_step

    t, peak = step_time(train_step(model, opt, inputs, False), steps=steps)
    return t, peak * 2**30, est, plan.pool.peak


def _cap(gib) -> None:
    import torch

    if gib is not None and dev() == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total))


def _row(rec: Recorder, which, strategy, cap, n, measured, ref, expect) -> None:
    t, peak, est, host = measured
    rec.row(which, strategy, cap or "-", n, expect, t * 1000, f"{t / ref:.3f}x" if ref else "-", peak / 2**30,
            est.peak / 2**30, f"{peak / est.peak:.3f}" if peak == peak else "n/a", host / 2**30, est.host / 2**30)


def part_long(rec: Recorder, limit_s: float) -> None:
    """Module doc: recompute against offload at several lengths, then the planner's edge under caps."""
    from leanact.estimate.maximize import reserve_for

    rec.note("targets: offload+recompute+tiled_mlp ≤ 1.10x full+tiled_mlp's step time where its copies fit under "
             "compute; under a cap, the planner's longest sequence runs (no OOM) with the measured peak within 3% of "
             "leanact.estimate(device=\"cuda\") and the host memory as predicted (pinned buffers rounded to powers "
             "of two), and 10% more is predicted over the cap and runs out of memory when forced")
    for n in size("long_overlap"):
        ref = None
        for strategy in ("full+tiled_mlp", STRATEGY):
            measured, kind, what = attempt(lambda s=strategy, n=n: _long_run("1b", s, n))
            empty_cache()
            if kind:
                rec.row("1b", strategy, "-", n, "fits", kind, *["n/a"] * 6)
                rec.note(f"1b {strategy} at {n}: {what}")
                continue
            ref = ref or measured[0]
            _row(rec, "1b", strategy, None, n, measured, ref if strategy == STRATEGY else None, "fits")
    for which, cap, n in size("long_edges"):
        _cap(cap)
        measured, kind, what = attempt(lambda w=which, n=n: _long_run(w, STRATEGY, n, steps=1))
        empty_cache()
        if kind:
            rec.row(which, STRATEGY, cap or "-", n, "fits", kind, *["n/a"] * 6)
            rec.note(f"{which} under {cap} GiB at {n} tokens: {what} (target missed: it must fit)")
        else:
            _row(rec, which, STRATEGY, cap, n, measured, None, "fits")
        over = n + -(-n // 10 // 1024) * 1024  # 10% more, in whole 1024-token blocks
        est = _predicted(which, over)
        budget = None if cap is None else cap * 2**30 - reserve_for(cap * 2**30)
        refused = budget is not None and est.peak > budget
        rec.note(f"{which} under {cap} GiB at {over} tokens (10% more): predicted peak {est.peak / 2**30:.2f} GiB, "
                 + ("over the cap less the reserve: refused" if refused else "not over the cap (target missed)"
                    if budget is not None else "no cap here"))
        forced, kind, what = attempt(lambda w=which, m=over: _long_run(w, STRATEGY, m, steps=1))
        empty_cache()
        if kind:
            rec.row(which, STRATEGY, cap or "-", over, "refused", kind, "-", "n/a", est.peak / 2**30, "n/a", "n/a",
                    est.host / 2**30)
            rec.note(f"{which} under {cap} GiB at {over} tokens, forced: {what}")
        else:
            _row(rec, which, STRATEGY, cap, over, forced, None, "refused")
            if budget is not None and dev() == "cuda":
                rec.note(f"{which} under {cap} GiB at {over} tokens, forced, ran: target missed (it must run out "
                         "of memory)")
        _cap(None if cap is None else 10**6)  # the whole device again
