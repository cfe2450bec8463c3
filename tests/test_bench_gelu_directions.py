"""benchmarks/gelu_directions.py without a GPU: the float32 GELU kernels under Triton's interpreter at
tiny sizes, each row read, launch shape and the backward's fma quotient checked against the default,
both tables printed."""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gelu_directions_runs_on_a_cpu(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "dirs.md"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gelu_directions.py"), "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    all_rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| erf") or
                line.startswith("| tanh")]
    rows, shaped = all_rows[:6], all_rows[6:]
    order = [(f"| {form}", d) for form in ("erf", "tanh") for d in ("forward", "backward", "backward, fma quotient")]
    assert [(r[0], r[1]) for r in rows] == order and [(r[0], r[1]) for r in shaped] == order
    for row in shaped:  # the read (0 or 1 here), a time per launch shape, best / torch
        assert row[2] in ("0", "1") and len(row) == 3 + 4 + 1
        assert all(float(v) > 0 for v in row[3:7]) and row[7].endswith("x |")
    for row in rows:
        assert float(row[2]) > 0 and float(row[3]) > 0  # torch's, the two-load kernel's
    assert all(float(row[4]) > 0 for row in rows if row[:2] != ["| tanh", "forward"])  # the split read's
