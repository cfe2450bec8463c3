"""The ``ops`` part: forward + backward time of each lean op against torch's (and Liger-Kernel's where
it imports): wall time, time in a stream, the kernels' device time and launches, and leanact's
achieved bandwidth against the device's peak.
"""
from __future__ import annotations

import gc
import os
import statistics
import time

from .common import COLUMNS, Recorder, dev, empty_cache, is_oom, kernel_note, ms_per_call, size
from .liger import liger_ops


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

    liger = liger_ops() if device == "cuda" else None
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

    if dev() != "cuda":
        rec.note("CPU smoke run: GB/s from wall times, no peak")
        return None
    peak, source = peak_gbs(torch.cuda.get_device_properties(0))
    copy = copy_gbs()
    rec.note(f"device memory bandwidth: peak {f'{peak:,.0f} GB/s' if peak else 'unknown'} ({source}); a 1 GiB "
             f"device-to-device copy reaches {copy:,.0f} GB/s. GB/s = bytes leanact's kernels must move "
             "(benchmarks/gpu_suite/ops.py MOVED, docs/triton.md) / leanact's time; target ≤ 1.1x torch's time")
    return peak


def part_ops(rec: Recorder, limit_s: float) -> None:
    import torch

    from leanact.ops.triton import dispatch

    if not dispatch.available():
        rec.note("Triton kernels unavailable here: the leanact column is the PyTorch path")
    os.environ["LEANACT_TRITON"] = "strict"  # a failing kernel is an error here, not a silent fallback
    deadline = time.perf_counter() + limit_s - 10
    iters, failed = size("iters"), []
    rec.note("torch / leanact / PyTorch path / Liger: wall time per call (CUDA events; the host's share included, "
             "which a training step hides while the GPU is busy); in a stream: ms per call of calls issued back to "
             "back between two events (the GPU kept busy, as in a training step: the longer of a call's host time "
             "and its kernels'); kernels: their device time per call (torch.profiler), launches: kernels per call")
    peak = _bandwidth_note(rec)
    for name, dt, shape, lean, ref, liger in op_cases(dev(), size("tokens")):
        if time.perf_counter() > deadline:
            rec.note(f"stopped before {name} {dt}: time limit")
            break
        oom = False
        try:
            torch.manual_seed(0)
            x = torch.randn(shape, device=dev(), dtype=getattr(torch, dt), requires_grad=True)
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
        empty_cache()
    kernel_note(rec)
    if failed:
        raise RuntimeError(f"{len(failed)} op case(s) failed: {', '.join(failed)}")
