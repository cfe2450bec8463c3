"""The norms' backward by programs per SM: the kernels' device time of LayerNorm and RMSNorm forward +
backward (torch.profiler), leanact at 2, 4 (the default), 8 and 16 programs per SM next to torch's op.

    python benchmarks/norm_programs.py          # a CUDA machine, under a minute

Each program of the backward streams its share of the rows (loading the next row while it reduces
this one) and keeps one float32 partial row of dγ (and dβ), summed by a second kernel: more
programs put more rows in flight and more partials to sum. The GPU suite's ops part measured the
default at 1.16x torch's kernel time for LayerNorm (bf16, 16,384 x 1,024) and 1.13x for RMSNorm
(16,384 x 2,048) on an H100; this tells which count brings them under 1.1x.
"""
from __future__ import annotations

import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import leanact  # noqa: E402
from leanact.ops.triton import dispatch  # noqa: E402

COUNTS = (2, 4, 8, 16)
SHAPES = {"LayerNorm": (16384, 1024), "RMSNorm": (16384, 2048)}


def kernels_ms(fn, x, dy, iters: int = 20, repeats: int = 3) -> float:
    """Median over ``repeats`` of the kernels' device ms per ``fn(x).backward(dy)`` (torch.profiler)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def once():
        x.grad = None
        fn(x).backward(dy)

    for _ in range(3):
        once()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                once()
            torch.cuda.synchronize()
        out.append(sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
                   / 1000 / iters)
    return statistics.median(out)


def main() -> int:
    if not torch.cuda.is_available():
        sys.exit("benchmarks/norm_programs.py needs a CUDA GPU; nothing measured.")
    rows = []
    for name, (r, n) in SHAPES.items():
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(r, n, device="cuda", dtype=dtype, requires_grad=True)
            dy = torch.randn_like(x)
            if name == "LayerNorm":
                ref_mod = torch.nn.LayerNorm(n, device="cuda", dtype=dtype)
                lean_mod = leanact.nn.LayerNorm(n, device="cuda", dtype=dtype)
            else:
                ref_mod = torch.nn.RMSNorm(n, device="cuda", dtype=dtype)
                lean_mod = leanact.nn.RMSNorm(n, device="cuda", dtype=dtype)
            torch_ms = kernels_ms(ref_mod, x, dy)
            row = [name, str(dtype).replace("torch.", ""), f"{r}x{n}", f"{torch_ms:.4f}"]
            saved = dispatch.PROGRAMS_PER_SM
            try:
                for k in COUNTS:
                    dispatch.PROGRAMS_PER_SM = k
                    ms = kernels_ms(lean_mod, x, dy)
                    row.append(f"{ms:.4f} ({ms / torch_ms:.2f}x)")
            finally:
                dispatch.PROGRAMS_PER_SM = saved
            rows.append(row)
            del x, dy
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)} ({sms} SMs), torch {torch.__version__}: kernels' device ms per "
          f"forward+backward (torch.profiler, median of 3 x 20 calls), leanact by programs per SM\n")
    print("| op | dtype | shape | torch | " + " | ".join(f"leanact, {k}/SM" for k in COUNTS) + " |")
    print("|---|---|---|---|" + "---|" * len(COUNTS))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
