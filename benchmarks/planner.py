"""leanact's planner vs checkpointing every layer vs torch.compile's activation_memory_budget.

    python benchmarks/planner.py [--layers 4] [--hidden 768] [--seq 512] [--dtype fp32]
                                 [--budgets 0.5 0.25 0.1] [--time-model measure|flops]
                                 [--no-compile] [--compile-values 1.0 0.3 0.1 0.0] [--markdown]

HF BertModel (sdpa, dropout 0.1, random weights, loss = mean of the squared last hidden state) on
the CPU. The reference is the unpatched model, unconstrained: its activation memory (bytes autograd
keeps in one step, measured by leanact's meter) and its step time. For each budget (a fraction
of that memory):

* leanact plan: leanact.patch + leanact.plan(model, batch, budget) (measured per-layer costs);
* leanact plan, unpatched layers: leanact.plan on the unpatched model (strategies over HF's ops);
* checkpoint every layer: HF gradient checkpointing (non-reentrant) on the unpatched model;
* torch.compile of the unpatched model with torch._functorch.config.activation_memory_budget:
  values are tried from --compile-values and the largest one whose measured memory meets the
  budget is kept ("-" when none does).

Kept = bytes autograd keeps during the step (meter; parameters excluded). Step time = forward +
backward, median of interleaved steps in this one process; ratio vs the unpatched model.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch

import leanact
import leanact.planner as lplan
from leanact import strategies as S
from leanact.memory import SavedTensorMeter

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build(args):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                     intermediate_size=4 * args.hidden, vocab_size=30522, max_position_embeddings=max(512, args.seq),
                     attn_implementation="sdpa")
    return BertModel(cfg, add_pooling_layer=False).to(DTYPES[args.dtype]).train()


def step(model, batch):
    loss = model(**batch).last_hidden_state.float().square().mean()
    loss.backward()
    return loss


def kept(model, batch) -> int:
    meter = SavedTensorMeter(model)
    with meter:
        out = model(**batch)
    k = S.split_kept(meter).device
    out.last_hidden_state.float().square().mean().backward()
    model.zero_grad(set_to_none=True)
    return k


def timed(models: dict, batch, repeats: int) -> dict:
    times = {k: [] for k in models}
    for i in range(repeats + 1):
        for k, m in models.items():
            t0 = time.perf_counter()
            step(m, batch)
            if i:
                times[k].append(time.perf_counter() - t0)
            m.zero_grad(set_to_none=True)
    return {k: statistics.median(v) for k, v in times.items()}


def compile_variant(base, batch, value: float, repeats: int):
    """(kept bytes, median step time, median time of ``base`` interleaved) for one budget value."""
    import torch._functorch.config as fconfig

    torch._dynamo.reset()
    with fconfig.patch(activation_memory_budget=value):
        model = torch.compile(copy.deepcopy(base))
        step(model, batch)  # compiles
        k = kept(model, batch)
        t = timed({"c": model, "base": base}, batch, repeats)
    return k, t["c"], t["base"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25, 0.1])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-values", type=float, nargs="+", default=[1.0, 0.4, 0.2, 0.1, 0.0])
    ap.add_argument("--time-model", choices=["measure", "flops"], default="measure",
                    help="the planner's per-layer time: timed, or FLOPs counted (deterministic, fast)")
    ap.add_argument("--plan-reps", type=int, default=3)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()

    g = torch.Generator().manual_seed(1)
    batch = dict(input_ids=torch.randint(1000, 30000, (args.batch, args.seq), generator=g),
                 attention_mask=torch.ones(args.batch, args.seq, dtype=torch.long))
    base = build(args)
    ref_kept = kept(base, batch)

    patched = leanact.patch(copy.deepcopy(base))
    ckpt = copy.deepcopy(base)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
    models = {"unpatched": base, "patched": patched, "ckpt": ckpt}
    plans = {}
    t0 = time.perf_counter()
    variants = {"leanact plan": patched, "leanact plan, unpatched layers": base}
    for vname, src in variants.items():
        costs = None
        for frac in args.budgets:
            budget = int(frac * ref_kept)
            m = copy.deepcopy(src)
            try:
                p = lplan.plan(m, batch, budget, costs=costs, time_model=args.time_model, reps=args.plan_reps)
            except lplan.InfeasibleBudget as e:
                costs = costs or None
                plans[vname, frac] = (None, f"infeasible (smallest {e.smallest / 2**20:.1f} MiB)")
                continue
            costs = p.costs
            p.apply(m)
            plans[vname, frac] = (p, None)
            models[vname, frac] = m
    plan_seconds = time.perf_counter() - t0
    log(f"planned in {plan_seconds:.0f} s; timing {len(models)} eager variants")
    kept_bytes = {k: kept(m, batch) for k, m in models.items()}
    times = timed(models, batch, args.repeats)
    ref_t = times["unpatched"]

    compiled = {}
    if not args.no_compile:
        tried = {}
        for v in sorted(args.compile_values, reverse=True):
            log(f"torch.compile with activation_memory_budget={v}")
            k, t, tb = compile_variant(base, batch, v, args.repeats)
            tried[v] = (k, t / tb)
        for frac in args.budgets:
            ok = [(v, kt) for v, kt in tried.items() if kt[0] <= frac * ref_kept]
            compiled[frac] = max(ok, key=lambda x: x[0]) if ok else None
        compiled["unconstrained"] = (1.0, tried[1.0]) if 1.0 in tried else None

    def mib(n):
        return f"{n / 2**20:.1f}"

    rows = [("-", "unpatched (reference)", "", mib(ref_kept), "100.0%", "", f"{ref_t * 1e3:.0f}", "1.00x"),
            ("-", "leanact.patch only", "", mib(kept_bytes["patched"]), f"{kept_bytes['patched'] / ref_kept:.1%}", "",
             f"{times['patched'] * 1e3:.0f}", f"{times['patched'] / ref_t:.2f}x")]
    if compiled.get("unconstrained"):
        v, (k, r) = compiled["unconstrained"]
        rows.append(("-", "torch.compile", "budget 1.0", mib(k), f"{k / ref_kept:.1%}", "", "", f"{r:.2f}x"))
    for frac in args.budgets:
        budget = frac * ref_kept
        label = f"{frac:.0%} ({mib(budget)} MiB)"
        for vname in variants:
            p, err = plans[vname, frac]
            if p is None:
                rows.append((label, vname, err, "", "", "no", "", ""))
                continue
            k = kept_bytes[vname, frac]
            counts = {s: p.choices.count(s) for s in dict.fromkeys(p.choices)}
            setting = ", ".join(f"{n}×{s}" for s, n in counts.items())
            rows.append((label, vname, setting, mib(k), f"{k / ref_kept:.1%}", "yes" if k <= budget else "NO",
                         f"{times[vname, frac] * 1e3:.0f}", f"{times[vname, frac] / ref_t:.2f}x"))
        k = kept_bytes["ckpt"]
        rows.append((label, "checkpoint every layer", "HF, non-reentrant", mib(k), f"{k / ref_kept:.1%}",
                     "yes" if k <= budget else "NO", f"{times['ckpt'] * 1e3:.0f}", f"{times['ckpt'] / ref_t:.2f}x"))
        if not args.no_compile:
            c = compiled.get(frac)
            if c is None:
                rows.append((label, "torch.compile", f"no value in {args.compile_values} meets it", "", "", "no", "",
                             ""))
            else:
                v, (k, r) = c
                rows.append((label, "torch.compile", f"activation_memory_budget={v}", mib(k), f"{k / ref_kept:.1%}",
                             "yes", "", f"{r:.2f}x"))
    header = ("budget", "method", "setting", "kept MiB", "vs unpatched", "meets", "step ms", "time ratio")
    title = (f"HF BertModel sdpa, {args.layers} layers, h={args.hidden} s={args.seq} b={args.batch} {args.dtype} "
             f"dropout 0.1, CPU {torch.get_num_threads()} threads; planning took {plan_seconds:.0f} s "
             "(torch.compile ratios: vs the unpatched model timed alongside each compiled variant)")
    if args.markdown:
        print(title + "\n")
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for r in rows:
            print("| " + " | ".join(r) + " |")
        return
    from rich.console import Console
    from rich.table import Table

    tab = Table(title=title)
    for c in header:
        tab.add_column(c, justify="right" if c in ("kept MiB", "vs unpatched", "step ms", "time ratio") else "left")
    for r in rows:
        tab.add_row(*r)
    console = Console(width=200)
    console.print(tab)
    for (vname, frac), (p, _) in plans.items():
        if p is not None:
            console.print(p.explain(title=f"{vname} at {frac:.0%}: {p.explain().title}"))


if __name__ == "__main__":
    main()
