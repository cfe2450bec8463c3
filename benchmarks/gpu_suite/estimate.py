"""The ``estimate`` part: ``leanact.estimate`` against the measured peak of a real steady-state step
(BERT-base), with what was live at that peak.
"""
from __future__ import annotations

import dataclasses
import os

from .common import Recorder, dev, empty_cache, size, smoke, step_time, unless_oom
from .models import train_step


def _peak_sites(step, top: int = 8) -> tuple[float, list[str]]:
    """(max_memory_allocated in GiB, notes) of one ``step()`` after a warm-up step, recorded with CUDA
    memory history: the peaks of allocated / requested / reserved bytes, what was allocated before the
    step, and the allocations of the step live at its peak grouped by the first leanact /
    transformers / benchmark frame that made them (what to compare with leanact.estimate's trace)."""
    import torch

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    st = torch.cuda.memory_stats()
    mib = 2**20
    peaks = {k: st[f"{k}_bytes.all.peak"] / mib for k in ("allocated", "requested", "reserved")}
    notes = [f"allocated peak {peaks['allocated']:.1f} MiB (requested {peaks['requested']:.1f}, reserved "
             f"{peaks['reserved']:.1f}); {base / mib:.1f} MiB allocated before the step"]
    trace = snap["device_traces"][torch.cuda.current_device()]

    def site(e) -> str:
        frames = e.get("frames") or []
        ours = (f for f in frames if any(k in f.get("filename", "") for k in ("leanact", "transformers", "benchmarks")))
        f = next(ours, frames[0] if frames else {})
        return f"{os.path.basename(f.get('filename', '?'))}:{f.get('line', '?')} {f.get('name', '?')}"

    def replay(stop: int | None):
        live, total, best = {}, 0, (0, -1)
        for i, e in enumerate(trace[:stop]):
            if e["action"] == "alloc":
                live[e["addr"]] = e
                total += e["size"]
            elif e["action"] == "free_completed" and e["addr"] in live:
                total -= live.pop(e["addr"])["size"]
            if total > best[0]:
                best = (total, i)
        return live, best

    _, (_, at) = replay(None)
    live, _ = replay(at + 1)
    by_site: dict[str, list[int]] = {}
    for e in live.values():
        by_site.setdefault(site(e), []).append(e["size"])
    rows = sorted(by_site.items(), key=lambda kv: -sum(kv[1]))
    notes += [f"live at the peak: {sum(v) / mib:.1f} MiB in {len(v)} blocks from {k}" for k, v in rows[:top]]
    return st["allocated_bytes.all.peak"] / 2**30, notes


def _estimate_and_measure(lean: bool, batch: int, seq: int = 512, rec: Recorder | None = None) -> tuple[float, float]:
    """(estimated peak, measured max_memory_allocated) in bytes of one steady-state step of BERT-base
    (bf16 weights, dropout 0.1, AdamW foreach). On the CPU (smoke run) the measurement is
    :func:`leanact.estimate.measure`'s real step. On CUDA, with ``rec``: notes of what was live at the
    measured peak (:func:`_peak_sites`) and the estimate's CUDA workspaces."""
    import torch
    import transformers

    import leanact
    from leanact.estimate import measure
    from leanact.models.geometries import GEOMETRIES

    g = GEOMETRIES["bert-base"]
    g = dataclasses.replace(g, kwargs={**g.kwargs, **size("est_bert")})
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(g.make_config(attn="sdpa"))
    model = model.to(device=dev(), dtype=torch.bfloat16).train()
    if lean:
        leanact.patch(model)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=dev())
    inputs = dict(input_ids=ids, labels=ids)
    est = leanact.estimate(model, inputs, None, device=dev(), optimizer="adamw")
    measured = measure(model, inputs, optimizer="adamw").peak if dev() == "cpu" else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    if measured is None and rec is not None:
        peak, notes = _peak_sites(train_step(model, opt, inputs, False))
        what = "leanact" if lean else "HF"
        rec.note(f"{what}: estimated workspaces {est.workspaces / 2**20:.1f} MiB {est.workspace_items}; "
                 f"at the estimated peak {({k: round(v / 2**20, 1) for k, v in est.at_peak.items()})} MiB")
        for n in notes:
            rec.note(f"{what}: {n}")
        return est.peak, peak * 2**30
    _, peak = step_time(train_step(model, opt, inputs, False), steps=1)
    return est.peak, measured if measured is not None else peak * 2**30


def part_estimate(rec: Recorder, limit_s: float) -> None:
    batch, seq = size("est_batch"), size("est_seq")
    if smoke():
        rec.note("smoke run: leanact.estimate(device=\"cpu\") vs leanact.estimate.measure (a real CPU step)")
    for label, lean in ((f"BERT-base s={seq}, HF sdpa", False), (f"BERT-base s={seq}, leanact", True)):
        both = unless_oom(rec, label, lambda: _estimate_and_measure(lean, batch, seq, rec))
        empty_cache()
        if both is None:
            continue
        est, measured = both
        rec.row(label, batch, est / 2**30, measured / 2**30, f"{est / measured:.3f}",
                "ok" if abs(est / measured - 1) <= 0.05 else "no")
