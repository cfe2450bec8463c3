"""The ``offload`` part: step time and peak with and without CPU offload of every layer."""
from __future__ import annotations

from .common import Recorder, dev, size, step_time, unless_oom
from .models import bert_module


def _offload_time(gb, offload: bool, batch: int) -> tuple[float, float, int]:
    """(median seconds per step, peak GiB, saved tensors copied to the host over all steps)."""
    import torch

    import leanact
    from leanact import strategies

    seq = size("bert_seq")
    model = gb.build("sdpa", None, "bf16", "autocast", seq, dev(), **size("bert"))
    leanact.patch(model)
    if offload:
        strategies.uniform(model, "offload", **size("offload_threshold")).apply(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step = gb.make_step(model, opt, "bf16", "autocast", seq)
    t, peak = step_time(lambda: step(batch), steps=3)
    # each offloaded layer's forward is wrapped with its OffloadTransform
    moved = sum(getattr(getattr(m.__dict__.get("forward"), "transform", None), "offloaded", 0) for m in model.modules())
    return t, peak, moved


def part_offload(rec: Recorder, limit_s: float) -> None:
    gb = bert_module()
    batch = size("offload_batch")
    ref = None
    for label, offload in (("leanact", False), ("leanact + offload (every layer)", True)):
        measured = unless_oom(rec, label, lambda: _offload_time(gb, offload, batch))
        gb._free()
        if measured is None:
            ref = ref or float("nan")
            continue
        t, peak, moved = measured
        if offload and not moved:
            raise RuntimeError("the offload plan copied no saved tensor to the host")
        ref = ref or t
        rec.row(label, batch, t * 1000, f"{t / ref:.3f}x", peak, moved)
