"""The gated MLP's Triton kernels (leanact/ops/gated_mlp/kernels.py) on CPU under Triton's interpreter.

Interpreter setup as in test_triton_kernels.py: ``TRITON_INTERPRET=1`` is set here when Triton is
not yet imported and there is no CUDA device; it also runs in process when an earlier test module
set it the same way; otherwise :func:`test_in_subprocess` runs this file in a fresh
interpreter-mode process.

Two references. (1) The kernels' own sequence -- torch's float32 formulas, FMAs where nvcc
contracts, erf correctly rounded, exp / tanh step by step as leanact.ops.triton.math32 computes
them -- spelled out with torch ops on the CPU (float64 where a single rounding is needed): bitwise.
(2) The PyTorch path (torch's CPU kernels, whose exp / erf are vectorized approximations): within
the bound of the module doc of gated_kernels (48 u |g| in act(g), 48 u (1 + |g|) |dy| in
dy act'(g), u = 2^-24, plus one ulp of the storage dtype per rounding that can land on the other
side of a boundary).
"""
import math
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

from leanact.memory import SavedTensorMeter  # noqa: E402
from leanact.ops.gated_mlp import GATED_ACTIVATIONS, act_grad, gated_act, gated_down  # noqa: E402
from leanact.ops.gated_mlp import launchers as gated  # noqa: E402
from leanact.ops.triton import dispatch  # noqa: E402

from _triton_run import compile_for_sm90, interpreter_marks, run_interpreted  # noqa: E402
from _ulp import rare_flips, within  # noqa: E402
from _ulp import ulp as _ulp  # noqa: E402

pytestmark, interp = interpreter_marks(INTERPRETED)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BOUND = 48  # gated_kernels.BOUND: act(g) within BOUND u |g| of torch's (exp / tanh up to 6 ulps apart)
U32 = 2.0 ** -24


@pytest.fixture(autouse=True)
def GK(monkeypatch):
    """The gated kernels' module, the kernels switched on (whatever the caller's LEANACT_TRITON)."""
    monkeypatch.setenv("LEANACT_TRITON", "1")
    from leanact.ops.gated_mlp import kernels as gated_kernels

    return gated_kernels


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (signs of zeros included), NaNs equal to NaNs."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool((((a == b) & (a.signbit() == b.signbit())) | (a.isnan() & b.isnan())).all())


def _inputs(dtype, rows=4, n=333, seed=0):
    """g (scales 1..12, both tails, specials in the first row), u, dh."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(rows, n, generator=gen, dtype=torch.float64) * torch.tensor([1.0, 3.0, 6.0, 12.0]).repeat(
        rows // 4 + 1)[:rows, None]
    specials = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-30, -1e-30, 1e-3, -1e-3, 30.0, -30.0, 200.0,
                -200.0, -88.0, -104.0, 2.0 ** -10, -(2.0 ** -10), 0.3]
    g[0, : len(specials)] = torch.tensor(specials, dtype=torch.float64)
    u = torch.randn(rows, n, generator=gen, dtype=torch.float64)
    dh = torch.randn(rows, n, generator=gen, dtype=torch.float64)
    return g.to(dtype), u.to(dtype), dh.to(dtype)


# -- (1) the kernels' own sequence, spelled out with torch ops ---------------------------------------

_C = {k: torch.tensor(v, dtype=torch.float32) for k, v in (  # torch's constants, as float32
    ("alpha", math.sqrt(0.5)), ("beta_erf", 2 / math.sqrt(math.pi) * math.sqrt(0.5) * 0.5),
    ("beta_tanh", math.sqrt(2.0) * 2 / math.sqrt(math.pi) * 0.5), ("kappa", 0.044715))}
_C["kappa3"] = 3 * _C["kappa"]


def _fma(a, b, c):
    """float32 fma (the float64 product is exact; the sum rounds twice only on a float32 tie, ~2^-29)."""
    return (a.double() * b.double() + c.double()).float()


_M = {k: torch.tensor(v, dtype=torch.float32) for k, v in (  # leanact.ops.triton.math32's constants
    ("l2e", 1 / math.log(2.0)), ("ln2_hi", 0.693145751953125), ("ln2_lo", math.log(2.0) - 0.693145751953125))}
_P = [torch.tensor(1 / math.factorial(n), dtype=torch.float32) for n in range(8)]


def _reduce(hi):
    """math32._reduce (lo = 0): (k, r), hi = k ln 2 + r."""
    hi = hi.clamp(-160.0, 89.0)
    k = torch.floor(hi * _M["l2e"] + 0.5)
    r = _fma(k, -_M["ln2_hi"], hi)
    return k, _fma(k, -_M["ln2_lo"], r) + 0.0


def _expm1_poly(r):
    p = _fma(r, _P[7], _P[6])
    for n in (5, 4, 3, 2):
        p = _fma(p, r, _P[n])
    return _fma(r * r, p, r)


def _two_pow(k):
    ki = k.to(torch.int32)
    k1 = ki >> 1
    return ((k1 + 127) << 23).view(torch.float32), ((ki - k1 + 127) << 23).view(torch.float32)


def _exp32(x):
    """math32.exp step by step."""
    k, r = _reduce(x)
    s1, s2 = _two_pow(k)
    return (_expm1_poly(r) + 1.0) * s1 * s2


def _tanh32(x):
    """math32.tanh step by step."""
    k, r = _reduce(-2.0 * x.abs())
    s1, s2 = _two_pow(k)
    s = s1 * s2
    m = _fma(s, _expm1_poly(r), s - 1.0)
    t = -m / (m + 2.0)
    return torch.where(x == 0, x, torch.where(x < 0, -t, t))


def _ref_act(kind, x):
    if kind == "silu":
        return x / (1.0 + _exp32(-x))
    if kind == "gelu":
        return x * 0.5 * (1.0 + torch.erf((x * _C["alpha"]).double()).float())
    inner = _fma(_C["kappa"], x * x * x, x) * _C["beta_tanh"]
    return 0.5 * x * (1.0 + _tanh32(inner))


def _ref_act_grad(kind, dy, x):
    if kind == "silu":
        s = 1.0 / (1.0 + _exp32(-x))
        return dy * s * _fma(x, 1.0 - s, torch.ones_like(x))
    if kind == "gelu":
        cdf = 0.5 * (1.0 + torch.erf((x * _C["alpha"]).double()).float())
        pdf = _exp32(x * -0.5 * x) * _C["beta_erf"]
        return dy * _fma(x, pdf, cdf)
    x_sq = x * x
    t = _tanh32(_fma(_C["kappa"], x_sq * x, x) * _C["beta_tanh"])
    left, left_d = 0.5 * x, 0.5 * (1.0 + t)
    return dy * _fma(left * _fma(-t, t, torch.ones_like(t)), _fma(_C["kappa3"], x_sq, torch.ones_like(x))
                     * _C["beta_tanh"], left_d)


def _ref(kind, g, u, dh):
    """(h, dg, du) by the kernels' sequence: a = round(act(g)), h = round(a u), dg = round(round(dh u) act'(g) ...)."""
    dt = g.dtype
    a = _ref_act(kind, g.float()).to(dt)
    h = (a.float() * u.float()).to(dt)
    t = (dh.float() * u.float()).to(dt)
    return h, _ref_act_grad(kind, t.float(), g.float()).to(dt), (dh.float() * a.float()).to(dt)


@interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", GATED_ACTIVATIONS)
def test_kernels_follow_their_sequence_bitwise(GK, kind, dtype):
    """Odd sizes (333 columns; blocks of 16 and of 512 leave ragged ends), every output."""
    g, u, dh = _inputs(dtype)
    h0, dg0, du0 = _ref(kind, g, u, dh)
    for block in (16, None):
        h = torch.empty_like(g)
        GK.glu_forward(g, u, h, kind, block=block)
        dg, du, hh = torch.empty_like(g), torch.empty_like(g), torch.empty_like(g)
        GK.glu_backward(g, u, dh, dg, du, hh, kind, block=block)
        assert _same(h, h0) and _same(hh, h0) and _same(du, du0) and _same(dg, dg0)
    dg = torch.empty_like(g)  # only dg: the other outputs are not written
    GK.glu_backward(g, u, dh, dg, None, None, kind)
    assert _same(dg, dg0)


# -- (2) against the PyTorch path ---------------------------------------------------------------------

_within = within  # |x - ref| <= bound + one ulp at the larger of the two (tests/_ulp.py)


def _torch_path(kind, g, u, dh):
    a = gated_act(kind, g)
    return a * u, act_grad(kind, dh * u, g), dh * a, a


@interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", GATED_ACTIVATIONS)
def test_dispatch_matches_the_pytorch_path_within_the_bound(GK, kind, dtype):
    g, u, dh = _inputs(dtype, seed=1)
    h0, dg0, du0, a0 = _torch_path(kind, g, u, dh)
    with dispatch.use_kernels(GK):
        h = gated.glu_forward(g, u, kind)
        dg, du, hh = gated.glu_backward(g, u, dh, kind, True, True, True)
    finite = g.isfinite()
    ga, ua, dha = (t.double().abs() for t in (g, u, dh))
    act_err = BOUND * U32 * ga + _ulp(a0, dtype)  # act(g) rounded to the storage dtype
    t = (dh.float() * u.float()).to(dtype).double().abs()
    assert _same(h, hh)
    assert _within(h[finite], h0[finite], (act_err * ua)[finite])
    assert _within(du[finite], du0[finite], (act_err * dha)[finite])
    assert _within(dg[finite], dg0[finite], (BOUND * U32 * (1 + ga) * t)[finite])
    # where the float32 distance is a small part of an ulp, few elements differ (tests/_ulp.py)
    apart = BOUND * U32 * ga
    for x, x0, d, at in ((h, h0, apart, a0), (du, du0, apart, a0), (dg, dg0, BOUND * U32 * (1 + ga) * t, dg0)):
        differing, allowed = rare_flips(x[finite], x0[finite], d[finite], at[finite])
        assert differing <= allowed, (differing, allowed)
    nan = g.isnan()  # (at ±inf torch's CPU erf approximation gives NaN, CUDA's erff ±1: test 1 covers them)
    assert all(x[nan].isnan().all() and x0[nan].isnan().all() for x, x0 in ((h, h0), (dg, dg0), (du, du0)))


@interp
def test_the_bound_catches_a_wrong_formula(GK):
    """SiLU's kernel against GELU's PyTorch path: far outside the bound (the test can fail)."""
    g, u, dh = _inputs(torch.float32, seed=2)
    with dispatch.use_kernels(GK):
        h = gated.glu_forward(g, u, "silu")
    ok = g.isfinite()
    assert not _within(h[ok], (gated_act("gelu", g) * u)[ok], (BOUND * U32 * g.double().abs() * u.double().abs())[ok])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", GATED_ACTIVATIONS)
def test_rare_flips_catch_a_wrong_rounding_order(kind, dtype):
    """act(g) * u rounded once (not act(g) first, as torch does) stays within the elementwise bound,
    but flips far more 16-bit values where the bound is a small part of an ulp than it allows: the
    CUDA test (test_triton_gated_cuda.py) can fail on it. Torch's own CPU path against the sequence
    with correctly rounded exp / erf / tanh (the kernels' under the interpreter) passes."""
    g, u, dh = _inputs(dtype, rows=64, n=1000, seed=4)
    ok = g.isfinite()
    g, u = g[ok], u[ok]
    a0 = gated_act(kind, g)
    h0 = a0 * u
    apart = BOUND * U32 * g.double().abs()
    bound = (apart + _ulp(a0, dtype)) * u.double().abs()
    once = (gated_act(kind, g.float()) * u.float()).to(dtype)
    assert _within(once, h0, bound)
    differing, allowed = rare_flips(once, h0, apart, a0)
    assert differing > 10 * allowed
    h = (_ref_act(kind, g.float()).to(dtype).float() * u.float()).to(dtype)
    assert _within(h, h0, bound)
    differing, allowed = rare_flips(h, h0, apart, a0)
    assert differing <= allowed


# -- the op: layouts, what is kept, fallbacks ---------------------------------------------------------


def _op_inputs(dtype, fused, rows=5, inter=37, hidden=6, seed=3):
    gen = torch.Generator().manual_seed(seed)
    if fused:
        gu = (torch.randn(rows, 2 * inter, generator=gen) * 2).to(dtype).requires_grad_()
        leaves = [gu]
    else:
        a = (torch.randn(rows, inter, generator=gen) * 2).to(dtype).requires_grad_()
        b = torch.randn(rows, inter, generator=gen).to(dtype).requires_grad_()
        leaves = [a, b]
    w = (torch.randn(hidden, inter, generator=gen) / inter ** 0.5).to(dtype).requires_grad_()
    bias = torch.randn(hidden, generator=gen).to(dtype).requires_grad_()
    return leaves, w, bias


def _split(leaves):
    return leaves[0].chunk(2, -1) if len(leaves) == 1 else leaves


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kind", GATED_ACTIVATIONS)
def test_op_runs_the_kernels(GK, kind, fused, dtype):
    """gated_down with the kernels: y = linear(kernel h), g/u gradients the backward kernel's dg, du,
    weight gradient from the kernel's h; the same
    tensors kept as on the PyTorch path."""
    leaves, w, bias = _op_inputs(dtype, fused)
    dy = torch.randn(5, 6, generator=torch.Generator().manual_seed(4)).to(dtype)
    saved = []
    for kernels in (None, GK):
        ls = [t.detach().clone().requires_grad_() for t in leaves]
        ww, bb = w.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
        ctx = dispatch.use_kernels(kernels) if kernels is not None else torch.enable_grad()
        with ctx:
            g, u = _split(ls)
            y = gated_down(g, u, ww, bb, kind)
            saved.append([(t.dtype, t.shape, t.stride(), t.storage_offset(), t.untyped_storage().nbytes())
                          for t in y.grad_fn.saved_tensors])
            y.backward(dy)
    assert saved[0] == saved[1]  # g, u (views of one storage when fused) and the weight, on both paths
    g, u = (t.detach() for t in _split(leaves))
    with dispatch.use_kernels(GK):
        h = gated.glu_forward(g, u, kind)
        dg, du, hb = gated.glu_backward(g, u, dy.mm(w.detach()), kind, True, True, True)
    assert _same(y.detach(), torch.nn.functional.linear(h, w.detach(), bias.detach()))
    grads = [torch.cat([dg, du], -1)] if fused else [dg, du]
    assert all(_same(t.grad, r) for t, r in zip(ls, grads))
    assert _same(hb, h) and _same(ww.grad, dy.t().mm(hb))


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_producer_runs_the_kernels_and_its_recipe_rebuilds_the_same(GK, dtype):
    """leanact.recompute.producers.swiglu (the LoRA and nn.fused path): forward and backward are the
    gated kernel's; under a RecipeTransform the next Linear's copy of the output is rebuilt through
    the kernel too, so the weight gradient uses exactly the forward's output."""
    from leanact.recompute import producers
    from leanact.recompute.recipes import RecipeTransform, counters, reset_counters

    gen = torch.Generator().manual_seed(5)
    ab = torch.randn(3, 2 * 37, generator=gen).to(dtype)
    w = (torch.randn(6, 37, generator=gen) * 0.2).to(dtype)
    dy = torch.randn(3, 6, generator=gen).to(dtype)
    a_, b_ = ab.chunk(2, -1)
    with dispatch.use_kernels(GK):
        h = gated.glu_forward(a_, b_, "silu")
        da, db, _ = gated.glu_backward(a_, b_, dy.mm(w), "silu", True, True, False)
        x, ww = ab.clone().requires_grad_(), w.clone().requires_grad_()
        reset_counters()
        with RecipeTransform():
            y = producers.swiglu(x) @ ww.t()
        assert counters().get("claimed", 0) == 1  # the matmul's copy of the output: a recipe
        y.backward(dy)
    assert _same(y.detach(), h @ w.t())
    assert _same(x.grad, torch.cat([da, db], -1))
    assert _same(ww.grad, (dy.t() @ h))


@interp
def test_fused_halves_are_read_in_place(GK):
    """The halves of a fused projection (row stride 2n) are not copied; other layouts are."""
    gu = torch.randn(3, 4, 2 * 37).to(torch.bfloat16)
    g, u = gu.chunk(2, -1)
    assert gated._rows(g).data_ptr() == g.data_ptr() and gated._rows(u).stride() == (74, 1)
    t = gu.transpose(0, 1)[..., :37]  # leading dims that do not merge
    assert gated._rows(t).is_contiguous() and gated._rows(t).data_ptr() != t.data_ptr()
    with dispatch.use_kernels(GK):
        assert _same(gated.glu_forward(g, u, "silu"), gated.glu_forward(g.contiguous(), u.contiguous(), "silu"))
        assert _same(gated.glu_forward(t, t, "gelu"), gated.glu_forward(t.contiguous(), t.contiguous(), "gelu"))


@interp
@pytest.mark.parametrize("fused", [False, True])
def test_kept_bytes_unchanged(GK, fused):
    lin = torch.nn.Linear(37, 6).to(torch.bfloat16)
    src = torch.randn(5, 74).to(torch.bfloat16).requires_grad_()
    totals = []
    for kernels in (None, GK):
        meter = SavedTensorMeter(lin, exclude=[src])
        with dispatch.use_kernels(kernels) if kernels is not None else torch.enable_grad(), meter:
            g, u = (src * 1).chunk(2, -1) if fused else (src[:, :37] * 1, src[:, 37:] * 1)
            y = gated_down(g, u, lin.weight, lin.bias, "gelu_tanh")
        meter.attribute(y)
        totals.append((meter.total_bytes, dict(meter.by_op())))
    assert totals[0] == totals[1] and totals[0][1] == {"GatedDownFunction": 2 * 5 * 37 * 2}


@interp
def test_double_backward_takes_the_pytorch_path(GK):
    leaves, w, bias = _op_inputs(torch.float32, False)
    g, u = leaves
    with dispatch.use_kernels(GK):
        y = gated_down(g, u, w, bias, "silu")
        (dg,) = torch.autograd.grad(y.sum(), g, create_graph=True)
        (ddg,) = torch.autograd.grad(dg.sum(), g)
    y0 = gated_down(g, u, w, bias, "silu")
    (dg0,) = torch.autograd.grad(y0.sum(), g, create_graph=True)
    (ddg0,) = torch.autograd.grad(dg0.sum(), g)
    assert _same(dg, dg0) and _same(ddg, ddg0)


def test_declines_float64_mixed_dtypes_and_when_off(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Boom:
        def __getattr__(self, name):
            raise AssertionError(f"kernel {name} ran")

    g, u = torch.randn(3, 8), torch.randn(3, 8)
    assert gated.glu_forward(g, u, "silu") is None  # CPU tensors: the PyTorch path
    with dispatch.use_kernels(Boom()):
        assert gated.glu_forward(g.double(), u.double(), "silu") is None  # float64
        assert gated.glu_forward(g, u.bfloat16(), "silu") is None  # mixed dtypes
        assert gated.glu_backward(g, u, torch.randn(3, 8).half(), "gelu", True, True, False) is None
        assert gated.glu_forward(g, u, "relu") is None
        gd, ud, w = (t.double().requires_grad_() for t in (g, u, torch.randn(4, 8)))
        y = gated_down(gd, ud, w, None, "gelu")  # float64 end to end on the PyTorch path
        y.sum().backward()
        assert torch.autograd.gradcheck(lambda a, b: gated_down(a, b, w.detach(), None, "gelu_tanh"), (gd, ud))
        with FakeTensorMode():
            assert gated.glu_forward(torch.empty(2, 8), torch.empty(2, 8), "silu") is None  # fake, not estimating
        monkeypatch.setenv("LEANACT_TRITON", "0")
        assert gated.glu_forward(g, u, "silu") is None


def test_shapes_only_allocates_the_outputs():
    """leanact.estimate's fake tensors: outputs of the PyTorch path's shapes and dtypes, nothing launched."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), dispatch.use_kernels(dispatch.SHAPES_ONLY, fake=True):
        gu = torch.empty(2, 3, 2 * 40, dtype=torch.bfloat16)
        g, u = gu.chunk(2, -1)
        h = gated.glu_forward(g, u, "gelu")
        dg, du, hb = gated.glu_backward(g, u, torch.empty(2, 3, 40, dtype=torch.bfloat16), "silu", True, False, True)
    assert h.shape == dg.shape == hb.shape == (2, 3, 40) and du is None
    assert h.dtype == dg.dtype == torch.bfloat16


def test_a_failing_kernel_warns_once_and_takes_the_pytorch_path():
    calls = []

    class Broken:
        def glu_forward(self, *args):
            calls.append("forward")
            raise RuntimeError("no such instruction")

        def glu_backward(self, *args):
            calls.append("backward")

    g, u = torch.randn(3, 8), torch.randn(3, 8)
    with dispatch.use_kernels(Broken(), strict=False):
        with pytest.warns(RuntimeWarning, match="gated_mlp uses its PyTorch path"):
            assert gated.glu_forward(g, u, "silu") is None
        assert gated.glu_backward(g, u, g, "silu", True, True, True) is None  # the op is marked broken
    assert calls == ["forward"]
    with dispatch.use_kernels(Broken()), pytest.raises(RuntimeError, match="no such instruction"):
        gated.glu_forward(g, u, "silu")  # strict: raises


@pytest.mark.slow
def test_in_subprocess():
    """When this process cannot run the interpreter (see the module doc), run the file in one that can."""
    if INTERPRETED:
        pytest.skip("the interpreter runs in this process")
    run_interpreted(__file__)


_COMPILE = r'''
from leanact.ops.gated_mlp import kernels as GK

for ty in ("bf16", "fp16", "fp32"):
    for kind in (0, 1, 2):
        build(GK._glu_fwd_kernel, {"g_ptr": "*" + ty, "u_ptr": "*" + ty, "h_ptr": "*" + ty, "n": "i32", "sg": "i64",
              "su": "i64"}, {"KIND": kind, "BLOCK": 1024}, **GK.UNFUSED)
        build(GK._glu_bwd_kernel, {"g_ptr": "*" + ty, "u_ptr": "*" + ty, "dh_ptr": "*" + ty, "dg_ptr": "*" + ty,
              "du_ptr": "*" + ty, "h_ptr": "*" + ty, "n": "i32", "sg": "i64", "su": "i64"},
              {"KIND": kind, "NEED_DG": True, "NEED_DU": True, "NEED_H": True, "BLOCK": 1024}, **GK.UNFUSED)
'''


@pytest.mark.slow
def test_kernels_compile_for_a_gpu_without_one():
    """The compiler (not the interpreter) accepts the kernels, every dtype and activation: compiled
    for sm_90 (PTX and cubin, Triton's bundled ptxas) in a fresh process. No GPU needed."""
    compile_for_sm90(_COMPILE)
