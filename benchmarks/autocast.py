"""Per-layer activation memory under mixed precision: fp32 weights + bf16 ``torch.autocast``.

    python benchmarks/autocast.py [--families bert-large llama-1b] [--seq N] [--repeats 3]
                                  [--time-seq N] [--no-time] [--markdown]

For each family (random weights, real geometry and dropout, vocabulary shrunk to 1000: embeddings
cancel), the bytes one layer keeps for backward = (2-layer model) − (1-layer model), measured with
``leanact.memory.SavedTensorMeter`` around a forward under ``torch.autocast("cpu", bfloat16)``
(storages deduplicated, parameters and inputs excluded), at batch 1 and batch 2:

* per sample: the slope between batch 1 and 2, divided by s·h (B/sbh);
* batch-independent: what is left at batch 1 after the slope (autocast's 16-bit copies of the
  weights, kept by every matmul; seeds), MiB per layer.

Modes: HF ``eager`` and ``sdpa`` under the same autocast, ``leanact.patch`` (fp32 weights +
autocast) and, for reference, ``leanact.patch`` with bf16 weights and no autocast. Then the step
time (forward + backward of the 2-layer model, autocast on, dropout on) of leanact over HF sdpa:
modes interleaved, ``--repeats`` each, medians; measured on the CPU.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch

from families import FAMILIES, VOCAB

MODES = ("eager", "sdpa", "leanact", "leanact, bf16 weights")


def _model(family: str, n: int, mode: str):
    import leanact

    builder = FAMILIES[family][0]
    torch.manual_seed(0)
    m = builder(n, "eager" if mode == "eager" else "sdpa").train()
    if mode.endswith("bf16 weights"):
        m = m.to(torch.bfloat16)
    if mode.startswith("leanact"):
        leanact.patch(m)
    return m


def _autocast(mode: str):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=not mode.endswith("bf16 weights"))


def _ids(b: int, s: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (b, s), generator=torch.Generator().manual_seed(0))


def _kept(family: str, n: int, mode: str, b: int, s: int) -> int:
    from leanact.memory import SavedTensorMeter

    model = _model(family, n, mode)
    ids = _ids(b, s)
    meter = SavedTensorMeter(model, exclude=[ids])
    with warnings.catch_warnings(), meter, _autocast(mode):
        warnings.simplefilter("ignore")
        out = model(ids).last_hidden_state
    meter.release()
    del out, model
    return meter.total_bytes


def layer_memory(family: str, mode: str, s: int) -> tuple[float, float]:
    """(per-sample B/sbh, batch-independent MiB) of one layer."""
    h = FAMILIES[family][1]
    layer = {b: _kept(family, 2, mode, b, s) - _kept(family, 1, mode, b, s) for b in (1, 2)}
    slope = layer[2] - layer[1]
    return slope / (s * h), (layer[1] - slope) / 2 ** 20


def step_ratio(family: str, s: int, repeats: int) -> tuple[float, float, float]:
    """(median leanact step, median HF sdpa step, ratio): 2-layer models, batch 1, autocast."""
    models = {m: _model(family, 2, m) for m in ("sdpa", "leanact")}
    ids = _ids(1, s)
    times: dict[str, list[float]] = {m: [] for m in models}

    def step(m):
        model = models[m]
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with warnings.catch_warnings(), _autocast(m):
            warnings.simplefilter("ignore")
            loss = model(ids).last_hidden_state.float().pow(2).mean()
        loss.backward()
        return time.perf_counter() - t0

    for m in models:  # warm-up
        step(m)
    for _ in range(repeats):
        for m in models:
            times[m].append(step(m))
    a, b = statistics.median(times["leanact"]), statistics.median(times["sdpa"])
    return a, b, a / b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", choices=["bert-large", "llama-1b", "llama-h1024", "gpt2-medium"],
                    default=["bert-large", "llama-1b"])
    ap.add_argument("--seq", type=int, default=None, help="sequence length for every family (default: real)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per mode (interleaved)")
    ap.add_argument("--time-seq", type=int, default=None, help="sequence length for the step time (default: --seq)")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    torch.set_grad_enabled(True)
    rows, trows = [], []
    for fam in args.families:
        s = args.seq or FAMILIES[fam][2]
        res = {}
        for m in args.modes:
            res[m] = layer_memory(fam, m, s)
            print(f"{fam} s={s} {m}: {res[m][0]:.2f} B/sbh, {res[m][1]:.2f} MiB", file=sys.stderr, flush=True)
        base = res.get("sdpa")
        for m, (per, const) in res.items():
            rows.append([fam, str(s), m, f"{per:.2f}", f"{const:.2f}", "" if base is None else f"{per / base[0]:.3f}x"])
        if not args.no_time:
            ts = args.time_seq or s
            a, b, r = step_ratio(fam, ts, args.repeats)
            trows.append([fam, str(ts), f"{b:.2f}", f"{a:.2f}", f"{r:.2f}"])
    header = ["family", "s", "mode", "per sample B/sbh", "batch-independent MiB/layer", "vs HF sdpa"]
    theader = ["family", "s", "HF sdpa step (s)", "leanact step (s)", "leanact / HF sdpa"]
    title = "one layer, fp32 weights + bf16 autocast (CPU), 2-layer minus 1-layer models, slope batch 1 -> 2"
    ttitle = f"step time, CPU, 2 layers, batch 1, autocast bf16, medians of {args.repeats} interleaved"
    legend = [f"{fam}: {FAMILIES[fam][4]}" for fam in args.families]
    if args.markdown:
        for t, hd, rs in ((title, header, rows), (ttitle, theader, trows)):
            if not rs:
                continue
            print(t + "\n")
            print("| " + " | ".join(hd) + " |\n|" + "---|" * len(hd))
            for r in rs:
                print("| " + " | ".join(r) + " |")
            print()
        print("; ".join(legend))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for t, hd, rs in ((title, header, rows), (ttitle, theader, trows)):
        if not rs:
            continue
        tab = Table(title=t)
        for c in hd:
            tab.add_column(c, justify="left" if c in ("family", "mode") else "right")
        for r in rs:
            tab.add_row(*r)
        console.print(tab)
    for line in legend:
        console.print(line)


if __name__ == "__main__":
    main()
