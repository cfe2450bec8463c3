"""Where a training step's host (Python and dispatch) time goes: cProfile of patched steps.

    python benchmarks/host_profile.py [--model bert-large|llama-1b] [--steps 3] [--top 30]

A step is host-bound when the GPU waits for the CPU to enqueue kernels: its wall time is then
above its kernels' device time (``gpu_suite.py --parts profile`` gives both). This script times
Hugging Face's and leanact's steps of the same model (fp32 weights + bf16 autocast, fused AdamW;
on a CPU: tiny sizes, to look at the host path only), then runs cProfile over leanact's steps and
prints its functions by their own time and the leanact functions by cumulative time.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import os
import pathlib
import pstats
import re
import statistics
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import gpu_bert_large as gb  # noqa: E402

import leanact  # noqa: E402

TINY = dict(hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=1000)


def build_model(model_name: str, device: str):
    """(model in training mode, its inputs with labels): BERT-Large MLM at b=32, s=512, or the
    Llama-3.2-1B geometry at b=4, s=2048, on CUDA; the same layer counts at tiny widths elsewhere."""
    cuda = device == "cuda"
    if model_name == "bert-large":
        seq, batch = (512, 32) if cuda else (16, 2)
        model = gb.build("sdpa", None, "bf16", "autocast", seq, device, **({} if cuda else TINY))
        return model, gb.make_batch(batch, seq, model.config.vocab_size, device)
    import transformers

    from leanact.models.geometries import GEOMETRIES

    g = GEOMETRIES["llama-1b-like"]
    seq, batch = (2048, 4) if cuda else (16, 2)
    torch.manual_seed(0)
    kwargs = {} if cuda else dict(hidden_size=32, num_hidden_layers=16, num_attention_heads=2, num_key_value_heads=1,
                                  head_dim=16, intermediate_size=64, vocab_size=1000)
    g = dataclasses.replace(g, kwargs={**g.kwargs, **kwargs})
    with torch.device(device):
        model = getattr(transformers, g.model_cls)(g.make_config(attn="sdpa", dropout=0.0)).train()
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    return model, dict(input_ids=ids, labels=ids)


def _step(model_name: str, lean: bool, device: str):
    model, inputs = build_model(model_name, device)
    if lean:
        leanact.patch(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["bert-large", "llama-1b"], default="bert-large")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    steps = {"HF": _step(args.model, False, device), "leanact": _step(args.model, True, device)}
    for s in steps.values():  # warm-up: kernels compiled, optimizer state made
        s()
        s()
    _sync(device)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.steps):
        for k, s in steps.items():
            t0 = time.perf_counter()
            s()
            _sync(device)
            times[k].append(time.perf_counter() - t0)
    print(f"{args.model} on {device}: "
          + ", ".join(f"{k} {statistics.median(v) * 1e3:.1f} ms" for k, v in times.items()))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        steps["leanact"]()
    _sync(device)
    prof.disable()
    # leanact's own files (by their directory: a virtual environment's path may contain "leanact" too)
    package = re.escape(str(pathlib.Path(leanact.__file__).resolve().parent) + os.sep)
    for order, pattern in (("tottime", ""), ("cumulative", package)):
        out = io.StringIO()
        restrictions = (pattern, args.top) if pattern else (args.top,)
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(*restrictions)
        print(f"--- leanact's steps by {order}{' (leanact functions)' if pattern else ''}, {args.steps} steps")
        print("\n".join(line[:200] for line in out.getvalue().splitlines() if line.strip())[-12000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
