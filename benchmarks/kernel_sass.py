"""Machine instructions per element of the GELU kernels, compiled for an H100/H200 without a GPU.

    python benchmarks/kernel_sass.py

A float32 GELU kernel does real arithmetic per element (float32 only, correctly rounded), and on a
GPU the slower of its instructions and its bytes sets its time; the H200 measured the float32
kernels at 2.5-3.2x torch's time when they took 300-370 instructions per element fwd+bwd. This
compiles each GELU kernel for sm_90 (Triton's bundled ``ptxas``; ``nvdisasm`` lists the SASS) as
Triton specializes it at run time for aligned tensors (pointers and ``n`` divisible by 16),
with ``BLOCK`` 1024 and 4 warps (8 elements per thread), over whole blocks (the float32 kernels'
``EVEN``: no masks, as for the suite's sizes), and counts the static instructions per
element in the kernel's own body: what one element executes, but for a branch's untaken side. A
correctly rounded division's rare slow path is a subroutine the body calls: counted apart. The
16-bit kernels (a table gather each way) are the memory-bound reference. The last table gives the
registers a thread of each float32 kernel holds at each launch shape ``gelu_directions.py`` times
and the warps an SM then fits (of 64; 65,536 registers, allocated per warp in units of 256): more
warps hide more of the loads' and gathers' latency.
"""
from __future__ import annotations

import collections
import os
import pathlib
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile, not interpret
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from leanact.ops.gelu import kernels32 as G32  # noqa: E402
from leanact.ops.gelu import kernels16 as K  # noqa: E402
from gelu_directions import SHAPES  # noqa: E402  (this script's folder is first on sys.path)

_BLOCK, _PER_THREAD = 1024, 8
_BIN = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_OP = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", re.M)
_SUBROUTINE = re.compile(r"^\s+\.type\s+\$__internal\S*,@function", re.M)
_REGS = re.compile(r"REG:(\d+)")


def _tool(name: str, cubin: bytes, *flags: str) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(_BIN / name), *flags, str(path)], capture_output=True, text=True,
                              check=True).stdout


def cubin(fn, sig: dict, consts: dict, **options) -> bytes:
    """``fn`` compiled for sm_90 (pointers and ``n`` 16-divisible)."""
    full = dict(sig, **{k: "constexpr" for k in consts})
    names = list(full)
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items() if v.startswith("*") or k == "n"}
    return triton.compile(ASTSource(fn=fn, signature=full, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]


def sass(fn, sig: dict, consts: dict, **options) -> list[str]:
    """The SASS opcodes of the kernel's body (its subroutines, such as a division's slow path, left out)."""
    return split_sass(cubin(fn, sig, consts, **options))[0]


def split_sass(binary: bytes) -> tuple[list[str], list[str]]:
    """``(the kernel body's opcodes, its subroutines' opcodes)``."""
    text = _tool("nvdisasm", binary, "-c")
    body, _, subs = text.partition(next((m.group(0) for m in _SUBROUTINE.finditer(text)), "\0"))
    return _OP.findall(body), _OP.findall(subs)


def registers(binary: bytes) -> int:
    """Registers per thread."""
    return int(_REGS.search(_tool("cuobjdump", binary, "--dump-resource-usage")).group(1))


def warps_per_sm(regs: int, warps: int) -> int:
    """Resident warps per SM of an sm_90 (64 at most, 32 programs at most) for ``regs`` per thread."""
    per_warp = -(-regs // 8) * 8 * 32
    return min(32, 65536 // (per_warp * warps), 64 // warps) * warps


_F32 = {"y_ptr": "*fp32", "bits_ptr": "*u8", "n": "i32"}


def float32_kernels(block: int = _BLOCK, wide: int = 0, even: bool = True, **options) -> list[tuple[str, bytes]]:
    """The float32 GELU kernels compiled (both forward forms; the backward with its quotient by
    ``div_rn``, then by ``fma``: its ``fma_div``), over whole blocks (``even``) or with masks."""
    out = []
    for form, tanh in (("erf", False), ("tanh", True)):
        out.append((f"GELU {form} forward", cubin(
            G32._gelu32f_fwd_kernel, {"x_ptr": "*fp32", **_F32, "tab_ptr": "*fp32" if tanh else "*i64", "thr": "fp32"},
            {"TANH": tanh, "WITH_BITS": True, "WIDE": wide, "EVEN": even, "BLOCK": block}, **G32.UNFUSED, **options)))
    for name, fma_div in (("GELU backward (both forms)", False), ("GELU backward, fma quotient", True)):
        out.append((name, cubin(
            G32._gelu32f_bwd_kernel, {**_F32, "dy_ptr": "*fp32", "out_ptr": "*fp32", "tab_ptr": "*i64", "c32": "fp32"},
            {"WIDE": wide, "FMA_DIV": fma_div, "EVEN": even, "BLOCK": block}, **G32.UNFUSED, **options)))
    return out


def rows() -> list[tuple[str, str, bytes]]:
    out = [(name, "float32", b) for name, b in float32_kernels()]
    out.append(("GELU forward (table)", "bfloat16", cubin(
        K._gelu16_fwd_kernel, {"x_ptr": "*i16", "y_ptr": "*i16", "bits_ptr": "*u8", "tab_ptr": "*i16", "n": "i32",
                               "u": "i32"}, {"WITH_BITS": True, "BLOCK": _BLOCK}, **K.FUSED)))
    out.append(("GELU backward (table)", "bfloat16", cubin(
        K._gelu16_bwd_kernel, {"y_ptr": "*i16", "bits_ptr": "*u8", "dy_ptr": "*bf16", "out_ptr": "*bf16",
                               "tab_ptr": "*fp32", "n": "i32"}, {"BLOCK": _BLOCK}, **K.FUSED)))
    return out


#: the kernels' ``wide`` argument: how a table row is read
ROW_READS = {0: "two 8-byte loads", 1: "a [BLOCK, 2] load, split", 2: "one 16-byte load (PTX)"}


def row_reads() -> list[tuple[str, int, list[str]]]:
    out = []
    for wide in ROW_READS:
        for name, b in float32_kernels(wide=wide):
            if name != "GELU tanh forward":  # reads no table
                out.append((name, wide, split_sass(b)[0]))
    return out


def main() -> int:
    if not (_BIN / "nvdisasm").exists():
        sys.exit(f"nvdisasm not found in this Triton install ({_BIN}): it disassembles the compiled kernels")
    print(f"SASS for sm_90 (triton {triton.__version__}), static instructions per element "
          f"(BLOCK {_BLOCK}, {_PER_THREAD} elements per thread)")
    print("| kernel | dtype | instructions per element | in subroutines (slow paths) | float32 arithmetic (FFMA, "
          "FMUL, FADD) | loads | most frequent, per element |")
    print("|---|---|---|---|---|---|---|")
    for name, dtype, binary in rows():
        ops, subs = split_sass(binary)
        n = collections.Counter(o.split(".")[0] for o in ops)
        flops = n["FFMA"] + n["FMUL"] + n["FADD"]
        common = ", ".join(f"{k} {v / _PER_THREAD:.1f}" for k, v in n.most_common(5))
        print(f"| {name} | {dtype} | {len(ops) / _PER_THREAD:.0f} | {len(subs)} | {flops / _PER_THREAD:.0f} | "
              f"{n['LDG'] / _PER_THREAD:.1f} | {common} |")
    print()
    print("float32 table kernels by how they read a 16-byte row (the kernels' `wide`; "
          "benchmarks/gelu_directions.py times them)")
    print("| kernel | row read | instructions per element | global loads | shared-memory ops and barriers |")
    print("|---|---|---|---|---|")
    for name, wide, ops in row_reads():
        n = collections.Counter(o.split(".")[0] for o in ops)
        smem = n["LDS"] + n["STS"] + n["LDSM"] + n["BAR"]
        print(f"| {name} | {ROW_READS[wide]} | {len(ops) / _PER_THREAD:.0f} | {n['LDG'] / _PER_THREAD:.1f} | "
              f"{smem / _PER_THREAD:.1f} |")
    print()
    print("float32 kernels' registers per thread and resident warps per SM (of 64), by launch shape "
          "(BLOCK / warps per program; gelu_directions.py times them)")
    print("| kernel | " + " | ".join(f"{b} / {w}" for b, w in SHAPES) + " |")
    print("|---|" + "---|" * len(SHAPES))
    table: dict = {}
    for b, w in SHAPES:
        for name, binary in float32_kernels(block=b, num_warps=w):
            regs = registers(binary)
            table.setdefault(name, []).append(f"{regs}, {warps_per_sm(regs, w)}")
    for name, cells in table.items():
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
