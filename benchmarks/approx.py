"""Lossy options (leanact.lossy): bytes kept per s·b·h on BERT-Large, and convergence vs exact.

    python benchmarks/approx.py                      # memory table + short convergence run
    python benchmarks/approx.py --skip-convergence   # memory table only (~5 min on 2 CPU cores)
    python benchmarks/approx.py --steps 300 --seeds 0 1 --out benchmarks/approx.png

Memory: HF ``BertForMaskedLM`` built from ``BertConfig`` (BERT-Large geometry: h=1024, a=16,
FFN 4096; vocabulary 1000, random weights), bf16, s=512, b=1, dropout 0.1, eager attention; B/sbh
is the 2-layer minus 1-layer figure of ``leanact.memory.measure_layer_cost`` (what autograd keeps,
storages deduplicated, parameters excluded). Rows: HF eager, ``leanact.patch`` (exact), and
``leanact.patch`` + each lossy option.

Convergence: ``benchmarks/convergence.py``'s ``compare`` (byte-level masked LM on Alice in
Wonderland, fp32, from scratch): exact (``leanact.patch``) vs patch + each lossy option, same
weights and batches per seed. The fp32 run compresses float32 tensors (``dtypes=(float32,)``)
and keeps the attention log-sum-exp, shaped (b, heads, s), exact through ``select``; curves go to
``--out`` and the final-loss differences are printed against the exact run's seed spread.
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import time

import torch

import leanact
import leanact.lossy as lossy
from leanact.memory import measure_layer_cost

HERE = pathlib.Path(__file__).resolve().parent



def _ffn_out(name: str, module) -> bool:
    """BERT's second FFN Linear (layer.N.output.dense): its input is the GELU output, which a
    few-bit GELU no longer keeps, so only there does a randomized Linear remove a kept tensor."""
    return name.endswith(".output.dense") and ".attention." not in name


# name -> (lossy spec or None, patched?, what it approximates)
MEMORY_ROWS = {
    "HF eager": (None, False, "exact"),
    "leanact.patch": (None, True, "exact"),
    "patch + fewbit=2": ({"fewbit": 2}, True, "GELU derivative (4 levels)"),
    "patch + randomized_linear=0.5": ({"randomized_linear": 0.5}, True, "Linear weight grads (ρ=0.5)"),
    "patch + fewbit=2 + rl=0.5": ({"fewbit": 2, "randomized_linear": 0.5}, True, "both of the above"),
    "patch + compress=int8": ({"compress": "int8"}, True, "saved 16-bit tensors, int8 stoch. rounding"),
    "patch + compress=fp8": ({"compress": "fp8"}, True, "saved 16-bit tensors, fp8 e4m3"),
    "patch + fewbit=2 + rl=0.5 + fp8": ({"fewbit": 2, "randomized_linear": 0.5, "compress": "fp8"}, True,
                                        "all three"),
    "patch + fewbit=2 + rl=0.5 (FFN out only)": ({"fewbit": 2,
                                                  "randomized_linear": {"ratio": 0.5, "modules": _ffn_out}},
                                                 True, "GELU derivative, FFN-out weight grad"),
    "patch + fewbit=2 + rl=0.5 (FFN out) + fp8": ({"fewbit": 2,
                                                   "randomized_linear": {"ratio": 0.5, "modules": _ffn_out},
                                                   "compress": "fp8"}, True, "the above + saved tensors in fp8"),
    "HF eager + compress=fp8": ({"compress": "fp8"}, False, "saved 16-bit tensors, fp8 e4m3"),
}


def build_bert(layers: int, spec, patched: bool, args) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=args.hidden, num_hidden_layers=layers, num_attention_heads=args.heads,
                                  intermediate_size=4 * args.hidden, vocab_size=1000, hidden_dropout_prob=0.1,
                                  attention_probs_dropout_prob=0.1, max_position_embeddings=max(512, args.seq),
                                  attn_implementation="eager")
    model = transformers.BertForMaskedLM(cfg).to(torch.bfloat16).train()
    if patched:
        leanact.patch(model)
    if spec is not None:
        lossy.apply(model, spec)
    return model


def memory_table(args, console) -> dict[str, float]:
    from rich.table import Table

    s, b, h = args.seq, args.batch, args.hidden

    def inputs():
        g = torch.Generator().manual_seed(0)
        return (torch.randint(0, 1000, (b, s), generator=g),)

    out = {}
    for name, (spec, patched, what) in MEMORY_ROWS.items():
        t0 = time.perf_counter()
        cost = measure_layer_cost(lambda n: build_bert(n, spec, patched, args), inputs, s, b, h)
        out[name] = (cost.per_sbh, what)
        console.print(f"{name}: {cost.per_sbh:.2f} B/sbh ({time.perf_counter() - t0:.0f} s)")
    tab = Table(title=f"BERT-Large layer (h={h}, a={args.heads}, s={s}, b={b}, bf16, dropout 0.1): bytes kept "
                      f"per s·b·h, CPU")
    for col in ("variant", "approximates", "B/sbh", "vs HF eager", "vs leanact.patch"):
        tab.add_column(col, justify="left" if col in ("variant", "approximates") else "right")
    eager, exact = out["HF eager"][0], out["leanact.patch"][0]
    for name, (v, what) in out.items():
        tab.add_row(name, what, f"{v:.2f}", f"{v / eager:.3f}x", f"{v / exact:.3f}x")
    console.print(tab)
    return {k: v for k, (v, _) in out.items()}


def _convergence_module():
    path = HERE / "convergence.py"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing (written by the convergence benchmark)")
    spec = importlib.util.spec_from_file_location("leanact_bench_convergence", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _prepare(spec, heads: int):
    def prepare(model):
        leanact.patch(model)
        if spec is None:
            return model
        spec2 = dict(lossy.parse(spec))
        if "compress" in spec2:  # fp32 run: compress float32, keep (b, heads, s) log-sum-exp exact
            spec2["compress"] = dict(spec2["compress"], dtypes=(torch.float32,),
                                     select=lambda t: not (t.dim() == 3 and t.shape[1] == heads))
        return lossy.apply(model, spec2)

    return prepare


def convergence(args, console) -> dict:
    conv = _convergence_module()
    heads = conv.SIZES[args.size][2]
    variants = {"exact (patch)": _prepare(None, heads)}
    for name in args.variants:
        variants[name] = _prepare(name, heads)
    out = conv.compare(variants, args.tasks, args.seeds, args.steps, args.out, console=console, size=args.size,
                       batch=args.batch_train, seq=args.seq_train, eval_every=max(1, args.steps // 6))
    ref = out["results"]
    for task, by_variant in ref.items():
        base = by_variant["exact (patch)"]
        for name, by_seed in by_variant.items():
            d = [by_seed[s]["final_eval"] - base[s]["final_eval"] for s in by_seed]
            console.print(f"{task} {name}: final eval - exact = {', '.join(f'{x:+.4f}' for x in d)}")
    return out


def main(argv=None):
    from rich.console import Console

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-convergence", action="store_true")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--tasks", nargs="+", default=["mlm"])
    ap.add_argument("--size", default="small")
    ap.add_argument("--batch-train", type=int, default=12)
    ap.add_argument("--seq-train", type=int, default=64)
    ap.add_argument("--variants", nargs="+",
                    default=["fewbit=2", "randomized_linear=0.5", "compress=int8", "compress=fp8",
                             "fewbit=2,randomized_linear=0.5,compress=fp8"])
    ap.add_argument("--out", default=str(HERE / "approx.png"))
    args = ap.parse_args(argv)
    console = Console()
    result = {}
    if not args.skip_memory:
        result["memory"] = memory_table(args, console)
    if not args.skip_convergence:
        result["convergence"] = convergence(args, console)
    return result


if __name__ == "__main__":
    main()
