"""A training step's host time on the CUDA code path, measured on a CPU: kernels stubbed, parts ablated.

    python benchmarks/host_stub.py [--model bert-large|llama-1b] [--steps 15] [--launches]

What a GPU step costs the host (Python, autograd, dispatch) decides the step time when the GPU
waits for it (BERT-Large at b=32 on an H100: 118 ms of kernels, a 166 ms step). This script runs
the CUDA path of every lean op on tiny CPU tensors with the Triton launches replaced by nothing
(``dispatch.use_kernels(SHAPES_ONLY)``: outputs allocated, no kernel run) and times whole steps
(fp32 weights + bf16 autocast; the model's layer count, tiny widths), Hugging Face's next to
leanact's, interleaved, medians. The optimizer steps nothing (the stubbed gradients are garbage, and
the norms would fall back on garbage γ) but runs its step hooks, bounded like AdamW's (a zero bound:
it moves nothing), so the norms' verdicts stand between steps as in AdamW training. leanact's attention takes its
CUDA path too (with dropout: SDPA's fused kernel, here the CPU's), not its CPU one.

Rows: leanact as patched; with ``cast_recipes=False`` (Linears keep autocast's 16-bit copy of a
norm's output); with ``recast_weights=False`` too (they keep autocast's copy of the weight too):
what each memory saving costs the host. Launch costs are not in these numbers unless ``--launches``:
then the kernels are compiled for sm_90 (Triton's bundled ptxas, no GPU) and launched into a Triton
driver that runs nothing (tests/_fake_triton_driver.py), so the host's side of every launch up to
the driver's call is in (leanact.ops.triton.launch's or Triton's ``JITFunction.run``); the driver's
own launch is not (``host_profile.py`` on a GPU has it). The last column counts the function calls of one
step (cProfile's count: Python functions and the builtins they call): unlike the times, it does not
move with the machine's load, so it tells a change of the host path's work from noise.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pathlib
import pstats
import statistics
import sys
import time

import torch

from host_profile import build_model

import leanact
import leanact.ops.attention.function as attention_op
from leanact.ops.norms import step_bound
from leanact.ops.triton import dispatch


class NoStep(torch.optim.SGD):
    """An optimizer whose step changes nothing (its step hooks still run: the norms' per-step decision)."""

    @torch.no_grad()
    def step(self, closure=None):
        return None


@contextlib.contextmanager
def _no_step_is_bounded():
    """NoStep's steps move no parameter: a step bound of 0 (leanact.ops.norms.step_bound), so the norms'
    verdicts stand between steps as under AdamW (no batched check, no sync), the host path of an
    AdamW training step."""
    real = step_bound.step_bound
    step_bound.step_bound = lambda opt, group, moment=None: (0.0, 0.0) if type(opt) is NoStep else real(
        opt, group, moment)
    try:
        yield
    finally:
        step_bound.step_bound = real


@contextlib.contextmanager
def _attention_as_on_cuda():
    """leanact's attention takes the path it takes for CUDA tensors: SDPA with dropout, whose output
    counts as lean (on CUDA a fused kernel's; the CPU's SDPA runs its math path with dropout, as for HF)."""
    real = attention_op._device_type, attention_op._lean_node
    attention_op._device_type, attention_op._lean_node = (lambda t: "cuda"), (lambda out: True)
    try:
        yield
    finally:
        attention_op._device_type, attention_op._lean_node = real


VARIANTS = {"HF": None, "leanact": {}, "leanact, cast_recipes=False": {"cast_recipes": False},
            "leanact, cast_recipes=False, recast_weights=False": {"cast_recipes": False, "recast_weights": False}}


def make_step(model_name: str, variant: dict | None):
    """One stubbed training step of ``model_name`` patched as ``variant`` says (None: HF's)."""
    model, inputs = build_model(model_name, "cpu")
    if variant is not None:
        leanact.patch(model, **variant)
    opt = NoStep(model.parameters(), lr=0.0)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["bert-large", "llama-1b"], default="bert-large")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--launches", action="store_true",
                    help="compiled kernels launched into a driver that runs nothing (the launches' host time in)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    kernels = dispatch.SHAPES_ONLY
    if args.launches:
        if "TRITON_INTERPRET" in os.environ:
            sys.exit("--launches compiles the kernels: unset TRITON_INTERPRET")
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
        from _fake_triton_driver import install

        install(keep=False)  # before the first launch: the driver that runs nothing
        from leanact.ops.triton import common as kernels
    with dispatch.use_kernels(kernels, strict=True, fake=False), _attention_as_on_cuda(), \
            _no_step_is_bounded():
        steps = {name: make_step(args.model, v) for name, v in VARIANTS.items()}
        calls: dict[str, int] = {}
        for k, s in steps.items():  # warm-up: the norms' decisions, tables, caches; then one step counted
            s()
            s()
            profile = cProfile.Profile()
            profile.runcall(s)
            calls[k] = pstats.Stats(profile).total_calls
        times: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(args.steps):
            for k, s in steps.items():
                t0 = time.perf_counter()
                s()
                times[k].append(time.perf_counter() - t0)
    hf = statistics.median(times["HF"])
    how = "launched into a driver that runs nothing" if args.launches else "stubbed"
    print(f"{args.model}, CUDA code path with the kernels {how}, on the CPU: host ms per step "
          f"(median of {args.steps} interleaved)")
    print("| step | host ms | vs HF | function calls per step |")
    print("|---|---|---|---|")
    for k, v in times.items():
        print(f"| {k} | {statistics.median(v) * 1e3:.1f} | {statistics.median(v) / hf:.2f}x | {calls[k]:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
