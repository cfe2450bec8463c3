"""Longest trainable sequence on one GPU, predicted by leanact.estimate(device="cuda"), batch 1, the
whole step counted (parameters, gradients, optimizer state, activations, temporaries; Trainer
protocol), AdamW, bf16 weights. Models are built on the meta device; nothing runs for real.

    python benchmarks/long_context.py [--budgets 24 80] [--multiple 1024] [--models 1b 8b-lora 8b-lora-fp32]
    python benchmarks/long_context.py --ranks 8 --budgets 80     # context parallelism: per rank of 8
    python benchmarks/long_context.py --plan-times [--budgets 80] # how long leanact.plan(maximize="seq") takes

With ``--ranks P`` the rows are leanact's with :func:`leanact.parallel.context_parallel` over P ranks
(DeepSpeed-Ulysses): the sequence is the whole one, each rank runs s/P tokens, the budget and the
host memory are per rank, weights, gradients and optimizer state replicated on every rank (with
FSDP they would be sharded: more room).

Models:
* ``1b``: Llama-3.2-1B geometry (llama-1b-like: h=2048, 16 layers, 32/8 heads, SwiGLU 8192, vocab
  128256, tied embeddings), full fine-tuning.
* ``8b-lora``: Llama-3.1-8B geometry (llama-8b-like: h=4096, 32 layers, 32/8 heads of 128, SwiGLU
  14336, vocab 128256, untied), PEFT LoRA r=16 on all linear layers, frozen bf16 base weights,
  bf16 adapters (``get_peft_model(..., autocast_adapter_dtype=False)``).
* ``8b-lora-fp32``: the same with PEFT's default fp32 adapters (each LoRA projection casts its
  input to fp32 and keeps that copy).

Rows: Hugging Face sdpa (flash kernel), + HF gradient checkpointing (non-reentrant), leanact.patch
(lean layers, fused linear + cross-entropy), and leanact.patch + a strategy on every layer
(``offload+...``: the last layer is not offloaded). Each cell is the largest multiple of --multiple
tokens whose predicted peak fits the budget less the caching allocator's reserve
(leanact.estimate.maximize.reserve_for: 1 GiB at 24 GiB, 1.6 GiB at 80 GiB), and, for offloading
rows, the pinned host memory that size needs.

``--plan-times``: instead, the time of ``leanact.plan(model, inputs, budget, maximize="seq")`` for
the patched 1B and 8B-LoRA models (the 6 default CUDA candidates), with the depth-scaled search
(leanact.estimate.depth) and, with ``--whole``, with whole-model estimates only; the estimates
counted by depth.
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
from leanact.estimate.maximize import reserve_for, step_estimate  # noqa: E402
from leanact.models.geometries import resolve  # noqa: E402

GIB = 2**30
MODELS = {
    "1b": ("Llama-3.2-1B, full fine-tuning", "llama-1b-like", None),
    "8b-lora": ("Llama-3.1-8B, LoRA r=16 (bf16 adapters)", "llama-8b-like", False),
    "8b-lora-fp32": ("Llama-3.1-8B, LoRA r=16 (PEFT's default fp32 adapters)", "llama-8b-like", True),
}
ROWS = {  # model -> (label, variant, strategy)
    "1b": [("HF sdpa", "hf", "lean"), ("HF sdpa + HF checkpointing", "hf+gc", "lean"),
           ("leanact.patch", "leanact", "lean"), ("leanact.patch + full", "leanact", "full"),
           ("leanact.patch + full+tiled_mlp", "leanact", "full+tiled_mlp"),
           ("leanact.patch + offload+recompute+tiled_mlp", "leanact", "offload+recompute+tiled_mlp")],
    "8b-lora": [("HF sdpa + HF checkpointing", "hf+gc", "lean"),
                ("leanact.patch + full+tiled_mlp", "leanact", "full+tiled_mlp"),
                ("leanact.patch + offload+recompute+tiled_mlp", "leanact", "offload+recompute+tiled_mlp")],
    "8b-lora-fp32": [("leanact.patch + offload+recompute+tiled_mlp", "leanact", "offload+recompute+tiled_mlp")],
}


def build(geometry: str, variant: str, lora_fp32: bool | None = None):
    import transformers

    cfg = resolve(geometry).make_config(attn="sdpa")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    if lora_fp32 is not None:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"),
                                    autocast_adapter_dtype=lora_fp32)
    if variant == "hf+gc":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if variant == "leanact":
        leanact.patch(model)
    return model.train()


def longest(model, sample, strategy: str, budgets: list[int], multiple: int,
            ranks: int | None = None) -> tuple[list[str], int]:
    """One row: per budget, the longest sequence that fits (and the pinned host memory it needs); and
    the number of estimates run."""
    memo: dict[int, object] = {}  # one estimate per size, shared by the budgets

    def cost(n: int) -> int:
        if n not in memo:
            memo[n] = step_estimate(model, sample, strategy, "seq", n, device="cuda", context_parallel=ranks)
        return memo[n].peak

    cells = []
    for b in budgets:
        n = largest_fitting(cost, b - reserve_for(b), probes=(8, 32, 128), multiple=multiple)[0]
        host = memo[n].host if n in memo else 0
        cells.append(f"{n:,}" + (f" ({host / GIB:.0f} GiB host)" if host else ""))
    return cells, len(memo)


def plan_times(models: list[str], budgets: list[int], whole: bool) -> None:
    """Print how long ``leanact.plan(maximize="seq")`` takes, and the estimates it ran by depth."""
    import collections

    maximize_mod = sys.modules["leanact.estimate.maximize"]
    ids = torch.zeros(1, 1024, dtype=torch.long)
    sample = dict(input_ids=ids, labels=ids)
    for key in models:
        title, geometry, lora_fp32 = MODELS[key]
        model = build(geometry, "leanact", lora_fp32)
        for budget in budgets:
            for scaling in (True, False) if whole else (True,):
                depths: collections.Counter = collections.Counter()
                real = maximize_mod.step_estimate

                def counted(m, *a, **k):
                    depths[len(leanact.strategies.find_layers(m))] += 1
                    return real(m, *a, **k)

                maximize_mod.step_estimate = counted
                try:
                    t0 = time.perf_counter()
                    found = maximize_mod.maximize(model, sample, budget, "seq", device="cuda", depth_scaling=scaling)
                    took = time.perf_counter() - t0
                finally:
                    maximize_mod.step_estimate = real
                print(f"{title}, {budget / GIB:g} GiB, {'depth-scaled' if scaling else 'whole-model'} search: "
                      f"{took:.1f} s; {found.value:,} tokens with {found.strategy} "
                      f"({found.host / GIB:.0f} GiB host); estimates by depth {dict(sorted(depths.items()))}",
                      flush=True)
        del model


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=float, nargs="+", default=[24, 80], help="GiB")
    ap.add_argument("--multiple", type=int, default=1024, help="sequence lengths searched in multiples of this")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--ranks", type=int, default=None, help="context-parallel ranks (leanact's rows only)")
    ap.add_argument("--plan-times", action="store_true", help="time leanact.plan(maximize='seq') instead")
    ap.add_argument("--whole", action="store_true", help="with --plan-times: also the whole-model search")
    args = ap.parse_args(argv)
    if args.ranks is not None and args.multiple % args.ranks:
        ap.error(f"--multiple {args.multiple} must be a multiple of --ranks {args.ranks}")
    budgets = [int(b * GIB) for b in args.budgets]
    if args.plan_times:
        plan_times([m for m in args.models if m != "8b-lora-fp32"], budgets, args.whole)
        return
    ids = torch.zeros(1, 1024, dtype=torch.long)
    sample = dict(input_ids=ids, labels=ids)
    tables = []
    for key in args.models:
        title, geometry, lora_fp32 = MODELS[key]
        per = f", {args.ranks} ranks with context parallelism: budget and host memory per rank" if args.ranks else ""
        lines = [f"\n**{title}** (batch 1, bf16, AdamW; predicted longest sequence, pinned host memory "
                 f"where offloaded{per})\n",
                 "| model | " + " | ".join(f"{b:g} GiB" for b in args.budgets) + " |",
                 "|---|" + "---:|" * len(budgets)]
        for label, variant, strategy in ROWS[key]:
            if args.ranks is not None and variant != "leanact":
                continue
            model = build(geometry, variant, lora_fp32)
            t0 = time.perf_counter()
            cells, estimates = longest(model, sample, strategy, budgets, args.multiple, args.ranks)
            print(f"{title} / {label}: {cells} ({estimates} estimates, {time.perf_counter() - t0:.0f} s)", flush=True)
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
            del model
        tables.append("\n".join(lines))
    print("\n".join(tables))


if __name__ == "__main__":
    main()
