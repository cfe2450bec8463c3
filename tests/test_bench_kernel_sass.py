"""benchmarks/kernel_sass.py compiles the GELU kernels for sm_90 (no GPU) and prints their
instructions per element."""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_kernel_sass_prints_every_gelu_kernel():
    pytest.importorskip("triton.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_sass.py")], env=env, capture_output=True,
                       text=True, timeout=600)
    if r.returncode != 0 and ("ptxas" in r.stderr or "nvdisasm" in r.stderr) and "not found" in r.stderr.lower():
        pytest.skip("no ptxas / nvdisasm in this Triton install")
    assert r.returncode == 0, r.stderr[-3000:]
    first, second = r.stdout.split("\n\n", 1)  # the kernels' table, then the row reads'
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in first.splitlines()
            if line.startswith("| GELU")}
    assert set(rows) == {"GELU erf forward", "GELU tanh forward", "GELU backward (both forms)", "GELU forward (table)",
                         "GELU backward (table)"}
    per_element = {k: int(v[2]) for k, v in rows.items()}
    assert all(n > 0 for n in per_element.values())
    # the float32 kernels do arithmetic the 16-bit ones (a gather) do not
    assert per_element["GELU backward (both forms)"] > per_element["GELU backward (table)"]
    # a table row read as one 16-byte load: one global load per element fewer than as two 8-byte
    # loads, without the split's trip through shared memory
    reads = {(line.split(" | ")[0].lstrip("| "), line.split(" | ")[1]): line.rstrip(" |").split(" | ")
             for line in second.splitlines() if line.startswith("| GELU")}
    for kernel in ("GELU erf forward", "GELU backward (both forms)"):
        two, split, ptx = (reads[kernel, k] for k in ("two 8-byte loads", "a [BLOCK, 2] load, split",
                                                       "one 16-byte load (PTX)"))
        assert float(ptx[3]) == float(split[3]) == pytest.approx(float(two[3]) - 1), (two, split, ptx)
        assert float(ptx[4]) == float(two[4]) < float(split[4]), (two, split, ptx)

