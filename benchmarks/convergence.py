"""Convergence: does ``leanact.patch`` change training? Unpatched vs patched, same start, same data.

    python benchmarks/convergence.py [--steps 300] [--tasks mlm clm] [--seeds 0 1]
                                     [--out benchmarks/convergence.png]

Trains a small BertForMaskedLM (MLM) and a small GPT2LMHeadModel (causal LM) from scratch on CPU,
fp32, on *Alice's Adventures in Wonderland* (public domain, ``benchmarks/data/``, see its README),
tokenised byte-level (ids 0-255 are the UTF-8 bytes, 256 is [MASK]: no tokenizer to download or
train, fully deterministic). For each seed, every variant starts from identical weights, sees
identical batches (and MLM masks) in the same order and starts training from the same torch RNG
state; only the dropout masks differ, because leanact draws them with its own counter-based RNG.
So the curves are not bitwise equal; the claim checked is that the final held-out loss of the
patched model differs from the unpatched one by no more than the unpatched model differs from
itself across seeds (the seed changes init, data order, MLM masks and dropout).

The eval loss is measured with dropout off on the same fixed held-out batches (last 10% of the
text) for every run, at step 0 and every ``eval_every`` steps. Another script can reuse
:func:`train_losses` and :func:`compare` with its own ``prepare`` functions (load this file with
``importlib.util.spec_from_file_location``).
"""
from __future__ import annotations

import argparse
import functools
import gzip
import hashlib
import math
import time
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch
from torch import nn

DATA_DIR = Path(__file__).resolve().parent / "data"
TEXT_PATH = DATA_DIR / "alice29.txt.gz"
TEXT_SHA256 = "cc660e04a3bef809b5436e822536cafefa278d55fb3639fb3e93665590d6fc0a"  # of the decompressed bytes
MASK_ID = 256
VOCAB_SIZE = 257
EVAL_FRACTION = 0.1  # the last 10% of the text is held out
EVAL_SEED = 1234  # the held-out batches are the same for every run
TASKS = ("mlm", "clm")
# layers, hidden, heads (FFN 4 * hidden), as in the real BERT / GPT-2 configs but smaller.
SIZES = {"tiny": (2, 64, 4), "small": (2, 128, 4), "base": (4, 256, 4)}

Prepare = Callable[[nn.Module], nn.Module]


def load_text() -> str:
    """The benchmark text (ASCII, LF line ends); raises if the shipped file was changed."""
    if not TEXT_PATH.exists():
        raise FileNotFoundError(f"{TEXT_PATH} is missing: restore benchmarks/data/ from the repository")
    data = gzip.decompress(TEXT_PATH.read_bytes())
    if hashlib.sha256(data).hexdigest() != TEXT_SHA256:
        raise RuntimeError(f"{TEXT_PATH} does not match its recorded sha256 (benchmarks/data/README.md): "
                           "restore it from the repository")
    return data.decode("ascii")


@functools.lru_cache(maxsize=None)
def token_ids(split: str) -> torch.Tensor:
    """Byte ids (int64) of the "train" part (first 90%) or the held-out "eval" part of the text."""
    ids = torch.frombuffer(bytearray(load_text().encode("ascii")), dtype=torch.uint8).long()
    cut = int(len(ids) * (1 - EVAL_FRACTION))
    if split == "train":
        return ids[:cut]
    if split == "eval":
        return ids[cut:]
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}")


def _check(task: str, size: str | None = None) -> None:
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if size is not None and size not in SIZES:
        raise ValueError(f"size must be one of {tuple(SIZES)}, got {size!r}")


def make_batches(task: str, split: str, seed: int, n: int, batch: int, seq: int) -> list[dict[str, torch.Tensor]]:
    """``n`` batches of ``batch`` random windows of ``seq`` bytes, a pure function of the arguments.

    "clm": labels are the inputs (the model shifts them). "mlm": 15% of the positions are
    predicted (80% of them replaced by [MASK], 10% by a random character of the text, 10% kept).
    """
    _check(task)
    ids = token_ids(split)
    if not 0 < seq <= len(ids):
        raise ValueError(f"seq must be in 1..{len(ids)} for the {split!r} split, got {seq}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seq + 1, (n, batch), generator=g)
    windows = ids[starts[..., None] + torch.arange(seq)]
    if task == "clm":
        return [dict(input_ids=w, labels=w.clone()) for w in windows]
    alphabet = torch.unique(ids)
    out = []
    for w in windows:
        picked = torch.rand(w.shape, generator=g) < 0.15
        how = torch.rand(w.shape, generator=g)
        noise = alphabet[torch.randint(len(alphabet), w.shape, generator=g)]
        inputs = torch.where(picked & (how < 0.8), MASK_ID, torch.where(picked & (how < 0.9), noise, w))
        out.append(dict(input_ids=inputs, labels=torch.where(picked, w, -100)))
    return out


def build_model(task: str, size: str = "small", dropout: float = 0.1, seq: int = 64) -> nn.Module:
    """A freshly initialised BertForMaskedLM ("mlm") or GPT2LMHeadModel ("clm"), SDPA attention
    (transformers' default), fp32; draws its weights from torch's default generator."""
    import transformers as T

    _check(task, size)
    layers, hidden, heads = SIZES[size]
    if task == "mlm":
        cfg = T.BertConfig(vocab_size=VOCAB_SIZE, hidden_size=hidden, num_hidden_layers=layers,
                           num_attention_heads=heads, intermediate_size=4 * hidden, max_position_embeddings=seq,
                           hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                           attn_implementation="sdpa")
        return T.BertForMaskedLM(cfg)
    cfg = T.GPT2Config(vocab_size=VOCAB_SIZE, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=heads,
                       resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=10,
                       eos_token_id=10, attn_implementation="sdpa")
    return T.GPT2LMHeadModel(cfg)


@torch.no_grad()
def eval_loss(model: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]]) -> float:
    """Mean loss over ``batches`` with dropout off (the model's train/eval mode is restored)."""
    was_training = model.training
    model.eval()
    try:
        losses = [model(**b).loss.item() for b in batches]
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over the first 10% of the steps, then linear decay to 0."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (steps - step) / max(1, steps - warmup))


def train_losses(task: str, prepare: Prepare | None, seed: int, steps: int, *, batch: int = 12, seq: int = 64,
                 size: str = "small", eval_every: int = 25, lr: float = 1e-3, dropout: float = 0.1,
                 eval_batches: int = 4, threads: int | None = 1) -> dict:
    """Train one model from scratch; returns {"train": [loss per step], "eval": [(step, loss)],
    "final_eval": float, "seconds": float, "params": int}.

    ``prepare``: None (unpatched) or a function applied to the freshly built model before the
    optimizer is made (e.g. ``leanact.patch``; it may modify in place and return the model).
    Everything but ``prepare`` is a function of the arguments: weights (``seed``), batches
    (``seed``), the torch RNG state at the first step (``seed``), the held-out batches (fixed).
    AdamW (betas 0.9/0.98, weight decay 0.01), gradient norm clipped at 1, :func:`lr_factor`.
    ``threads``: torch CPU threads for the run (restored afterwards; None keeps the current
    setting). 1 by default: the numbers do not depend on the core count, and on a shared,
    oversubscribed machine one thread runs these small models many times faster than two.
    """
    _check(task, size)
    if steps < 1 or eval_every < 1:
        raise ValueError(f"steps and eval_every must be >= 1, got steps={steps}, eval_every={eval_every}")
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _train(task, prepare, seed, steps, batch, seq, size, eval_every, lr, dropout, eval_batches)
    finally:
        torch.set_num_threads(before)


def _train(task, prepare, seed, steps, batch, seq, size, eval_every, lr, dropout, eval_batches) -> dict:
    torch.manual_seed(seed)
    model = build_model(task, size, dropout, seq)
    if prepare is not None:
        prepared = prepare(model)
        model = model if prepared is None else prepared
    model.train()
    train_batches = make_batches(task, "train", seed, steps, batch, seq)
    held_out = make_batches(task, "eval", EVAL_SEED, eval_batches, batch, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps))
    train, evals = [], [(0, eval_loss(model, held_out))]
    torch.manual_seed(seed)  # the same RNG state for every variant, whatever building/prepare drew
    t0 = time.perf_counter()
    for step, b in enumerate(train_batches, 1):
        loss = model(**b).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        train.append(loss.item())
        if not math.isfinite(train[-1]):
            raise FloatingPointError(f"{task} seed {seed}: loss became {train[-1]} at step {step}")
        if step % eval_every == 0 or step == steps:
            evals.append((step, eval_loss(model, held_out)))
    return dict(train=train, eval=evals, final_eval=evals[-1][1], seconds=time.perf_counter() - t0,
                params=sum(p.numel() for p in model.parameters()))


def _spread(xs: list[float]) -> float:
    return max(xs) - min(xs) if len(xs) > 1 else float("nan")


def _rms_late(pairs: list[tuple[dict, dict]]) -> float:
    """RMS over the eval points of the second half of training of ``a - b`` for (a, b) runs."""
    d = [la - lb for a, b in pairs for (s, la), (_, lb) in zip(a["eval"], b["eval"]) if 2 * s >= a["eval"][-1][0]]
    return math.sqrt(sum(x * x for x in d) / len(d)) if d else float("nan")


def summarize(results: dict, reference: str) -> list[dict]:
    """Per task and variant: final eval losses by seed, the differences from ``reference`` at the
    same seed, and the reference's seed-to-seed spread of final losses (max - min over seeds), the
    noise level. Also the RMS over the second half's eval points of the difference from the
    reference (``rms``) and of the reference's difference from its first seed (``noise_rms``)."""
    rows = []
    for task, by_variant in results.items():
        ref = by_variant[reference]
        noise = _spread([r["final_eval"] for r in ref.values()])
        first = next(iter(ref.values()))
        noise_rms = _rms_late([(r, first) for r in list(ref.values())[1:]]) if len(ref) > 1 else float("nan")
        for variant, by_seed in by_variant.items():
            diffs = [by_seed[s]["final_eval"] - ref[s]["final_eval"] for s in by_seed]
            rows.append(dict(task=task, variant=variant, final={s: r["final_eval"] for s, r in by_seed.items()},
                             diff=diffs, max_abs_diff=max(abs(d) for d in diffs), noise=noise,
                             rms=_rms_late([(by_seed[s], ref[s]) for s in by_seed]), noise_rms=noise_rms,
                             seconds=sum(r["seconds"] for r in by_seed.values())))
    return rows


def _table(rows: list[dict], reference: str, seeds: list[int], steps: int):
    from rich.table import Table

    t = Table(title=f"held-out loss after {steps} steps (nats/token); noise = {reference} seed-to-seed; "
                    "RMS = over the eval points of the second half")
    t.add_column("task")
    t.add_column("variant")
    for s in seeds:
        t.add_column(f"seed {s}", justify="right")
    for col in (f"Δ vs {reference}", "max |Δ|", "noise", "|Δ| / noise", "RMS Δ", "RMS noise", "train s"):
        t.add_column(col, justify="right")
    for r in rows:
        is_ref = r["variant"] == reference
        ratio = r["max_abs_diff"] / r["noise"] if r["noise"] > 0 else float("nan")
        verdict = "" if is_ref else ("[green]within noise[/]" if ratio <= 1 else "[red]above noise[/]")
        t.add_row(r["task"], r["variant"], *(f"{r['final'][s]:.4f}" for s in seeds),
                  "" if is_ref else " ".join(f"{d:+.4f}" for d in r["diff"]),
                  "" if is_ref else f"{r['max_abs_diff']:.4f}", f"{r['noise']:.4f}",
                  "" if is_ref else f"{ratio:.2f} {verdict}", "" if is_ref else f"{r['rms']:.4f}",
                  f"{r['noise_rms']:.4f}", f"{r['seconds']:.0f}")
    return t


def plot(results: dict, out_png: str | Path, steps: int) -> None:
    """Top row, per task: train loss (moving average over 10 steps, thin) and held-out loss
    (markers) of every run. Bottom row: each run's held-out loss minus the reference's (first
    variant) at the same seed, next to the reference's seed-to-seed difference (the noise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {"mlm": "BERT masked LM", "clm": "GPT-2 causal LM"}
    fig, axes = plt.subplots(2, len(results), figsize=(6.5 * len(results), 8), squeeze=False,
                             gridspec_kw=dict(height_ratios=[3, 2]))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    for col, (task, by_variant) in enumerate(results.items()):
        top, bottom = axes[0, col], axes[1, col]
        reference = next(iter(by_variant.values()))
        for vi, (variant, by_seed) in enumerate(by_variant.items()):
            for si, (seed, r) in enumerate(by_seed.items()):
                c, ls = colors[vi % len(colors)], styles[si % len(styles)]
                w = torch.tensor(r["train"])
                k = min(10, len(w))
                smooth = torch.nn.functional.avg_pool1d(w[None, None], k, 1)[0, 0]
                top.plot(range(k, len(w) + 1), smooth, color=c, ls=ls, lw=0.8, alpha=0.6)
                es, el = zip(*r["eval"])
                top.plot(es, el, color=c, ls=ls, lw=1.6, marker="o", ms=3, label=f"{variant}, seed {seed}")
                if vi:
                    ref = [loss for _, loss in reference[seed]["eval"]]
                    bottom.plot(es, [a - b for a, b in zip(el, ref)], color=c, ls=ls, marker="o", ms=3,
                                label=f"{variant} − reference, seed {seed}")
        seeds = list(reference)
        for si, seed in enumerate(seeds[1:], 1):
            es, el = zip(*reference[seed]["eval"])
            base = [loss for _, loss in reference[seeds[0]]["eval"]]
            bottom.plot(es, [a - b for a, b in zip(el, base)], color="gray", ls=styles[si % len(styles)],
                        marker="s", ms=3, label=f"noise: reference seed {seed} − seed {seeds[0]}")
        top.set_title(f"{names[task]} on Alice in Wonderland (byte-level)")
        top.set_ylabel("loss (nats/token): thin = train, markers = held-out")
        bottom.set_ylabel("held-out loss difference")
        # Start the difference plot after the steep first part, where every difference is large.
        tail = [(s, loss) for s, loss in reference[seeds[0]]["eval"] if s >= steps // 5]
        if tail:
            bottom.set_xlim(tail[0][0] - steps / 50, steps + steps / 50)
            vals = [abs(y) for ln in bottom.get_lines() for x, y in zip(*ln.get_data()) if x >= tail[0][0]]
            if vals:
                lim = 1.15 * max(vals) or 1e-3
                bottom.set_ylim(-lim, lim)
        bottom.axhline(0, color="black", lw=0.6)
        for ax in (top, bottom):
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        top.set_xlim(0, steps)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def compare(variants: Mapping[str, Prepare | None], tasks: Iterable[str] = TASKS, seeds: Iterable[int] = (0, 1),
            steps: int = 300, out_png: str | Path | None = None, *, console=None, **train_kwargs) -> dict:
    """Run :func:`train_losses` for every task x seed x variant (variants interleaved, so machine
    load affects them alike), print the rich table and save the plot to ``out_png`` (if given).
    The first variant is the reference. Returns {"results": {task: {variant: {seed: result}}},
    "summary": :func:`summarize` rows}."""
    from rich.console import Console

    console = console or Console(width=max(130, Console().width))
    variants, tasks, seeds = dict(variants), list(tasks), list(seeds)
    if not variants:
        raise ValueError("variants is empty: pass e.g. {'unpatched': None, 'leanact.patch': leanact.patch}")
    reference = next(iter(variants))
    results: dict = {t: {v: {} for v in variants} for t in tasks}
    for task in tasks:
        for seed in seeds:
            for name, prepare in variants.items():
                r = train_losses(task, prepare, seed, steps, **train_kwargs)
                results[task][name][seed] = r
                console.print(f"{task} seed {seed} {name}: eval {r['eval'][0][1]:.4f} -> {r['final_eval']:.4f} "
                              f"({r['seconds']:.0f} s, {r['params'] / 1e6:.2f} M params)")
    rows = summarize(results, reference)
    console.print(_table(rows, reference, seeds, steps))
    if out_png is not None:
        plot(results, out_png, steps)
        console.print(f"plot saved to {out_png}")
    return dict(results=results, summary=rows)


def main(argv: list[str] | None = None) -> dict:
    import leanact

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "convergence.png"))
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--attention", choices=["recompute", "tempo"], default="recompute")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per run (see train_losses)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    variants = {"unpatched": None,
                "leanact.patch": functools.partial(leanact.patch, attention=args.attention)}
    out = compare(variants, args.tasks, args.seeds, args.steps, args.out, batch=args.batch, seq=args.seq,
                  size=args.size, eval_every=args.eval_every, lr=args.lr, dropout=args.dropout,
                  threads=args.threads)
    print(f"total wall time {time.perf_counter() - t0:.0f} s")
    return out


if __name__ == "__main__":
    main()
