"""benchmarks/kernel_sass.py compiles the GELU kernels for sm_90 (no GPU) and prints their
instructions per element, their table-row reads and the float32 kernels' registers by launch shape."""
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
    first, second, third = r.stdout.split("\n\n")  # the kernels' table, the row reads', the registers'
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in first.splitlines()
            if line.startswith("| GELU")}
    assert set(rows) == {"GELU erf forward", "GELU tanh forward", "GELU backward (both forms)",
                         "GELU backward, fma quotient", "GELU forward (table)", "GELU backward (table)"}
    per_element = {k: int(v[2]) for k, v in rows.items()}
    assert all(n > 0 for n in per_element.values())
    # the tanh forward's quotient is recip12's fma (no division, no slow path); the backward's
    # left key is a div_rn, whose slow path is a subroutine counted apart
    assert int(rows["GELU tanh forward"][3]) == 0 < int(rows["GELU backward (both forms)"][3])
    assert int(rows["GELU backward, fma quotient"][3]) == 0  # math32.quotient: no slow path either
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

    # registers per thread and resident warps per SM, for each launch shape gelu_directions.py times
    lines = [line for line in third.splitlines() if line.startswith("|")]
    shapes = [tuple(int(v) for v in cell.split(" / ")) for cell in lines[0].rstrip(" |").split(" | ")[1:]]
    assert shapes[0] == (1024, 4) and len(shapes) >= 2  # the kernels' default first
    regs = {line.split(" | ")[0].lstrip("| "): line.rstrip(" |").split(" | ")[1:] for line in lines
            if line.startswith("| GELU")}
    assert set(regs) == {"GELU erf forward", "GELU tanh forward", "GELU backward (both forms)",
                         "GELU backward, fma quotient"}
    for cells in regs.values():
        assert len(cells) == len(shapes)
        for cell, (_, warps) in zip(cells, shapes):
            r_, w_ = (int(v) for v in cell.split(", "))
            assert 0 < r_ <= 255 and w_ == _warps_per_sm(r_, warps), (cell, warps)


def _warps_per_sm(regs: int, warps: int) -> int:
    """sm_90's occupancy rule: registers allocated per warp in units of 256 (8 a thread), 65,536 per
    SM, 64 warps and 32 programs at most."""
    per_warp = (regs + 7) // 8 * 8 * 32
    return min(32, 65536 // (per_warp * warps), 64 // warps) * warps


def test_the_occupancy_rule():
    assert _warps_per_sm(32, 4) == 64  # 1024 registers a warp: 16 programs of 4 warps
    assert _warps_per_sm(40, 4) == 48  # 1280 a warp: 51 warps' worth, 12 programs
    assert _warps_per_sm(67, 4) == 28  # rounded up to 72 a thread: 7 programs
    assert _warps_per_sm(16, 1) == 32  # the 32-program limit
    assert _warps_per_sm(255, 8) == 8
