"""``python benchmarks/gpu_suite``: the command line (:func:`main`), and the ``--worker`` process that
runs one part (:data:`WORKERS`) and records its rows.
"""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import sys
import time
import traceback

if __name__ == "__main__":
    _PACKAGE = pathlib.Path(__file__).resolve().parent
    # this checkout's leanact first (also in the --worker processes), then the package by its name from
    # benchmarks/ (its own folder, which Python put first, is left out: its modules are no top-level ones)
    sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _PACKAGE]
    sys.path[:0] = [str(_PACKAGE.parent.parent), str(_PACKAGE.parent)]

import gpu_suite  # noqa: E402
from gpu_suite.bert import part_bert  # noqa: E402
from gpu_suite.compiled import part_compiled  # noqa: E402
from gpu_suite.common import (BENCHMARKS, COLUMNS, LIMITS, OPTIONAL, PARTS, SMOKE_ENV, Recorder,  # noqa: E402
                              freeze_imports, markdown, run_part, versions)
from gpu_suite.estimate import part_estimate  # noqa: E402
from gpu_suite.head import part_head  # noqa: E402
from gpu_suite.llama import part_llama  # noqa: E402
from gpu_suite.long import part_long  # noqa: E402
from gpu_suite.offload import part_offload  # noqa: E402
from gpu_suite.ops import part_ops  # noqa: E402
from gpu_suite.profile import part_profile  # noqa: E402
from gpu_suite.steps import part_steps  # noqa: E402
from gpu_suite.tests import part_tests  # noqa: E402


def _frames(e: BaseException, n: int = 5) -> str:
    """Where ``e`` was raised: the innermost ``n`` frames as "file:line function", innermost last."""
    frames = traceback.extract_tb(e.__traceback__)[-n:]
    return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames)) or "?"


def _selftest(kind: str):
    """Parts for the suite's own tests (no CUDA needed): a row, an error, a hang."""

    def part(rec: Recorder, limit_s: float) -> None:
        rec.row("first", 1.5)
        if kind == "fail":
            raise RuntimeError("boom")
        if kind == "hang":
            time.sleep(60)
        rec.row("second", 2)

    return part


WORKERS = {"tests": part_tests, "ops": part_ops, "bert": part_bert, "llama": part_llama,
           "estimate": part_estimate, "offload": part_offload, "head": part_head, "steps": part_steps,
           "long": part_long, "profile": part_profile, "compiled": part_compiled,
           "_selftest_ok": _selftest("ok"), "_selftest_fail": _selftest("fail"), "_selftest_hang": _selftest("hang")}


def worker(name: str, json_path: str | None) -> int:
    rec = Recorder(json_path, COLUMNS.get(name, ["item", "value"]))
    try:
        if name in PARTS + OPTIONAL and name != "tests":  # (the tests part runs pytest in a process of its own)
            freeze_imports()
        WORKERS[name](rec, LIMITS.get(name, 60))
    except Exception as e:
        rec.note(f"{type(e).__name__}: {str(e)[:300]} (at {_frames(e)})")
        traceback.print_exc()
        rec.done("failed")
        return 1
    rec.done("ok")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=gpu_suite.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="markdown file to append to (default benchmarks/RESULTS.md; required with --smoke)")
    ap.add_argument("--parts", nargs="+", choices=PARTS + OPTIONAL, default=PARTS)
    ap.add_argument("--smoke", action="store_true",
                    help="every part on the CPU at tiny sizes: checks the suite's code, measures nothing")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.json)
    import torch

    if args.smoke:
        if not args.out or pathlib.Path(args.out).resolve() == BENCHMARKS / "RESULTS.md":
            ap.error("--smoke needs --out, not benchmarks/RESULTS.md (its rows are no GPU results)")
        device = "CPU (smoke run, tiny sizes)"
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_suite needs a CUDA GPU (torch.cuda.is_available() is False); nothing written.")
    else:
        device = torch.cuda.get_device_name(0)
    args.out = args.out or str(BENCHMARKS / "RESULTS.md")
    header = {"device": device, "date": datetime.date.today().isoformat(), **versions()}
    results = {}
    t0 = time.perf_counter()
    # a smoke run (CPU only) forks its parts from this process, which imports their shared modules once
    forked = worker if args.smoke and hasattr(os, "fork") else None
    if forked is not None:
        freeze_imports()
    for name in args.parts:
        print(f"[gpu_suite] {name} (limit {LIMITS[name]} s) ...", flush=True)
        results[name] = run_part(name, LIMITS[name], extra_env={SMOKE_ENV: "1" if args.smoke else "0"},
                                 forked=forked)
        print(f"[gpu_suite] {name}: {results[name]['status']} in {results[name]['seconds']:.0f} s", flush=True)
    md = markdown(header, results)
    print(md)
    with open(args.out, "a") as f:
        f.write("\n" + md)
    print(f"[gpu_suite] appended to {args.out} ({time.perf_counter() - t0:.0f} s)")
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
