"""One command for a CUDA machine: tests, kernel timings, memory and speed, appended to RESULTS.md.

    python benchmarks/gpu_suite [--out benchmarks/RESULTS.md]
        [--parts tests ops bert llama estimate offload head steps long profile]

Parts (each in its own process with its own time limit, so a crash, a hang or a poisoned CUDA
context in one part leaves the others running; every part says whether it ran, failed or timed
out, and what it finished before that). A configuration that runs out of GPU memory is a result,
not a crash: its row says "OOM" (with a note), memory is freed (``gc.collect``,
``torch.cuda.empty_cache``) and the part goes on with the next one:

1. ``tests``: the CUDA subset of the test suite (``-m "cuda or triton"``: the compiled Triton
   kernels against the PyTorch path on CUDA, patched tiny models against unpatched ones, attention,
   offload, the dropout mask across devices). Failed if any test failed or errored (the counts and
   the failing tests are kept).
2. ``ops``: forward+backward time of each lean op (Triton kernels, and the PyTorch path with
   ``LEANACT_TRITON=0``) against torch's own op of the same role, and Liger-Kernel's RMSNorm /
   LayerNorm / SwiGLU when ``liger_kernel`` imports: wall time per call, and the kernels' own device
   time and launches per call (torch.profiler); with leanact's achieved bandwidth (the bytes its
   kernels must move, :func:`moved_bytes`, over its kernels' device time) and that as a share of the
   device's peak (a note gives the peak: from the device's memory clock and bus width where torch
   reports them, else its datasheet value, and a measured device-to-device copy). Target: leanact
   ≤ 1.1x torch.
3. ``bert``: Tempo's comparison. BERT-Large (s=512, bf16 autocast, AdamW) under a memory cap
   (``torch.cuda.set_per_process_memory_fraction``), each mode at its own largest batch (an OOM in
   the search is a "no"; one outside it is the mode's row) and its throughput there: HF sdpa and
   leanact (its Triton kernels on) under 8 GiB (Tempo's 11 GB card, where the baseline fits about 2
   sequences) and 16 GiB, then HF eager and HF sdpa + gradient checkpointing under 16 GiB
   (:data:`BERT_CAPS`). Targets, leanact vs HF sdpa: at 8 GiB batch ≥ 1.6x and throughput ≥ 1.16x
   (Tempo's +16%); at 16 GiB batch ≥ 1.6x and throughput ≥ 1.0x. (The b=32 step time and peak
   against HF sdpa: the ``steps`` part.)
4. ``llama``: LLaMA-1B-like (Llama-3.2-1B geometry) training-step time at equal batch, HF sdpa vs
   leanact with its Triton kernels and with its PyTorch path. Target ≤ 1.05x.
5. ``estimate``: ``leanact.estimate(device="cuda")`` against ``torch.cuda.max_memory_allocated`` of a
   real steady-state step. Target: within 5%.
6. ``offload``: step time and peak with and without CPU offload of every layer (overlap).
7. ``head``: head + causal-LM loss forward+backward at 8,192 tokens, hidden 2048, V=128,256, bf16
   weights and inputs (issue #23): HF's ``ForCausalLMLoss(F.linear(x, W), labels, V)``, leanact's
   ``linear_cross_entropy(..., grad_in_forward=True)`` (what ``leanact.patch`` runs in training),
   torch's ``F.linear_cross_entropy`` (torch >= 2.13) and Liger-Kernel's
   ``LigerFusedLinearCrossEntropyLoss`` where they exist (a note where not), in turns: median time,
   ratio to HF, transient above the inputs (dx, dW included; also as % of HF's fp32 logits N·V·4),
   max relative difference of loss / dx / dW to HF's. Targets: leanact ≤ HF's and Liger's time,
   transient without dx, dW ≤ 5% of the fp32 logits.
8. ``steps``: whole training steps side by side in one process, in turns (A, B, C, A, ...; fp32
   weights + bf16 autocast, fused AdamW, each mode its own model with the same seed, all kept
   allocated when they fit, else one after another with a note): Llama-3.2-1B geometry b=4 s=2048,
   HF sdpa / Liger-Kernel (its Llama patch, swapped in only for its own model) / leanact, then
   BERT-Large MLM b=32 s=512, HF sdpa / leanact. Targets: Llama leanact ≤ 1.00x HF's step and ≤
   Liger's, peak ≤ 0.55x HF's; BERT-Large ≤ 1.05x, peak ≤ 0.6x.

9. ``long`` (only when named: ``--parts long``; up to 4 minutes): the Llama-3.2-1B geometry in bf16,
   batch 1, AdamW, at 32,768 tokens with ``full+tiled_mlp`` and with ``offload+recompute+tiled_mlp``
   on every layer (target: offload ≤ 1.10x, its copies hidden under compute), each measured peak
   against ``leanact.estimate(device="cuda")`` and the offload pool's host memory against the
   prediction; then :data:`LONG_CAP_SEQ` tokens, the longest predicted to fit 16 GiB, run for real
   under a 16 GiB cap (target: no OOM, peak within 5%).
10. ``profile`` (only when named: ``--parts profile``; about a minute): the ``steps`` part's
   BERT-Large and Llama steps, HF sdpa and leanact, one step each under torch.profiler after a
   warm-up step: the step's kernels by device time (:data:`PROFILE_TOP` of them), launches and wall
   time. Where a step-time gap comes from.

The default run (parts 1-8) stays under 9.5 minutes (the per-part limits add up to :data:`TOTAL_S`). Rows go to
``--out`` under a header with the device, torch / triton / transformers / liger-kernel versions, the
git commit of the leanact package that runs ("unknown" outside a git checkout) and the date.
Without CUDA it exits with a message and writes nothing.

``--smoke --out FILE`` runs every part on the CPU at tiny sizes (:data:`SIZES`; no CUDA calls, peaks
"n/a", ``tests`` a small CPU subset) to catch Python errors in the parts before a GPU run.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

PACKAGE = pathlib.Path(__file__).resolve().parent  # benchmarks/gpu_suite, run as ``python benchmarks/gpu_suite``
HERE = PACKAGE.parent  # benchmarks/
ROOT = HERE.parent
PARTS = ["tests", "ops", "bert", "llama", "estimate", "offload", "head", "steps"]
OPTIONAL = ["long", "profile"]  # run only when named in --parts (the default run stays under 9.5 minutes)
# seconds; the first H200 run took tests 62 (82 tests), ops 23, estimate 27, offload 32 (bert died at 22);
# the H100 runs: tests 88 (255 tests, 4 processes), ops 27, bert 64-68, steps 38-45, profile 36; estimate
# over 35 once its leanact row ran (the estimate, then a real step under the memory history)
LIMITS = {"tests": 140, "ops": 50, "bert": 100, "llama": 50, "estimate": 60, "offload": 35, "head": 40, "steps": 90,
          "long": 240, "profile": 60}
TOTAL_S = sum(LIMITS[p] for p in PARTS)  # 565 s, under 9.5 minutes
#: The longest sequence of the Llama-3.2-1B geometry (bf16, AdamW, batch 1) whose step
#: leanact.estimate(device="cuda") fits 16 GiB less maximize's reserve with offload+recompute+tiled_mlp
#: on every layer (leanact.plan(maximize="seq", strategies=[...]), multiples of 1024 tokens).
LONG_CAP_SEQ = 144_384
SMOKE_ENV = "LEANACT_GPU_SUITE_SMOKE"  # "1" in the workers of a --smoke run
_TINY_BERT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=1000)
SIZES = {  # per run kind: model sizes and batch / sequence / search limits of the parts
    "gpu": dict(tokens=16384, iters=10, bert={}, bert_seq=512, bert_limit=256, bert_steps=3, llama={}, llama_batch=4,
                llama_seq=1024, est_bert={}, est_batch=8, est_seq=512, offload_batch=8, offload_threshold={},
                head_batch=4, head_seq=2048, head_hidden=2048, head_vocab=128256, head_rounds=10,
                steps_llama_batch=4, steps_llama_seq=2048, steps_bert_batch=32, steps_bert_seq=512, steps_rounds=5,
                long_seq=32768, long_cap_gib=16, long_cap_seq=LONG_CAP_SEQ),
    "smoke": dict(tokens=4, iters=1, bert=_TINY_BERT, bert_seq=32, bert_limit=2, bert_steps=1,
                  llama=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, intermediate_size=172, vocab_size=1000),
                  llama_batch=1, llama_seq=32, est_bert=_TINY_BERT, est_batch=2, est_seq=32, offload_batch=2,
                  offload_threshold=dict(offload_threshold=0),  # tiny tensors are offloaded too
                  head_batch=2, head_seq=8, head_hidden=32, head_vocab=300, head_rounds=2,
                  steps_llama_batch=1, steps_llama_seq=16, steps_bert_batch=2, steps_bert_seq=16, steps_rounds=2,
                  long_seq=64, long_cap_gib=None, long_cap_seq=128),
}
TITLES = {
    "tests": "CUDA tests",
    "ops": "Per-op forward+backward time (ms, median)",
    "bert": "BERT-Large MLM, s=512, bf16 autocast, AdamW: largest batch and throughput under 8 and 16 GiB caps",
    "llama": "LLaMA-1B-like step time at equal batch (bf16 autocast, AdamW)",
    "estimate": "leanact.estimate(device=\"cuda\") vs torch.cuda.max_memory_allocated (BERT-base, bf16, AdamW)",
    "offload": "CPU offload of every layer: step time and peak",
    "head": "Head + causal-LM loss forward+backward, 8,192 tokens, hidden 2048, V=128,256, bf16",
    "steps": "Whole training steps side by side, interleaved (fp32 weights + bf16 autocast, fused AdamW)",
    "profile": "Where a training step's GPU time goes: kernels by device time (HF sdpa and leanact)",
    "long": "Long context, Llama-3.2-1B geometry, bf16 weights, AdamW, batch 1: recompute vs offload, predicted vs "
            "measured",
}


# -- results: a JSON file per part, written as rows arrive ----------------------------------------


class Recorder:
    """Rows of one part, rewritten to ``path`` after each row: a part that dies or times out
    still leaves what it finished."""

    def __init__(self, path: str | None, columns: list[str]):
        self.path, self.data = path, {"columns": columns, "rows": [], "notes": [], "status": "running"}
        self._flush()

    def row(self, *values) -> None:
        self.data["rows"].append([_cell(v) for v in values])
        self._flush()

    def note(self, text: str) -> None:
        self.data["notes"].append(str(text))
        self._flush()

    def done(self, status: str = "ok") -> None:
        self.data["status"] = status
        self._flush()

    def _flush(self) -> None:
        if self.path:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.data, f)
            os.replace(tmp, self.path)


def _cell(v) -> str:
    if isinstance(v, float):
        if v != v:
            return "n/a"
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def smoke() -> bool:
    """Whether this process runs a --smoke run's part (CPU, tiny sizes)."""
    return os.environ.get(SMOKE_ENV) == "1"


def _dev() -> str:
    return "cpu" if smoke() else "cuda"


def _size(key: str):
    return SIZES["smoke" if smoke() else "gpu"][key]


def _sync() -> None:
    import torch

    if _dev() == "cuda":
        torch.cuda.synchronize()


def _reset_peak() -> None:
    import torch

    if _dev() == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _allocated() -> float:
    """``torch.cuda.memory_allocated`` in bytes; NaN on the CPU."""
    import torch

    return float(torch.cuda.memory_allocated()) if _dev() == "cuda" else float("nan")


def _max_allocated() -> float:
    """``torch.cuda.max_memory_allocated`` in bytes; NaN on the CPU."""
    import torch

    return float(torch.cuda.max_memory_allocated()) if _dev() == "cuda" else float("nan")


def _peak_gib() -> float:
    """``torch.cuda.max_memory_allocated`` in GiB; NaN on the CPU."""
    return _max_allocated() / 2**30


def _empty_cache() -> None:
    import torch

    if _dev() == "cuda":
        torch.cuda.empty_cache()


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` is the GPU running out of memory (``torch.cuda.OutOfMemoryError``, or a
    RuntimeError saying "out of memory": cuBLAS / cuDNN workspaces, older torch)."""
    import torch

    return isinstance(e, torch.cuda.OutOfMemoryError) or (isinstance(e, RuntimeError) and "out of memory" in str(e))


def attempt(fn, catch_all: bool = False):
    """``(fn(), None, None)``, or ``(None, kind, what)`` when it raised: kind "OOM" when it ran out of
    GPU memory, "error" for another exception (caught only with ``catch_all``; else it propagates);
    memory is freed then (``gc.collect``, ``torch.cuda.empty_cache``)."""
    try:
        return fn(), None, None
    except Exception as e:
        oom = is_oom(e)
        if not (oom or catch_all):
            raise
        what = f"{type(e).__name__}: {str(e)[:200]}"
    # here, outside the except block, the traceback (and the tensors its frames hold) is gone
    gc.collect()
    _empty_cache()
    return None, "OOM" if oom else "error", what


def failed_row(rec: Recorder, lead: list, kind: str, what: str) -> None:
    """A row ``*lead, kind, "n/a", ...`` (the table's width) and a note "<lead>: out of memory (...)"
    (kind "OOM") or "<lead>: failed (...)"."""
    width = max(len(lead) + 1, len(rec.data["columns"]))
    rec.row(*lead, kind, *["n/a"] * (width - len(lead) - 1))
    rec.note(f"{' '.join(map(str, lead))}: {'out of memory' if kind == 'OOM' else 'failed'} ({what})")


def unless_oom(rec: Recorder, label: str, fn):
    """``fn()``, or None when it runs out of GPU memory: then a row ``label, "OOM", "n/a", ...`` and a
    note are recorded and the memory is freed. Other errors propagate."""
    value, kind, what = attempt(fn)
    if kind:
        failed_row(rec, [label], kind, what)
    return value


def run_part(name: str, limit_s: float, python: str = sys.executable, extra_env: dict | None = None) -> dict:
    """Run one part in a fresh process (``--worker``); returns its result dict with ``status``
    "ok", "failed" (with the error) or "timeout", and ``seconds``."""
    fd, path = tempfile.mkstemp(suffix=f"-{name}.json")
    os.close(fd)
    os.unlink(path)
    cmd = [python, str(PACKAGE), "--worker", name, "--json", path]
    t0 = time.perf_counter()
    env = dict(os.environ, **(extra_env or {}))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s)
        status, tail = None, (proc.stdout[-1500:] + proc.stderr[-2500:])
        if proc.returncode != 0:
            status = "failed"
    except subprocess.TimeoutExpired as e:
        status, tail = "timeout", _text(e.stdout)[-1500:] + _text(e.stderr)[-1500:]
    result = {"columns": [], "rows": [], "notes": [], "status": "failed"}
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, ValueError):
        result["notes"].append("the part wrote no results")
    finally:
        for p in (path, path + ".tmp"):
            if os.path.exists(p):
                os.unlink(p)
    if status == "timeout":
        result["status"] = "timeout"
        result["notes"].append(f"stopped after its limit of {limit_s:g} s")
    elif status == "failed" or result.get("status") != "ok":
        result["status"] = "failed"
        if result.get("status") == "running" or not result["notes"]:
            result["notes"].append("process ended early: " + _last_lines(tail))
    result["seconds"] = time.perf_counter() - t0
    return result


def _text(b) -> str:
    if b is None:
        return ""
    return b.decode(errors="replace") if isinstance(b, bytes) else b


def _frames(e: BaseException, n: int = 5) -> str:
    """Where ``e`` was raised: the innermost ``n`` frames as "file:line function", innermost last."""
    frames = traceback.extract_tb(e.__traceback__)[-n:]
    return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames)) or "?"


def _last_lines(text: str, n: int = 3) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " / ".join(lines[-n:]) if lines else "(no output)"


def markdown(header: dict, results: dict[str, dict]) -> str:
    """The RESULTS.md section: a header line, then per part its status, its table and notes."""
    out = [f"## GPU suite — {header.get('device', '?')}, {header.get('date', '?')}", "",
           ", ".join(f"{k} {v}" for k, v in header.items() if k not in ("device", "date")), ""]
    for name, res in results.items():
        status = res.get("status", "failed")
        took = f", {res['seconds']:.0f} s" if "seconds" in res else ""
        out.append(f"### {TITLES.get(name, name)} — {status}{took}")
        out.append("")
        cols, rows = res.get("columns") or [], res.get("rows") or []
        if cols and rows:
            out.append("| " + " | ".join(cols) + " |")
            out.append("|" + "|".join("---" for _ in cols) + "|")
            out.extend("| " + " | ".join(str(c) for c in r) + " |" for r in rows)
            out.append("")
        elif status != "ok":
            out.append("(no rows)")
            out.append("")
        for note in res.get("notes") or []:
            out.append(f"- {note}")
        if res.get("notes"):
            out.append("")
    return "\n".join(out).rstrip() + "\n"


#: distribution -> module of the versions in the header
DISTRIBUTIONS = {"torch": "torch", "triton": "triton", "transformers": "transformers", "liger-kernel": "liger_kernel"}


def version(dist: str, module: str) -> str:
    """The module's ``__version__``, else its distribution's (``liger_kernel`` has no ``__version__``),
    "not installed" when neither the module imports nor the distribution is installed; never raises."""
    try:
        ver = getattr(importlib.import_module(module), "__version__", None)
        imports = True
    except Exception:
        ver, imports = None, False
    if ver is None:
        try:
            ver = importlib.metadata.version(dist)
        except Exception:
            return "?" if imports else "not installed"
        if not imports:
            ver += " (does not import)"
    return str(ver)


def commit_of(package_dir) -> str:
    """Short commit of the git checkout that tracks ``package_dir``'s ``__init__.py``; "unknown" when
    there is none (an installed copy, a tarball, a checkout that does not track it); never raises."""
    try:
        init = pathlib.Path(package_dir) / "__init__.py"

        def git(*args):
            return subprocess.run(["git", "-C", str(package_dir), *args], capture_output=True, text=True, timeout=10)

        if git("ls-files", "--error-unmatch", init.name).returncode != 0:
            return "unknown"
        out = git("rev-parse", "--short", "HEAD")
        if out.returncode != 0 or not out.stdout.strip():
            return "unknown"
        # tracked files that differ from that commit (a copy of a working tree sent over a base
        # checkout, edits not yet committed): the commit alone would misname what runs
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", "../benchmarks")
        return out.stdout.strip() + (" + uncommitted changes" if dirty.returncode != 0 or dirty.stdout.strip() else "")
    except Exception:
        return "unknown"


def versions() -> dict:
    """Versions of :data:`DISTRIBUTIONS`, and the commit of the leanact package that runs (where
    ``import leanact`` finds it, not the working directory's repository); never raises."""
    info = {dist: version(dist, module) for dist, module in DISTRIBUTIONS.items()}
    try:
        spec = importlib.util.find_spec("leanact")
        info["commit"] = commit_of(pathlib.Path(spec.origin).parent) if spec and spec.origin else "unknown"
    except Exception:
        info["commit"] = "unknown"
    return info


def parse_pytest(output: str) -> dict[str, int]:
    """Counts from pytest's summary line ("3 passed, 1 failed, 2 skipped in 1.2s")."""
    counts = {}
    tail = output.strip().splitlines()[-1] if output.strip() else ""
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", tail):
        counts["error" if what.startswith("error") else what] = int(n)
    return counts


# -- the parts (run inside --worker processes) -----------------------------------------------------


def part_tests(rec: Recorder, limit_s: float) -> None:
    cmd = _pytest_command()
    if smoke():
        rec.note("smoke run: a small CPU subset instead of the CUDA tests")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(10.0, limit_s - 10))
    check_pytest(rec, proc.stdout, proc.returncode)


def _pytest_command() -> list[str]:
    """The tests part's pytest command (a function: the suite's tests run it on a file of their own)."""
    # the interpreter re-run and the offline compile are the CPU machines' checks: left out here
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda or triton", "-k",
           "not test_in_subprocess and not compile_for_a_gpu", "tests"]
    if smoke():  # the same machinery on a few quick CPU tests
        cmd[-5:] = ["-k", "largest_fitting", "tests/test_bench_gpu_bert_large.py"]
    elif importlib.util.find_spec("xdist") is not None:  # Triton's compiles dominate: 4 processes share the GPU
        cmd[4:4] = ["-n", "4"]
    return cmd


def check_pytest(rec: Recorder, output: str, returncode: int) -> None:
    """Rows (passed, failed, error, skipped counts), a note per failing test; raises (the part
    fails, its rows kept) when a test failed or errored or pytest itself did not finish cleanly
    (exit code other than 0, or 5: nothing collected)."""
    counts = parse_pytest(output)
    for what in ("passed", "failed", "error", "skipped"):
        rec.row(what, counts.get(what, 0))
    for line in output.splitlines():
        if line.startswith(("FAILED", "ERROR")):
            rec.note(line[:300])
    bad = counts.get("failed", 0) + counts.get("error", 0)
    if bad or returncode not in (0, 5):
        raise RuntimeError(f"FAILED {bad} test(s) (pytest exit code {returncode})")


def _time_fwd_bwd(fn, x, dy, iters: int = 10) -> float:
    """Median ms of ``fn(x)`` forward + backward(dy) (CUDA events, or the wall clock on the CPU; 3
    warm-up calls, 1 for a single timed one)."""
    import torch

    def once():
        x.grad = None
        fn(x).backward(dy)

    for _ in range(3 if iters > 1 else 1):
        once()
    times = []
    for _ in range(iters):
        if x.device.type != "cuda":
            t0 = time.perf_counter()
            once()
            times.append((time.perf_counter() - t0) * 1000)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        once()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _time_stream(fn, x, dy, iters: int = 10, repeats: int = 3) -> float:
    """ms per call of ``fn(x)`` forward + backward(dy) with ``iters`` calls issued back to back
    between two CUDA events (the wall clock on the CPU), median of ``repeats``: the GPU kept busy
    as in a training step, where a call costs the longer of its host time and its kernels' (not
    the host's latency in front of an idle GPU, as :func:`_time_fwd_bwd`)."""
    def once():
        x.grad = None
        fn(x).backward(dy)

    once()
    return ms_per_call(once, x.device.type == "cuda", iters, repeats)


def ms_per_call(fn, cuda: bool, iters: int, repeats: int = 1) -> float:
    """ms per call of ``fn()`` issued ``iters`` times back to back between two CUDA events (``cuda``;
    else the wall clock), median of ``repeats``."""
    import torch

    out = []
    for _ in range(repeats):
        if not cuda:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - t0) * 1000 / iters)
            continue
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / iters)
    return statistics.median(out)


def _kernel_stats(fn, x, dy, iters: int = 10) -> tuple[float, float]:
    """(ms, launches) of the GPU kernels ``fn(x)`` forward + backward(dy) runs, per call, from
    torch.profiler's device timeline: what the kernels cost, without the host's share (Python,
    autograd, launch latency) that the wall times include and that a training step hides while
    the GPU is busy. (nan, nan) off CUDA."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if x.device.type != "cuda":
        return float("nan"), float("nan")

    def once():
        x.grad = None
        fn(x).backward(dy)

    once()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            once()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in kernels) / 1000 / iters, len(kernels) / iters


def _liger():
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception:
        return None
    fns = {"rms": lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps),
           "ln": lambda x, w, b, eps: LigerLayerNormFunction.apply(x, w, b, eps)}
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception:
        return fns
    fns["swiglu"] = lambda g, u: LigerSiLUMulFunction.apply(g, u)
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except Exception:
        return fns
    fns["rope"] = lambda q, k, cos, sin: LigerRopeFunction.apply(q, k, cos, sin)
    return fns


def _rope_tables(seq: int, d: int, device: str):
    """Llama-3's (cos, sin) for positions 0..seq-1, (1, seq, d) float32 (what HF's RoPE module returns
    under autocast: the tables in the hidden states' fp32)."""
    import torch

    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    freqs = torch.arange(seq, device=device, dtype=torch.float32)[:, None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[None], emb.sin()[None]


def _rope_hf(x, k, cos, sin):
    """HF's apply_rotary_pos_emb on q = x viewed (B, H, S, D), as HF's attention views its projection."""
    from transformers.models.llama import modeling_llama

    fn = modeling_llama.apply_rotary_pos_emb
    return getattr(fn, "_leanact_original", fn)(x.transpose(1, 2), k, cos, sin)[0]


def _rope_lean(x, k, cos, sin):
    """leanact's rotation (the kernels; where they do not apply, HF's function, as a patched model)."""
    from leanact.ops.rotary import rotary

    out = rotary(x.transpose(1, 2), k, cos, sin)
    return _rope_hf(x, k, cos, sin) if out is None else out[0]


def _rope_liger(fn):
    def run(x, k, cos, sin):
        return fn(x.transpose(1, 2), k, cos, sin)[0]

    return run


def op_cases(device: str = "cuda", tokens: int = 16384):
    """(name, dtype name, shape, leanact fn, torch fn, liger fn or None): BERT-Large FFN / hidden and
    LLaMA-1B hidden sizes at ``tokens`` = b·s rows."""
    import torch
    import torch.nn.functional as F

    import leanact.functional as LF
    from leanact.ops.gated_mlp import gated_down
    from leanact.ops.norms.layer_norm import layer_norm
    from leanact.ops.norms.rms_norm import rms_norm

    liger = _liger() if device == "cuda" else None
    w1k, b1k = torch.rand(1024, device=device) + 0.5, torch.randn(1024, device=device) * 0.1
    w2k = torch.rand(2048, device=device) + 0.5
    wd = torch.randn(2048, 8192, device=device) * 0.01  # LLaMA-1B's down projection
    cases = []
    for dt in ("bfloat16", "float32"):
        d = getattr(torch, dt)
        for mode in ("none", "tanh"):
            cases.append((f"GELU {mode}", dt, (tokens, 4096), lambda x, m=mode: LF.gelu(x, approximate=m),
                          lambda x, m=mode: F.gelu(x, approximate=m), None))
        cases.append(("dropout p=0.1", dt, (tokens, 4096), lambda x: LF.dropout(x, 0.1),
                      lambda x: F.dropout(x, 0.1, training=True), None))
        w, b, w2 = w1k.to(d), b1k.to(d), w2k.to(d)
        cases.append(("LayerNorm", dt, (tokens, 1024), lambda x, w=w, b=b: layer_norm(x, (1024,), w, b),
                      lambda x, w=w, b=b: F.layer_norm(x, (1024,), w, b),
                      (lambda x, w=w, b=b: liger["ln"](x, w, b, 1e-5)) if liger else None))
        # BERT's sub-layer end under autocast: h (the dense output) in dt, the residual stream, γ, β and y
        # in fp32; the residual needs a gradient too (cleared per call: no accumulation kernel timed)
        r = torch.randn(tokens, 1024, device=device, requires_grad=True)
        cases.append(("sub-layer end (dropout, add, LayerNorm)", dt, (tokens, 1024),
                      lambda x, r=r: LF.dropout_add_layer_norm(x, _fresh(r), 1024, w1k, b1k, 1e-5, 0.1),
                      lambda x, r=r: F.layer_norm(F.dropout(x, 0.1) + _fresh(r), (1024,), w1k, b1k, 1e-5), None))
        cases.append(("RMSNorm", dt, (tokens, 2048), lambda x, w=w2: rms_norm(x, (2048,), w, 1e-6),
                      lambda x, w=w2: F.rms_norm(x, (2048,), w, 1e-6),
                      (lambda x, w=w2: liger["rms"](x, w, 1e-6)) if liger else None))
        # RoPE of q (Llama-1B: 32 heads of 64, HF's transposed view of the projection; fp32 tables, as under
        # autocast); k one head (1/32 of the work, no gradient)
        seq = min(2048, tokens)
        cos, sin = _rope_tables(seq, 64, device)
        k = torch.randn(max(1, tokens // seq), 1, seq, 64, device=device, dtype=d)
        rope_liger = liger.get("rope") if liger else None
        if rope_liger is not None:  # (a Liger whose RoPE does not take these dtypes: no Liger column)
            try:
                rope_liger(torch.randn(1, 2, 4, 64, device=device, dtype=d), k[:1, :, :4], cos[:, :4], sin[:, :4])
            except Exception:  # noqa: BLE001
                rope_liger = None
        cases.append(("RoPE (q)", dt, (max(1, tokens // seq), seq, 32, 64),
                      lambda x, t=(k, cos, sin): _rope_lean(x, *t), lambda x, t=(k, cos, sin): _rope_hf(x, *t),
                      (lambda x, t=(k, cos, sin), f=_rope_liger(rope_liger): f(x, *t)) if rope_liger else None))
        # SwiGLU + down projection on a fused gate_up output (tokens, 2·8192): leanact keeps g, u only
        half = 8192
        cases.append(("SwiGLU + down", dt, (tokens // 4, 2 * half),
                      lambda x, w=wd.to(d): gated_down(x[:, :half], x[:, half:], w, kind="silu"),
                      lambda x, w=wd.to(d): F.linear(F.silu(x[:, :half]) * x[:, half:], w),
                      (lambda x, w=wd.to(d): F.linear(liger["swiglu"](x[:, :half], x[:, half:]), w))
                      if liger and "swiglu" in liger else None))
    return cases


def _fresh(t):
    """``t`` with its ``.grad`` cleared (a leaf's gradient is then stored, not accumulated)."""
    t.grad = None
    return t


#: Bytes leanact's kernels move per element of the op's input, forward + backward, for an element
#: size s (docs/triton.md): GELU writes y and a bit, its backward reads y, the bit and dy and writes
#: dx; dropout reads and writes once each way (the mask is rebuilt from the seed); the norms' forward
#: reads x and writes y, their backward reads y and dy and writes dx; the sub-layer end reads h and the
#: residual and writes y, then reads dy and y and writes both gradients (per-row statistics and the
#: dγ/dβ partials are below 5% at these widths and left out); RoPE reads q and writes its rotation in
#: the tables' fp32, then reads that gradient and writes q's (the tables, shared by the heads, from
#: cache). None: not bandwidth-bound (the MLP).
MOVED = {"GELU": lambda s: 5 * s + 0.25, "dropout": lambda s: 4 * s, "LayerNorm": lambda s: 5 * s,
         "RMSNorm": lambda s: 5 * s, "sub-layer end": lambda s: 2 * s + 20,  # (h in s; residual, y, dy fp32)
         "RoPE": lambda s: 2 * s + 8}  # q read, its fp32 rotation written; fp32 dy read, dq written
#: Datasheet memory bandwidth (GB/s) by device name, for when torch does not report the memory clock.
PEAK_GBS = {"H200": 4800, "H100 NVL": 3900, "H100 PCIe": 2000, "H100": 3350, "GH200": 4000, "A100-SXM4-80GB": 2039,
            "A100 80GB PCIe": 1935, "A100": 1555, "L40S": 864, "L4": 300, "A10G": 600, "A10": 600,
            "RTX 4090": 1008, "B200": 8000}


def moved_bytes(name: str, dtype: str, shape) -> float | None:
    """Bytes leanact's forward + backward kernels move for an input of ``shape`` (:data:`MOVED`)."""
    import math

    import torch

    rule = next((f for key, f in MOVED.items() if name.startswith(key)), None)
    return None if rule is None else rule(torch.finfo(getattr(torch, dtype)).bits / 8) * math.prod(shape)


def peak_gbs(props) -> tuple[float | None, str]:
    """(peak memory bandwidth in GB/s, where it comes from) of a device's properties: 2 x memory
    clock x bus width (DDR) where torch reports them, else :data:`PEAK_GBS` by name, else None."""
    clock, width = getattr(props, "memory_clock_rate", None), getattr(props, "memory_bus_width", None)
    if clock and width:  # kHz, bits
        return 2 * clock * 1e3 * width / 8 / 1e9, "memory clock x bus width"
    name = getattr(props, "name", "")
    key = max((k for k in PEAK_GBS if k in name), key=len, default=None)
    return (PEAK_GBS[key], f"datasheet value for {key}") if key else (None, "unknown device")


def copy_gbs(nbytes: int = 1 << 30, iters: int = 5) -> float:
    """Achieved bandwidth of a device-to-device copy (read + write) of ``nbytes``, GB/s (median)."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(iters + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return 2 * nbytes / (statistics.median(times[1:]) * 1e-3) / 1e9


def _bandwidth_note(rec: Recorder):
    """The device's peak GB/s (None on the CPU), noted with a measured copy's."""
    import torch

    if _dev() != "cuda":
        rec.note("CPU smoke run: GB/s from wall times, no peak")
        return None
    peak, source = peak_gbs(torch.cuda.get_device_properties(0))
    copy = copy_gbs()
    rec.note(f"device memory bandwidth: peak {f'{peak:,.0f} GB/s' if peak else 'unknown'} ({source}); a 1 GiB "
             f"device-to-device copy reaches {copy:,.0f} GB/s. GB/s = bytes leanact's kernels must move "
             "(benchmarks/gpu_suite.py MOVED, docs/triton.md) / leanact's time; target ≤ 1.1x torch's time")
    return peak


def part_ops(rec: Recorder, limit_s: float) -> None:
    import torch

    from leanact.ops.triton import dispatch

    if not dispatch.available():
        rec.note("Triton kernels unavailable here: the leanact column is the PyTorch path")
    os.environ["LEANACT_TRITON"] = "strict"  # a failing kernel is an error here, not a silent fallback
    deadline = time.perf_counter() + limit_s - 10
    iters, failed = _size("iters"), []
    rec.note("torch / leanact / PyTorch path / Liger: wall time per call (CUDA events; the host's share included, "
             "which a training step hides while the GPU is busy); in a stream: ms per call of calls issued back to "
             "back between two events (the GPU kept busy, as in a training step: the longer of a call's host time "
             "and its kernels'); kernels: their device time per call (torch.profiler), launches: kernels per call")
    peak = _bandwidth_note(rec)
    for name, dt, shape, lean, ref, liger in op_cases(_dev(), _size("tokens")):
        if time.perf_counter() > deadline:
            rec.note(f"stopped before {name} {dt}: time limit")
            break
        oom = False
        try:
            torch.manual_seed(0)
            x = torch.randn(shape, device=_dev(), dtype=getattr(torch, dt), requires_grad=True)
            with torch.no_grad():
                dy = torch.randn_like(ref(x))  # the output's shape (an MLP's differs from its input's)
            t_ref = _time_fwd_bwd(ref, x, dy, iters)
            t_lean = _time_fwd_bwd(lean, x, dy, iters)
            os.environ["LEANACT_TRITON"] = "0"
            try:
                t_path = _time_fwd_bwd(lean, x, dy, iters)
            finally:
                os.environ["LEANACT_TRITON"] = "strict"
            t_liger = _time_fwd_bwd(liger, x, dy, iters) if liger is not None else float("nan")
            s_ref = _time_stream(ref, x, dy, iters)
            s_lean = _time_stream(lean, x, dy, iters)
            s_ratio = s_lean / s_ref
            try:  # the profiler's columns are extra: without them the row keeps its wall times
                k_ref, n_ref = _kernel_stats(ref, x, dy, iters)
                k_lean, n_lean = _kernel_stats(lean, x, dy, iters)
            except Exception as e:  # noqa: BLE001
                k_ref = n_ref = k_lean = n_lean = float("nan")
                rec.note(f"{name} {dt}: no kernel times ({type(e).__name__}: {str(e)[:150]})")
            ratio = t_lean / t_ref
            moved = moved_bytes(name, dt, shape)
            basis = k_lean if k_lean == k_lean else t_lean  # the kernels' time where the profiler has it
            gbs = moved / (basis * 1e-3) / 1e9 if moved else None
            rec.row(name, dt, "x".join(map(str, shape)), t_ref, t_lean, f"{ratio:.2f}x", "ok" if ratio <= 1.1 else "no",
                    s_ref, s_lean, f"{s_ratio:.2f}x", "ok" if s_ratio <= 1.1 else "no", t_path, t_liger, k_ref, k_lean,
                    f"{k_lean / k_ref:.2f}x" if k_ref == k_ref else "n/a",
                    f"{n_ref:g} / {n_lean:g}" if n_ref == n_ref else "n/a", f"{gbs:,.0f}" if gbs else "n/a",
                    f"{100 * gbs / peak:.0f}%" if gbs and peak else "n/a")
        except Exception as e:  # one op failing leaves the others (the part still fails at the end; an OOM is a row)
            oom = is_oom(e)
            if not oom:
                failed.append(f"{name} {dt}")
            rec.note(f"{name} {dt}: {type(e).__name__}: {str(e)[:200]}")
        if oom:
            rec.row(name, dt, "x".join(map(str, shape)), "OOM", *["n/a"] * (len(COLUMNS["ops"]) - 4))
        x = dy = None  # freed here, outside the except block (whose traceback holds the tensors)
        gc.collect()
        _empty_cache()
    _kernel_note(rec)
    if failed:
        raise RuntimeError(f"{len(failed)} op case(s) failed: {', '.join(failed)}")


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


def _bench_module(name: str):
    """benchmarks/<name>.py as a module (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _bert_module():
    return _bench_module("gpu_bert_large")


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

    seq = _size("bert_seq")
    model = gb.build(attn, None, "bf16", "autocast", seq, _dev(), **_size("bert"))
    os.environ["LEANACT_TRITON"] = "1"  # leanact's rows: its Triton kernels (the PyTorch path: LLaMA's part)
    if how == "patch":
        leanact.patch(model)
    elif how == "checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    return gb.measure_step(gb.make_step(model, opt, "bf16", "autocast", seq), limit=_size("bert_limit"),
                           steps=_size("bert_steps"), opt=opt, device=_dev())


def part_bert(rec: Recorder, limit_s: float, caps=None) -> None:
    import torch

    gb = _bert_module()
    total = None if smoke() else torch.cuda.get_device_properties(0).total_memory
    if total is None:
        rec.note(f"smoke run: no memory cap, batches up to {_size('bert_limit')}")
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


def _llama(attn: str):
    import torch
    import transformers

    from leanact.models.geometries import GEOMETRIES

    g = GEOMETRIES["llama-1b-like"]
    g = dataclasses.replace(g, kwargs={**g.kwargs, **_size("llama")})
    torch.manual_seed(0)
    with torch.device(_dev()):
        model = getattr(transformers, g.model_cls)(g.make_config(attn=attn, dropout=0.0))
    return model.train()


def _step_time(step, steps: int) -> tuple[float, float]:
    """(median seconds per step, peak GiB (NaN on the CPU)) after one warm-up step."""
    step()
    _sync()
    _reset_peak()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), _peak_gib()


def _train_step(model, opt, inputs: dict, autocast: bool):
    import torch

    def step() -> None:
        with torch.autocast(_dev(), dtype=torch.bfloat16, enabled=autocast):
            loss = model(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _llama_time(lean: bool, batch: int, seq: int, kernels: bool = True) -> tuple[float, float]:
    import torch

    import leanact

    os.environ["LEANACT_TRITON"] = "1" if kernels else "0"
    model = _llama("sdpa")
    if lean:
        leanact.patch(model)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=_dev())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    return _step_time(_train_step(model, opt, dict(input_ids=ids, labels=ids), True), steps=4)


def part_llama(rec: Recorder, limit_s: float) -> None:
    batch, seq = _size("llama_batch"), _size("llama_seq")
    rec.note(f"batch {batch}, seq {seq}; target: leanact ≤ 1.05x HF sdpa's step time")
    ref = None
    for label in ("HF sdpa", "leanact", "leanact, PyTorch path (LEANACT_TRITON=0)"):
        measured = unless_oom(rec, label, lambda: _llama_time(label != "HF sdpa", batch, seq,
                                                               kernels="PyTorch" not in label))
        _empty_cache()
        if measured is None:
            ref = ref or float("nan")  # HF sdpa's OOM: no ratios
            continue
        t, peak = measured
        ref = ref or t
        rec.row(label, batch, seq, t * 1000, f"{t / ref:.3f}x", peak)


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
    g = dataclasses.replace(g, kwargs={**g.kwargs, **_size("est_bert")})
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(g.make_config(attn="sdpa"))
    model = model.to(device=_dev(), dtype=torch.bfloat16).train()
    if lean:
        leanact.patch(model)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=_dev())
    inputs = dict(input_ids=ids, labels=ids)
    est = leanact.estimate(model, inputs, None, device=_dev(), optimizer="adamw")
    measured = measure(model, inputs, optimizer="adamw").peak if _dev() == "cpu" else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    if measured is None and rec is not None:
        peak, notes = _peak_sites(_train_step(model, opt, inputs, False))
        what = "leanact" if lean else "HF"
        rec.note(f"{what}: estimated workspaces {est.workspaces / 2**20:.1f} MiB {est.workspace_items}; "
                 f"at the estimated peak {({k: round(v / 2**20, 1) for k, v in est.at_peak.items()})} MiB")
        for n in notes:
            rec.note(f"{what}: {n}")
        return est.peak, peak * 2**30
    _, peak = _step_time(_train_step(model, opt, inputs, False), steps=1)
    return est.peak, measured if measured is not None else peak * 2**30


def part_estimate(rec: Recorder, limit_s: float) -> None:
    batch, seq = _size("est_batch"), _size("est_seq")
    if smoke():
        rec.note("smoke run: leanact.estimate(device=\"cpu\") vs leanact.estimate.measure (a real CPU step)")
    for label, lean in ((f"BERT-base s={seq}, HF sdpa", False), (f"BERT-base s={seq}, leanact", True)):
        both = unless_oom(rec, label, lambda: _estimate_and_measure(lean, batch, seq, rec))
        _empty_cache()
        if both is None:
            continue
        est, measured = both
        rec.row(label, batch, est / 2**30, measured / 2**30, f"{est / measured:.3f}",
                "ok" if abs(est / measured - 1) <= 0.05 else "no")


def _offload_time(gb, offload: bool, batch: int) -> tuple[float, float, int]:
    """(median seconds per step, peak GiB, saved tensors copied to the host over all steps)."""
    import torch

    import leanact
    from leanact import strategies

    seq = _size("bert_seq")
    model = gb.build("sdpa", None, "bf16", "autocast", seq, _dev(), **_size("bert"))
    leanact.patch(model)
    if offload:
        strategies.uniform(model, "offload", **_size("offload_threshold")).apply(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step = gb.make_step(model, opt, "bf16", "autocast", seq)
    t, peak = _step_time(lambda: step(batch), steps=3)
    # each offloaded layer's forward is wrapped with its OffloadTransform
    moved = sum(getattr(getattr(m.__dict__.get("forward"), "transform", None), "offloaded", 0) for m in model.modules())
    return t, peak, moved


def part_offload(rec: Recorder, limit_s: float) -> None:
    gb = _bert_module()
    batch = _size("offload_batch")
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


# -- long context: recompute against offload, the estimate against a real step ----------------------


def _long_run(strategy: str, seq: int, steps: int = 2) -> tuple[float, float, object, int]:
    """(median seconds per step, peak bytes (NaN on the CPU), leanact.estimate of the step, host bytes
    the offload pool held) of the patched Llama-3.2-1B geometry in bf16 with ``strategy`` on every
    layer (MLP chunks as leanact.plan(maximize=...) sets them), batch 1, AdamW."""
    import torch

    import leanact
    from leanact.estimate.maximize import step_estimate, strategy_plan

    model = leanact.patch(_llama("sdpa").to(torch.bfloat16))
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device=_dev())
    inputs = dict(input_ids=ids, labels=ids)
    est = step_estimate(model, inputs, strategy, "seq", seq, device="cpu" if smoke() else "cuda")
    plan = strategy_plan(model, strategy, seq)
    plan.apply(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    t, peak = _step_time(_train_step(model, opt, inputs, False), steps=steps)
    return t, peak * 2**30, est, plan.pool.peak


def part_long(rec: Recorder, limit_s: float) -> None:
    """Both recompute strategies side by side at ``long_seq`` tokens (target: offload ≤ 1.10x, the
    copies hidden under compute), each against its prediction; then the longest sequence predicted to
    fit ``long_cap_gib`` run for real under that cap (target: no OOM, peak within 5% of the prediction)."""
    import torch

    seq, cap, cap_seq = _size("long_seq"), _size("long_cap_gib"), _size("long_cap_seq")
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
        _empty_cache()
        if measured is None:
            continue
        t, peak, est, host = measured
        ref = ref or t
        rec.row(strategy, cap_gib or "-", n, t * 1000, f"{t / ref:.3f}x" if cap_gib is None else "-", peak / 2**30,
                est.peak / 2**30, f"{peak / est.peak:.3f}" if peak == peak else "n/a", host / 2**30, est.host / 2**30)


# -- side by side: modes timed in turns (the head and steps parts) ---------------------------------


@dataclasses.dataclass
class Mode:
    """One side of an interleaved comparison. ``step()`` is the timed unit (a training step, a head's
    forward + backward); ``own`` the bytes the mode keeps between its steps (model, optimizer state,
    inputs), added to what its step allocates on top of what was allocated before it, so that its
    peak is that of the mode alone whatever the other modes keep allocated meanwhile (0 for the
    head: its peak is the transient above the inputs)."""

    label: str
    step: object = None  # callable, None once released or failed
    own: float = 0.0
    times: list = dataclasses.field(default_factory=list)  # seconds of the timed steps
    peak: float = float("nan")  # bytes, the most over the timed steps (NaN on the CPU)
    failed: tuple | None = None  # (kind "OOM" / "error", what)

    def measured(self) -> tuple[float, float]:
        """(seconds, peak bytes) of one step (synchronized; ``reset_peak_memory_stats`` before it)."""
        _sync()
        before = _allocated()
        _reset_peak()
        t0 = time.perf_counter()
        self.step()
        _sync()
        return time.perf_counter() - t0, _max_allocated() - before + self.own

    def fail(self, kind: str, what: str) -> None:
        self.failed = (kind, what)
        self.release()

    def release(self) -> None:
        self.step = None
        gc.collect()
        _empty_cache()

    @property
    def ms(self) -> float:
        return statistics.median(self.times) * 1000 if self.times else float("nan")


def interleave(modes: list[Mode], rounds: int, warmup: int = 1, deadline: float | None = None) -> None:
    """The modes' steps in turns, A, B, C, A, B, C, ...: ``warmup`` untimed rounds, then ``rounds``
    timed ones (fewer once ``time.perf_counter()`` passes ``deadline``; at least one). Times and the
    peak go to each mode; a mode whose step fails (out of memory or another error) leaves the
    rotation with ``failed`` set and its state released, and the others go on."""
    for r in range(warmup + max(1, rounds)):
        if r > warmup and deadline is not None and time.perf_counter() > deadline:
            break
        for m in modes:
            if m.step is None:
                continue
            out, kind, what = attempt(m.measured, catch_all=True)
            if kind:
                m.fail(kind, what)
            elif r >= warmup:
                m.times.append(out[0])
                m.peak = out[1] if m.peak != m.peak else max(m.peak, out[1])


def fits_together(n: int, own: float, peak: float, total: float, share: float = 0.9) -> bool:
    """Whether ``n`` modes can stay allocated at once: n - 1 modes' resident bytes (``own``, the
    first mode's: model, optimizer state, inputs) plus the first mode's step peak (its own resident
    bytes included) within ``share`` of the device's ``total`` memory."""
    return (n - 1) * own + peak <= share * total


def _total_memory() -> float | None:
    """The GPU's memory in bytes; None on the CPU (a smoke run keeps its tiny models together)."""
    import torch

    return float(torch.cuda.get_device_properties(0).total_memory) if _dev() == "cuda" else None


def compare(rec: Recorder, group: str, builders: list, rounds: int, deadline: float | None = None) -> list[Mode]:
    """Modes (``label, build`` in ``builders``; ``build()`` makes a model and returns its step) built
    in order, one step each after building (kernels compile, the optimizer allocates its state; the
    resident bytes are measured after it), then timed in turns (:func:`interleave`) while all stay
    allocated. On CUDA, when the first mode's resident bytes and step peak say they do not all fit
    (:func:`fits_together`), each is built, timed and freed before the next is built instead (a note
    says which). A mode that fails to build or to step keeps ``failed``; the others go on."""
    modes = [Mode(label) for label, _ in builders]
    together, alive = None, []
    for i, (m, (_, build)) in enumerate(zip(modes, builders)):
        before = _allocated()
        m.step, kind, what = attempt(build, catch_all=True)  # no other reference: release() frees the model
        if not kind:
            _, kind, what = attempt(m.measured, catch_all=True)
        if kind:
            m.fail(kind, what)
            continue
        m.own = _allocated() - before
        if together is None:
            together = True
            total = _total_memory()
            if total is not None and len(modes) > 1:
                out, kind, what = attempt(m.measured, catch_all=True)  # a step with the optimizer's state
                if kind:
                    m.fail(kind, what)
                    together = None
                    continue
                together = fits_together(len(modes), m.own, out[1], total)
                need = (len(modes) - 1) * m.own + out[1]
                rec.note(f"{group}: {m.label} keeps {m.own / 2**30:.1f} GiB, its step peaks at "
                         f"{out[1] / 2**30:.1f} GiB; "
                         f"{len(modes)} models at once need ~{need / 2**30:.1f} GiB of {total / 2**30:.1f} GiB: "
                         + ("all kept allocated, steps interleaved" if together else
                            "each built, timed and freed in turn instead (not interleaved)"))
        if together:
            alive.append(m)
            continue
        share = None if deadline is None else time.perf_counter() + (deadline - time.perf_counter()) / (len(modes) - i)
        interleave([m], rounds, deadline=share)
        m.release()
    interleave(alive, rounds, deadline=deadline)
    return modes


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}x" if a == a and b == b and b else "n/a"


def _check(what: str, a: float, b: float, limit: float) -> str:
    """"what 0.970x (target ≤ 1.00x: ok)", "n/a" where a side is missing."""
    if not (a == a and b == b and b):
        return f"{what} n/a"
    return f"{what} {a / b:.3f}x (target ≤ {limit:.2f}x: {'ok' if a / b <= limit else 'no'})"


def _failures(modes: list[Mode], third_party: tuple = ("Liger", "torch")) -> list[str]:
    """Modes of this project (not Liger's or torch's) that failed with an error other than an OOM."""
    return [m.label for m in modes if m.failed and m.failed[0] == "error" and not m.label.startswith(third_party)]


def _kernel_note(rec: Recorder) -> None:
    """Which leanact Triton kernels passed their self-check on this GPU and which fell back."""
    from leanact.ops.triton import dispatch

    if _dev() != "cuda":
        return
    passed = sorted(f"{op} {key}" for op, device, key in dispatch.verified() if device.startswith("cuda"))
    rec.note("kernel self-checks passed on this GPU: " + (", ".join(passed) if passed else "none"))
    broken = sorted(getattr(dispatch, "_BROKEN", ()))
    if broken:
        rec.note("leanact kernels on the PyTorch path after a failure: " + ", ".join(map(str, broken)))


def _shifted(labels):
    """Hugging Face's causal-LM shift: position t predicts labels[t + 1], the last one nothing."""
    import torch.nn.functional as F

    return F.pad(labels, (0, 1), value=-100)[..., 1:]


def _liger_head():
    """(loss(x, W, labels) through Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss``, "") or
    (None, why not)."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as e:
        return None, ("liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss does not import "
                      f"({type(e).__name__}: {str(e)[:120]})")
    loss_fn = LigerFusedLinearCrossEntropyLoss()

    def run(x, w, labels):
        out = loss_fn(w, x.reshape(-1, x.shape[-1]), _shifted(labels).reshape(-1))
        return out[0] if isinstance(out, tuple) else getattr(out, "loss", out)

    return run, ""


def head_modes(rec: Recorder) -> list[tuple[str, object]]:
    """(label, loss(x, W, labels)) of the head part, HF's first (the reference); notes the rows left out."""
    import torch
    import torch.nn.functional as F

    hm = _bench_module("head")
    modes = [("HF ForCausalLMLoss", hm.hf_loss), ("leanact (grad_in_forward, as patch trains)", hm.lean_loss(True))]
    if hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions"):
        modes.append(("torch F.linear_cross_entropy", hm.torch_loss))
    else:
        rec.note(f"torch {torch.__version__} has no F.linear_cross_entropy with LinearCrossEntropyOptions "
                 "(torch >= 2.13): no torch row")
    liger, why = _liger_head()
    if liger is None:
        rec.note(f"no Liger row: {why}")
    else:
        modes.append(("Liger LigerFusedLinearCrossEntropyLoss", liger))
    return modes


def part_head(rec: Recorder, limit_s: float) -> None:
    import torch

    os.environ["LEANACT_TRITON"] = "1"
    deadline = time.perf_counter() + limit_s - 10
    b, s, h, v = (_size(k) for k in ("head_batch", "head_seq", "head_hidden", "head_vocab"))
    logits32 = b * s * v * 4  # HF's fp32 logits, the unit of the target
    rec.note(f"b={b} s={s} ({b * s} tokens), hidden {h}, vocabulary {v}, bf16 weights and inputs; HF's fp32 logits "
             f"N·V·4 = {logits32 / 2**30:.2f} GiB; transient = max_memory_allocated above the inputs over forward + "
             "backward, gradients dx, dW included; targets: leanact's time ≤ HF's and ≤ Liger's, its transient "
             "without dx, dW ≤ 5% of HF's fp32 logits")
    torch.manual_seed(0)
    x = torch.randn(b, s, h, device=_dev()).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(v, h, device=_dev()) * h ** -0.5).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (b, s), device=_dev())
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
    interleave(runs, _size("head_rounds"), deadline=deadline)
    hf = runs[0]
    for m in runs:
        if m.failed:
            failed_row(rec, [m.label], *m.failed)
            continue
        rel = diffs.get(m.label, 0.0 if m is hf else float("nan"))
        share, extra = ("n/a", "n/a") if m.peak != m.peak else (f"{m.peak / logits32:.1%}",
                                                                 f"{(m.peak - grads) / logits32:.1%}")
        rec.row(m.label, m.ms, _ratio(m.ms, hf.ms), m.peak / 2**30, share, extra, f"{rel:.1e}", len(m.times))
    lean = runs[1]
    liger = next((m for m in runs if m.label.startswith("Liger")), None)
    checks = [_check("time vs HF", lean.ms, hf.ms, 1.0)]
    if liger is not None:
        checks.append(_check("time vs Liger", lean.ms, liger.ms, 1.0))
    extra = (lean.peak - grads) / logits32
    verdict = "ok" if extra <= 0.05 else "no"
    checks.append(f"transient without dx, dW {extra:.1%} of HF's fp32 logits (target ≤ 5%: {verdict})"
                  if extra == extra else "transient n/a")
    rec.note("leanact: " + "; ".join(checks))
    _kernel_note(rec)
    bad = _failures(runs)
    if bad:
        raise RuntimeError(f"{len(bad)} mode(s) failed: {', '.join(bad)}")


_MISSING = object()


class AttributeSwap:
    """What a process-wide patch changes in a module and in the classes it defines, undone as soon as
    it ran and put back in place only inside :meth:`active`. Liger-Kernel's Llama patch rebinds names
    of transformers' ``modeling_llama`` (the RoPE function, the RMSNorm and MLP classes) and
    ``LlamaForCausalLM.forward``: left in place, the HF sdpa and leanact models stepping in turns with
    Liger's in one process would run Liger's code."""

    def __init__(self, module):
        self.module = module
        self.changes: list = []  # (owner, name, original or _MISSING, patched or _MISSING)

    def capture(self, fn) -> None:
        mod = self.module
        owners = [mod] + [v for v in list(vars(mod).values()) if isinstance(v, type) and v.__module__ == mod.__name__]
        before = [dict(vars(o)) for o in owners]
        try:
            fn()
        finally:
            for owner, old in zip(owners, before):
                new = dict(vars(owner))
                for name in sorted(set(old) | set(new)):
                    if old.get(name, _MISSING) is not new.get(name, _MISSING):
                        self.changes.append((owner, name, old.get(name, _MISSING), new.get(name, _MISSING)))
            self._put(patched=False)

    def _put(self, patched: bool) -> None:
        for owner, name, original, changed in self.changes:
            value = changed if patched else original
            if value is _MISSING:
                if name in vars(owner):
                    delattr(owner, name)
            else:
                setattr(owner, name, value)

    @contextlib.contextmanager
    def active(self):
        self._put(patched=True)
        try:
            yield
        finally:
            self._put(patched=False)

    def describe(self) -> str:
        names = [f"{owner.__name__.rsplit('.', 1)[-1]}.{name}" for owner, name, _, _ in self.changes]
        return ", ".join(names) or "nothing"


LIGER_LLAMA = dict(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)


def liger_llama_patch():
    """The installed Liger-Kernel's Llama patch: ``(("before", fn()), what)`` for
    ``apply_liger_kernel_to_llama`` with the :data:`LIGER_LLAMA` options this version takes (run
    before building), ``(("instance", fn(model)), what)`` for ``_apply_liger_kernel_to_instance``,
    or ``(None, why not)``."""
    try:
        import liger_kernel.transformers as lt
    except Exception as e:
        return None, f"liger_kernel does not import ({type(e).__name__}: {str(e)[:120]})"
    apply = getattr(lt, "apply_liger_kernel_to_llama", None)
    if apply is not None:
        try:
            params = inspect.signature(apply).parameters
            anything = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
        except (TypeError, ValueError):
            params, anything = {}, True
        kwargs = {k: v for k, v in LIGER_LLAMA.items() if anything or k in params}
        what = f"apply_liger_kernel_to_llama({', '.join(f'{k}={v}' for k, v in kwargs.items())}) before building"
        left = [k for k in LIGER_LLAMA if k not in kwargs]
        if left:
            what += f" (this version takes no {', '.join(left)})"
        return ("before", lambda: apply(**kwargs)), what
    inst = getattr(lt, "_apply_liger_kernel_to_instance", None)
    if inst is not None:
        return ("instance", lambda model: inst(model=model)), ("_apply_liger_kernel_to_instance(model=...) on the "
                                                                "built model")
    return None, "liger_kernel.transformers has neither apply_liger_kernel_to_llama nor _apply_liger_kernel_to_instance"


def _adamw(model):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=1e-5, fused=_dev() == "cuda")


def llama_builders(rec: Recorder, batch: int, seq: int) -> list:
    """(label, build) of the steps part's Llama modes: HF sdpa, Liger (when it imports), leanact; each
    build makes its model with the same seed, fused AdamW and the same batch, and returns its step."""
    import torch

    import leanact

    def train(model):
        torch.manual_seed(1)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=_dev())
        return _train_step(model, _adamw(model), dict(input_ids=ids, labels=ids), True)

    def hf():
        return train(_llama("sdpa"))

    def lean():
        return train(leanact.patch(_llama("sdpa")))

    builders = [("HF sdpa", hf)]
    patch, what = liger_llama_patch()
    if patch is None:
        rec.note(f"no Liger row: {what}")
    else:
        def liger():
            from transformers.models.llama import modeling_llama

            swap, (how, fn) = AttributeSwap(modeling_llama), patch
            if how == "before":
                swap.capture(fn)
                with swap.active():
                    model = _llama("sdpa")
            else:
                model = _llama("sdpa")
                swap.capture(lambda: fn(model))
            kinds = {}
            for mod in model.modules():
                if type(mod).__name__.startswith("Liger"):
                    kinds[type(mod).__name__] = kinds.get(type(mod).__name__, 0) + 1
            rec.note(f"Liger: {what}; it rebound {swap.describe()} (in place only while its model builds and steps); "
                     f"its model has {', '.join(f'{n} {k}' for k, n in kinds.items()) or 'no Liger modules'}")
            step = train(model)

            def liger_step():
                with swap.active():
                    step()

            return liger_step

        builders.append(("Liger", liger))
    builders.append(("leanact", lean))
    return builders


def bert_builders(rec: Recorder, batch: int, seq: int) -> list:
    """(label, build) of the steps part's BERT-Large modes: HF sdpa, leanact (Liger has no BERT patch)."""
    import torch

    import leanact

    gb = _bert_module()
    rec.note("BERT-Large: no Liger row (Liger-Kernel has no BERT patch)")

    def build(options: dict | None):
        model = gb.build("sdpa", None, "bf16", "autocast", seq, _dev(), **_size("bert"))
        if options is not None:
            leanact.patch(model, **options)
        torch.manual_seed(1)
        return _train_step(model, _adamw(model), gb.make_batch(batch, seq, model.config.vocab_size, _dev()), True)

    # the last mode: without the two autocast memory savings, whose saved-tensor hooks cost host time
    # (benchmarks/host_stub.py): what they cost a host-bound step, and what they save
    fast = dict(cast_recipes=False, recast_weights=False)
    return [("HF sdpa", lambda: build(None)), ("leanact", lambda: build({})),
            ("leanact, cast_recipes=False, recast_weights=False", lambda: build(fast))]


def _step_rows(rec: Recorder, model: str, shape: str, modes: list[Mode]) -> None:
    hf = modes[0]
    for m in modes:
        if m.failed:
            failed_row(rec, [model, m.label], *m.failed)
        else:
            rec.row(model, m.label, shape, m.ms, _ratio(m.ms, hf.ms), m.peak / 2**30, _ratio(m.peak, hf.peak),
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
    rounds = _size("steps_rounds")
    lb, ls, bb, bs = (_size(k) for k in ("steps_llama_batch", "steps_llama_seq", "steps_bert_batch", "steps_bert_seq"))
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
        _step_rows(rec, name, f"{batch}x{seq}", modes)
        by = {m.label: m for m in modes}
        hf, lean = by["HF sdpa"], by["leanact"]
        if name.startswith("Llama"):
            checks = [_check("step vs HF sdpa", lean.ms, hf.ms, 1.0)]
            if "Liger" in by:
                checks.append(_check("step vs Liger", lean.ms, by["Liger"].ms, 1.0))
            checks.append(_check("peak vs HF sdpa", lean.peak, hf.peak, 0.55))
        else:
            checks = [_check("step vs HF sdpa", lean.ms, hf.ms, 1.05),
                      _check("peak vs HF sdpa", lean.peak, hf.peak, 0.6)]
        rec.note(f"{name}, leanact: " + "; ".join(checks))
        failed += [f"{name} {label}" for label in _failures(modes)]
        for m in modes:
            m.release()
        del modes, by, hf, lean
    _kernel_note(rec)
    if failed:
        raise RuntimeError(f"{len(failed)} mode(s) failed: {', '.join(failed)}")


#: Kernels listed per mode in the profile part (by device time; the rest summed in one row).
PROFILE_TOP = 12


def profile_step(step) -> tuple[list[tuple[str, int, float]], float, int, float]:
    """One step (after one warm-up step) under torch.profiler: ``(kernels, device ms, launches, wall
    ms)``, kernels = ``(name, calls, ms)`` by device time, most first (CUDA kernels; on the CPU the
    aten operators by their own CPU time)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step()
    _sync()
    cuda = _dev() == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        _sync()
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
    lb, ls, bb, bs = (_size(k) for k in ("steps_llama_batch", "steps_llama_seq", "steps_bert_batch", "steps_bert_seq"))
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
            _empty_cache()
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


def _selftest(kind: str):
    """Parts for the suite's own tests (no CUDA needed): a row, an error, a hang."""

    def part(rec: Recorder, limit_s: float) -> None:
        rec.row("first", 1.5)
        if kind == "fail":
            raise RuntimeError("boom")
        if kind == "hang":
            time.sleep(60)
        rec.row("second", 2)

    return part


WORKERS = {"tests": part_tests, "ops": part_ops, "bert": part_bert, "llama": part_llama,
           "estimate": part_estimate, "offload": part_offload, "head": part_head, "steps": part_steps,
           "long": part_long, "profile": part_profile,
           "_selftest_ok": _selftest("ok"), "_selftest_fail": _selftest("fail"), "_selftest_hang": _selftest("hang")}
COLUMNS = {
    "tests": ["outcome", "count"],
    "ops": ["op", "dtype", "shape", "torch", "leanact", "leanact/torch", "≤ 1.1x", "torch, in a stream",
            "leanact, in a stream", "in a stream leanact/torch", "≤ 1.1x in a stream", "leanact PyTorch path",
            "Liger", "torch kernels", "leanact kernels", "kernels leanact/torch", "launches torch / leanact",
            "leanact GB/s (kernels)", "of peak"],
    "bert": ["cap GiB", "mode", "max batch", "vs HF sdpa", "seq/s", "vs HF sdpa", "peak GiB", "targets"],
    "llama": ["mode", "batch", "seq", "step ms", "vs HF sdpa", "peak GiB"],
    "estimate": ["model", "batch", "estimate GiB", "max_memory_allocated GiB", "ratio", "within 5%"],
    "offload": ["mode", "batch", "step ms", "vs no offload", "peak GiB", "tensors offloaded"],
    "head": ["mode", "ms", "vs HF", "transient GiB", "% of HF fp32 logits", "without dx, dW", "max rel. diff vs HF",
             "timed runs"],
    "steps": ["model", "mode", "batch x seq", "step ms", "vs HF sdpa", "peak GiB", "peak vs HF sdpa", "timed steps"],
    "profile": ["model", "mode", "kernel", "calls per step", "ms per step", "% of the step's kernel time"],
    "long": ["strategy (every layer)", "cap GiB", "seq", "step ms", "vs full+tiled_mlp", "peak GiB",
             "predicted GiB", "measured/predicted", "host GiB", "predicted host GiB"],
}


def worker(name: str, json_path: str | None) -> int:
    rec = Recorder(json_path, COLUMNS.get(name, ["item", "value"]))
    try:
        WORKERS[name](rec, LIMITS.get(name, 60))
    except Exception as e:
        rec.note(f"{type(e).__name__}: {str(e)[:300]} (at {_frames(e)})")
        traceback.print_exc()
        rec.done("failed")
        return 1
    rec.done("ok")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="markdown file to append to (default benchmarks/RESULTS.md; required with --smoke)")
    ap.add_argument("--parts", nargs="+", choices=PARTS + OPTIONAL, default=PARTS)
    ap.add_argument("--smoke", action="store_true",
                    help="every part on the CPU at tiny sizes: checks the suite's code, measures nothing")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.json)
    import torch

    if args.smoke:
        if not args.out or pathlib.Path(args.out).resolve() == HERE / "RESULTS.md":
            ap.error("--smoke needs --out, not benchmarks/RESULTS.md (its rows are no GPU results)")
        device = "CPU (smoke run, tiny sizes)"
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_suite needs a CUDA GPU (torch.cuda.is_available() is False); nothing written.")
    else:
        device = torch.cuda.get_device_name(0)
    args.out = args.out or str(HERE / "RESULTS.md")
    header = {"device": device, "date": datetime.date.today().isoformat(), **versions()}
    results = {}
    t0 = time.perf_counter()
    for name in args.parts:
        print(f"[gpu_suite] {name} (limit {LIMITS[name]} s) ...", flush=True)
        results[name] = run_part(name, LIMITS[name], extra_env={SMOKE_ENV: "1" if args.smoke else "0"})
        print(f"[gpu_suite] {name}: {results[name]['status']} in {results[name]['seconds']:.0f} s", flush=True)
    md = markdown(header, results)
    print(md)
    with open(args.out, "a") as f:
        f.write("\n" + md)
    print(f"[gpu_suite] appended to {args.out} ({time.perf_counter() - t0:.0f} s)")
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1
