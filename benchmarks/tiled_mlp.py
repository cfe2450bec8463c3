"""Sequence-tiled MLP: bytes one layer keeps and its forward+backward time, lean vs tiled_mlp vs full.

    python benchmarks/tiled_mlp.py [--seq 2048] [--hidden 1024] [--inter 2816] [--chunk 1024] [--dtype fp32]

A patched (``leanact.patch``) 2-layer LlamaForCausalLM of the given geometry, random weights; per
strategy, the planner's own measurement (``leanact.planner.costs.measure_costs``): what the layer keeps
(``SavedTensorMeter``) and the forward+backward time of the layer alone (best of ``--repeats``
after a warm-up), all in one process.
"""
from __future__ import annotations

import argparse
import warnings

import torch
import transformers as T

import leanact
from leanact.planner.costs import measure_costs
from leanact.strategies import find_layers

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=1024, help="tokens per MLP chunk")
    ap.add_argument("--dtype", choices=DTYPES, default="fp32")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    cfg = T.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.inter, num_hidden_layers=2,
                        num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 4), vocab_size=1000,
                        max_position_embeddings=max(args.seq, 64))
    torch.manual_seed(0)
    model = leanact.patch(T.LlamaForCausalLM(cfg).to(DTYPES[args.dtype])).train()
    ids = torch.randint(0, 1000, (args.batch, args.seq))
    layers = find_layers(model)[:1]
    strategies = ["lean", "tiled_mlp", "full"]
    import leanact.strategies.tiled as TL

    TL.DEFAULT_MLP_CHUNK = args.chunk  # measure_costs builds its plans with the default chunk
    costs = measure_costs(model, dict(input_ids=ids, labels=ids), layers, strategies, reps=args.repeats,
                          threshold=1 << 20)
    by = costs.layers[0].by_strategy
    sbh = args.seq * args.batch * args.hidden
    print(f"LLaMA layer h={args.hidden} I={args.inter} s={args.seq} b={args.batch} {args.dtype}, patched, "
          f"MLP chunk {args.chunk} tokens, CPU ({torch.get_num_threads()} threads)")
    print(f"{'strategy':12s} {'kept':>12s} {'B/sbh':>7s} {'fwd+bwd':>9s} {'vs lean':>8s}")
    for s in strategies:
        c = by[s]
        print(f"{s:12s} {c.kept / 2**20:9.2f} MiB {c.kept / sbh:7.2f} {c.time * 1e3:7.0f} ms "
              f"{c.time / by['lean'].time:7.2f}x")


if __name__ == "__main__":
    main()
