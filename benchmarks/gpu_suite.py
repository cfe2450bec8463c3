"""One command for a CUDA machine: tests, kernel timings, memory and speed, appended to RESULTS.md.

    python benchmarks/gpu_suite.py [--out benchmarks/RESULTS.md] [--parts tests ops bert llama estimate offload]

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
   LayerNorm / SwiGLU when ``liger_kernel`` imports. Target: leanact ≤ 1.2x torch.
3. ``bert``: BERT-Large (s=512, bf16 autocast, AdamW) largest batch under a 16 GiB cap
   (``torch.cuda.set_per_process_memory_fraction``) and throughput at that batch: HF eager, HF sdpa,
   HF sdpa + gradient checkpointing, leanact (its Triton kernels on). Targets: batch ≥ 1.6x HF sdpa,
   throughput ≥ 1.15x.
4. ``llama``: LLaMA-1B-like (Llama-3.2-1B geometry) training-step time at equal batch, HF sdpa vs
   leanact with its Triton kernels and with its PyTorch path. Target ≤ 1.05x.
5. ``estimate``: ``leanact.estimate(device="cuda")`` against ``torch.cuda.max_memory_allocated`` of a
   real steady-state step. Target: within 5%.
6. ``offload``: step time and peak with and without CPU offload of every layer (overlap).

The whole run stays under 9 minutes (the per-part limits add up to :data:`TOTAL_S`). Rows go to
``--out`` under a header with the device, torch / triton / transformers / liger-kernel versions, the
git commit of the leanact package that runs ("unknown" outside a git checkout) and the date.
Without CUDA it exits with a message and writes nothing.

``--smoke --out FILE`` runs every part on the CPU at tiny sizes (:data:`SIZES`; no CUDA calls, peaks
"n/a", ``tests`` a small CPU subset) to catch Python errors in the parts before a GPU run.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib
import importlib.metadata
import importlib.util
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

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
PARTS = ["tests", "ops", "bert", "llama", "estimate", "offload"]
LIMITS = {"tests": 140, "ops": 70, "bert": 160, "llama": 60, "estimate": 50, "offload": 45}  # seconds
TOTAL_S = sum(LIMITS.values())  # 525 s, under 9 minutes
SMOKE_ENV = "LEANACT_GPU_SUITE_SMOKE"  # "1" in the workers of a --smoke run
_TINY_BERT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=1000)
SIZES = {  # per run kind: model sizes and batch / sequence / search limits of the parts
    "gpu": dict(tokens=16384, iters=10, bert={}, bert_seq=512, bert_limit=256, bert_steps=3, llama={}, llama_batch=4,
                llama_seq=1024, est_bert={}, est_batch=8, est_seq=512, offload_batch=8, offload_threshold={}),
    "smoke": dict(tokens=4, iters=1, bert=_TINY_BERT, bert_seq=32, bert_limit=2, bert_steps=1,
                  llama=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, intermediate_size=172, vocab_size=1000),
                  llama_batch=1, llama_seq=32, est_bert=_TINY_BERT, est_batch=2, est_seq=32, offload_batch=2,
                  offload_threshold=dict(offload_threshold=0)),  # tiny tensors are offloaded too
}
TITLES = {
    "tests": "CUDA tests",
    "ops": "Per-op forward+backward time (ms, median)",
    "bert": "BERT-Large MLM, s=512, bf16 autocast, AdamW, 16 GiB cap",
    "llama": "LLaMA-1B-like step time at equal batch (bf16 autocast, AdamW)",
    "estimate": "leanact.estimate(device=\"cuda\") vs torch.cuda.max_memory_allocated (BERT-base, bf16, AdamW)",
    "offload": "CPU offload of every layer: step time and peak",
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


def _peak_gib() -> float:
    """``torch.cuda.max_memory_allocated`` in GiB; NaN on the CPU."""
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if _dev() == "cuda" else float("nan")


def _empty_cache() -> None:
    import torch

    if _dev() == "cuda":
        torch.cuda.empty_cache()


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` is the GPU running out of memory (``torch.cuda.OutOfMemoryError``, or a
    RuntimeError saying "out of memory": cuBLAS / cuDNN workspaces, older torch)."""
    import torch

    return isinstance(e, torch.cuda.OutOfMemoryError) or (isinstance(e, RuntimeError) and "out of memory" in str(e))


def unless_oom(rec: Recorder, label: str, fn):
    """``fn()``, or None when it runs out of GPU memory: then a row ``label, "OOM", "n/a", ...`` and a
    note are recorded and the memory is freed. Other errors propagate."""
    try:
        return fn()
    except Exception as e:
        if not is_oom(e):
            raise
        what = f"{type(e).__name__}: {str(e)[:200]}"
    # here, outside the except block, the traceback (and the tensors its frames hold) is gone
    gc.collect()
    _empty_cache()
    width = max(2, len(rec.data["columns"]))
    rec.row(label, "OOM", *["n/a"] * (width - 2))
    rec.note(f"{label}: out of memory ({what})")
    return None


def run_part(name: str, limit_s: float, python: str = sys.executable, extra_env: dict | None = None) -> dict:
    """Run one part in a fresh process (``--worker``); returns its result dict with ``status``
    "ok", "failed" (with the error) or "timeout", and ``seconds``."""
    fd, path = tempfile.mkstemp(suffix=f"-{name}.json")
    os.close(fd)
    os.unlink(path)
    cmd = [python, str(pathlib.Path(__file__).resolve()), "--worker", name, "--json", path]
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
        return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"
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
    return fns


def op_cases(device: str = "cuda", tokens: int = 16384):
    """(name, dtype name, shape, leanact fn, torch fn, liger fn or None): BERT-Large FFN / hidden and
    LLaMA-1B hidden sizes at ``tokens`` = b·s rows."""
    import torch
    import torch.nn.functional as F

    import leanact.functional as LF
    from leanact.ops.gated_mlp import gated_down
    from leanact.ops.layer_norm import layer_norm
    from leanact.ops.rms_norm import rms_norm

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
        cases.append(("RMSNorm", dt, (tokens, 2048), lambda x, w=w2: rms_norm(x, (2048,), w, 1e-6),
                      lambda x, w=w2: F.rms_norm(x, (2048,), w, 1e-6),
                      (lambda x, w=w2: liger["rms"](x, w, 1e-6)) if liger else None))
        # SwiGLU + down projection on a fused gate_up output (tokens, 2·8192): leanact keeps g, u only
        half = 8192
        cases.append(("SwiGLU + down", dt, (tokens // 4, 2 * half),
                      lambda x, w=wd.to(d): gated_down(x[:, :half], x[:, half:], w, kind="silu"),
                      lambda x, w=wd.to(d): F.linear(F.silu(x[:, :half]) * x[:, half:], w),
                      (lambda x, w=wd.to(d): F.linear(liger["swiglu"](x[:, :half], x[:, half:]), w))
                      if liger and "swiglu" in liger else None))
    return cases


def part_ops(rec: Recorder, limit_s: float) -> None:
    import torch

    from leanact.ops.triton import dispatch

    if not dispatch.available():
        rec.note("Triton kernels unavailable here: the leanact column is the PyTorch path")
    os.environ["LEANACT_TRITON"] = "strict"  # a failing kernel is an error here, not a silent fallback
    deadline = time.perf_counter() + limit_s - 10
    iters, failed = _size("iters"), []
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
            ratio = t_lean / t_ref
            rec.row(name, dt, "x".join(map(str, shape)), t_ref, t_lean, f"{ratio:.2f}x", "ok" if ratio <= 1.2 else "no",
                    t_path, t_liger)
        except Exception as e:  # one op failing leaves the others (the part still fails at the end; an OOM is a row)
            oom = is_oom(e)
            if not oom:
                failed.append(f"{name} {dt}")
            rec.note(f"{name} {dt}: {type(e).__name__}: {str(e)[:200]}")
        if oom:
            rec.row(name, dt, "x".join(map(str, shape)), "OOM", *["n/a"] * 5)
        x = dy = None  # freed here, outside the except block (whose traceback holds the tensors)
        gc.collect()
        _empty_cache()
    passed = sorted(f"{op} {key}" for op, device, key in dispatch.verified() if device.startswith("cuda"))
    rec.note("kernel self-checks passed on this GPU: " + (", ".join(passed) if passed else "none"))
    if failed:
        raise RuntimeError(f"{len(failed)} op case(s) failed: {', '.join(failed)}")


BERT_MODES = [("HF sdpa", "sdpa", None), ("leanact", "sdpa", "patch"), ("HF eager", "eager", None),
              ("HF sdpa + checkpointing", "sdpa", "checkpointing")]


def _bert_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bert_large", HERE / "gpu_bert_large.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


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


def part_bert(rec: Recorder, limit_s: float, cap_gib: float = 16.0) -> None:
    import torch

    gb = _bert_module()
    if smoke():
        rec.note(f"smoke run: no memory cap, batches up to {_size('bert_limit')}")
    else:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total))
        rec.note(f"cap {cap_gib:g} GiB of {total / 2**30:.0f} GiB; targets: leanact batch ≥ 1.6x HF sdpa's, "
                 "throughput at its largest batch ≥ 1.15x HF sdpa's at its own")
    done = []
    for label, attn, how in BERT_MODES:
        # an OOM outside the batch search (building the model, the optimizer's first step) is this mode's row
        measured = unless_oom(rec, label, lambda: _bert_mode(gb, attn, how))
        gb._free()
        if measured is None:
            continue
        batch, speed, peak = measured
        done.append((label, batch, speed))
        rb, rs = {m: (rb, rs) for m, rb, rs in bert_ratios(done)}[label]
        rec.row(label, batch, f"{rb:.2f}x", speed, f"{rs:.2f}x", peak)


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


def _estimate_and_measure(lean: bool, batch: int, seq: int = 512) -> tuple[float, float]:
    """(estimated peak, measured max_memory_allocated) in bytes of one steady-state step of BERT-base
    (bf16 weights, dropout 0.1, AdamW foreach). On the CPU (smoke run) the measurement is
    :func:`leanact.estimate.measure`'s real step."""
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
    _, peak = _step_time(_train_step(model, opt, inputs, False), steps=1)
    return est.peak, measured if measured is not None else peak * 2**30


def part_estimate(rec: Recorder, limit_s: float) -> None:
    batch, seq = _size("est_batch"), _size("est_seq")
    if smoke():
        rec.note("smoke run: leanact.estimate(device=\"cpu\") vs leanact.estimate.measure (a real CPU step)")
    for label, lean in ((f"BERT-base s={seq}, HF sdpa", False), (f"BERT-base s={seq}, leanact", True)):
        both = unless_oom(rec, label, lambda: _estimate_and_measure(lean, batch, seq))
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
           "estimate": part_estimate, "offload": part_offload,
           "_selftest_ok": _selftest("ok"), "_selftest_fail": _selftest("fail"), "_selftest_hang": _selftest("hang")}
COLUMNS = {
    "tests": ["outcome", "count"],
    "ops": ["op", "dtype", "shape", "torch", "leanact", "leanact/torch", "≤ 1.2x", "leanact PyTorch path",
            "Liger"],
    "bert": ["mode", "max batch", "vs HF sdpa", "seq/s", "vs HF sdpa", "peak GiB"],
    "llama": ["mode", "batch", "seq", "step ms", "vs HF sdpa", "peak GiB"],
    "estimate": ["model", "batch", "estimate GiB", "max_memory_allocated GiB", "ratio", "within 5%"],
    "offload": ["mode", "batch", "step ms", "vs no offload", "peak GiB", "tensors offloaded"],
}


def worker(name: str, json_path: str | None) -> int:
    rec = Recorder(json_path, COLUMNS.get(name, ["item", "value"]))
    try:
        WORKERS[name](rec, LIMITS.get(name, 60))
    except Exception as e:
        rec.note(f"{type(e).__name__}: {str(e)[:300]} ({_last_lines(traceback.format_exc(), 2)})")
        rec.done("failed")
        return 1
    rec.done("ok")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="markdown file to append to (default benchmarks/RESULTS.md; required with --smoke)")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS)
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
        sys.exit("benchmarks/gpu_suite.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing written.")
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


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # this checkout's leanact, also in the --worker processes
    sys.exit(main())
