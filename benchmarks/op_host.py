"""Where a lean op's host time goes on a CUDA machine: leanact's Python, Triton's launcher, the launch.

    python benchmarks/op_host.py [--out FILE]            # a CUDA machine, under a minute
    python benchmarks/op_host.py --smoke                 # the CPU, tiny sizes: checks the script only

A lean op's wall time per call is its kernels' time or its host time, whichever is longer (the
suite's ops part: leanact's bf16 kernels take 0.47-1.16x torch's time on an H100, its wall time per
call 1.2-2.6x). For GELU, LayerNorm and the sub-layer end (dropout, add, LayerNorm), bf16, the suite's
shapes, this prints per forward+backward call:

* wall µs (CUDA events, the GPU's time included), torch's op and leanact's;
* host µs: the time the host takes to enqueue one call (``perf_counter`` around it, no sync), for
  torch's op, for leanact's, and for leanact's with the Triton launches replaced by nothing
  (``dispatch.use_kernels(SHAPES_ONLY)``: outputs allocated, no kernel): the difference is what the
  launches cost (Triton's launcher in Python, then the driver);
* the host µs of one launch: a trivial Triton kernel (12 arguments), with leanact's launch option,
  leanact's GELU forward kernel from its launcher, then through its dispatch;
* cProfile of leanact's GELU calls (functions by own time).

Medians of interleaved calls.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pathlib
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # this checkout's leanact
import leanact  # noqa: E402
from leanact.ops.norms.dropout_add_norm import dropout_add_layer_norm  # noqa: E402
from leanact.ops.triton import dispatch  # noqa: E402

SIZES = {"gpu": dict(rows=16384, gelu=4096, norm=1024, calls=60), "smoke": dict(rows=8, gelu=64, norm=32, calls=5)}


def _ops(rows: int, gelu: int, norm: int, device: str):
    """(name, torch fwd+bwd, leanact fwd+bwd) closures on fresh bf16 tensors."""
    bf16 = torch.bfloat16
    g = torch.randn(rows, gelu, device=device, dtype=bf16, requires_grad=True)
    dg = torch.randn_like(g)
    h = torch.randn(rows, norm, device=device, dtype=bf16, requires_grad=True)
    r = torch.randn_like(h, requires_grad=True)
    dn = torch.randn_like(h)
    ln = torch.nn.LayerNorm(norm, device=device, dtype=bf16)
    lean_ln = leanact.nn.LayerNorm(norm, device=device, dtype=bf16)

    return [
        ("GELU", lambda: F.gelu(g).backward(dg), lambda: leanact.functional.gelu(g).backward(dg)),
        ("LayerNorm", lambda: ln(h).backward(dn), lambda: lean_ln(h).backward(dn)),
        ("sub-layer end (dropout, add, LayerNorm)",
         lambda: ln(F.dropout(h, 0.1) + r).backward(dn),
         lambda: dropout_add_layer_norm(h, r, (norm,), lean_ln.weight, lean_ln.bias, 1e-5, 0.1).backward(dn)),
    ]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _host_us(fn, device: str) -> float:
    """Host time of one call: ``perf_counter`` around it, the GPU drained before (not after)."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    _sync(device)
    return dt * 1e6


def _wall_us(fn, device: str) -> float:
    if device != "cuda":
        return _host_us(fn, device)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3


@contextlib.contextmanager
def _stubbed():
    with dispatch.use_kernels(dispatch.SHAPES_ONLY, strict=True, fake=False, verify=False):
        yield


def _stubbed_call(fn):
    def call():
        with _stubbed():
            fn()
    return call


def measure(device: str, rows: int, gelu: int, norm: int, calls: int) -> list[tuple]:
    """Rows ``(op, torch wall, leanact wall, torch host, leanact host, leanact host stubbed)`` in µs."""
    out = []
    for name, ref, lean in _ops(rows, gelu, norm, device):
        stub = _stubbed_call(lean)
        for f in (ref, lean, stub):  # warm-up: self-checks, tables, compilation
            f()
            f()
        times: dict[str, list[float]] = {k: [] for k in ("tw", "lw", "th", "lh", "sh")}
        for _ in range(calls):
            times["tw"].append(_wall_us(ref, device))
            times["lw"].append(_wall_us(lean, device))
            times["th"].append(_host_us(ref, device))
            times["lh"].append(_host_us(lean, device))
            times["sh"].append(_host_us(stub, device))
        out.append((name, *(statistics.median(times[k]) for k in ("tw", "lw", "th", "lh", "sh"))))
    return out


def launch_us(calls: int) -> list[tuple[str, str]] | None:
    """Host µs of one launch, from a bare Triton kernel to leanact's GELU forward through its
    dispatch, each step adding one layer (None without CUDA): where a launch's host time goes."""
    if not torch.cuda.is_available():
        return None
    import triton
    import triton.language as tl

    from leanact.ops.gelu import minimum, tables
    from leanact.ops.gelu import launchers as gelu_launchers
    from leanact.ops.triton import common as kernels

    @triton.jit
    def _nop(a, b, c, d, e, f, g, h, n, m, eps, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        tl.store(a + offs, tl.load(b + offs, mask=offs < n, other=0.0), mask=offs < n)

    t = [torch.zeros(1024, device="cuda") for _ in range(8)]
    x = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    y, bits = torch.empty_like(x), torch.empty(128, dtype=torch.uint8, device="cuda")
    table = tables._ACCESSORS["y16", tables._dtype_name(x.dtype), "none"]("cuda")
    u = minimum._THRESHOLDS[x.dtype]["none"][1]
    steps = [
        ("a trivial Triton kernel, 12 arguments", lambda: _nop[(1,)](*t, 1024, 1024, 1e-5, BLOCK=1024)),
        ("the same with enable_fp_fusion=True (leanact's launch option)",
         lambda: _nop[(1,)](*t, 1024, 1024, 1e-5, BLOCK=1024, enable_fp_fusion=True)),
        ("leanact's GELU forward kernel, its launcher (kernels.gelu_forward16)",
         lambda: kernels.gelu_forward16(x, y, bits, table, u)),
        ("leanact's GELU forward through its dispatch (outputs allocated, checks)",
         lambda: gelu_launchers.gelu_forward(x, "none", True)),
    ]
    out = []
    for label, fn in steps:
        try:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            samples = []
            for _ in range(calls):
                t0 = time.perf_counter()
                for _ in range(20):
                    fn()
                samples.append((time.perf_counter() - t0) / 20 * 1e6)
                torch.cuda.synchronize()
            out.append((label, f"{statistics.median(samples):.1f}"))
        except Exception as e:  # noqa: BLE001 - a row that says why, the other rows still measured
            out.append((label, f"failed: {type(e).__name__}: {str(e)[:200]}"))
    return out


def profile_gelu(device: str, rows: int, gelu: int, calls: int) -> str:
    name, _ref, lean = _ops(rows, gelu, 8, device)[0]
    lean()
    _sync(device)
    prof = cProfile.Profile()
    for _ in range(calls):
        prof.runcall(lean)
    _sync(device)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    return f"cProfile of {calls} leanact {name} forward+backward calls ({rows}x{gelu} bf16), by own time:\n" + \
        buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="the CPU at tiny sizes (kernels stubbed): checks the script")
    ap.add_argument("--out", help="also write the report to this file")
    args = ap.parse_args(argv)
    if args.smoke:
        device, size = "cpu", SIZES["smoke"]
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/op_host.py needs a CUDA GPU (or --smoke); nothing measured.")
    else:
        device, size = "cuda", SIZES["gpu"]
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU (smoke run, kernels stubbed)"
    with (_stubbed() if args.smoke else contextlib.nullcontext()):  # (the CPU has no kernels to launch)
        rows = measure(device, size["rows"], size["gelu"], size["norm"], size["calls"])
        launches = launch_us(size["calls"])
        prof = profile_gelu(device, size["rows"], size["gelu"], size["calls"])
    lines = [f"{name}, torch {torch.__version__}; bf16 forward+backward per call, µs, medians of {size['calls']}",
             "", "| op | torch wall | leanact wall | torch host | leanact host | leanact host, launches stubbed |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {n} | {tw:.0f} | {lw:.0f} | {th:.0f} | {lh:.0f} | {sh:.0f} |" for n, tw, lw, th, lh, sh in rows]
    lines += ["", "host µs of one launch (the GPU idle, 20 launches in a row):"]
    lines += ["- n/a (no CUDA)"] if launches is None else [f"- {label}: {us}" for label, us in launches]
    lines += ["", prof]
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
