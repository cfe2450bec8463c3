"""The ``steps`` part: whole training steps side by side in one process, in turns (the Llama-3.2-1B
geometry: HF sdpa, Liger-Kernel, leanact; BERT-Large: HF sdpa, leanact), and the time of the
norms' per-step decision.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time

from .common import Recorder, failed_row, kernel_note, size
from .models import bert_builders, llama_builders
from .side_by_side import Mode, check, compare, failures, ratio


def step_rows(rec: Recorder, model: str, shape: str, modes: list[Mode]) -> None:
    hf = modes[0]
    for m in modes:
        if m.failed:
            failed_row(rec, [model, m.label], *m.failed)
        else:
            rec.row(model, m.label, shape, m.ms, ratio(m.ms, hf.ms), m.peak / 2**30, ratio(m.peak, hf.peak),
                    len(m.times))


@contextlib.contextmanager
def _decision_timer():
    """Yields ``(seconds, syncs)``: the seconds of each per-step decision of leanact's norms
    (``leanact.ops.norms.verdict._refresh_stale``, at the first norm of a step: verdicts that stand
    under Adam's step bound, the others checked in one batch) and the item counts of the batched
    checks (``check_many``: one device-to-host sync each)."""
    from leanact.ops.norms import verdict

    real, real_check = verdict._refresh_stale, verdict.check_many
    seconds: list[float] = []
    syncs: list[int] = []

    def timed(device):
        t0 = time.perf_counter()
        try:
            return real(device)
        finally:
            seconds.append(time.perf_counter() - t0)

    def counted(items, **kw):
        syncs.append(len(items))
        return real_check(items, **kw)

    verdict._refresh_stale, verdict.check_many = timed, counted
    try:
        yield seconds, syncs
    finally:
        verdict._refresh_stale, verdict.check_many = real, real_check


def part_steps(rec: Recorder, limit_s: float) -> None:
    os.environ["LEANACT_TRITON"] = "1"
    start = time.perf_counter()
    rounds = size("steps_rounds")
    lb, ls, bb, bs = (size(k) for k in ("steps_llama_batch", "steps_llama_seq", "steps_bert_batch", "steps_bert_seq"))
    rec.note("fp32 weights + bf16 autocast, fused AdamW, each mode its own model built with the same seed, steps in "
             "turns (A, B, C, A, ...), median step; peak = max_memory_allocated over its steps, less what the other "
             "modes keep; targets: Llama leanact ≤ 1.00x HF sdpa's step and ≤ Liger's, peak ≤ 0.55x HF sdpa's; "
             "BERT-Large leanact ≤ 1.05x HF sdpa's step, peak ≤ 0.6x")
    failed = []
    runs = [("Llama-3.2-1B geometry", lb, ls, llama_builders, 0.6), ("BERT-Large MLM", bb, bs, bert_builders, 1.0)]
    for name, batch, seq, builders, share in runs:
        deadline = start + share * (limit_s - 10)
        with _decision_timer() as (decisions, syncs):
            modes = compare(rec, name, builders(rec, batch, seq), rounds, deadline=deadline)
        if decisions:
            rec.note(f"{name}: the norms' per-step decision ran {len(decisions)} times (median "
                     f"{statistics.median(decisions) * 1e3:.2f} ms), {len(syncs)} of them a batched check with "
                     "its one sync (leanact.ops.norms.batch_check; the others: verdicts standing under AdamW's step "
                     "bound, leanact.ops.norms.step_bound)")
        step_rows(rec, name, f"{batch}x{seq}", modes)
        llama = name.startswith("Llama")
        failed += judge(rec, name, modes, 1.0 if llama else 1.05, 1.0 if llama else None, 0.55 if llama else 0.6)
        del modes
    finish(rec, failed)


def judge(rec: Recorder, name: str, modes: list[Mode], step_limit: float, liger_limit: float | None,
          peak_limit: float) -> list[str]:
    """Note leanact's step and peak against HF sdpa's (and its step against Liger's where it ran) with
    their targets, release the modes, and return the failed ones' names."""
    by = {m.label: m for m in modes}
    hf, lean = by["HF sdpa"], by["leanact"]
    checks = [check("step vs HF sdpa", lean.ms, hf.ms, step_limit)]
    if liger_limit is not None and "Liger" in by:
        checks.append(check("step vs Liger", lean.ms, by["Liger"].ms, liger_limit))
    checks.append(check("peak vs HF sdpa", lean.peak, hf.peak, peak_limit))
    rec.note(f"{name}, leanact: " + "; ".join(checks))
    failed = [f"{name} {label}" for label in failures(modes)]
    for m in modes:
        m.release()
    return failed


def finish(rec: Recorder, failed: list[str]) -> None:
    kernel_note(rec)
    if failed:
        raise RuntimeError(f"{len(failed)} mode(s) failed: {', '.join(failed)}")
