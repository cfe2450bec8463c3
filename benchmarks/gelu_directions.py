"""The float32 GELU kernels' device time per direction against torch's, and by how they read a table row.

    python benchmarks/gelu_directions.py [--rows 16384] [--cols 4096] [--out FILE]

On a CUDA GPU: forward and backward apart (``F.gelu`` and ``aten.gelu_backward`` against leanact's
float32 kernels, both forms), CUDA events around back-to-back calls, variants in turns, medians.
Each table kernel (the erf forward, the backward) runs with its 16-byte row read three ways (the
kernels' ``wide`` argument): 0, two 8-byte loads; 1, one [BLOCK, 2] load split in registers (a
layout change through shared memory); 2, one 16-byte load by inline PTX. Variants 1 and 2 are
checked bitwise against 0 first. The backward also runs with its quotient in ``fma`` (the
launcher's ``fma_div``: no slow-path call, fewer registers, more instructions), checked against
``div_rn``'s values. A variant that computes other values than the default is listed under the
tables (``MISMATCH``) and left untimed; the script then exits 1. A second table times each
direction's fastest read at other launch shapes (``BLOCK`` and warps per program: 4 elements per
thread instead of 8 halves the registers a thread holds, so more warps fit on an SM; ``python
benchmarks/kernel_sass.py`` lists the registers). The last table adds each direction's fastest
variant, forward + backward, against torch's: the suite's ops-part target (≤ 1.1x) with the
variants the launchers should default to.
Without a GPU: the same tables at tiny sizes under Triton's interpreter (variant 2, PTX, is
skipped), to check the script.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gpu_suite.common import ms_per_call  # noqa: E402  (this script's folder is on sys.path)


#: (BLOCK, warps per program) the second table tries; the first is the kernels' default
SHAPES = ((1024, 4), (1024, 8), (512, 4), (2048, 8))


def medians(fns: dict, rounds: int, cuda: bool, reps: int) -> dict:
    """The median ms per call of each function, the functions timed in turns."""
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for k, fn in fns.items():
            times[k].append(ms_per_call(fn, cuda, reps))
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", help="also write the markdown table here")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"
        args.rows, args.cols, args.rounds = min(args.rows, 4), min(args.cols, 256), min(args.rounds, 2)
    from leanact.ops.triton import dispatch
    from leanact.ops.gelu import launchers as G
    from leanact.ops.gelu import kernels32 as G32
    from leanact.ops.triton import common as K

    dev = "cuda" if cuda else "cpu"
    widths = (0, 1, 2) if cuda else (0, 1)
    reps = 20 if cuda else 1
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(args.rows, args.cols, device=dev, generator=g)  # as the suite's ops part
    dy = torch.randn(args.rows, args.cols, device=dev, generator=g)
    n = x.numel()
    lines = [f"{torch.cuda.get_device_name(0) if cuda else 'CPU (interpreter, tiny sizes: checks the script)'}, "
             f"float32 {args.rows}x{args.cols}, ms per call (median of {args.rounds} rounds of {reps} calls, "
             "variants in turns)", "",
             "| form | direction | torch | leanact, 2 loads | leanact, split | leanact, 16-byte PTX | best / torch | "
             "best GB/s |", "|---|---|---|---|---|---|---|---|"]
    # bytes leanact's kernels must move per element: forward x in, y and a bit out; backward y, a
    # bit and dy in, dx out
    moved = {"forward": 8 + 1 / 8, "backward": 12 + 1 / 8}
    mismatches: list[str] = []
    shape_lines = ["", "The fastest read of each direction by launch shape (ms per call; BLOCK / warps)", "",
                   "| form | direction | read | " + " | ".join(f"{b} / {w}" for b, w in SHAPES) + " | best / torch |",
                   "|---|---|---|" + "---|" * len(SHAPES) + "---|"]
    best: dict = {}  # (form, forward / backward) -> (leanact's fastest ms, its variant, torch's ms)
    with dispatch.use_kernels(K, strict=True) if not cuda else contextlib.nullcontext():
        for approximate in ("none", "tanh"):
            thr, mills = G._args("forward", x, approximate)
            slope, c32 = G._args("backward", x, approximate)
            y = torch.empty_like(x)
            bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=dev)
            out = torch.empty_like(x)

            def fwd_at(w, block=1024, warps=4):
                return lambda: G32.gelu32_forward(x, y, bits, mills, thr, block=block, wide=w, num_warps=warps)

            def bwd_at(w, block=1024, warps=4, fma_div=False):
                return lambda: G32.gelu32_backward(y, bits, dy, out, slope, c32, block=block, wide=w, num_warps=warps,
                                                   fma_div=fma_div)

            def fma_at(w, block=1024, warps=4):
                return bwd_at(w, block, warps, True)

            variants = [(w, 1024, 4, False) for w in widths] + [(0, b, k, False) for b, k in SHAPES[1:]]
            variants += [(w, 1024, 4, True) for w in widths]
            ref = []
            for w, b, k, f in variants:  # every read, launch shape and quotient computes the same values
                fwd_at(w, b, k)()
                bwd_at(w, b, k, f)()
                ref.append((y.clone(), bits.clone(), out.clone()))
            skip = set()  # (direction, read) of a variant that computes other values: reported, not timed
            for (w, b, k, f), got in zip(variants[1:], ref[1:]):
                fwd_ok = torch.equal(got[0], ref[0][0]) and torch.equal(got[1], ref[0][1])
                bwd_ok = torch.equal(got[2], ref[0][2])
                if not (fwd_ok and bwd_ok):
                    mismatches.append(f"{approximate}: read {w}, BLOCK {b} / {k} warps, fma quotient {f}: "
                                      f"{'forward' if not fwd_ok else 'backward'} differs from the default")
                    skip.update([("forward", w)] if not fwd_ok else [])
                    skip.add(("backward, fma quotient" if f else "backward", w))
            torch_bwd = lambda: torch.ops.aten.gelu_backward(dy, x, approximate=approximate)  # noqa: E731
            cases = {  # direction: (its launcher at a read and shape, torch's op)
                "forward": (fwd_at, lambda: F.gelu(x, approximate=approximate)),
                "backward": (bwd_at, torch_bwd),
                "backward, fma quotient": (fma_at, torch_bwd),
            }
            form = "erf" if approximate == "none" else "tanh"
            for direction, (at, ref_fn) in cases.items():
                tanh_forward = (form, direction) == ("tanh", "forward")  # (reads no table)
                reads = (0,) if tanh_forward else widths
                reads = [w for w in reads if (direction, w) not in skip]
                if not reads:  # (only the fma quotient's: the default is the reference)
                    lines.append(f"| {form} | {direction} | | | | | MISMATCH | |")
                    blank = " | ".join("" for _ in SHAPES)
                    shape_lines.append(f"| {form} | {direction} | | {blank} | MISMATCH |")
                    continue
                med = medians({"torch": ref_fn, **{w: at(w) for w in reads}}, args.rounds, cuda, reps)
                cells = [f"{med[w]:.4f}" if w in med else "" for w in (0, 1, 2)]
                read = min((k for k in med if k != "torch"), key=med.get)
                bytes_ = moved[direction.split(",")[0]]
                lines.append(f"| {form} | {direction} | {med['torch']:.4f} | {' | '.join(cells)} | "
                             f"{med[read] / med['torch']:.2f}x | {bytes_ * n / med[read] / 1e6:,.0f} |")
                shaped = medians({"torch": ref_fn, **{s: at(read, *s) for s in SHAPES}}, args.rounds, cuda, reps)
                fastest = min(SHAPES, key=shaped.get)
                cells = " | ".join(f"{shaped[s]:.4f}" for s in SHAPES)
                shape_lines.append(f"| {form} | {direction} | {read} | {cells} | "
                                   f"{shaped[fastest] / shaped['torch']:.2f}x |")
                which = (form, direction.split(",")[0])
                quotient = ", fma quotient" if "fma" in direction else ""
                if which not in best or shaped[fastest] < best[which][0]:
                    best[which] = (shaped[fastest], f"read {read}, {fastest[0]} / {fastest[1]}{quotient}",
                                   shaped["torch"])
    # the ops part's target (forward + backward within 1.1x torch's) with each direction's fastest variant
    total_lines = ["", "Forward + backward, each direction's fastest variant (ms per call; target ≤ 1.1x torch's)",
                   "", "| form | torch | leanact | leanact / torch | ≤ 1.1x | forward | backward |",
                   "|---|---|---|---|---|---|---|"]
    for form in ("erf", "tanh"):
        if (form, "forward") in best and (form, "backward") in best:
            (f_ms, f_var, f_ref), (b_ms, b_var, b_ref) = best[form, "forward"], best[form, "backward"]
            ratio = round((f_ms + b_ms) / (f_ref + b_ref), 2)  # (as printed: the verdict is the printed ratio's)
            total_lines.append(f"| {form} | {f_ref + b_ref:.4f} | {f_ms + b_ms:.4f} | {ratio:.2f}x | "
                               f"{'ok' if ratio <= 1.1 else 'no'} | {f_var} | {b_var} |")
    text = "\n".join(lines + shape_lines + total_lines
                     + ([""] + [f"MISMATCH {m}" for m in mismatches] if mismatches else []))
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    return 1 if mismatches else 0  # (the tables printed first: the other variants' times stand)


if __name__ == "__main__":
    sys.exit(main())
