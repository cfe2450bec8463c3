"""The ``compiled`` part (only when named): the ``steps`` part's whole training steps with every model
under ``torch.compile`` (inductor; Dynamo alone, backend ``eager``, in a smoke run), side by side in turns: the
Llama-3.2-1B geometry (HF sdpa, Liger-Kernel, leanact) and BERT-Large (HF sdpa, leanact; on CUDA also
both with CUDA graphs, ``mode="reduce-overhead"``), each model's first step (tracing and compiling)
noted next to the others'.
"""
from __future__ import annotations

import os
import time

from .common import Recorder, size, smoke
from .models import bert_builders, llama_builders
from .side_by_side import check, compare
from .steps import finish, judge, step_rows


def part_compiled(rec: Recorder, limit_s: float) -> None:
    os.environ["LEANACT_TRITON"] = "1"
    start = time.perf_counter()
    backend = "eager" if smoke() else "inductor"  # (a smoke run checks the part's code: Dynamo alone)
    rounds = size("steps_rounds")
    lb, ls, bb, bs = (size(k) for k in ("steps_llama_batch", "steps_llama_seq", "steps_bert_batch", "steps_bert_seq"))
    rec.note(f"every model under torch.compile (backend {backend}); fp32 weights + bf16 autocast, fused AdamW, "
             "steps in turns, median step; targets: Llama leanact ≤ 0.90x HF sdpa's compiled step and ≤ Liger's, "
             "peak ≤ 0.5x HF sdpa's; BERT-Large leanact ≤ 0.90x HF sdpa's compiled step, peak ≤ 0.6x")
    failed = []
    runs = [("Llama-3.2-1B geometry", lb, ls, llama_builders, 0.6), ("BERT-Large MLM", bb, bs, bert_builders, 1.0)]
    for name, batch, seq, builders, share in runs:
        deadline = start + share * (limit_s - 10)
        modes = compare(rec, name + " (compiled)", builders(rec, batch, seq, backend), rounds, deadline=deadline)
        step_rows(rec, name + " (compiled)", f"{batch}x{seq}", modes)
        llama = name.startswith("Llama")
        by = {m.label: m for m in modes}
        ro = ("HF sdpa, reduce-overhead", "leanact, reduce-overhead")
        if all(k in by for k in ro):
            rec.note(f"{name} with CUDA graphs (mode='reduce-overhead'), leanact: "
                     + check("step vs HF sdpa's", by[ro[1]].ms, by[ro[0]].ms, 0.9) + "; "
                     + check("peak vs HF sdpa's", by[ro[1]].peak, by[ro[0]].peak, 0.6) + "; "
                     + check("step vs leanact's without CUDA graphs", by[ro[1]].ms, by["leanact"].ms, 1.0))
        failed += judge(rec, name + " (compiled)", modes, 0.9, 1.0 if llama else None, 0.5 if llama else 0.6)
        del modes
    finish(rec, failed)
