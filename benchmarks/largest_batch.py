"""Largest batch whose whole training step fits one GPU, predicted by leanact.estimate(device="cuda").

    python benchmarks/largest_batch.py [--models bert-base bert-large gpt2 llama-1b-like] [--budgets 16 24 80]

Each geometry (random weights, built on the meta device: nothing runs for real) at its default
sequence (``leanact.models.geometries``: bert-base 128, bert-large 512, gpt2 1024, llama-1b-like
1024), bf16 weights, AdamW, the whole step counted (parameters, gradients, optimizer state,
activations, temporaries; Trainer protocol, CUDA's kernels):
HF sdpa, HF sdpa + HF gradient checkpointing (non-reentrant), leanact.patch, and leanact.patch + the
best plan of ``--plans`` (each strategy on every layer, as ``plan(maximize="batch")`` picks). A cell
is the largest batch whose predicted peak fits the budget (leanact.estimate.fit.largest_fitting).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import leanact  # noqa: E402
from leanact.estimate.fit import largest_fitting  # noqa: E402
from leanact.estimate.maximize import step_estimate  # noqa: E402
from leanact.models.geometries import resolve  # noqa: E402

GIB = 2**30


def build(name: str, variant: str):
    import transformers

    geo = resolve(name)
    with torch.device("meta"):
        model = getattr(transformers, geo.model_cls)(geo.make_config(attn="sdpa")).to(torch.bfloat16)
    if variant == "hf+gc":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if variant == "leanact":
        leanact.patch(model)
    return model.train(), geo


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["bert-base", "bert-large", "gpt2", "llama-1b-like"])
    ap.add_argument("--budgets", type=float, nargs="+", default=[16, 24, 80], help="GiB")
    ap.add_argument("--plans", nargs="+", default=["selective:attention", "full"],
                    help="strategies for the leanact + plan row")
    args = ap.parse_args(argv)
    budgets = [int(b * GIB) for b in args.budgets]
    rows = [("HF sdpa", "hf", ["lean"]), ("HF sdpa + HF checkpointing", "hf+gc", ["lean"]),
            ("leanact.patch", "leanact", ["lean"]), ("leanact.patch + plan", "leanact", args.plans)]
    lines = ["| model (s) | variant | " + " | ".join(f"{b:g} GiB" for b in args.budgets) + " |",
             "|---|---|" + "---:|" * len(budgets)]
    for name in args.models:
        base = None
        for label, variant, strategies in rows:
            model, geo = build(name, variant)
            sample = geo.batch_inputs(1, geo.seq, torch.bfloat16)
            best = [0] * len(budgets)
            t0 = time.perf_counter()
            for strategy in strategies:
                memo: dict[int, int] = {}

                def cost(n: int) -> int:
                    if n not in memo:
                        memo[n] = step_estimate(model, sample, strategy, "batch", n, device="cuda").peak
                    return memo[n]

                for i, b in enumerate(budgets):
                    best[i] = max(best[i], largest_fitting(cost, b, probes=(1, 8, 32))[0])
            base = base or best
            cells = [f"{v}" + (f" ({v / max(h, 1):.1f}x)" if label != "HF sdpa" else "") for v, h in zip(best, base)]
            lines.append(f"| {name} ({geo.seq}) | {label} | " + " | ".join(cells) + " |")
            print(f"{name} {label}: {best} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
