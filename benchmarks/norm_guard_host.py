"""Host time of the norms' guard per training step under AdamW (BERT-Large's 49 LayerNorms of 1024
channels by default), by part:

* the step hooks (leanact's global optimizer pre- and post-hook: the watched-step test, the drift
  bound, the moments' signatures), per ``optimizer.step()``;
* the deferred confirmation, per forward: launching the batched check of every cached verdict
  (``_arm``) and reading it in the backward (``confirm_verdicts``);
* the synchronous batched check with slack that a step without the bound takes instead.

    python benchmarks/norm_guard_host.py [--norms 49] [--width 1024] [--repeat 200]

On a CPU the checks compute where a GPU only enqueues ~20 small kernels and a copy: their CPU time
is an upper bound of the host time there; the hooks' time is the same on both."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import leanact
from leanact.ops.norms import batch_check, step_bound, verdict as LN


def _median_us(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--norms", type=int, default=49)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    torch.manual_seed(0)
    LN.clear_decision_cache()
    norms = torch.nn.ModuleList([leanact.nn.LayerNorm(args.width) for _ in range(args.norms)])
    opt = torch.optim.AdamW(norms.parameters(), lr=2e-5)
    x = torch.randn(2, args.width)
    for _ in range(3):  # decided, stepped, decided with slack (verdicts standing on the bound)
        for m in norms:
            m(x).sum().backward()
        opt.step()
    norms[0](x)

    def hooks():
        step_bound._before_step(opt, (opt,), {})
        step_bound._after_step(opt, (opt,), {})

    def confirm():
        LN._arm()
        LN.confirm_verdicts()

    items = [(m.weight, m.bias, args.width, torch.float32, LN.DEFAULT_MAX_RATIO) for m in norms]
    print(f"{args.norms} norms x {args.width}, AdamW; median host time of {args.repeat} calls "
          f"({torch.get_num_threads()} threads):")
    print(f"  step hooks (pre + post), per optimizer step: {_median_us(hooks, args.repeat):8.1f} us")
    print(f"  deferred confirmation (launch + read), per forward: {_median_us(confirm, args.repeat):8.1f} us")
    print(f"  synchronous check with slack (no bound), per step: "
          f"{_median_us(lambda: batch_check.check_many(items, slack=True), args.repeat):8.1f} us")


if __name__ == "__main__":
    main()
