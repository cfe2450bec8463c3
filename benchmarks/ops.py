"""Per op: bytes kept for backward and forward+backward time, torch vs leanact, side by side.

    python benchmarks/ops.py [--repeats 20] [--markdown]
    python benchmarks/ops.py --host [--rows 8 --hidden 64]


"kept alone" counts what the op's autograd node keeps (storages deduplicated, parameters
excluded). "net in a layer" is what the op adds when the next Linear keeps its output anyway
(the usual Transformer situation): bytes kept by op→Linear minus the Linear's own input.
Times are medians of interleaved runs in one process, so both see the same machine state.

``--host``: the host's time per call on the CUDA path (Python, autograd, the launchers' checks and
allocations) with the Triton launches stubbed out (``dispatch.use_kernels(SHAPES_ONLY)``: nothing is
computed), next to torch's op on the same tiny tensors: what every call costs before the GPU does
any work, which decides the step time when batches are small (the GPU waits for the host).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import leanact.functional as LF
from leanact import nn as lnn
from leanact.memory import saved_bytes


class SubLayerEnd(nn.Module):
    """BERT's sub-layer end after its dense: LayerNorm(dropout(x) + residual); the residual stream is a
    parameter here (it needs a gradient, and the meter leaves parameters out), torch's ops or leanact's
    one op (:func:`leanact.functional.dropout_add_layer_norm`)."""

    def __init__(self, hidden: int, rows: int, lean: bool, p: float = 0.1):
        super().__init__()
        self.norm, self.p, self.lean = nn.LayerNorm(hidden), p, lean
        self.residual = nn.Parameter(torch.zeros(rows, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.norm
        if self.lean:
            return LF.dropout_add_layer_norm(x, self.residual, n.normalized_shape, n.weight, n.bias, n.eps, self.p)
        return n(F.dropout(x, self.p) + self.residual)


def cases(rows: int, hidden: int):
    ffn = 4 * hidden
    return [
        ("GELU (erf)", (rows, ffn), lambda: nn.GELU(), lambda: lnn.GELU()),
        ("GELU (tanh)", (rows, ffn), lambda: nn.GELU("tanh"), lambda: lnn.GELU("tanh")),
        ("LayerNorm", (rows, hidden), lambda: nn.LayerNorm(hidden), lambda: lnn.LayerNorm(hidden)),
        ("RMSNorm", (rows, hidden), lambda: nn.RMSNorm(hidden), lambda: lnn.RMSNorm(hidden)),
        ("Dropout p=0.1", (rows, hidden), lambda: nn.Dropout(0.1), lambda: lnn.Dropout(0.1)),
        ("dropout + add + LayerNorm", (rows, hidden), lambda: SubLayerEnd(hidden, rows, False),
         lambda: SubLayerEnd(hidden, rows, True)),
    ]


def _fill(module: nn.Module) -> nn.Module:
    # Non-trivial affine parameters, identical for both implementations, in the range trained
    # Transformers have (γ in [0.5, 1.5], |β| ≲ 1): leanact's norms fall back to keeping their input
    # when some |β/γ| > 8 or γ ≈ 0 (see leanact.ops.norms.layer_norm).
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for name, p in module.named_parameters():
            if name.rsplit(".", 1)[-1] == "weight":
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return module


def kept(module: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    alone = saved_bytes(lambda: module(x), module)
    nxt = nn.Linear(x.shape[-1], 8).to(x.dtype)
    in_layer = saved_bytes(lambda: nxt(module(x)), [module, nxt])
    return alone, in_layer - x.numel() * x.element_size()  # minus the Linear's input (op output)


def step(module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> float:
    t0 = time.perf_counter()
    module(x).backward(g)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096, help="tokens s·b (default 4096)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table (for the README)")
    ap.add_argument("--host", action="store_true", help="host time per call, kernel launches stubbed (see above)")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.host:
        return host(args)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, shape, make_ref, make_lean in cases(args.rows, args.hidden):
            ref, lean = _fill(make_ref().to(dtype)), _fill(make_lean().to(dtype))
            x = torch.randn(shape, dtype=dtype, requires_grad=True)
            g = torch.randn(shape, dtype=dtype)
            (ref_alone, ref_net), (lean_alone, lean_net) = kept(ref, x), kept(lean, x)
            times = ([], [])
            for i in range(args.repeats + 2):
                for j, m in enumerate((ref, lean)):
                    t = step(m, x, g)
                    if i >= 2:
                        times[j].append(t)
            t_ref, t_lean = statistics.median(times[0]), statistics.median(times[1])
            rows.append((name, str(dtype).replace("torch.", ""), "x".join(map(str, shape)), ref_alone, lean_alone,
                         ref_net, lean_net, t_ref * 1e3, t_lean * 1e3, t_lean / t_ref))
    header = ("op", "dtype", "shape", "torch kept", "leanact kept", "torch net in layer", "leanact net in layer",
              "torch ms", "leanact ms", "time ratio")

    def fmt(r):
        return [r[0], r[1], r[2], f"{r[3]:,}", f"{r[4]:,}", f"{r[5]:,}", f"{r[6]:,}", f"{r[7]:.2f}", f"{r[8]:.2f}",
                f"{r[9]:.2f}x"]

    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for r in rows:
            print("| " + " | ".join(fmt(r)) + " |")
        return
    from rich.console import Console
    from rich.table import Table

    tab = Table(title=f"leanact ops vs torch (CPU, {torch.get_num_threads()} threads, fwd+bwd median of "
                      f"{args.repeats})")
    for h in header:
        tab.add_column(h, justify="left" if h in ("op", "dtype", "shape") else "right")
    for r in rows:
        tab.add_row(*fmt(r))
    Console().print(tab)


def host(args) -> None:
    """--host: microseconds per forward+backward call, torch's module vs leanact's on the kernel path."""
    from leanact.ops.triton import dispatch

    repeats = max(args.repeats, 200)
    print(f"host time per call, fwd+bwd, µs (median of {repeats} interleaved; leanact's kernel launches stubbed)")
    print("| op | dtype | shape | torch µs | leanact µs | ratio |")
    print("|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for name, shape, make_ref, make_lean in cases(args.rows, args.hidden):
            ref, lean = _fill(make_ref().to(dtype)), _fill(make_lean().to(dtype))
            x = torch.randn(shape, dtype=dtype, requires_grad=True)
            g = torch.randn(shape, dtype=dtype)
            times = ([], [])
            with dispatch.use_kernels(dispatch.SHAPES_ONLY, strict=True, fake=False):
                for i in range(repeats + 20):
                    times[0].append(step(ref, x, g))
                    times[1].append(step(lean, x, g))
            t_ref, t_lean = (statistics.median(t[20:]) * 1e6 for t in times)
            print(f"| {name} | {str(dtype).replace('torch.', '')} | {'x'.join(map(str, shape))} | {t_ref:.1f} | "
                  f"{t_lean:.1f} | {t_lean / t_ref:.2f}x |")


if __name__ == "__main__":
    main()
