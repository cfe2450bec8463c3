"""The ``head`` part: head + causal-LM loss forward + backward, HF's, leanact's, torch's and
Liger-Kernel's in turns: time, transient memory, and the difference to HF's loss and gradients.
"""
from __future__ import annotations

import os
import time

from .common import Recorder, attempt, bench_module, dev, failed_row, kernel_note, size
from .liger import liger_head
from .side_by_side import Mode, check, failures, interleave, ratio


def head_modes(rec: Recorder) -> list[tuple[str, object]]:
    """(label, loss(x, W, labels)) of the head part, HF's first (the reference); notes the rows left out."""
    import torch
    import torch.nn.functional as F

    hm = bench_module("head")
    modes = [("HF ForCausalLMLoss", hm.hf_loss), ("leanact (grad_in_forward, as patch trains)", hm.lean_loss(True))]
    if hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions"):
        modes.append(("torch F.linear_cross_entropy", hm.torch_loss))
    else:
        rec.note(f"torch {torch.__version__} has no F.linear_cross_entropy with LinearCrossEntropyOptions "
                 "(torch >= 2.13): no torch row")
    liger, why = liger_head()
    if liger is None:
        rec.note(f"no Liger row: {why}")
    else:
        modes.append(("Liger LigerFusedLinearCrossEntropyLoss", liger))
    return modes


def part_head(rec: Recorder, limit_s: float) -> None:
    import torch

    os.environ["LEANACT_TRITON"] = "1"
    deadline = time.perf_counter() + limit_s - 10
    b, s, h, v = (size(k) for k in ("head_batch", "head_seq", "head_hidden", "head_vocab"))
    logits32 = b * s * v * 4  # HF's fp32 logits, the unit of the target
    rec.note(f"b={b} s={s} ({b * s} tokens), hidden {h}, vocabulary {v}, bf16 weights and inputs; HF's fp32 logits "
             f"N·V·4 = {logits32 / 2**30:.2f} GiB; transient = max_memory_allocated above the inputs over forward + "
             "backward, gradients dx, dW included; targets: leanact's time ≤ HF's and ≤ Liger's, its transient "
             "without dx, dW ≤ 5% of HF's fp32 logits")
    torch.manual_seed(0)
    x = torch.randn(b, s, h, device=dev()).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(v, h, device=dev()) * h ** -0.5).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (b, s), device=dev())
    grads = (x.numel() + w.numel()) * 2
    ref, diffs = [], {}

    def checked(label, fn, first: bool):
        """One forward + backward: the first mode's (HF's) loss, dx, dW kept (fp32) as the reference,
        the others' max relative difference (norm-wise) to it; returns the mode's step (which frees
        its gradients after it: the next step's transient includes them)."""
        x.grad = w.grad = None
        loss = fn(x, w, labels)
        loss.backward()
        got = (loss.detach().float(), x.grad.float(), w.grad.float())
        x.grad = w.grad = None
        if first:
            ref.extend(got)
        elif ref:
            diffs[label] = max(((a - c).norm() / c.norm()).item() for a, c in zip(got, ref))

        def step():
            fn(x, w, labels).backward()
            x.grad = w.grad = None

        return step

    runs = []
    for i, (label, fn) in enumerate(head_modes(rec)):
        m = Mode(label)
        m.step, kind, what = attempt(lambda: checked(label, fn, i == 0), catch_all=True)
        if kind:
            m.fail(kind, what)
        runs.append(m)
    interleave(runs, size("head_rounds"), deadline=deadline)
    hf = runs[0]
    for m in runs:
        if m.failed:
            failed_row(rec, [m.label], *m.failed)
            continue
        rel = diffs.get(m.label, 0.0 if m is hf else float("nan"))
        share, extra = ("n/a", "n/a") if m.peak != m.peak else (f"{m.peak / logits32:.1%}",
                                                                 f"{(m.peak - grads) / logits32:.1%}")
        rec.row(m.label, m.ms, ratio(m.ms, hf.ms), m.peak / 2**30, share, extra, f"{rel:.1e}", len(m.times))
    lean = runs[1]
    liger = next((m for m in runs if m.label.startswith("Liger")), None)
    checks = [check("time vs HF", lean.ms, hf.ms, 1.0)]
    if liger is not None:
        checks.append(check("time vs Liger", lean.ms, liger.ms, 1.0))
    extra = (lean.peak - grads) / logits32
    verdict = "ok" if extra <= 0.05 else "no"
    checks.append(f"transient without dx, dW {extra:.1%} of HF's fp32 logits (target ≤ 5%: {verdict})"
                  if extra == extra else "transient n/a")
    rec.note("leanact: " + "; ".join(checks))
    kernel_note(rec)
    bad = failures(runs)
    if bad:
        raise RuntimeError(f"{len(bad)} mode(s) failed: {', '.join(bad)}")
