"""Tempo's experiment on a GPU: BERT-Large (masked LM), s=512 -- largest batch under a memory cap
and training throughput at that batch, HF eager vs HF sdpa vs leanact.patch.

    python benchmarks/gpu_bert_large.py [--cap-gib 16] [--precisions bf16 fp16] [--seq 512]
                                        [--cast autocast|model] [--steps 10] [--append benchmarks/RESULTS.md]

For each precision and mode the model is built from BertConfig (random weights, BERT-Large
geometry, dropout 0.1), trained with AdamW (fp32 master weights under autocast, the usual mixed
precision; ``--cast model`` puts the whole model in the low precision instead) on random token
ids with 15% of positions labelled. The GPU is capped with
``torch.cuda.set_per_process_memory_fraction`` so the cap covers weights, gradients, optimizer
state and activations alike. The largest batch is found by doubling then bisecting on a
"does one training step fit" test (an OOM means no; the cache is emptied after each try), then
throughput (sequences/s) is the median over ``--steps`` timed steps at that batch. Targets
(Tempo): at least 3x eager's batch and 1.2x its throughput.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

MODES = [("HF eager", "eager", None), ("HF sdpa", "sdpa", None),
         ("leanact recompute", "sdpa", "recompute"), ("leanact tempo", "sdpa", "tempo")]
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
TARGET_BATCH, TARGET_SPEED = 3.0, 1.2


def largest_fitting(fits: Callable[[int], bool], limit: int = 4096) -> int:
    """Largest b in [1, limit] with ``fits(b)`` (0 if not even 1 fits), assuming fits is monotone:
    double until a batch fails, then bisect between the last success and the first failure."""
    lo, hi = 0, 1
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class Row:
    precision: str
    mode: str
    batch: int
    seq_per_s: float
    peak_gib: float


def build(attn: str, lean: str | None, precision: str, cast: str, seq: int, device: str = "cuda", **sizes):
    """BERT-Large (``sizes``: BertConfig fields to override, e.g. a tiny model for a CPU smoke run) on
    ``device``, in training mode, ``leanact.patch``'ed with ``attention=lean`` unless None."""
    import transformers

    import leanact

    torch.manual_seed(0)
    geometry = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                    vocab_size=30522, max_position_embeddings=max(512, seq))
    cfg = transformers.BertConfig(**{**geometry, **sizes}, attn_implementation=attn)
    model = transformers.BertForMaskedLM(cfg)
    if cast == "model":
        model = model.to(LOW[precision])
    model = model.to(device).train()
    if lean is not None:
        leanact.patch(model, attention=lean)
    return model


def make_batch(b: int, seq: int, vocab: int = 30522, device: str = "cuda") -> dict:
    ids = torch.randint(0, vocab, (b, seq), device=device)
    labels = torch.where(torch.rand(b, seq, device=device) < 0.15, ids, torch.full_like(ids, -100))
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)


def make_step(model, opt, precision: str, cast: str, seq: int):
    """One training step (forward, backward, optimizer) at batch b on the model's device; returns nothing."""
    device = next(model.parameters()).device.type
    scaler = torch.amp.GradScaler(device, enabled=(precision == "fp16" and cast == "autocast"))

    def step(b: int) -> None:
        batch = make_batch(b, seq, model.config.vocab_size, device)
        with torch.autocast(device, dtype=LOW[precision], enabled=(cast == "autocast")):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def _free(model=None, opt=None) -> None:
    if opt is not None:
        opt.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` is the device running out of memory: ``torch.cuda.OutOfMemoryError`` (also
    ``torch.OutOfMemoryError``), or a RuntimeError saying "out of memory" (cuBLAS / cuDNN workspaces,
    older torch)."""
    return isinstance(e, torch.cuda.OutOfMemoryError) or (isinstance(e, RuntimeError) and "out of memory" in str(e))


def measure_step(step: Callable[[int], None], limit: int, steps: int, opt=None,
                 device: str = "cuda") -> tuple[int, float, float]:
    """(largest batch for which ``step(b)`` fits, sequences/s at it (median of ``steps`` timed steps
    after two warm-up steps), peak GiB over the timed steps); (0, 0, 0) if not even 1 fits. ``opt``'s
    gradients are dropped after each try (an out-of-memory step may leave them allocated). A batch
    that fit once in the search may not fit again in the warm-up or timed steps (the allocator's
    fragmentation, the optimizer state created by the first step): then the batch is lowered by a
    sixteenth (at least 1) until the timed steps run, and that batch is the one returned. On a
    ``device`` other than CUDA nothing is synchronized and the peak is NaN."""
    cuda = device == "cuda"

    def fits(b: int) -> bool:
        try:
            step(b)
            if cuda:
                torch.cuda.synchronize()
            return True
        except Exception as e:
            if not is_oom(e):
                raise
            return False
        finally:
            _free(None, opt)

    def timed(b: int) -> tuple[float, float]:
        for _ in range(2):  # warm-up
            step(b)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step(b)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return b / statistics.median(times), torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")

    batch = largest_fitting(fits, limit)
    while batch:
        try:
            speed, peak = timed(batch)
            return batch, speed, peak
        except Exception as e:
            if not is_oom(e):
                raise
        _free(None, opt)  # outside the except block: the traceback's frames (and their tensors) are gone
        batch -= max(1, batch // 16)
    return 0, 0.0, 0.0


def measure(label: str, attn: str, lean: str | None, precision: str, cast: str, seq: int, steps: int,
            limit: int) -> Row:
    model = build(attn, lean, precision, cast, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step = make_step(model, opt, precision, cast, seq)
    batch, speed, peak = measure_step(step, limit, steps, opt)
    del step, opt, model
    _free()
    return Row(precision, label, batch, speed, peak)


def ratios(rows: list[Row]) -> list[tuple[Row, float, float]]:
    """(row, batch vs eager, throughput vs eager) with eager of the same precision as reference."""
    eager = {r.precision: r for r in rows if r.mode == "HF eager"}
    out = []
    for r in rows:
        e = eager[r.precision]
        out.append((r, r.batch / e.batch if e.batch else float("nan"),
                    r.seq_per_s / e.seq_per_s if e.seq_per_s else float("nan")))
    return out


def markdown(rows: list[Row], device: str, cap_gib: float, seq: int, cast: str, date: str) -> str:
    lines = [f"### BERT-Large MLM, s={seq}, {cast}, memory cap {cap_gib:g} GiB — {device}, {date}", "",
             "| precision | mode | max batch | vs eager | seq/s | vs eager | peak GiB |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r, rb, rs in ratios(rows):
        lines.append(f"| {r.precision} | {r.mode} | {r.batch} | {rb:.2f}x | {r.seq_per_s:.1f} | {rs:.2f}x "
                     f"| {r.peak_gib:.2f} |")
    lines.append(f"\nTargets (Tempo): leanact ≥ {TARGET_BATCH:g}x eager's batch and ≥ {TARGET_SPEED:g}x its "
                 "throughput.")
    return "\n".join(lines) + "\n"


def table(rows: list[Row], title: str):
    from rich.table import Table

    t = Table(title=title)
    for c in ("precision", "mode", "max batch", "vs eager", "seq/s", "vs eager", "peak GiB", "targets"):
        t.add_column(c, justify="left" if c in ("precision", "mode", "targets") else "right")
    for r, rb, rs in ratios(rows):
        ok = "" if not r.mode.startswith("leanact") else (
            ("[green]batch ok[/]" if rb >= TARGET_BATCH else "[red]batch < 3x[/]") + ", "
            + ("[green]speed ok[/]" if rs >= TARGET_SPEED else "[red]speed < 1.2x[/]"))
        t.add_row(r.precision, r.mode, str(r.batch), f"{rb:.2f}x", f"{r.seq_per_s:.1f}", f"{rs:.2f}x",
                  f"{r.peak_gib:.2f}", ok)
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cap-gib", type=float, default=16.0, help="memory cap for this process (default 16 GiB)")
    ap.add_argument("--precisions", nargs="+", choices=sorted(LOW), default=["bf16", "fp16"])
    ap.add_argument("--cast", choices=["autocast", "model"], default="autocast",
                    help="autocast: fp32 weights + autocast (default); model: the model in the low precision")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10, help="timed steps at the largest batch (default 10)")
    ap.add_argument("--limit", type=int, default=1024, help="largest batch tried (default 1024)")
    ap.add_argument("--modes", nargs="+", choices=[m[0] for m in MODES], default=[m[0] for m in MODES])
    ap.add_argument("--append", metavar="FILE.md", help="also append the markdown to this file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_bert_large.py needs a CUDA GPU (torch.cuda.is_available() is False); "
                 "run it on a GPU machine.")
    total = torch.cuda.get_device_properties(0).total_memory
    if args.cap_gib * 2**30 > total:
        sys.exit(f"--cap-gib {args.cap_gib:g} exceeds the GPU's {total / 2**30:.1f} GiB; choose a smaller cap.")
    if "HF eager" not in args.modes:
        args.modes.insert(0, "HF eager")  # the reference for the ratios
    torch.cuda.set_per_process_memory_fraction(args.cap_gib * 2**30 / total)
    from rich.console import Console

    console = Console()
    rows = []
    for precision in args.precisions:
        for label, attn, lean in MODES:
            if label in args.modes:
                with console.status(f"{precision} {label}: searching the largest batch"):
                    rows.append(measure(label, attn, lean, precision, args.cast, args.seq, args.steps, args.limit))
                console.print(f"{precision} {label}: batch {rows[-1].batch}, {rows[-1].seq_per_s:.1f} seq/s")
    device = torch.cuda.get_device_name(0)
    date = datetime.date.today().isoformat()
    console.print(table(rows, f"BERT-Large MLM, s={args.seq}, {args.cast}, cap {args.cap_gib:g} GiB, {device}"))
    md = markdown(rows, device, args.cap_gib, args.seq, args.cast, date)
    print(md)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
