"""Head + loss of a LLaMA-1B-like model: bytes kept for backward, peak and time, HF vs leanact.

    python benchmarks/head.py [--seq 256] [--batch 1] [--dtype bf16] [--repeats 3] [--modes hf,lean,...] [--markdown]

What runs: x (b, s, h) -- the final norm's output, kept by the norm anyway, so not counted -- goes
through the head W (V, h) and the causal-LM loss:

* HF: ``ForCausalLMLoss(F.linear(x, W), labels, V)`` (transformers' own function: shift, upcast
  to fp32, ``F.cross_entropy``), the path of every ``*ForCausalLM`` model;
* leanact: ``leanact.functional.linear_cross_entropy`` on the shifted labels, default (recompute
  in backward) and ``grad_in_forward`` (what ``leanact.patch`` runs in training);
* torch: ``F.linear_cross_entropy`` with ``LinearCrossEntropyOptions()`` (torch >= 2.13's chunked path);
  for 16-bit on a CPU that emulates 16-bit GEMM (no AVX512-BF16/AMX) leanact's tiles run fp32
  matmuls by default, so a row with 16-bit matmuls (as HF's) is added.

Columns: kept = bytes autograd keeps between forward and backward (``SavedTensorMeter``; x and W
excluded); peak fwd / peak bwd = the most bytes allocated at once during the forward / during
``backward()`` on top of what existed before it (a dispatch mode counting new storages), gradients
dx and dW included (both sides allocate them); logits = HF's logits size (b·s·V in the model dtype), the
unit the comparisons use; time = forward + backward, median of ``--repeats`` interleaved runs.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from leanact.functional import linear_cross_entropy
from leanact.memory import NewStoragePeak, SavedTensorMeter

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def hf_loss(x, w, labels):
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(F.linear(x, w), labels, w.shape[0])


def lean_loss(grad_in_forward, matmul_dtype=None):
    def run(x, w, labels):
        shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
        return linear_cross_entropy(x, w, shift, grad_in_forward=grad_in_forward, matmul_dtype=matmul_dtype)
    return run


def torch_loss(x, w, labels):
    """torch's own fused head (torch >= 2.13): ``F.linear_cross_entropy`` with its chunked path."""
    shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.linear_cross_entropy(x.reshape(-1, x.shape[-1]), w, shift.reshape(-1), ignore_index=-100,
                                  options=torch.nn.LinearCrossEntropyOptions())


def modes(dtype, keys):
    from leanact.ops.cross_entropy.function import _matmul_dtype

    m = {"hf": ("HF ForCausalLMLoss", hf_loss), "lean": ("leanact (recompute)", lean_loss(False))}
    if hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions"):
        m["torch"] = ("torch F.linear_cross_entropy (chunked)", torch_loss)
    if _matmul_dtype(dtype, torch.device("cpu")) != dtype:  # the automatic choice is fp32 here: show both
        m["lean16"] = (f"leanact, {DTYPE_NAMES[dtype]} matmuls", lean_loss(False, dtype))
    m["gif"] = ("leanact grad_in_forward", lean_loss(True))
    return dict(m[k] for k in m if k in keys or k == "hf")


def kept_bytes(fn, x, w, labels) -> tuple[int, int]:
    """(activation bytes kept for backward, bytes of gradients computed in the forward and kept)."""
    meter = SavedTensorMeter(exclude=[x, w])
    with meter:
        loss = fn(x, w, labels)
    total = meter.total_bytes
    grads = sum(r.storage_nbytes for r in meter.records if r.excluded == "gradient")
    del loss
    return total, grads


def peaks(fn, x, w, labels) -> tuple[int, int]:
    def peak_of(run):
        mode = NewStoragePeak()
        with mode:
            out = run()
        return out, mode.peak

    x.grad = w.grad = None
    loss, fwd = peak_of(lambda: fn(x, w, labels))
    _, bwd = peak_of(lambda: loss.backward())
    x.grad = w.grad = None
    return fwd, bwd


def step_time(fn, x, w, labels) -> float:
    x.grad = w.grad = None
    t0 = time.perf_counter()
    fn(x, w, labels).backward()
    dt = time.perf_counter() - t0
    x.grad = w.grad = None
    return dt


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--modes", default="hf,lean,lean16,gif,torch",
                    help="comma list of hf, lean, lean16 (16-bit matmuls, where leanact picks fp32), gif (the "
                         "gradients in the forward: what leanact.patch runs in training), torch (torch's own)")
    args = ap.parse_args(argv)
    dt = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    b, s, h, v = args.batch, args.seq, args.hidden, args.vocab
    x = torch.randn(b, s, h, generator=g).to(dt).requires_grad_()
    w = (torch.randn(v, h, generator=g) * h ** -0.5).to(dt).requires_grad_()
    labels = torch.randint(0, v, (b, s), generator=g)
    logits = b * s * v * torch.finfo(dt).bits // 8

    rows = {}
    ref = None
    MODES = modes(dt, args.modes.split(","))
    for name, fn in MODES.items():
        x.grad = w.grad = None
        loss = fn(x, w, labels)
        loss.backward()
        if ref is None:
            ref = (loss.detach().float(), x.grad.float(), w.grad.float())
        else:
            err = max(((a.float() - c).norm() / c.norm()).item() for a, c in zip((loss, x.grad, w.grad), ref))
            rows.setdefault(name, {})["rel. diff vs HF"] = err
        rows.setdefault(name, {})["kept"], rows[name]["kept gradients"] = kept_bytes(fn, x, w, labels)
        rows[name]["peak fwd"], rows[name]["peak bwd"] = peaks(fn, x, w, labels)
    times = {name: [] for name in MODES}
    for _ in range(max(args.repeats, 0)):
        for name, fn in MODES.items():
            times[name].append(step_time(fn, x, w, labels))

    hf = rows["HF ForCausalLMLoss"]
    def mib(n):
        return f"{n / 2**20:.2f} MiB" if abs(n) >= 2**20 else f"{n / 2**10:.1f} KiB"
    head = ["mode", "kept", "vs HF", "peak fwd", "peak bwd", "peak bwd − grads", "fwd+bwd", "vs HF", "rel. diff"]
    grads = x.numel() * x.element_size() + w.numel() * w.element_size()
    table = []
    for name, r in rows.items():
        t = statistics.median(times[name]) if times[name] else float("nan")
        t_hf = statistics.median(times["HF ForCausalLMLoss"]) if times["HF ForCausalLMLoss"] else float("nan")
        kept = mib(r["kept"]) + (f" (+ {mib(r['kept gradients'])} of gradients)" if r["kept gradients"] else "")
        table.append([name, kept, f"{r['kept'] / hf['kept']:.4f}x", mib(r["peak fwd"]), mib(r["peak bwd"]),
                      f"{mib(r['peak bwd'] - grads)} ({(r['peak bwd'] - grads) / logits:.1%} of logits)",
                      f"{t:.2f} s", f"{t / t_hf:.2f}x", f"{r.get('rel. diff vs HF', 0.0):.1e}"])
    title = (f"head + causal-LM loss, b={b} s={s} h={h} V={v} {args.dtype}, CPU ({torch.get_num_threads()} threads); "
             f"HF logits = {mib(logits)}; grads dx+dW = {mib(grads)}")
    if args.markdown:
        print(title + "\n")
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in table:
            print("| " + " | ".join(r) + " |")
    else:
        print(title)
        widths = [max(len(str(c)) for c in col) for col in zip(head, *table)]
        for r in [head] + table:
            print("  ".join(str(c).ljust(wd) for c, wd in zip(r, widths)))


if __name__ == "__main__":
    main()
