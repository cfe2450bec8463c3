"""What the interpreter cannot see: Triton's float32 ``/`` compiles on CUDA to ``div.full.f32`` (an
approximation, up to 2 ulp) and ``tl.sqrt`` to ``sqrt.approx.f32``, while the interpreter divides and
takes square roots correctly rounded (numpy); an instruction with ``.ftz`` flushes subnormals to
zero, which torch's kernels do not. A kernel whose result must equal a PyTorch path
bitwise therefore passes every interpreter test and fails on a GPU. Compiled here for sm_90 without
a GPU (Triton's bundled ptxas is not needed: the PTX is enough), every kernel of
leanact/ops/triton is scanned for approximate instructions.

Allowed where the results are not compared bitwise or the approximation is the reference's own:
the norms' means ``sum / N`` (LayerNorm / RMSNorm: checked against float64 within a tolerance),
and the ``ex2.approx`` inside libdevice's ``erff`` (GeGLU's ``tl.erf``; torch's ``erff`` is an
approximation too, tests/test_triton_gated_cuda.py bounds the difference).
"""
import ast
import os
import subprocess
import sys
import tempfile

import pytest

from _triton_run import _BUILD, ROOT

pytestmark = [pytest.mark.triton, pytest.mark.slow]

_SCAN = r'''
import re
from leanact.ops.gelu import kernels16 as K16
from leanact.ops.norms import kernels as NK
from leanact.ops.dropout import kernels as DK
from leanact.ops.gated_mlp import kernels as GK
from leanact.ops.triton import common as K
from leanact.ops.gelu import kernels32 as G32
from leanact.ops.lossy import kernels as LK
from leanact.ops.rotary import kernels as RK

APPROX = re.compile(r"\b(div\.full\.f32|div\.approx\.\w+|rcp\.approx\.\w+|sqrt\.approx\.\w+|rsqrt\.approx\.\w+"
                    r"|ex2\.approx\.\w+|lg2\.approx\.\w+|tanh\.approx\.\w+|sin\.approx\.\w+|cos\.approx\.\w+)")
F64 = re.compile(r"\.f64\b")
FTZ = re.compile(r"\b(?:add|sub|mul|fma|neg|abs|min|max|cvt)(?:\.\w+)*\.ftz\b")
found, built, f64, ftz, fma = {}, set(), set(), set(), set()

def scan(fn, sig, consts, **opts):
    full = dict(sig, **{k: "constexpr" for k in consts})
    c = triton.compile(ASTSource(fn=fn, signature=full, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options=opts)
    name = fn.__name__ if hasattr(fn, "__name__") else fn.fn.__name__
    built.add(name)
    found.setdefault(name, set()).update(m.split(".")[0] + "." + m.split(".")[1] for m in APPROX.findall(c.asm["ptx"]))
    if FTZ.search(c.asm["ptx"]):  # subnormals flushed to zero (tl.exp's ex2.approx.ftz, ...)
        ftz.add(name)
    if re.search(r"\bfma\.rn\.f32\b", c.asm["ptx"]):  # a product and a sum contracted: one rounding
        fma.add(name)
    if F64.search(c.asm["ptx"]):
        f64.add(name)

''' + "{body}" + r'''
kernels = {n for mod in (DK, NK, K16, LK, GK, G32, RK) for n in vars(mod)
           if n.startswith("_") and n.endswith("_kernel")}
print("KERNELS", sorted(kernels - built), "MISSING")
print("F64", sorted(f64))
print("FTZ", sorted(ftz))
print("FMA", sorted(fma))
for name in sorted(found):
    print("FOUND", name, sorted(found[name]))
'''


def _compile_scripts() -> str:
    """The kernels (and their signatures) the compile tests of test_triton_kernels.py,
    test_triton_lossy.py and test_triton_gated.py build, read from those files (importing them would
    set up the interpreter), then the variants they leave out."""
    out = []
    for name in ("test_triton_kernels.py", "test_triton_lossy.py", "test_triton_gated.py", "test_triton_rotary.py"):
        with open(os.path.join(ROOT, "tests", name)) as f:
            tree = ast.parse(f.read())
        out += [node.value.value for node in tree.body if isinstance(node, ast.Assign)
                and [getattr(t, "id", None) for t in node.targets] == ["_COMPILE"]]
    return "\nbuild = scan\n" + "\n".join(out) + _MORE


_MORE = r'''
for rms in (False, True):
    build(NK._ln_fwd_kernel, {"x_ptr": "*bf16", "y_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16",
          "rstd_ptr": "*fp32", "N": "i32", "eps": "fp32", "r_ptr": "*bf16", "seed_ptr": "*i64", "thr": "i64",
          "scale": "fp32"}, {"HAS_W": True, "HAS_B": not rms, "RMS": rms, "BLOCK_N": 1024, "RESIDUAL": False,
          "DROPOUT": False, "Z_KIND": 0}, **K.FUSED)
    build(NK._ln_bwd_kernel, {"dy_ptr": "*bf16", "t_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16",
          "rstd_ptr": "*fp32", "dx_ptr": "*bf16", "dw_ptr": "*fp32", "db_ptr": "*fp32", "M": "i32", "N": "i32",
          "rows_per_prog": "i32", "dh_ptr": "*bf16", "seed_ptr": "*i64", "thr": "i64", "scale": "fp32"},
          {"HAS_W": True, "HAS_B": not rms, "RMS": rms, "FROM_OUTPUT": False, "NEED_DX": True, "NEED_DW": True,
           "NEED_DB": not rms, "BLOCK_N": 1024, "RESIDUAL": False, "NEED_DH": False, "DROPOUT": False,
           "Z_KIND": 0}, **K.FUSED)
# the sub-layer end in a bf16 model (z rounded to bf16) and without dropout
build(NK._ln_fwd_kernel, {"x_ptr": "*bf16", "y_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16",
      "rstd_ptr": "*fp32", "N": "i32", "eps": "fp32", "r_ptr": "*bf16", "seed_ptr": "*i64", "thr": "i64",
      "scale": "fp32"}, {"HAS_W": True, "HAS_B": True, "RMS": False, "BLOCK_N": 1024, "RESIDUAL": True,
      "DROPOUT": True, "Z_KIND": 1}, **K.UNFUSED)
build(NK._ln_bwd_kernel, {"dy_ptr": "*bf16", "t_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16",
      "rstd_ptr": "*fp32", "dx_ptr": "*bf16", "dw_ptr": "*fp32", "db_ptr": "*fp32", "M": "i32", "N": "i32",
      "rows_per_prog": "i32", "dh_ptr": "*bf16", "seed_ptr": "*i64", "thr": "i64", "scale": "fp32"},
      {"HAS_W": True, "HAS_B": True, "RMS": False, "FROM_OUTPUT": True, "NEED_DX": True, "NEED_DW": True,
       "NEED_DB": True, "BLOCK_N": 1024, "RESIDUAL": True, "NEED_DH": True, "DROPOUT": False, "Z_KIND": 1},
      **K.FUSED)
for dtype in ("*bf16", "*fp32"):
    build(NK._partials_sum_kernel, {"pw_ptr": "*fp32", "pb_ptr": "*fp32", "w_ptr": dtype, "dw_ptr": dtype,
          "db_ptr": dtype, "P": "i32", "N": "i32"}, {"HAS_DW": True, "HAS_DB": True, "DIV_W": dtype == "*fp32",
          "BLOCK_P": 32, "BLOCK_N": 64}, **K.FUSED)
build(K16._gelu16_bwd_kernel, {"y_ptr": "*i16", "bits_ptr": "*u8", "dy_ptr": "*bf16", "out_ptr": "*bf16",
      "tab_ptr": "*fp32", "n": "i32"}, {"BLOCK": 1024}, **K.FUSED)
# the three ways to read a table row, with masks and over whole blocks (EVEN: no masks)
for wide, even in ((0, False), (1, False), (2, False), (0, True), (2, True)):
    for tanh in (False, True):
        build(G32._gelu32f_fwd_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32", "bits_ptr": "*u8",
              "tab_ptr": "*fp32" if tanh else "*i64", "n": "i32", "thr": "fp32"},
              {"TANH": tanh, "WITH_BITS": True, "WIDE": wide, "EVEN": even, "BLOCK": 1024}, **G32.UNFUSED)
    for fma_div in (False, True):  # the left key's quotient by div_rn, or by math32.quotient
        build(G32._gelu32f_bwd_kernel, {"y_ptr": "*fp32", "bits_ptr": "*u8", "dy_ptr": "*fp32", "out_ptr": "*fp32",
              "tab_ptr": "*i64", "n": "i32", "c32": "fp32"},
              {"WIDE": wide, "FMA_DIV": fma_div, "EVEN": even, "BLOCK": 1024}, **G32.UNFUSED)
'''

_F64 = r'''
import triton.language as tl

@triton.jit
def _f64_kernel(x_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i) * 3.0)

scan(_f64_kernel, {"x_ptr": "*fp64"}, {"BLOCK": 128}, **K.UNFUSED)
'''

_DIVIDES = r'''
import triton.language as tl

@triton.jit
def _divides_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i) / tl.load(y_ptr + i))

scan(_divides_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32"}, {"BLOCK": 128}, **K.UNFUSED)
'''

#: kernel -> approximate instructions allowed in it (module doc)
ALLOWED = {"_ln_fwd_kernel": {"div.full"}, "_ln_bwd_kernel": {"div.full"}, "_glu_fwd_kernel": {"ex2.approx"},
           "_glu_bwd_kernel": {"ex2.approx"}}


def _scan(body: str) -> dict:
    """Compile in a fresh process without TRITON_INTERPRET (as _triton_run.compile_for_sm90) and read
    what the scan printed."""
    pytest.importorskip("triton.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT)
    with tempfile.TemporaryDirectory() as tmp:  # a file: @triton.jit reads its function's source
        script = os.path.join(tmp, "scan.py")
        with open(script, "w") as f:
            f.write(_BUILD + _SCAN.replace("{body}", body))
        r = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("no ptxas in this Triton install")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    missing = next(line for line in lines if line.startswith("KERNELS"))
    f64 = eval(next(line for line in lines if line.startswith("F64 "))[4:])  # a printed list of names
    ftz = eval(next(line for line in lines if line.startswith("FTZ "))[4:])
    fma = eval(next(line for line in lines if line.startswith("FMA "))[4:])
    found = {}
    for line in lines:
        if line.startswith("FOUND "):
            _, name, rest = line.split(" ", 2)
            found[name] = set(eval(rest))  # a printed list of strings
    return {"missing": missing, "found": found, "f64": set(f64), "ftz": set(ftz), "fma": set(fma)}


def test_no_approximate_division_or_sqrt_where_results_are_bitwise():
    result = _scan(_compile_scripts())
    assert result["missing"] == "KERNELS [] MISSING", result["missing"]  # every kernel scanned
    extra = {name: sorted(ops - ALLOWED.get(name, set())) for name, ops in result["found"].items()
             if ops - ALLOWED.get(name, set())}
    assert not extra, extra


def test_no_kernel_uses_float64():
    """Every kernel runs in float32 at most (float64 is 1/2 to 1/64 of float32's rate on GPUs); with
    no approximate instruction (above), the float32 GELU, exp and tanh compute compiled what the
    interpreter computes, whose error the tests measure."""
    result = _scan(_compile_scripts())
    assert not result["f64"], result["f64"]


#: kernels whose outputs must be torch's bitwise on subnormal values too (no instruction flushes them)
NO_FTZ = {"_rotary_kernel"}


def test_bitwise_kernels_keep_subnormals_and_round_each_operation():
    """The RoPE kernel's products, sums and conversions keep subnormal values as torch's kernels do,
    and round each product before its sum (no FMA), as torch's separate ops do (its self-check
    compares them bitwise, subnormals included)."""
    result = _scan(_compile_scripts())
    assert NO_FTZ <= set(result["found"]) and not NO_FTZ & result["ftz"], result["ftz"]
    assert not NO_FTZ & result["fma"], result["fma"]
    assert result["fma"], "no kernel contracts: the FMA scan sees nothing"  # (the norms are launched with FMA on)


def test_the_scan_sees_a_flush_to_zero():
    """The check can fail: a ``mul.ftz.f32`` shows in the PTX."""
    assert _scan(_FTZ)["ftz"] == {"_ftz_kernel"}


_FTZ = r'''
import triton.language as tl

@triton.jit
def _ftz_kernel(x_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i)
    y = tl.inline_asm_elementwise("mul.ftz.f32 $0, $1, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    tl.store(x_ptr + i, y)

scan(_ftz_kernel, {"x_ptr": "*fp32"}, {"BLOCK": 128}, **K.UNFUSED)
'''


def test_the_scan_sees_float64():
    """The check can fail: a float64 product shows in the PTX."""
    assert _scan(_F64)["f64"] == {"_f64_kernel"}


def test_the_scan_sees_a_plain_float32_division():
    """The check can fail: ``x / y`` in float32 is ``div.full.f32`` on CUDA."""
    assert _scan(_DIVIDES)["found"].get("_divides_kernel") == {"div.full"}
