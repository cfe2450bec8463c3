"""The lossy options' Triton kernels (leanact/ops/lossy/kernels.py) against their PyTorch paths,
on CPU under Triton's interpreter: few-bit activations (index planes, backward) and 8-bit compression.

Interpreter setup as tests/test_triton_kernels.py (TRITON_INTERPRET=1 set before Triton is imported,
else the file re-runs itself in a subprocess). Bitwise throughout: packed index planes, level
products, fp8 / int8 values, scales and decompressed values. One exception is documented and
bounded: the fused few-bit forward of 16-bit x looks y up in a table of torch's activation of every
16-bit pattern; torch's CPU kernels round some elements one ulp differently at different positions
(vectorized body vs scalar tail), CUDA's do not, so here y equals the table bitwise and torch's
elementwise result to one ulp; the CUDA tests at the end check it bitwise on a GPU, with the
compiled kernels against the PyTorch path on the device.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _triton_run import interpreter_setup  # noqa: E402

triton, INTERPRETED = interpreter_setup()
tl = pytest.importorskip("triton.language")

from leanact.lossy.compress import CompressTransform, compress, decompress  # noqa: E402
from leanact.ops.lossy import fewbit as FB  # noqa: E402
from leanact.ops.lossy import kernels as LK  # noqa: E402
from leanact.ops.lossy import launchers as L  # noqa: E402
from leanact.ops.triton import dispatch  # noqa: E402

from _triton_run import compile_for_sm90, interpreter_marks, run_interpreted  # noqa: E402

pytestmark, interp = interpreter_marks(INTERPRETED)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    monkeypatch.setenv("LEANACT_TRITON", "1")


@pytest.fixture(scope="module")
def K():
    from leanact.ops.triton import common as kernels

    return kernels


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern (integer view) of t, NaNs made one pattern (their payloads may differ)."""
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    if not t.is_floating_point():
        return t
    t = torch.where(t.isnan(), torch.full_like(t, float("nan")), t)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _fewbit_inputs(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """n normal-ish values, every border of every table (and its float neighbours), specials."""
    g = torch.Generator().manual_seed(seed)
    borders = torch.tensor([b for t in FB.TABLES.values() for b in t["borders"]], dtype=torch.float64).to(dtype)
    near = torch.cat([borders, torch.nextafter(borders, torch.full_like(borders, 9.0)),
                      torch.nextafter(borders, torch.full_like(borders, -9.0))])
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 60000.0, -60000.0, 1e-7, -1e-7])
    return torch.cat([(torch.randn(n, generator=g) * 2.5).to(dtype), near, specials.to(dtype)])


# -- few-bit activations ---------------------------------------------------------------------------


def _check_fewbit_forward(K, x, function, bits):
    ref_packed = FB._pack(FB.fewbit_index(x, function, bits), bits)
    with dispatch.use_kernels(K):
        y, packed = FB._kernel_forward(x, function, bits)
    assert torch.equal(packed, ref_packed) and packed.numel() == FB.fewbit_packed_nbytes(x.numel(), bits)
    ref_y = FB._forward(x, function)
    if x.dtype == torch.float32:
        assert _same(y, ref_y)  # torch's own activation
    else:
        table = FB._y_table(function, x.dtype, x.device)
        assert _same(y, table[_bits(x).long() & 0xFFFF])
        # torch's CPU kernel itself rounds differently by position (vector body / scalar tail)
        step = torch.finfo(x.dtype).eps * ref_y.float().abs().clamp_min(torch.finfo(x.dtype).tiny)
        off = ~((y == ref_y) | (y.isnan() & ref_y.isnan()))
        assert ((y.float() - ref_y.float()).abs()[off] <= step[off]).all()


@interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_fewbit_forward_bitwise(K, dtype, bits):
    for function in FB.FUNCTIONS:
        _check_fewbit_forward(K, _fewbit_inputs(2500, dtype, bits), function, bits)
        _check_fewbit_forward(K, _fewbit_inputs(0, dtype)[:1], function, bits)  # one element


@interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fewbit_forward_every_16bit_pattern(K, dtype):
    x = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    for function in FB.FUNCTIONS:
        _check_fewbit_forward(K, x, function, 4)


@interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_fewbit_autograd_bitwise_and_keeps_the_same(K, dtype, bits):
    torch.manual_seed(bits)
    x = _fewbit_inputs(1500, dtype, bits)
    x = x[: x.numel() // 7 * 7].view(7, -1)
    dy = torch.randn(x.shape).to(dtype)
    for function in FB.FUNCTIONS:
        runs = []
        for kernels in (None, K):
            xx = x.clone().requires_grad_()
            with dispatch.use_kernels(kernels) if kernels is not None else torch.enable_grad():
                y = FB.fewbit_activation(xx, function, bits)
                kept = [t.clone() for t in y.grad_fn.saved_tensors]
                y.backward(dy)
            runs.append((y.detach(), xx.grad, kept))
        (y0, g0, s0), (y1, g1, s1) = runs
        assert len(s0) == len(s1) == 1 and _same(s0[0], s1[0])  # the packed planes, bit for bit
        assert _same(g0, g1)
        if dtype == torch.float32:
            assert _same(y0, y1)


@interp
def test_fewbit_noncontiguous_and_grad_dtype(K):
    x = (torch.randn(33, 40) * 2).to(torch.bfloat16).t()  # y by torch, index from a contiguous copy
    ref = FB._pack(FB.fewbit_index(x.contiguous(), "silu", 3), 3)
    with dispatch.use_kernels(K):
        y, packed = FB._kernel_forward(x, "silu", 3)
    assert torch.equal(packed, ref) and _same(y, FB._forward(x, "silu"))
    _, _, levels = FB._tensors("silu", 3, torch.bfloat16, x.device)
    dy = torch.randn(40, 33)  # a float32 gradient of a bfloat16 activation
    want = (dy * levels[FB._unpack(ref, 3, x.numel(), x.shape).long()]).to(dy.dtype)
    with dispatch.use_kernels(K):
        assert _same(L.fewbit_backward(ref, levels, dy.t().contiguous().t(), 3), want)


# -- 8-bit compression -----------------------------------------------------------------------------


def _compress_inputs(n: int, dtype: torch.dtype, block: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n + block)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2)
    if n >= 4 * block:
        x[:block] = 0.0  # an all-zero block: scale 0
        x[block + 3] = float("inf")  # non-finite blocks decompress to NaN
        x[2 * block + 1] = float("nan")
        x[3 * block: 4 * block] *= 1e-30  # tiny (subnormal in 16-bit storage)
    return x.to(dtype)


@interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_compress_and_decompress_bitwise(K, dtype, fmt):
    for n, block in ((1000, 128), (777, 100), (50, 7), (3, 128), (9000, 8192), (0, 128)):
        x = _compress_inputs(n, dtype, block)
        q0, s0 = compress(x, fmt, block, torch.Generator().manual_seed(n))
        with dispatch.use_kernels(K):
            q1, s1 = compress(x, fmt, block, torch.Generator().manual_seed(n))
        assert _same(q0, q1) and _same(s0, s1), (n, block)
        for out in DTYPES:
            ref = decompress(q0, s0, out, block)
            with dispatch.use_kernels(K):
                assert _same(decompress(q0, s0, out, block), ref), (n, block, out)


class _CudaScalarDivision(TorchDispatchMode):
    """CUDA's rule for dividing a float32 tensor by a Python number, on CPU tensors: ATen's
    ``div_true_kernel_cuda`` multiplies by the reciprocal rounded to float32 (for 448 that rounds
    differently from the division in about half the cases). The CPU divides correctly rounded, as
    the kernel (``div_rn``) does on both, so the interpreter alone cannot show the difference."""

    def __init__(self):
        super().__init__()
        self.divisions_by_a_number = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (func in (torch.ops.aten.div.Tensor, torch.ops.aten.div_.Tensor) and not kwargs
                and isinstance(args[1], (int, float)) and args[0].dtype == torch.float32):
            self.divisions_by_a_number += 1
            inv = torch.tensor(1.0) / torch.tensor(float(args[1]))  # float32, as ATen's opmath_t(1) / b
            return (torch.ops.aten.mul_.Tensor if func is torch.ops.aten.div_.Tensor else torch.ops.aten.mul.Tensor)(
                args[0], inv)
        return func(*args, **(kwargs or {}))


@interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_compress_scales_do_not_depend_on_cudas_division_by_a_number(K, dtype, fmt):
    """On an H200 the fp8 scales of the PyTorch path differed from the kernel's in 3-4 of 8 blocks:
    ``amax.div_(448.0)`` is ``amax * fl(1/448)`` on CUDA. The PyTorch path divides by a tensor on
    the data's device instead (correctly rounded everywhere): under CUDA's rule, emulated here, its
    scales stay the kernel's, and they are amax / qmax correctly rounded."""
    x = _compress_inputs(50_000, dtype, 128)
    with _CudaScalarDivision() as mode:
        q0, s0 = compress(x, fmt, 128, torch.Generator().manual_seed(3))
    with dispatch.use_kernels(K):
        q1, s1 = compress(x, fmt, 128, torch.Generator().manual_seed(3))
    assert _same(s0, s1) and _same(q0, q1)
    assert mode.divisions_by_a_number == 0
    amax = torch.cat([x.float(), x.new_zeros(-x.numel() % 128, dtype=torch.float32)]).view(-1, 128).abs().amax(1)
    qmax = {"fp8": 448.0, "int8": 127.0}[fmt]
    assert _same(s1, (amax.double() / qmax).float())  # float64 quotient rounded once: correctly rounded
    probe = torch.tensor([1.0, 3.0, 5.0, 7.0, 11.0])  # the emulation itself: CUDA's rule differs here
    with _CudaScalarDivision():
        assert not torch.equal(probe.clone().div_(448.0), probe / torch.tensor(448.0))


@triton.jit
def _e4m3_roundtrip(x_ptr, q_ptr, v_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    q = LK._e4m3_bits(tl.load(x_ptr + offs, mask=m, other=0.0))
    tl.store(q_ptr + offs, q.to(tl.uint8), mask=m)
    tl.store(v_ptr + offs, LK._e4m3_value(q), mask=m)


@interp
def test_fp8_encoding_follows_torch_at_every_rounding_boundary():
    """float32 -> e4m3fn as torch's cast: around every midpoint of the e4m3 grid, subnormals,
    saturation (448 .. 480 .. inf, NaN); and every byte decodes as torch decodes it."""
    enc = _e4m3_roundtrip
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    fin = grid[grid.isfinite()].unique()
    mids = (fin[1:] + fin[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    x = torch.cat([fin, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1),
                   torch.tensor([448.0, 463.9, 464.0, 464.1, 479.9, 480.0, 1e6, float("inf"), float("nan")]),
                   torch.rand(2000, generator=g) * 2.0**-6, torch.randn(2000, generator=g) * 100])
    x = torch.cat([x, -x])
    q, v = torch.empty(x.numel(), dtype=torch.uint8), torch.empty(x.numel())
    enc[(triton.cdiv(x.numel(), 1024),)](x, q, v, x.numel(), BLOCK=1024)
    ref = x.to(torch.float8_e4m3fn).view(torch.uint8)
    # |v| >= 464 (never reached by compress): torch 2.13 saturates to 448, older releases gave NaN
    big = x.abs() >= 464
    assert torch.equal(q[~big], ref[~big]) and big.sum() == 12
    assert (q[big] & 0x7F == 0x7E).all()
    assert _same(v, q.view(torch.float8_e4m3fn).float())
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    x2 = every.view(torch.float8_e4m3fn).float()
    enc[(1,)](x2, q[:256], v[:256], 256, BLOCK=256)
    assert torch.equal(q[:256], x2.to(torch.float8_e4m3fn).view(torch.uint8)) and _same(v[:256], x2)


@interp
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_compress_transform_keeps_the_same_bytes(K, fmt):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48).to(torch.bfloat16)
    x = torch.randn(5, 70, 64, dtype=torch.bfloat16, requires_grad=True)
    runs = []
    for kernels in (None, K):
        tr = CompressTransform(fmt, min_numel=16, seed=3)
        kept = []
        with dispatch.use_kernels(kernels) if kernels is not None else torch.enable_grad():
            with tr:
                y = lin(torch.tanh(x))
            kept = [t.clone() for h in tr._live.values() for t in (h.values, h.scales)]
            y.backward(torch.ones_like(y))
        runs.append((kept, x.grad.clone(), lin.weight.grad.clone()))
        x.grad = None
        lin.zero_grad()
    (k0, gx0, gw0), (k1, gx1, gw1) = runs
    assert len(k0) == len(k1) > 0 and all(_same(a, b) for a, b in zip(k0, k1))
    assert _same(gx0, gx1) and _same(gw0, gw1)


# -- dispatch --------------------------------------------------------------------------------------


def test_dispatch_declines_without_cuda_or_when_unsupported(monkeypatch):
    x = torch.randn(300)
    tables = lambda: (torch.zeros(1), torch.zeros(2, dtype=torch.uint8))  # noqa: E731
    assert L.fewbit_forward(x, tables, 1, lambda: None) is None  # CPU tensors: the PyTorch path
    assert L.compress_8bit(x, True, 128, 448.0, None) is None

    class Boom:
        def __getattr__(self, name):
            raise AssertionError(f"kernel {name} ran")

    with dispatch.use_kernels(Boom()):
        assert L.fewbit_forward(x.double(), tables, 1, lambda: None) is None
        assert L.fewbit_backward(torch.zeros(38, dtype=torch.uint8), torch.zeros(2, dtype=torch.float64), x, 1) is None
        assert L.compress_8bit(x, True, L.MAX_QBLOCK + 1, 448.0, None) is None
        assert L.compress_8bit(x.view(3, 100), True, 128, 448.0, None) is None
        assert L.decompress_8bit(torch.zeros(300, dtype=torch.int8), torch.ones(3), torch.float64, 128) is None
        monkeypatch.setenv("LEANACT_TRITON", "0")
        assert L.decompress_8bit(torch.zeros(300, dtype=torch.int8), torch.ones(3), torch.float32, 128) is None


def test_shapes_only_allocates_the_outputs():
    """leanact.estimate: fake tensors get the outputs of the kernels and nothing else (no y table)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), dispatch.use_kernels(dispatch.SHAPES_ONLY, fake=True):
        x = torch.empty(10, 30, dtype=torch.bfloat16)
        y, packed = L.fewbit_forward(x, lambda: pytest.fail("tables built"), 2, lambda: pytest.fail("table built"))
        assert y.shape == x.shape and y.dtype == x.dtype and packed.shape == (2 * 38,)
        g = L.fewbit_backward(packed, torch.empty(4), torch.empty(10, 30, dtype=torch.bfloat16), 2)
        assert g.shape == (10, 30) and g.dtype == torch.bfloat16
        q, s = L.compress_8bit(x.view(-1), False, 128, 127.0, torch.empty(384))
        assert q.shape == (300,) and q.dtype == torch.int8 and s.shape == (3,) and s.dtype == torch.float32
        out = L.decompress_8bit(q, s, torch.float16, 128)
        assert out.shape == (300,) and out.dtype == torch.float16


@pytest.mark.slow
def test_in_subprocess():
    """When this process cannot run the interpreter (see the module doc), run the file in one that can."""
    if INTERPRETED:
        pytest.skip("the interpreter runs in this process")
    run_interpreted(__file__)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_fewbit_y_is_torchs_bitwise(dtype, monkeypatch):
    """On CUDA torch's activation does not depend on the position: the table lookup is bitwise."""
    monkeypatch.setenv("LEANACT_TRITON", "strict")
    x = (torch.randn(1 << 20, device="cuda") * 3).to(dtype)
    for function in FB.FUNCTIONS:
        fused = FB._kernel_forward(x, function, 2)
        assert fused is not None and _same(fused[0], FB._forward(x, function))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_kernels_match_the_pytorch_path_on_the_device(dtype, monkeypatch):
    """The compiled kernels (division, contraction, casts as lowered by the compiler) against the
    PyTorch path on the same GPU: packed planes, gradients, 8-bit values, scales, decompression."""
    if not dispatch.available():
        pytest.skip("Triton does not import here")

    def both(fn):
        monkeypatch.setenv("LEANACT_TRITON", "0")
        ref = fn()
        monkeypatch.setenv("LEANACT_TRITON", "strict")
        return ref, fn()

    x = _fewbit_inputs(100_000, dtype).cuda()
    dy = torch.randn(x.shape, device="cuda").to(dtype)
    for function in FB.FUNCTIONS:
        for bits in (1, 2, 3, 4):
            def run():
                xx = x.clone().requires_grad_()
                y = FB.fewbit_activation(xx, function, bits)
                packed = y.grad_fn.saved_tensors[0].clone()
                y.backward(dy)
                return y.detach(), packed, xx.grad

            ref, got = both(run)
            assert all(_same(a, b) for a, b in zip(ref, got)), (function, bits)
    xc = _compress_inputs(300_000, dtype, 128).cuda()
    for fmt in ("fp8", "int8"):
        for block in (128, 100):
            (q0, s0), (q1, s1) = both(lambda: compress(xc, fmt, block, torch.Generator("cuda").manual_seed(1)))
            assert _same(q0, q1) and _same(s0, s1), (fmt, block)
            d0, d1 = both(lambda: decompress(q0, s0, dtype, block))
            assert _same(d0, d1)


_COMPILE = r'''
from leanact.ops.lossy import kernels as LK
from leanact.ops.triton import common as K
for kind, ptr in ((0, "*fp32"), (1, "*i16")):
    build(LK._fewbit_fwd_kernel, {"x_ptr": ptr, "y_ptr": ptr, "tab_ptr": ptr, "packed_ptr": "*u8",
          "borders_ptr": "*fp32", "labels_ptr": "*u8", "n": "i32", "per": "i32"},
          {"NB": 19, "BITS": 4, "KIND": kind, "WITH_Y": kind == 1, "BLOCK": 1024}, **K.UNFUSED)
build(LK._fewbit_bwd_kernel, {"packed_ptr": "*u8", "levels_ptr": "*fp32", "dy_ptr": "*bf16", "out_ptr": "*bf16",
      "n": "i32", "per": "i32"}, {"BITS": 3, "BLOCK": 1024}, **K.UNFUSED)
for int8, q in ((True, "*i8"), (False, "*u8")):
    build(LK._quantize_kernel, {"x_ptr": "*bf16", "q_ptr": q, "scale_ptr": "*fp32", "u_ptr": "*fp32", "n": "i32",
          "nblocks": "i32", "block": "i32", "qmax": "fp32"}, {"INT8": int8, "R": 32, "BP": 128}, **K.UNFUSED)
    build(LK._dequantize_kernel, {"q_ptr": q, "scale_ptr": "*fp32", "out_ptr": "*fp16", "n": "i32", "block": "i32"},
          {"FP8": not int8, "BLOCK": 1024}, **K.UNFUSED)
'''


@pytest.mark.slow
def test_kernels_compile_for_a_gpu_without_one():
    """The compiler (not the interpreter) accepts the kernels: compiled for sm_90 (PTX and cubin,
    Triton's bundled ptxas), in a fresh process without TRITON_INTERPRET. No GPU needed."""
    compile_for_sm90(_COMPILE)
