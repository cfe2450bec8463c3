"""Longest trainable sequence on one GPU, predicted by leanact.estimate(device="cuda"): Llama-3.2-1B
geometry (llama-1b-like: h=2048, 16 layers, 32/8 heads, SwiGLU 8192, vocab 128256, tied
embeddings), full fine-tuning, bf16 weights, AdamW, batch 1, the whole step counted (parameters,
gradients, optimizer state, activations, temporaries; Trainer protocol). Models are built on the
meta device; nothing runs for real.

    python benchmarks/long_context.py [--budgets 24 80] [--multiple 1024] [--plans tiled_mlp full]

Rows: Hugging Face sdpa (flash kernel: no padding), + HF gradient checkpointing (non-reentrant),
leanact.patch (lean layers, fused linear + cross-entropy), and leanact.patch + a plan (each
strategy on every layer; "leanact + plan" is the best of them, as plan(maximize="seq") picks).
Each cell is the largest multiple of --multiple tokens whose predicted peak fits the budget
(leanact.estimate.fit.largest_fitting: exact for the estimate, typically 5-8 estimates per row).
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


def build(variant: str):
    import transformers

    cfg = resolve("llama-1b-like").make_config(attn="sdpa")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    if variant == "hf+gc":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if variant == "leanact":
        leanact.patch(model)
    return model.train()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=float, nargs="+", default=[24, 80], help="GiB")
    ap.add_argument("--multiple", type=int, default=1024, help="sequence lengths searched in multiples of this")
    ap.add_argument("--plans", nargs="+", default=["tiled_mlp", "full"], help="strategies for the leanact + plan rows")
    args = ap.parse_args(argv)
    ids = torch.zeros(1, 1024, dtype=torch.long)
    sample = dict(input_ids=ids, labels=ids)
    rows = [("HF sdpa", "hf", "lean"), ("HF sdpa + HF checkpointing", "hf+gc", "lean"),
            ("leanact.patch", "leanact", "lean")] + [(f"leanact.patch + plan: {p}", "leanact", p) for p in args.plans]
    budgets = [int(b * GIB) for b in args.budgets]
    results: dict[str, list[int]] = {}
    for label, variant, strategy in rows:
        model = build(variant)
        memo: dict[int, int] = {}  # one estimate per size, shared by the budgets
        t0 = time.perf_counter()

        def cost(n: int) -> int:
            if n not in memo:
                memo[n] = step_estimate(model, sample, strategy, "seq", n, device="cuda").peak
            return memo[n]

        results[label] = [largest_fitting(cost, b, probes=(1, 8, 32), multiple=args.multiple)[0] for b in budgets]
        print(f"{label}: {results[label]} ({len(memo)} estimates, {time.perf_counter() - t0:.0f} s)", flush=True)
    best = [max(results[label][i] for label, _, _ in rows[3:]) for i in range(len(budgets))] if len(rows) > 3 else None
    hf, gc = results["HF sdpa"], results["HF sdpa + HF checkpointing"]
    head = "| model | " + " | ".join(f"{b:g} GiB" for b in args.budgets) + " |"
    print("\n" + head + "\n|---|" + "---:|" * len(budgets))
    for label, _, _ in rows:
        print(f"| {label} | " + " | ".join(f"{v:,}" for v in results[label]) + " |")
    if best is not None:
        print("| **leanact + plan** (best) | " + " | ".join(
            f"**{v:,}** ({v / max(h, 1):.0f}x HF, {v / max(g, 1):.1f}x HF+ckpt)" for v, h, g in zip(best, hf, gc)) + " |")


if __name__ == "__main__":
    main()
