"""The ``profile`` part (only when named): the ``steps`` part's steps, HF sdpa and leanact, one step
each under torch.profiler: its kernels by device time.
"""
from __future__ import annotations

import gc
import os
import time

from .common import Recorder, attempt, dev, empty_cache, failed_row, size, sync
from .models import bert_builders, llama_builders


#: Kernels listed per mode in the profile part (by device time; the rest summed in one row).
PROFILE_TOP = 12


def profile_step(step) -> tuple[list[tuple[str, int, float]], float, int, float]:
    """One step (after one warm-up step) under torch.profiler: ``(kernels, device ms, launches, wall
    ms)``, kernels = ``(name, calls, ms)`` by device time, most first (CUDA kernels; on the CPU the
    aten operators by their own CPU time)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step()
    sync()
    cuda = dev() == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        sync()
        wall = (time.perf_counter() - t0) * 1000
    by: dict[str, list] = {}
    if cuda:
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                entry = by.setdefault(e.name, [0, 0.0])
                entry[0] += 1
                entry[1] += e.time_range.elapsed_us() / 1000
    else:
        for e in prof.key_averages():
            if e.key.startswith("aten::"):
                by[e.key] = [e.count, e.self_cpu_time_total / 1000]
    kernels = sorted(((n, c, ms) for n, (c, ms) in by.items()), key=lambda k: -k[2])
    return kernels, sum(k[2] for k in kernels), sum(k[1] for k in kernels), wall


def _short(name: str, width: int = 90) -> str:
    """A kernel's name for a table cell: no pipes, at most ``width`` characters."""
    name = name.replace("|", "/").replace("\n", " ")
    return name if len(name) <= width else name[: width - 3] + "..."


def part_profile(rec: Recorder, limit_s: float) -> None:
    """Where a step's GPU time goes: the steps part's BERT-Large and Llama steps (HF sdpa and
    leanact), each profiled for one step, its kernels by device time."""
    os.environ["LEANACT_TRITON"] = "1"
    start = time.perf_counter()
    rec.note("one step after one warm-up step, the steps part's models, batches and optimizer; kernels by their "
             "device time in that step (torch.profiler; CPU smoke run: aten operators by their own CPU time); "
             "'(all)' = every kernel, with the step's wall time in the last column's note")
    lb, ls, bb, bs = (size(k) for k in ("steps_llama_batch", "steps_llama_seq", "steps_bert_batch", "steps_bert_seq"))
    failed = []
    runs = [("BERT-Large MLM", bb, bs, bert_builders), ("Llama-3.2-1B geometry", lb, ls, llama_builders)]
    for name, batch, seq, builders in runs:
        for label, build in builders(rec, batch, seq):
            if label not in ("HF sdpa", "leanact"):
                continue
            if time.perf_counter() - start > limit_s - 20:
                rec.note(f"stopped before {name} {label}: time limit")
                break
            step, kind, what = attempt(build, catch_all=True)
            out = None
            if not kind:
                out, kind, what = attempt(lambda: profile_step(step), catch_all=True)
            step = None
            gc.collect()
            empty_cache()
            if kind:
                failed_row(rec, [name, label], kind, what)
                failed.append(f"{name} {label}")
                continue
            kernels, total, launches, wall = out
            rec.row(name, label, "(all)", launches, total, 100.0)
            rec.note(f"{name}, {label}: device time {total:.1f} ms in {launches} launches, wall {wall:.1f} ms")
            for kname, calls, ms in kernels[:PROFILE_TOP]:
                rec.row(name, label, _short(kname), calls, ms, 100 * ms / total if total else float("nan"))
    if failed:
        raise RuntimeError(f"{len(failed)} mode(s) failed: {', '.join(failed)}")
