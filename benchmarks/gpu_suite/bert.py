"""The ``bert`` part: Tempo's comparison, BERT-Large's largest batch and its throughput per mode under
the memory caps of :data:`BERT_CAPS`, leanact's against HF sdpa's.
"""
from __future__ import annotations

import os
import time

from .common import Recorder, attempt, dev, failed_row, size, smoke
from .models import bert_module


BERT_MODES = [("HF sdpa", "sdpa", None), ("leanact", "sdpa", "patch"), ("HF eager", "eager", None),
              ("HF sdpa + checkpointing", "sdpa", "checkpointing")]
#: (cap GiB, leanact's batch target, its throughput target), each vs HF sdpa's under the same cap
BERT_CAPS = [(8.0, 1.6, 1.16), (16.0, 1.6, 1.0)]
BERT_CORE = ("HF sdpa", "leanact")  # run under every cap; the other modes under the largest only


def bert_runs(caps=None, modes=None) -> list[tuple]:
    """(cap GiB, batch target, throughput target, label, attn, how) in the order the bert part runs
    them: the core comparison under every cap first, the other modes last (under the largest cap)."""
    caps, modes = caps or BERT_CAPS, modes or BERT_MODES
    largest = max(c[0] for c in caps)
    core = [(c, tb, ts, *m) for c, tb, ts in caps for m in modes if m[0] in BERT_CORE]
    rest = [(c, tb, ts, *m) for c, tb, ts in caps for m in modes if m[0] not in BERT_CORE and c == largest]
    return core + rest


def bert_verdict(label: str, rb: float, rs: float, target_batch: float, target_speed: float) -> str:
    """The targets column of a bert row: leanact's batch and throughput against HF sdpa's."""
    def ok(v: float, t: float) -> str:
        return ("ok" if v >= t else "no") + f" (≥ {t:g}x)"  # nan: no

    return f"batch {ok(rb, target_batch)}, throughput {ok(rs, target_speed)}" if label == "leanact" else ""


def bert_ratios(rows: list[tuple[str, int, float]]) -> list[tuple[str, float, float]]:
    """(mode, batch / HF sdpa's, throughput / HF sdpa's) for rows (mode, batch, seq/s)."""
    ref = next((r for r in rows if r[0] == "HF sdpa"), None)
    out = []
    for mode, batch, speed in rows:
        rb = batch / ref[1] if ref and ref[1] else float("nan")
        rs = speed / ref[2] if ref and ref[2] else float("nan")
        out.append((mode, rb, rs))
    return out


def _bert_mode(gb, attn: str, how: str | None) -> tuple[int, float, float]:
    """(largest batch, seq/s, peak GiB) of one BERT-Large mode (a function: its model is freed on return)."""
    import torch

    import leanact

    seq = size("bert_seq")
    model = gb.build(attn, None, "bf16", "autocast", seq, dev(), **size("bert"))
    os.environ["LEANACT_TRITON"] = "1"  # leanact's rows: its Triton kernels (the PyTorch path: LLaMA's part)
    if how == "patch":
        leanact.patch(model)
    elif how == "checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    return gb.measure_step(gb.make_step(model, opt, "bf16", "autocast", seq), limit=size("bert_limit"),
                           steps=size("bert_steps"), opt=opt, device=dev())


def part_bert(rec: Recorder, limit_s: float, caps=None) -> None:
    import torch

    gb = bert_module()
    total = None if smoke() else torch.cuda.get_device_properties(0).total_memory
    if total is None:
        rec.note(f"smoke run: no memory cap, batches up to {size('bert_limit')}")
    else:
        rec.note(f"caps of {total / 2**30:.0f} GiB; each mode at its own largest batch, ratios to HF sdpa under "
                 "the same cap; the b=32 step time and peak: the steps part")
    deadline = time.perf_counter() + limit_s - 5
    done: dict[float, list] = {}
    for cap, target_batch, target_speed, label, attn, how in bert_runs(caps):
        if time.perf_counter() > deadline:
            rec.note(f"stopped before {label} at {cap:g} GiB: time limit")
            break
        if total is not None:
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 2**30 / total))
        # an OOM outside the batch search (building the model, the optimizer's first step) is this mode's row
        measured, kind, what = attempt(lambda: _bert_mode(gb, attn, how))
        gb._free()
        if kind:
            failed_row(rec, [f"{cap:g}", label], kind, what)
            continue
        batch, speed, peak = measured
        done.setdefault(cap, []).append((label, batch, speed))
        rb, rs = {m: (rb, rs) for m, rb, rs in bert_ratios(done[cap])}[label]
        rec.row(f"{cap:g}", label, batch, f"{rb:.2f}x", speed, f"{rs:.2f}x", peak,
                bert_verdict(label, rb, rs, target_batch, target_speed))
