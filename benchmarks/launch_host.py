"""Host time of one launch of each leanact Triton kernel: Triton's ``kernel[grid](...)`` against
``leanact.ops.triton.launch`` (the compiled kernel's launcher called directly).

    python benchmarks/launch_host.py            # a CUDA machine: real launches (tiny tensors)
    python benchmarks/launch_host.py --cpu      # no GPU: kernels compiled for sm_90, launches recorded
                                                # by a driver that runs nothing (tests/_fake_triton_driver.py)

Every kernel's launch arguments come from running each op's launchers once on small bfloat16 and
float32 tensors (tests/_launch_sweep.py); each row is a kernel's first specialization of a dtype.
Both ways are timed in turns (20 launches a sample, medians of ``--samples``); with ``--cpu`` the
launcher itself is a no-op, so the numbers are the Python in front of it, on CUDA they include the
driver's launch. A trivial kernel with 12 arguments is the floor of Triton's own path.

A second table times whole lean ops (forward + backward on 64 x 256 tensors: GELU, LayerNorm,
RMSNorm, the sub-layer end) with every launch through Triton and with the direct launches, in
turns, the minimum of ``--samples`` x 10 calls (the host's time; the GPU's is small at this size).
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def _time(fn, reps: int = 20) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="no GPU: compile for sm_90, record launches instead")
    ap.add_argument("--samples", type=int, default=30)
    args = ap.parse_args(argv)
    if args.cpu:
        from _fake_triton_driver import install

        install()
    import torch
    import triton
    import triton.language as tl

    from _launch_sweep import sweep
    from leanact.ops.triton import launch as L

    device = "cpu" if args.cpu else "cuda"
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("benchmarks/launch_host.py needs a CUDA GPU, or --cpu")

    @triton.jit
    def _nop(a, b, c, d, e, f, g, h, n, m, eps, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(a + offs, tl.load(b + offs, mask=offs < n, other=0.0), mask=offs < n)

    rows = {}
    for dt in (torch.bfloat16, torch.float32):
        for kernel, grid, a, kw in sweep(device, dtypes=(dt,)):
            rows.setdefault((kernel.__name__, str(dt).replace("torch.", "")), (kernel, grid, a, kw))
    t = [torch.zeros(1024, device=device) for _ in range(8)]
    rows[("trivial kernel, 12 arguments", "float32")] = (_nop, (1,), (*t, 1024, 1024, 1e-5), {"BLOCK": 1024})

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = []
    for (name, dt), (kernel, grid, a, kw) in rows.items():
        triton_launch = (lambda k=kernel, g=grid, a=a, kw=kw: k[g](*a, **kw))
        leanact_launch = (lambda k=kernel, g=grid, a=a, kw=kw: L.launch(k, g, *a, **kw))
        for f in (triton_launch, leanact_launch):
            f()
            f()
        sync()
        ts, ls = [], []
        for _ in range(args.samples):
            ts.append(_time(triton_launch))
            sync()
            ls.append(_time(leanact_launch))
            sync()
        out.append((name, dt, statistics.median(ts), statistics.median(ls)))

    ops = _ops_host(device, args.samples, L)
    where = "no-op launcher (--cpu)" if args.cpu else torch.cuda.get_device_name(0)
    print(f"host µs per launch, {where}; torch {torch.__version__}, triton {triton.__version__}; "
          f"medians of {args.samples} x 20 launches\n")
    print("| kernel | dtype | Triton's launch | leanact's launch | leanact / Triton |")
    print("|---|---|---|---|---|")
    for name, dt, tt, lt in out:
        print(f"| {name} | {dt} | {tt:.1f} | {lt:.1f} | {lt / tt:.2f}x |")
    print(f"\nhost µs per forward+backward of a lean op (64 x 256; min of {args.samples} x 10 calls)\n")
    print("| op | dtype | launches through Triton | direct launches | direct / Triton |")
    print("|---|---|---|---|---|")
    for name, dt, tt, lt in ops:
        print(f"| {name} | {dt} | {tt:.1f} | {lt:.1f} | {lt / tt:.2f}x |")
    return 0


def _ops_host(device: str, samples: int, L) -> list[tuple[str, str, float, float]]:
    """(op, dtype, host µs with Triton's launches, with the direct ones) per forward+backward."""
    import contextlib

    import torch

    import leanact
    from leanact.ops.dropout_add_norm import dropout_add_layer_norm
    from leanact.ops.triton import dispatch, kernels

    out = []
    cpu = device == "cpu"
    for dt in (torch.bfloat16, torch.float32):
        with torch.device(device):
            x = torch.randn(64, 256, dtype=dt, requires_grad=True)
            r = torch.randn_like(x, requires_grad=True)
            dy = torch.randn_like(x)
            ln, rms = leanact.nn.LayerNorm(256, dtype=dt), leanact.nn.RMSNorm(256, dtype=dt)
        ops = {"GELU": lambda: leanact.functional.gelu(x).backward(dy),
               "LayerNorm": lambda: ln(x).backward(dy),
               "RMSNorm": lambda: rms(x).backward(dy),
               "sub-layer end (dropout, add, LayerNorm)":
                   lambda: dropout_add_layer_norm(x, r, (256,), ln.weight, ln.bias, 1e-5, 0.1).backward(dy)}
        with (dispatch.use_kernels(kernels, strict=True) if cpu else contextlib.nullcontext()):
            for name, fn in ops.items():
                for direct in (False, True, False, True):  # warm-up both, then timed in turns
                    L._STATE["on"] = None if direct else False  # (None: the direct path, set up again)
                    fn()
                times = {False: [], True: []}
                for _ in range(samples):
                    for direct in (False, True):
                        L._STATE["on"] = None if direct else False
                        if not cpu:
                            torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        for _ in range(10):
                            fn()
                        times[direct].append((time.perf_counter() - t0) / 10 * 1e6)
                L._STATE["on"] = None
                per = {k: min(v) for k, v in times.items()}
                out.append((name, str(dt).replace("torch.", ""), per[False], per[True]))
    return out


if __name__ == "__main__":
    sys.exit(main())
