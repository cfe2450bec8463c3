"""The ``tests`` part: the CUDA subset of the test suite in a pytest process (a small CPU subset in a
smoke run); failed when a test failed or errored, the counts and the failing tests kept.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

from .common import ROOT, Recorder, smoke


def parse_pytest(output: str) -> dict[str, int]:
    """Counts from pytest's summary line ("3 passed, 1 failed, 2 skipped in 1.2s")."""
    counts = {}
    tail = output.strip().splitlines()[-1] if output.strip() else ""
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", tail):
        counts["error" if what.startswith("error") else what] = int(n)
    return counts


def part_tests(rec: Recorder, limit_s: float) -> None:
    cmd = _pytest_command()
    if smoke():
        rec.note("smoke run: a small CPU subset instead of the CUDA tests")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(10.0, limit_s - 10))
    check_pytest(rec, proc.stdout, proc.returncode)


def _pytest_command() -> list[str]:
    """The tests part's pytest command (a function: the suite's tests run it on a file of their own)."""
    # the interpreter re-run and the offline compile are the CPU machines' checks: left out here
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda or triton", "-k",
           "not test_in_subprocess and not compile_for_a_gpu", "tests"]
    if smoke():  # the same machinery on a few quick CPU tests
        cmd[-5:] = ["-k", "largest_fitting", "tests/test_bench_gpu_bert_large.py"]
    elif importlib.util.find_spec("xdist") is not None:  # Triton's compiles dominate: 4 processes share the GPU
        cmd[4:4] = ["-n", "4"]
    return cmd


def check_pytest(rec: Recorder, output: str, returncode: int) -> None:
    """Rows (passed, failed, error, skipped counts), a note per failing test; raises (the part
    fails, its rows kept) when a test failed or errored or pytest itself did not finish cleanly
    (exit code other than 0, or 5: nothing collected)."""
    counts = parse_pytest(output)
    for what in ("passed", "failed", "error", "skipped"):
        rec.row(what, counts.get(what, 0))
    for line in output.splitlines():
        if line.startswith(("FAILED", "ERROR")):
            rec.note(line[:300])
    bad = counts.get("failed", 0) + counts.get("error", 0)
    if bad or returncode not in (0, 5):
        raise RuntimeError(f"FAILED {bad} test(s) (pytest exit code {returncode})")
