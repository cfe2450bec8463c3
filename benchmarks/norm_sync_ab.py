"""The norms' per-step check against verdicts standing under Adam's step bound, on one machine.

    python benchmarks/norm_sync_ab.py sync|drift     # on a CUDA machine; prints the steps part's rows

Runs the steps part of ``benchmarks/gpu_suite`` (``gpu_suite/steps.py``: Llama-3.2-1B geometry and
BERT-Large MLM steps, HF sdpa next to leanact, interleaved, medians) in this process, either as leanact runs
(``drift``: a passing from-output verdict stands while AdamW's steps since its check stay within its
slack, :mod:`leanact.ops.norms.step_bound`) or with every verdict checked again after each optimizer
step (``sync``: one batched check and one device-to-host sync per step, as before). Run the two
alternately on the same machine (A, B, A, B): a host-bound step's time moves with the machine's CPU
more than with this change. Prints the rows and the last notes as JSON.
"""
from __future__ import annotations

import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in ("sync", "drift"):
        sys.exit("usage: python benchmarks/norm_sync_ab.py sync|drift")
    sys.path.insert(0, str(HERE.parent))
    from gpu_suite import common, steps  # (benchmarks/, this script's folder, is on sys.path)
    from leanact.ops.norms import step_bound

    if argv[0] == "sync":
        step_bound.Stand.holds = lambda self: False  # every verdict checked again after each step (one sync)
    common.freeze_imports()  # as a worker of the suite does
    rec = common.Recorder(None, common.COLUMNS["steps"])
    steps.part_steps(rec, common.LIMITS["steps"])
    print(argv[0], json.dumps(rec.data["rows"]), json.dumps(rec.data["notes"][-6:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
