"""Whole-model activation memory per sample under fp32 weights + bf16 autocast, predicted on fake tensors.

    python benchmarks/autocast_whole.py [--layers 16] [--seq 2048] [--device cpu]

LLaMA-3.2-1B geometry (h=2048, 32/8 heads, SwiGLU 8192, vocabulary 128256; a LlamaForCausalLM with
labels, so the head and loss are included), HF sdpa vs ``leanact.patch``: ``leanact.estimate_config``
(fake tensors, nothing allocated) at batch 1 and 2; per sample = the slope of the activation bytes.
``--device cpu`` models the CPU's kernels (the ones measured by the per-layer benchmark,
benchmarks/autocast.py); ``cuda`` models CUDA's (leanact.estimate's assumptions, docs/estimate.md).
"""
from __future__ import annotations

import argparse

import torch
import transformers

import leanact


def per_sample(cfg, seq: int, patch: bool, device: str) -> int:
    acts = {}
    for b in (1, 2):
        ids = torch.zeros(b, seq, dtype=torch.long)
        acts[b] = leanact.estimate_config(cfg, dict(input_ids=ids, labels=ids),
                                          model_class=transformers.LlamaForCausalLM,
                                          patch=patch, autocast="bf16", device=device).activations
    return acts[2] - acts[1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args(argv)
    cfg = transformers.LlamaConfig(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
                                   intermediate_size=8192, num_hidden_layers=args.layers, vocab_size=128256,
                                   max_position_embeddings=max(4096, args.seq), attn_implementation="sdpa")
    hf = per_sample(cfg, args.seq, False, args.device)
    lean = per_sample(cfg, args.seq, True, args.device)
    print(f"| model | s | device modelled | HF sdpa MiB/sample | leanact MiB/sample | leanact / HF sdpa |\n"
          f"|---|---|---|---|---|---|\n"
          f"| LLaMA-1B-like, {args.layers} layers, fp32 + bf16 autocast | {args.seq} | {args.device} | "
          f"{hf / 2**20:.0f} | {lean / 2**20:.0f} | {lean / hf:.3f}x |")


if __name__ == "__main__":
    main()
