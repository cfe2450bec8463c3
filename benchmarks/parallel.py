"""Per-rank activation bytes of a patched HF BERT layer under tensor + sequence parallelism.

    python benchmarks/parallel.py [--tp 1 2 4] [--seq 512] [--hidden 1024] [--heads 16] [--markdown]

For each tensor-parallel size t, t CPU processes (gloo) run one forward of a 2-layer
``leanact.patch``'ed BertModel (dropout 0.1, bf16, no padding) split with
``leanact.parallel.parallelize(model, mesh, sequence_parallel=True)``; each rank measures what
autograd keeps with ``leanact.parallel.meter.ShardedSavedTensorMeter``. B/sbh is the second
layer's bytes on rank 0 divided by s*b*h (the first layer's input belongs to the embeddings).
Next to it: Megatron's per-layer formulas for plain 16-bit layers (REFERENCE.md), tensor
parallel sbh(10 + 24/t + 5as/(ht)) and with sequence parallel sbh(34/t + 5as/(ht)), and the
expectation for leanact: the lean layer's single-process figure L1 split t ways (L1/t; the
column-parallel linears keep their input's shard and re-gather it in backward, as Megatron's do),
and, with ``regather=False``, L1/t + 4 (the two all-gathered 16-bit inputs of q/k/v and fc1 kept
whole, as DTensor's ColwiseParallel alone does).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank, world, args, port, outdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        import transformers
        from torch.distributed.device_mesh import init_device_mesh

        import leanact
        import leanact.parallel
        from leanact.parallel.meter import ShardedSavedTensorMeter

        torch.manual_seed(0)
        cfg = transformers.BertConfig(hidden_size=args.hidden, num_attention_heads=args.heads,
                                      intermediate_size=4 * args.hidden, num_hidden_layers=2, vocab_size=1000,
                                      max_position_embeddings=args.seq, hidden_dropout_prob=0.1,
                                      attention_probs_dropout_prob=0.1, attn_implementation="sdpa")
        model = leanact.patch(transformers.BertModel(cfg, add_pooling_layer=False)).to(torch.bfloat16).train()
        mesh = init_device_mesh("cpu", (world,))
        ids = torch.randint(0, 1000, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
        out = {}
        for regather in (True, False):
            m = leanact.parallel.parallelize(copy.deepcopy(model), mesh, sequence_parallel=True, regather=regather)
            meter = ShardedSavedTensorMeter(m)
            with meter:
                m(input_ids=ids)
            out[regather] = meter.by_module(depth=3)["encoder.layer.1"]
        torch.save(out, os.path.join(outdir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def measure(t: int, args) -> dict:
    with tempfile.TemporaryDirectory() as outdir, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        mp.start_processes(_rank, args=(t, args, port, outdir), nprocs=t, join=True, start_method="spawn")
        return [torch.load(os.path.join(outdir, f"{r}.pt")) for r in range(t)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    s, b, h, a = args.seq, args.batch, args.hidden, args.heads
    sbh = s * b * h
    rows, l1 = [], None
    for t in args.tp:
        ranks = measure(t, args)
        per_rank = [d[True] / sbh for d in ranks]
        kept_gathered = ranks[0][False] / sbh
        if t == 1:
            l1 = per_rank[0]
        rows.append((t, per_rank, kept_gathered))
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"per-rank B/sbh of one BERT layer, bf16, s={s} b={b} h={h} a={a}, dropout 0.1 (CPU, gloo)")
    cols = ["t", "leanact TP+SP (rank 0)", "ranks max/min", "expected L1/t", "vs t=1",
            "regather=False", "expected L1/t + 4", "Megatron TP 10+24/t+5as/ht", "Megatron TP+SP 34/t+5as/ht"]
    for c in cols:
        table.add_column(c, justify="right")
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for t, per_rank, kept_gathered in rows:
        cells = [str(t), f"{per_rank[0]:.2f}", f"{max(per_rank):.2f}/{min(per_rank):.2f}",
                 f"{l1 / t:.2f}" if l1 else "-", f"{per_rank[0] / l1:.3f}" if l1 else "-",
                 f"{kept_gathered:.2f}", f"{l1 / t + (4 if t > 1 else 0):.2f}" if l1 else "-",
                 f"{10 + 24 / t + 5 * a * s / (h * t):.2f}", f"{34 / t + 5 * a * s / (h * t):.2f}"]
        table.add_row(*cells)
        md.append("| " + " | ".join(cells) + " |")
    Console().print(table)
    if args.markdown:
        print("\n".join(md))


if __name__ == "__main__":
    main()
