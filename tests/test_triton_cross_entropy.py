"""The fused head's chunk kernel (leanact/ops/cross_entropy/kernels.py) on CPU under Triton's
interpreter (setup as in test_triton_gated.py; :func:`test_in_subprocess` when this process cannot).

* the kernel's statistics and gradient against the float64 truth, no further than 4x the PyTorch
  path's own error plus 2 ulp of the dtype (its self-check's rule), several vocabulary blocks with
  a ragged tail, every dtype, with and without soft-cap, scale and smoothing;
* the whole op (``linear_cross_entropy``) through the kernel equals the PyTorch path within the
  rules of tests/test_linear_cross_entropy.py (fp32 1e-5; 16-bit within 2x the unfused error
  against float64), gradients in the forward and recomputed, masked rows, reduction none;
* the self-check passes, and a kernel that writes a wrong gradient fails it;
* the kernel compiles for sm_90 (no GPU needed).
"""
import os
import sys

import pytest
import torch

pytest.importorskip("numpy")
_FRESH = "triton" not in sys.modules
if _FRESH and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")


from _triton_run import interpreting  # noqa: E402

INTERPRETED = interpreting(_FRESH)

import leanact.ops.cross_entropy.function as L  # noqa: E402
from leanact.ops.cross_entropy import launchers as CE  # noqa: E402
from leanact.ops.triton import dispatch  # noqa: E402

from _triton_run import compile_for_sm90, interpreter_marks, run_interpreted  # noqa: E402

pytestmark, interp = interpreter_marks(INTERPRETED)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def KM(monkeypatch):
    monkeypatch.setenv("LEANACT_TRITON", "1")
    from leanact.ops.cross_entropy import kernels as cross_entropy_kernels
    from leanact.ops.triton import common as kernels

    return kernels, cross_entropy_kernels


def _chunk(dtype, rows=5, v=700, seed=0):
    gen = torch.Generator().manual_seed(seed)
    z = (torch.randn(rows, v, generator=gen) * 3).to(dtype)
    y = torch.randint(0, v, (rows,), generator=gen)
    coef = torch.rand(rows, generator=gen)
    return z, y, coef


@interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["plain", "softcap", "smooth-scale"])
def test_kernel_against_float64(KM, dtype, variant):
    z, y, coef = _chunk(dtype)
    scale = 0.7 if variant == "smooth-scale" else 1.0
    softcap = 20.0 if variant == "softcap" else None
    eps = 0.1 if variant == "smooth-scale" else 0.0
    truth = CE.reference_(z.double(), y, coef.double(), scale, softcap, eps, torch.float64)
    ours = CE.reference_(z, y, coef, scale, softcap, eps, torch.float32)
    lse, zy, zsum = (torch.empty(5) for _ in range(3))
    g = z.clone()
    KM[1].chunk_(g, y, coef, lse, zy, zsum, scale, softcap, eps, True, True, block=256)  # 3 blocks, ragged tail
    for name, got, mine, true in zip(("lse", "zy", "zsum", "grad"), (lse, zy, zsum, g), ours, truth):
        if name == "zsum" and not eps:
            continue
        ulp = torch.finfo(mine.dtype).eps * true.abs().max().item()
        e_got = (got.double() - true).abs().max().item()
        e_ref = (mine.double() - true).abs().max().item()
        assert e_got <= 4 * e_ref + 2 * ulp, (name, e_got, e_ref)
    # the gradient from a given lse (backward, recompute mode) is the same computation
    g2 = z.clone()
    KM[1].chunk_(g2, y, coef, lse, zy, None, scale, softcap, eps, False, True, block=256)
    assert torch.equal(g2, g)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw", [dict(grad_in_forward=True), dict(), dict(reduction="none"),
                                dict(grad_in_forward=True, label_smoothing=0.1, softcap=8.0)],
                         ids=["grad_in_forward", "recompute", "none", "smooth-softcap"])
@pytest.mark.parametrize("fraction", [None, 4.0], ids=["product-per-chunk", "products-of-chunks"])
def test_op_through_the_kernel(KM, dtype, kw, fraction, monkeypatch):
    if fraction is not None:  # several chunks' gradients per dW product (fp32: 2 chunks, bf16: all 3)
        monkeypatch.setattr(L, "PRODUCT_FRACTION", fraction)
    gen = torch.Generator().manual_seed(3)
    n, h, v = 40, 16, 300
    x = torch.randn(n, h, generator=gen).to(dtype)
    w = (torch.randn(v, h, generator=gen) * 0.3).to(dtype)
    y = torch.randint(0, v, (n,), generator=gen)
    y[::5] = -100

    def run(kernels):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        if kernels:
            with dispatch.use_kernels(KM[0]):
                loss = L.linear_cross_entropy(xr, wr, y, chunk_tokens=16, matmul_dtype=dtype, **kw)
        else:
            loss = L.linear_cross_entropy(xr, wr, y, chunk_tokens=16, matmul_dtype=dtype, **kw)
        loss.sum().backward()
        return [loss.detach()] + [xr.grad, wr.grad]

    got, path = run(True), run(False)
    if dtype == torch.float32:
        assert max(_rel(a, b) for a, b in zip(got, path)) < 1e-5
        return
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    ref_kw = {k: val for k, val in kw.items() if k != "grad_in_forward"}
    truth = L.linear_cross_entropy_reference(xd, wd, y, **ref_kw)
    truth.sum().backward()
    truth = [truth.detach(), xd.grad, wd.grad]
    for a, b, t in zip(got, path, truth):
        assert _rel(a, t) <= 2 * max(_rel(b, t), 2 ** -9), (_rel(a, t), _rel(b, t))


@interp
def test_self_check_passes_and_catches_a_wrong_kernel(KM, monkeypatch):
    with dispatch.use_kernels(KM[0]):
        for key in [(d, c, s) for d in DTYPES for c in (False, True) for s in (False, True)]:
            CE._check(torch.device("cpu"), key)
    real = KM[1].chunk_

    def wrong(z, *args, **kwargs):
        real(z, *args, **kwargs)
        if args[9]:  # grad: one element off by 1%
            z[0, 0] = z[0, 0] * 1.01 + 1e-3

    monkeypatch.setattr(KM[1], "chunk_", wrong)
    with dispatch.use_kernels(KM[0]), pytest.raises(AssertionError, match="cross_entropy gradient"):
        CE._check(torch.device("cpu"), (torch.float32, False, False))


@pytest.mark.slow
def test_in_subprocess():
    if INTERPRETED:
        pytest.skip("the interpreter runs in this process")
    run_interpreted(__file__)


_COMPILE = r'''
from leanact.ops.cross_entropy import kernels as K

for ty in ("bf16", "fp16", "fp32"):
    for stats, grad, cap, eps in ((True, True, False, False), (True, True, True, True), (False, True, False, False),
                                  (True, False, False, True)):
        build(K._ce_chunk_kernel, {"z_ptr": "*" + ty, "z_stride": "i64", "y_ptr": "*i64", "coef_ptr": "*fp32",
              "lse_ptr": "*fp32", "zy_ptr": "*fp32", "zsum_ptr": "*fp32", "V": "i32", "scale": "fp32",
              "softcap": "fp32", "eps": "fp32"},
              {"STATS": stats, "GRAD": grad, "SOFTCAP": cap, "EPS": eps, "BLOCK": 4096})
'''


@pytest.mark.slow
def test_kernel_compiles_for_a_gpu_without_one():
    compile_for_sm90(_COMPILE)
