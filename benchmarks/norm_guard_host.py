"""Host time per optimizer step of the norms' guard under AdamW (BERT-Large's 49 LayerNorms of 1024
channels by default): the step hooks (leanact's pre- and post-hook: watched-step test, drift, moment
signatures) and the first norm's refresh (verdicts standing on the bound, the deferred check launched).

    python benchmarks/norm_guard_host.py [--norms 49] [--width 1024] [--steps 200] [--bound 0|1]

On a CPU the deferred check computes where a GPU would only enqueue it; the numbers are an upper
bound of its host cost there."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import leanact
from leanact.ops import layer_norm as LN


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--norms", type=int, default=49)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--bound", type=int, default=1, help="1: verdicts stand on Adam's bound; 0: checked every step")
    args = ap.parse_args()
    torch.manual_seed(0)
    norms = torch.nn.ModuleList([leanact.nn.LayerNorm(args.width) for _ in range(args.norms)])
    opt = torch.optim.AdamW(norms.parameters(), lr=2e-5)
    x = torch.randn(2, args.width)
    if hasattr(LN, "use_step_bound"):
        LN.use_step_bound(bool(args.bound))
    for m in norms:
        m(x).sum().backward()
    step_t, first_t, rest_t = [], [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        norms[0](x)  # the first norm after a step: the refresh of every verdict
        t2 = time.perf_counter()
        for m in norms[1:]:
            m(x)
        t3 = time.perf_counter()
        step_t.append(t1 - t0)
        first_t.append(t2 - t1)
        rest_t.append((t3 - t2) / max(1, args.norms - 1))
    getattr(LN, "confirm_verdicts", lambda: None)()
    med = statistics.median
    print(f"{args.norms} norms x {args.width}, AdamW, step bound {'on' if args.bound else 'off'}: "
          f"optimizer.step {med(step_t) * 1e6:.0f} us, first norm (refresh) {med(first_t) * 1e6:.0f} us, "
          f"other norms {med(rest_t) * 1e6:.1f} us each (medians of {args.steps} steps)")


if __name__ == "__main__":
    main()
