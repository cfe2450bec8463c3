"""The ``long`` part (only when named): long context, recompute against offload, each measured peak
against ``leanact.estimate``; then the longest sequence predicted to fit 16 GiB, run under that cap.
"""
from __future__ import annotations

from .common import Recorder, dev, empty_cache, size, smoke, step_time, unless_oom
from .models import llama_model, train_step


def _long_run(strategy: str, seq: int, steps: int = 2) -> tuple[float, float, object, int]:
    """(median seconds per step, peak bytes (NaN on the CPU), leanact.estimate of the step, host bytes
    the offload pool held) of the patched Llama-3.2-1B geometry in bf16 with ``strategy`` on every
    layer (MLP chunks as leanact.plan(maximize=...) sets them), batch 1, AdamW."""
    import torch

    import leanact
    from leanact.estimate.maximize import step_estimate, strategy_plan

    model = leanact.patch(llama_model("sdpa").to(torch.bfloat16))
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device=dev())
    inputs = dict(input_ids=ids, labels=ids)
    est = step_estimate(model, inputs, strategy, "seq", seq, device="cpu" if smoke() else "cuda")
    plan = strategy_plan(model, strategy, seq)
    plan.apply(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    t, peak = step_time(train_step(model, opt, inputs, False), steps=steps)
    return t, peak * 2**30, est, plan.pool.peak


def part_long(rec: Recorder, limit_s: float) -> None:
    """Both recompute strategies side by side at ``long_seq`` tokens (target: offload ≤ 1.10x, the
    copies hidden under compute), each against its prediction; then the longest sequence predicted to
    fit ``long_cap_gib`` run for real under that cap (target: no OOM, peak within 5% of the prediction)."""
    import torch

    seq, cap, cap_seq = size("long_seq"), size("long_cap_gib"), size("long_cap_seq")
    rec.note("targets: offload+recompute+tiled_mlp ≤ 1.10x full+tiled_mlp's step time; measured peak within 5% of "
             "leanact.estimate(device=\"cuda\"); host memory as predicted (pinned buffers rounded to powers of two)")
    ref = None
    runs = [("full+tiled_mlp", None, seq, 2), ("offload+recompute+tiled_mlp", None, seq, 2)]
    if cap is not None and cap_seq:
        runs.append(("offload+recompute+tiled_mlp", cap, cap_seq, 1))
    for strategy, cap_gib, n, steps in runs:
        if cap_gib is not None:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total))
        measured = unless_oom(rec, f"{strategy} (cap {cap_gib} GiB)" if cap_gib else strategy,
                              lambda: _long_run(strategy, n, steps))
        empty_cache()
        if measured is None:
            continue
        t, peak, est, host = measured
        ref = ref or t
        rec.row(strategy, cap_gib or "-", n, t * 1000, f"{t / ref:.3f}x" if cap_gib is None else "-", peak / 2**30,
                est.peak / 2**30, f"{peak / est.peak:.3f}" if peak == peak else "n/a", host / 2**30, est.host / 2**30)
