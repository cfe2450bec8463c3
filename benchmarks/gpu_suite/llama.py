"""The ``llama`` part: the LLaMA-1B-like training step at equal batch, HF sdpa against leanact (its
Triton kernels, and its PyTorch path).
"""
from __future__ import annotations

import os

from .common import Recorder, dev, empty_cache, size, step_time, unless_oom
from .models import llama_model, train_step


def _llama_time(lean: bool, batch: int, seq: int, kernels: bool = True) -> tuple[float, float]:
    import torch

    import leanact

    os.environ["LEANACT_TRITON"] = "1" if kernels else "0"
    model = llama_model("sdpa")
    if lean:
        leanact.patch(model)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=dev())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    return step_time(train_step(model, opt, dict(input_ids=ids, labels=ids), True), steps=4)


def part_llama(rec: Recorder, limit_s: float) -> None:
    batch, seq = size("llama_batch"), size("llama_seq")
    rec.note(f"batch {batch}, seq {seq}; target: leanact ≤ 1.05x HF sdpa's step time")
    ref = None
    for label in ("HF sdpa", "leanact", "leanact, PyTorch path (LEANACT_TRITON=0)"):
        measured = unless_oom(rec, label, lambda: _llama_time(label != "HF sdpa", batch, seq,
                                                               kernels="PyTorch" not in label))
        empty_cache()
        if measured is None:
            ref = ref or float("nan")  # HF sdpa's OOM: no ratios
            continue
        t, peak = measured
        ref = ref or t
        rec.row(label, batch, seq, t * 1000, f"{t / ref:.3f}x", peak)
