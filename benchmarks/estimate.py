"""Validation of leanact.estimate: predicted (fake tensors) vs measured (real tensors, torch's
MemTracker, one AdamW training step on the CPU), BERT / GPT-2 / LLaMA geometries, fp32 and bf16,
unpatched and leanact.patch'ed (optionally with a strategy). Prints a rich table.

    python benchmarks/estimate.py [--hidden 256 --layers 4 --seq 128 --batch 4] [--families bert gpt2 llama]
                                  [--dtypes float32 bfloat16] [--strategy full] [--autocast bf16|fp16]
                                  [--variants sdpa leanact eager hf-ckpt leanact+plan]

``--autocast``: fp32 weights, the forward under ``torch.autocast`` of that dtype (``--dtypes`` ignored).
Variants: HF sdpa, leanact.patch, HF eager attention, HF gradient checkpointing (non-reentrant),
leanact.patch + leanact.plan under half the lean model's kept bytes. The step follows the Trainer
protocol (output released before backward).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import leanact  # noqa: E402
from leanact.estimate import estimate, measure  # noqa: E402
from leanact.estimate.result import fmt_bytes  # noqa: E402


def build(family: str, h: int, layers: int, vocab: int, seq: int, dtype: torch.dtype, attn: str = "sdpa"):
    import transformers as T

    torch.manual_seed(0)
    heads = max(1, h // 64)
    if family == "bert":
        m = T.BertForMaskedLM(T.BertConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                                           intermediate_size=4 * h, vocab_size=vocab, attn_implementation=attn))
    elif family == "gpt2":
        m = T.GPT2LMHeadModel(T.GPT2Config(n_embd=h, n_layer=layers, n_head=heads, vocab_size=vocab,
                                           n_positions=2 * seq, attn_implementation=attn))
    elif family == "llama":
        m = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                                             num_key_value_heads=max(1, heads // 2), intermediate_size=int(2.6875 * h),
                                             vocab_size=vocab, max_position_embeddings=2 * seq,
                                             attn_implementation=attn))
    else:
        raise SystemExit(f"unknown family {family!r}; choose bert, gpt2 or llama")
    return m.to(dtype)


def inputs(b: int, s: int, vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[min(1, b - 1), s // 2:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--families", nargs="+", default=["bert", "gpt2", "llama"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--strategy", default=None, help="a leanact.strategies name applied to every layer")
    ap.add_argument("--autocast", choices=["bf16", "fp16"], default=None,
                    help="fp32 weights, the forward under torch.autocast of this dtype")
    ap.add_argument("--variants", nargs="+", default=["sdpa", "leanact"],
                    choices=["sdpa", "leanact", "eager", "hf-ckpt", "leanact+plan"])
    args = ap.parse_args(argv)
    if args.autocast:
        args.dtypes = ["float32"]

    tab = Table(title=f"leanact.estimate vs measured (CPU, MemTracker, AdamW step; h={args.hidden} "
                      f"L={args.layers} s={args.seq} b={args.batch}{', ' + args.strategy if args.strategy else ''})")
    for col in ("model", "dtype", "variant", "peak pred", "peak meas", "err", "act pred", "act meas", "err",
                "per-layer exact", "t est", "t meas"):
        tab.add_column(col, justify="left" if col in ("model", "dtype", "variant") else "right")
    for family in args.families:
        for dt in args.dtypes:
            for variant in args.variants:
                patched = variant.startswith("leanact")
                model = build(family, args.hidden, args.layers, args.vocab, args.seq, getattr(torch, dt),
                              "eager" if variant == "eager" else "sdpa")
                if patched:
                    leanact.patch(model)
                if variant == "hf-ckpt":
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                x = inputs(args.batch, args.seq, args.vocab)
                strategy = args.strategy
                if variant == "leanact+plan":
                    lean = estimate(model, x).saved
                    try:
                        strategy = leanact.plan(model, x, lean // 2, time_model="flops")
                    except leanact.InfeasibleBudget as e:  # the smallest budget a plan meets
                        strategy = leanact.plan(model, x, e.smallest, time_model="flops")
                t0 = time.perf_counter()
                pred = estimate(model, x, strategy, autocast=args.autocast or False)
                t1 = time.perf_counter()
                real = measure(model, x, strategy, autocast=args.autocast or False)
                t2 = time.perf_counter()
                pe = (pred.peak - real.peak) / real.peak
                ae = (pred.activations - real.activations) / real.activations
                tab.add_row(family, dt + (f" + {args.autocast} autocast" if args.autocast else ""), variant,
                            fmt_bytes(pred.peak), fmt_bytes(real.peak), f"{pe:+.2%}", fmt_bytes(pred.activations),
                            fmt_bytes(real.activations), f"{ae:+.2%}",
                            "yes" if pred.per_layer == real.per_layer else "NO", f"{t1 - t0:.1f}s", f"{t2 - t1:.1f}s")
    Console(width=220).print(tab)


if __name__ == "__main__":
    main()
