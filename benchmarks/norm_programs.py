"""The norms' backward by programs: the kernels' device time of LayerNorm and RMSNorm forward +
backward (torch.profiler), leanact at several program counts next to torch's op.

    python benchmarks/norm_programs.py          # a CUDA machine, about two minutes

Each program of the backward streams its share of the rows (loading the next row while it reduces
this one) and, when γ and β train, keeps one float32 partial row of dγ (and dβ), summed by a second
kernel: more programs put more rows in flight and more partials to sum. First table: γ, β trained,
leanact at 2, 4, 8 and 16 programs per SM (the defaults: ``launchers.PROGRAMS_PER_SM``, 4, for
LayerNorm, ``launchers.RMS_PROGRAMS_PER_SM``, 2, for RMSNorm). Second table: γ, β frozen (PEFT /
LoRA; no partials), leanact at 1,024, 2,048 and 4,096 programs and one per row (the default,
``launchers.PROGRAMS_WITHOUT_PARTIALS = None``).
"""
from __future__ import annotations

import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import leanact  # noqa: E402
from leanact.ops.norms import launchers  # noqa: E402

COUNTS = (2, 4, 8, 16)  # programs per SM, γ and β trained
FREE_COUNTS = (1024, 2048, 4096)  # programs, γ and β frozen (and None: one per row)
DEVICE = "cuda"
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


def _modules(name: str, n: int, dtype, frozen: bool):
    if name == "LayerNorm":
        ref = torch.nn.LayerNorm(n, device=DEVICE, dtype=dtype)
        lean = leanact.nn.LayerNorm(n, device=DEVICE, dtype=dtype)
    else:
        ref, lean = torch.nn.RMSNorm(n, device=DEVICE, dtype=dtype), leanact.nn.RMSNorm(n, device=DEVICE, dtype=dtype)
    for p in (*ref.parameters(), *lean.parameters()):
        p.requires_grad_(not frozen)
    return ref, lean


def table(frozen: bool) -> list[list[str]]:
    """Rows (op, dtype, shape, torch ms, leanact ms (ratio) per count)."""
    rows = []
    for name, (r, n) in SHAPES.items():
        attr = ("PROGRAMS_WITHOUT_PARTIALS" if frozen else
                "PROGRAMS_PER_SM" if name == "LayerNorm" else "RMS_PROGRAMS_PER_SM")
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(r, n, device=DEVICE, dtype=dtype, requires_grad=True)
            dy = torch.randn_like(x)
            ref_mod, lean_mod = _modules(name, n, dtype, frozen)
            torch_ms = kernels_ms(ref_mod, x, dy)
            row = [name, str(dtype).replace("torch.", ""), f"{r}x{n}", f"{torch_ms:.4f}"]
            saved = getattr(launchers, attr)
            try:
                for k in (FREE_COUNTS + (None,)) if frozen else COUNTS:
                    setattr(launchers, attr, k)
                    ms = kernels_ms(lean_mod, x, dy)
                    row.append(f"{ms:.4f} ({ms / torch_ms:.2f}x)")
            finally:
                setattr(launchers, attr, saved)
            rows.append(row)
            del x, dy
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        sys.exit("benchmarks/norm_programs.py needs a CUDA GPU; nothing measured.")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)} ({sms} SMs), torch {torch.__version__}: kernels' device ms per "
          f"forward+backward (torch.profiler, median of 3 x 20 calls)\n")
    for frozen, heads in ((False, [f"leanact, {k}/SM" for k in COUNTS]),
                          (True, [f"leanact, {k:,} programs" for k in FREE_COUNTS]
                           + ["leanact, one per row (default)"])):
        print("γ, β frozen (no partials), leanact by programs\n" if frozen else
              "γ, β trained, leanact by programs per SM\n")
        print("| op | dtype | shape | torch | " + " | ".join(heads) + " |")
        print("|---|---|---|---|" + "---|" * len(heads))
        for row in table(frozen):
            print("| " + " | ".join(row) + " |")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
