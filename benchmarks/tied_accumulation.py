"""Does autograd add a tied embedding's gradient into the LM head's in place? The peak RSS of the
backward of an embedding + TRL's fused head (leanact's backward of it) with the head's weight tied
to the embedding's, and untied, each in a fresh process (the allocator returns every large block to
the system: ``MALLOC_MMAP_THRESHOLD_``), and the same with a plain ``h @ wᵀ`` head.

    python benchmarks/tied_accumulation.py [--vocab 50000] [--hidden 1024]

Equal tied and untied peaks: the embedding's gradient was added into the head's in place (no third
V×H buffer). Without any ``TorchDispatchMode`` active only; under one (MemTracker, leanact.estimate)
autograd adds out of place. Measure on an idle machine: RSS is the operating system's count.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = r'''
import resource, sys, torch, torch.nn.functional as F
V, H, N = int(sys.argv[1]), int(sys.argv[2]), 64
tied, head_kind = sys.argv[3] == "tied", sys.argv[4]
torch.manual_seed(0)
w = torch.nn.Parameter(torch.randn(V, H))
head = w if tied else torch.nn.Parameter(torch.randn(V, H))
ids = torch.randint(0, V, (N,))
h = F.embedding(ids, w) * 1.0
if head_kind == "trl":
    from trl.kernels import chunked_logprob as K
    from leanact.ops.cross_entropy.trl_logprobs import lean_class
    loss = lean_class(K).apply(h, head, None, ids, 1.0, 4096, None, 1.0, ("log_probs",))[0].sum()
else:
    loss = (h @ head.t()).logsumexp(-1).sum()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
loss.backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
'''


def peak(vocab: int, hidden: int, tied: str, head: str) -> int:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, "-c", CHILD, str(vocab), str(hidden), tied, head], env=env,
                         capture_output=True, text=True, check=True, timeout=600).stdout
    return int(out.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=50000)
    ap.add_argument("--hidden", type=int, default=1024)
    args = ap.parse_args()
    vh = args.vocab * args.hidden * 4
    print(f"V·H = {vh / 2**20:.0f} MiB (fp32); backward's peak RSS above the forward's, in V·H")
    for head in ("trl", "matmul"):
        tied, untied = (peak(args.vocab, args.hidden, t, head) for t in ("tied", "untied"))
        print(f"{head:>6} head: tied {tied / vh:.2f}, untied {untied / vh:.2f} -> "
              f"{'in place' if abs(tied - untied) < 0.25 * vh else 'out of place (+1 V·H)'}")


if __name__ == "__main__":
    main()
