"""Transformer encoder layer: bytes kept per s·b·h and forward+backward time, side by side.

    python benchmarks/blocks.py [--seqs 128 512 2048] [--repeats 5] [--markdown]

Modes (same weights): torch.nn.TransformerEncoderLayer; leanact.nn.TransformerEncoderLayer with
attention_mode="tempo" (keeps the softmax output, regenerates the dropout mask); with
attention_mode="recompute" (keeps no s² tensor). B/sbh is the 2-layer minus 1-layer figure
(REFERENCE.md); time is the median of interleaved fwd+bwd steps of one layer in one process.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from leanact.memory import measure_layer_cost
from leanact.nn import TransformerEncoderLayer

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build(mode: str, layers: int, args) -> nn.Module:
    torch.manual_seed(0)
    kw = dict(d_model=args.hidden, nhead=args.heads, dim_feedforward=4 * args.hidden, dropout=args.dropout,
              activation="gelu", batch_first=True)
    make = (lambda: nn.TransformerEncoderLayer(**kw)) if mode == "torch" else (
        lambda: TransformerEncoderLayer(**kw, attention_mode=mode))
    return nn.Sequential(*[make() for _ in range(layers)]).to(DTYPES[args.dtype]).train()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    modes = ["torch", "tempo", "recompute"]
    rows = []
    for s in args.seqs:
        b, h = args.batch, args.hidden
        dtype = DTYPES[args.dtype]
        per_sbh = {m: measure_layer_cost(lambda n, m=m: build(m, n, args),
                                         lambda: (torch.randn(b, s, h, dtype=dtype),), s, b, h).per_sbh
                   for m in modes}
        models = {m: build(m, 1, args) for m in modes}
        x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
        times = {m: [] for m in modes}
        for i in range(args.repeats + 1):
            for m in modes:
                t0 = time.perf_counter()
                models[m](x).float().square().mean().backward()
                if i:  # first round is warm-up
                    times[m].append(time.perf_counter() - t0)
        base = statistics.median(times["torch"])
        for m in modes:
            t = statistics.median(times[m])
            rows.append((s, m, per_sbh[m], per_sbh[m] / per_sbh["torch"], t * 1e3, t / base))
    header = ("s", "mode", "B/sbh", "memory vs torch", "fwd+bwd ms", "time vs torch")

    def fmt(r):
        return [str(r[0]), r[1], f"{r[2]:.2f}", f"{r[3]:.3f}x", f"{r[4]:.1f}", f"{r[5]:.2f}x"]

    title = (f"encoder layer h={args.hidden} a={args.heads} b={args.batch} {args.dtype} dropout={args.dropout}, "
             f"CPU {torch.get_num_threads()} threads")
    if args.markdown:
        print(title + "\n")
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for r in rows:
            print("| " + " | ".join(fmt(r)) + " |")
        return
    from rich.console import Console
    from rich.table import Table

    tab = Table(title=title)
    for c in header:
        tab.add_column(c, justify="left" if c == "mode" else "right")
    for r in rows:
        tab.add_row(*fmt(r))
    Console().print(tab)


if __name__ == "__main__":
    main()
