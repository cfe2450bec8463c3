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
RMSNorm, the sub-layer end; RoPE of q and k as a patched Llama calls it, HF's transposed q of 4
heads, k of 2, 64 positions of 64, fp32 tables as under autocast; with ``--cpu`` 4 x 64 and 8
positions, since the norms' forward is torch's own op, which then computes on the CPU) with every launch through Triton
and with the direct launches, in turns, the minimum of ``--samples`` x 10 calls (the host's time;
the GPU's is small at this size). With ``--liger`` (where Liger-Kernel imports), its LayerNorm,
RMSNorm and RoPE (``LigerLayerNormFunction``, ``LigerRMSNormFunction``, ``LigerRopeFunction``:
Triton's own launches) are timed in the same turns: the host's share of the suite's per-op wall
times against Liger's (off by default: on a GPU their kernels at these sizes compile first, tens of
seconds that ``scripts/gpu_checks.sh``'s limit for this script does not hold).
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
    ap.add_argument("--liger", action="store_true", help="also time Liger-Kernel's LayerNorm, RMSNorm and RoPE")
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
        def triton_launch(k=kernel, g=grid, a=a, kw=kw):
            return k[g](*a, **kw)

        def leanact_launch(k=kernel, g=grid, a=a, kw=kw):
            return L.launch(k, g, *a, **kw)

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

    ops = _ops_host(device, args.samples, L, args.liger)
    where = "no-op launcher (--cpu)" if args.cpu else torch.cuda.get_device_name(0)
    print(f"host µs per launch, {where}; torch {torch.__version__}, triton {triton.__version__}; "
          f"medians of {args.samples} x 20 launches\n")
    print("| kernel | dtype | Triton's launch | leanact's launch | leanact / Triton |")
    print("|---|---|---|---|---|")
    for name, dt, tt, lt in out:
        print(f"| {name} | {dt} | {tt:.1f} | {lt:.1f} | {lt / tt:.2f}x |")
    shape = "4 x 64, RoPE 8 positions" if args.cpu else "64 x 256, RoPE 64 positions"
    print(f"\nhost µs per forward+backward of a lean op ({shape}; min of {args.samples} x 10 calls)\n")
    print("| op | dtype | launches through Triton | direct launches | direct / Triton | Liger-Kernel "
          "| direct / Liger |")
    print("|---|---|---|---|---|---|---|")
    for name, dt, tt, lt, gt in ops:
        liger = f"{gt:.1f} | {lt / gt:.2f}x" if gt == gt else "n/a | n/a"
        print(f"| {name} | {dt} | {tt:.1f} | {lt:.1f} | {lt / tt:.2f}x | {liger} |")
    return 0


def _liger() -> dict:
    """Liger-Kernel's LayerNorm, RMSNorm and RoPE autograd Functions, those that import."""
    fns = {}
    for name, module, attr in (("LayerNorm", "layer_norm", "LigerLayerNormFunction"),
                               ("RMSNorm", "rms_norm", "LigerRMSNormFunction"),
                               ("RoPE (q and k)", "rope", "LigerRopeFunction")):
        try:
            fns[name] = getattr(__import__(f"liger_kernel.ops.{module}", fromlist=[attr]), attr)
        except Exception:  # noqa: BLE001 - not installed, or another version: no Liger cell
            pass
    return fns


def _ops_host(device: str, samples: int, L, with_liger: bool = False) -> list[tuple[str, str, float, float, float]]:
    """(op, dtype, host µs with Triton's launches, with the direct ones, Liger's op's or nan) per
    forward+backward."""
    import contextlib

    import torch

    import leanact
    from leanact.ops.norms.dropout_add_norm import dropout_add_layer_norm
    from leanact.ops.rotary import rotary
    from leanact.ops.triton import common as kernels, dispatch

    out = []
    cpu = device == "cpu"
    # (on the CPU tiny tensors: the norms' forward is torch's own op there, which computes on the CPU)
    rows, width, seq = (4, 64, 8) if cpu else (64, 256, 64)
    liger = _liger() if with_liger else {}
    for dt in (torch.bfloat16, torch.float32):
        with torch.device(device):
            x = torch.randn(rows, width, dtype=dt, requires_grad=True)
            r = torch.randn_like(x, requires_grad=True)
            dy = torch.randn_like(x)
            ln, rms = leanact.nn.LayerNorm(width, dtype=dt), leanact.nn.RMSNorm(width, dtype=dt)
            q = torch.randn(2, seq, 4, 64, dtype=dt).transpose(1, 2).requires_grad_()  # HF's (b, s, h, d) viewed
            k = torch.randn(2, 2, seq, 64, dtype=dt, requires_grad=True)
            cos, sin = torch.randn(1, seq, 64), torch.randn(1, seq, 64)  # fp32 tables, as under autocast
            dq, dk = torch.randn(q.shape), torch.randn(k.shape)  # the rotations' gradients (fp32, as they are)
            dq16, dk16 = dq.to(dt), dk.to(dt)  # Liger's (its rotation keeps q's dtype)
        ops = {"GELU": (lambda: leanact.functional.gelu(x).backward(dy), None),
               "LayerNorm": (lambda: ln(x).backward(dy),
                             lambda f: f.apply(x, ln.weight, ln.bias, 1e-5).backward(dy)),
               "RMSNorm": (lambda: rms(x).backward(dy), lambda f: f.apply(x, rms.weight, 1e-6).backward(dy)),
               "sub-layer end (dropout, add, LayerNorm)":
                   (lambda: dropout_add_layer_norm(x, r, (width,), ln.weight, ln.bias, 1e-5, 0.1).backward(dy), None),
               "RoPE (q and k)": (lambda: torch.autograd.backward(rotary(q, k, cos, sin), (dq, dk)),
                                  lambda f: torch.autograd.backward(f.apply(q, k, cos, sin), (dq16, dk16)))}
        with (dispatch.use_kernels(kernels, strict=True) if cpu else contextlib.nullcontext()):
            for name, (fn, of_liger) in ops.items():
                runs = {False: fn, True: fn}  # launches through Triton, direct
                if name in liger and of_liger is not None:
                    runs["Liger"] = lambda f=liger[name], run=of_liger: run(f)
                for way in [*runs] * 2:  # warm-up every way, then timed in turns
                    L._STATE["on"] = None if way is True else False  # (None: the direct path, set up again)
                    runs[way]()
                times = {way: [] for way in runs}
                for _ in range(samples):
                    for way, run in runs.items():
                        L._STATE["on"] = None if way is True else False
                        if not cpu:
                            torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        for _ in range(10):
                            run()
                        times[way].append((time.perf_counter() - t0) / 10 * 1e6)
                L._STATE["on"] = None
                per = {k: min(v) for k, v in times.items()}
                out.append((name, str(dt).replace("torch.", ""), per[False], per[True], per.get("Liger", float("nan"))))
    return out


if __name__ == "__main__":
    sys.exit(main())
