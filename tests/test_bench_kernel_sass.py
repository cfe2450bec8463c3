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
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in r.stdout.splitlines()
            if line.startswith("| GELU")}
    assert set(rows) == {"GELU erf forward", "GELU tanh forward", "GELU backward (both forms)", "GELU forward (table)",
                         "GELU backward (table)"}
    per_element = {k: int(v[2]) for k, v in rows.items()}
    assert all(n > 0 for n in per_element.values())
    # the float32 kernels do arithmetic the 16-bit ones (a gather) do not
    assert per_element["GELU backward (both forms)"] > per_element["GELU backward (table)"]
