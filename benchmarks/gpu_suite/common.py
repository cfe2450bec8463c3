"""What the parts and the command line share: the parts' names, time limits, titles, columns and
sizes (GPU and smoke runs); the rows a part records (:class:`Recorder`, a JSON file rewritten after
each row); the device, memory and timing helpers (the CPU's in a smoke run); an OOM as a row
(:func:`attempt`, :func:`unless_oom`); one part in a process of its own under its limit
(:func:`run_part`, :func:`run_forked`); the markdown section; the versions and commit of its header.
"""
from __future__ import annotations

import gc
import importlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time


PACKAGE = pathlib.Path(__file__).resolve().parent  # benchmarks/gpu_suite, run as ``python benchmarks/gpu_suite``
BENCHMARKS = PACKAGE.parent  # benchmarks/
ROOT = BENCHMARKS.parent
PARTS = ["tests", "ops", "bert", "llama", "estimate", "offload", "head", "steps"]
OPTIONAL = ["long", "profile", "compiled"]  # run only when named in --parts (the default run stays under 9.5 minutes)
# seconds; the first H200 run took tests 62 (82 tests), ops 23, estimate 27, offload 32 (bert died at 22);
# the H100 runs: tests 88 (255 tests, 4 processes), ops 27, bert 64-68, steps 38-45, profile 36; estimate
# over 35 once its leanact row ran (the estimate, then a real step under the memory history)
LIMITS = {"tests": 140, "ops": 50, "bert": 100, "llama": 50, "estimate": 60, "offload": 35, "head": 40, "steps": 90,
          "long": 540, "profile": 60, "compiled": 240}
TOTAL_S = sum(LIMITS[p] for p in PARTS)  # 565 s, under 9.5 minutes
#: The longest sequence of the Llama-3.2-1B geometry (bf16, AdamW, batch 1) whose step
#: leanact.estimate(device="cuda") fits 16 GiB less maximize's reserve with offload+recompute+tiled_mlp
#: on every layer (leanact.plan(maximize="seq", strategies=[...]), multiples of 1024 tokens).
LONG_CAP_SEQ = 144_384
# (the 24 GiB rows, 1B 342,016 and 8B LoRA 94,208 tokens: python benchmarks/long_context.py, the same rule)
SMOKE_ENV = "LEANACT_GPU_SUITE_SMOKE"  # "1" in the workers of a --smoke run
_TINY_BERT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=1000)
SIZES = {  # per run kind: model sizes and batch / sequence / search limits of the parts
    "gpu": dict(tokens=16384, iters=10, bert={}, bert_seq=512, bert_limit=256, bert_steps=3, llama={}, llama_batch=4,
                llama_seq=1024, est_bert={}, est_batch=8, est_seq=512, offload_batch=8, offload_threshold={},
                head_batch=4, head_seq=2048, head_hidden=2048, head_vocab=128256, head_rounds=10,
                steps_llama_batch=4, steps_llama_seq=2048, steps_bert_batch=32, steps_bert_seq=512, steps_rounds=5,
                long_overlap=(8192, 16384, 32768),
                long_edges=[("1b", 16, LONG_CAP_SEQ), ("1b", 24, 342_016), ("8b-lora", 24, 94_208)]),
    "smoke": dict(tokens=4, iters=1, bert=_TINY_BERT, bert_seq=32, bert_limit=2, bert_steps=1,
                  llama=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, intermediate_size=172, vocab_size=1000),
                  llama_batch=1, llama_seq=32, est_bert=_TINY_BERT, est_batch=2, est_seq=32, offload_batch=2,
                  offload_threshold=dict(offload_threshold=0),  # tiny tensors are offloaded too
                  head_batch=2, head_seq=8, head_hidden=32, head_vocab=300, head_rounds=2,
                  steps_llama_batch=1, steps_llama_seq=16, steps_bert_batch=2, steps_bert_seq=16, steps_rounds=2,
                  long_overlap=(64,), long_edges=[("1b", None, 128), ("8b-lora", None, 64)]),
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
    "compiled": "Whole training steps under torch.compile, side by side, interleaved (fp32 weights + bf16 autocast, "
                "fused AdamW)",
    "long": "Long context, bf16 weights, AdamW, batch 1: recompute vs offload (Llama-3.2-1B geometry), the planner's "
            "longest sequence under 16 and 24 GiB caps (1B, 8B LoRA) and 10% more; predicted vs measured",
}


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


def dev() -> str:
    return "cpu" if smoke() else "cuda"


def size(key: str):
    return SIZES["smoke" if smoke() else "gpu"][key]


def sync() -> None:
    import torch

    if dev() == "cuda":
        torch.cuda.synchronize()


def reset_peak() -> None:
    import torch

    if dev() == "cuda":
        torch.cuda.reset_peak_memory_stats()


def allocated() -> float:
    """``torch.cuda.memory_allocated`` in bytes; NaN on the CPU."""
    import torch

    return float(torch.cuda.memory_allocated()) if dev() == "cuda" else float("nan")


def max_allocated() -> float:
    """``torch.cuda.max_memory_allocated`` in bytes; NaN on the CPU."""
    import torch

    return float(torch.cuda.max_memory_allocated()) if dev() == "cuda" else float("nan")


def _peak_gib() -> float:
    """``torch.cuda.max_memory_allocated`` in GiB; NaN on the CPU."""
    return max_allocated() / 2**30


def empty_cache() -> None:
    import torch

    if dev() == "cuda":
        torch.cuda.empty_cache()


def freeze_imports() -> None:
    """Import what the parts build on (torch, transformers' BERT and Llama models) and move every
    object alive then out of the garbage collector's reach (``gc.freeze``): a module's objects are
    never garbage, and each ``gc.collect`` a part runs to free memory (after an op case, a model, a
    mode) then walks only what the part made since instead of all of them again."""
    import torch  # noqa: F401
    from transformers import BertForMaskedLM, LlamaForCausalLM  # noqa: F401

    gc.freeze()


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
    empty_cache()
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


def run_part(name: str, limit_s: float, python: str = sys.executable, extra_env: dict | None = None,
             forked=None) -> dict:
    """Run one part in a process of its own under its limit; returns its result dict with ``status``
    "ok", "failed" (with the error) or "timeout", and ``seconds``. The process is a fresh interpreter
    (``--worker``), or with ``forked`` (a smoke run on the CPU, :func:`run_forked`) a fork of this one,
    which has imported what the parts share already, running ``forked(name, json_path)``."""
    fd, path = tempfile.mkstemp(suffix=f"-{name}.json")
    os.close(fd)
    os.unlink(path)
    t0 = time.perf_counter()
    if forked is not None:
        status, tail = run_forked(lambda: forked(name, path), limit_s, extra_env or {})
    else:
        cmd = [python, str(PACKAGE), "--worker", name, "--json", path]
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


def run_forked(fn, limit_s: float, env: dict) -> tuple[str | None, str]:
    """``fn()`` in a forked child with ``env`` added to its environment and its output in a file; the
    child exits with 0 when ``fn`` returns 0. Returns ``(None | "failed" | "timeout", output tail)``;
    a child past ``limit_s`` is killed. POSIX only, and only where no CUDA context exists yet (a smoke
    run): a fork shares this process's imports instead of importing them again."""
    import signal

    with tempfile.TemporaryFile() as log:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the caller's code
            code = 1
            try:
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                os.environ.update(env)
                code = 0 if fn() == 0 else 1
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        deadline = time.monotonic() + limit_s
        status, running = "timeout", True
        try:
            while time.monotonic() < deadline:
                done, code = os.waitpid(pid, os.WNOHANG)
                if done:
                    status, running = None if os.waitstatus_to_exitcode(code) == 0 else "failed", False
                    break
                time.sleep(0.05)
        finally:  # past its limit, or this process interrupted (Ctrl-C): the child goes too
            if running:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        log.seek(0)
        return status, log.read().decode(errors="replace")[-4000:]


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


def bench_module(name: str):
    """benchmarks/<name>.py as a module (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def step_time(step, steps: int) -> tuple[float, float]:
    """(median seconds per step, peak GiB (NaN on the CPU)) after one warm-up step."""
    step()
    sync()
    reset_peak()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), _peak_gib()


def kernel_note(rec: Recorder) -> None:
    """Which leanact Triton kernels passed their self-check on this GPU and which fell back."""
    from leanact.ops.triton import dispatch

    if dev() != "cuda":
        return
    passed = sorted(f"{op} {key}" for op, device, key in dispatch.verified() if device.startswith("cuda"))
    rec.note("kernel self-checks passed on this GPU: " + (", ".join(passed) if passed else "none"))
    broken = sorted(getattr(dispatch, "_BROKEN", ()))
    if broken:
        rec.note("leanact kernels on the PyTorch path after a failure: " + ", ".join(map(str, broken)))


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
    "compiled": ["model", "mode", "batch x seq", "step ms", "vs HF sdpa", "peak GiB", "peak vs HF sdpa",
                 "timed steps"],
    "profile": ["model", "mode", "kernel", "calls per step", "ms per step", "% of the step's kernel time"],
    "long": ["model", "strategy (every layer)", "cap GiB", "seq", "expected", "step ms", "vs full+tiled_mlp",
             "peak GiB", "predicted GiB", "measured/predicted", "host GiB", "predicted host GiB"],
}
