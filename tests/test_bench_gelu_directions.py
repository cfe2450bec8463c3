"""benchmarks/gelu_directions.py without a GPU: the float32 GELU kernels under Triton's interpreter at
tiny sizes, each row read, launch shape and the backward's fma quotient checked against the default,
the three tables printed."""
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
    rows, shaped, totals = all_rows[:6], all_rows[6:12], all_rows[12:]
    order = [(f"| {form}", d) for form in ("erf", "tanh") for d in ("forward", "backward", "backward, fma quotient")]
    assert [(r[0], r[1]) for r in rows] == order and [(r[0], r[1]) for r in shaped] == order
    for row in shaped:  # the read (0 or 1 here), a time per launch shape, best / torch
        assert row[2] in ("0", "1") and len(row) == 3 + 4 + 1
        assert all(float(v) > 0 for v in row[3:7]) and row[7].endswith("x |")
    for row in rows:
        assert float(row[2]) > 0 and float(row[3]) > 0  # torch's, the two-load kernel's
    assert all(float(row[4]) > 0 for row in rows if row[:2] != ["| tanh", "forward"])  # the split read's
    # forward + backward with each direction's fastest variant: torch's, leanact's, their ratio, the target
    assert [r[0] for r in totals] == ["| erf", "| tanh"]
    for form, ref, lean, ratio, ok, fwd, bwd in totals:
        assert float(ratio[:-1]) == pytest.approx(float(lean) / float(ref), rel=0.01, abs=0.01)
        assert ok == ("ok" if float(ratio[:-1]) <= 1.1 else "no")
        assert fwd.startswith("read ") and " / " in fwd and bwd.startswith("read ") and " / " in bwd


_BROKEN_FMA = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, {bench!r})
import gelu_directions as GD
from leanact.ops.gelu import kernels32 as G32

real = G32.gelu32_backward


def wrong(y, bits, dy, out, *args, fma_div=False, **kwargs):  # the fma quotient one ulp off, everywhere
    real(y, bits, dy, out, *args, fma_div=fma_div, **kwargs)
    if fma_div:
        out.copy_(torch.nextafter(out, out.new_tensor(float("inf"))))


import torch
G32.gelu32_backward = wrong
sys.exit(GD.main(["--out", {out!r}]))
"""


@pytest.mark.slow
def test_a_variant_that_computes_other_values_is_reported_not_timed(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "dirs.md"
    script = tmp_path / "run.py"
    script.write_text(_BROKEN_FMA.format(bench=str(ROOT / "benchmarks"), out=str(out)))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stderr[-3000:]  # the tables printed, the mismatch reported
    text = out.read_text()
    fma_rows = [line for line in text.splitlines() if "backward, fma quotient" in line]
    assert len(fma_rows) == 4 and all(line.rstrip(" |").endswith("MISMATCH") for line in fma_rows)
    assert sum(line.startswith("MISMATCH ") for line in text.splitlines()) == 2 * 2  # 2 forms x reads 0, 1
    assert all("backward differs" in line for line in text.splitlines() if line.startswith("MISMATCH "))
    timed = [line for line in text.splitlines() if line.startswith("| erf | backward |")]
    assert timed and float(timed[0].split(" | ")[3]) > 0  # the div_rn backward still timed
