"""LayerNorm / RMSNorm that keep only the output and rstd: exactness, memory, fallback, compile.

Tolerances. fp32: compared with torch's fp32 result, rtol 1e-5 and atol 1e-5·max|ref| (observed
< 1e-6). 16-bit: torch's own 16-bit gradients are not a good reference (its CPU bf16 dγ/dβ are off
by up to ~7 unit roundoffs from accumulating in bf16), so both are compared with torch's fp64
result on the same rounded inputs, as max|err| / max|ref|; the bound is 4u (u = 2^-8 bf16,
2^-11 fp16): the output/gradient rounding (u) plus y's rounding carried into x̂ (u·(|x̂| + ≤9),
see leanact.ops.norms.layer_norm) averaged over a row; observed ≤ 1.7u. Forward outputs are bitwise
equal to torch's in every dtype.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leanact.memory import saved_bytes
from leanact.nn.normalization import LayerNorm, RMSNorm
from leanact.ops.norms import verdict as ln_mod
from leanact.ops.norms.layer_norm import layer_norm
from leanact.ops.norms.rms_norm import rms_norm

U = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def gamma(shape, dtype=torch.float32, seed=0):
    """Random non-trivial γ ~ 1 + 0.5·randn, both signs, |γ| ≥ 0.4 (so |β|/|γ| ≤ 7.5 < 8)."""
    g = 1 + 0.5 * torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return torch.where(g.abs() < 0.4, torch.full_like(g, 0.4).copysign(g), g).to(dtype)


def beta(shape, dtype=torch.float32, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).clamp(-3, 3).to(dtype)


def run(fn, x, params, dy, **kw):
    """Output and gradients (dx, then one per parameter) of fn(x, *params, **kw)."""
    x = x.detach().clone().requires_grad_()
    params = [None if p is None else p.detach().clone().requires_grad_() for p in params]
    y = fn(x, *params, **kw)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad for p in params if p is not None]


def ln(x, w, b, **kw):
    return layer_norm(x, x.shape[-2:] if x.dim() == 4 else x.shape[-1:], w, b, **kw)


def ln_ref(x, w, b):
    return F.layer_norm(x, x.shape[-2:] if x.dim() == 4 else x.shape[-1:], w, b)


def rms(x, w, **kw):
    return rms_norm(x, x.shape[-2:] if x.dim() == 4 else x.shape[-1:], w, **kw)


def rms_ref(x, w):
    return F.rms_norm(x, x.shape[-2:] if x.dim() == 4 else x.shape[-1:], w)


def rel_err(a, ref):
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-300)).item()


def ln_rstd_size(dtype):
    return torch.empty((), dtype=dtype).element_size()  # torch's CPU LayerNorm kernel: rstd in x's dtype


def rms_rstd_size(dtype):
    return 8 if dtype == torch.float64 else 4  # _fused_rms_norm: fp32 for 16-bit, fp64 for fp64


# --- gradcheck (float64) ------------------------------------------------------------------------

@pytest.mark.parametrize("affine", ["wb", "w", "b", "none"])
@pytest.mark.parametrize("from_output", [True, False])
def test_gradcheck_layer_norm(affine, from_output):
    x = torch.randn(3, 2, 4, 5, dtype=torch.float64, requires_grad=True)
    w = gamma((4, 5), torch.float64).requires_grad_() if "w" in affine else None
    b = beta((4, 5), torch.float64).requires_grad_() if "b" in affine else None
    inputs = tuple(t for t in (x, w, b) if t is not None)

    def f(*ts):
        it = iter(ts[1:])
        return layer_norm(ts[0], (4, 5), next(it) if w is not None else None, next(it) if b is not None else None,
                          from_output=from_output)

    assert torch.autograd.gradcheck(f, inputs)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("from_output", [True, False])
@pytest.mark.parametrize("ns", [(5,), (4, 5)])
def test_gradcheck_rms_norm(affine, from_output, ns):
    x = torch.randn(3, 2, 4, 5, dtype=torch.float64, requires_grad=True)
    w = gamma(ns, torch.float64).requires_grad_() if affine else None
    inputs = (x, w) if affine else (x,)
    assert torch.autograd.gradcheck(lambda *t: rms_norm(t[0], ns, t[1] if affine else None, from_output=from_output),
                                    inputs)


# --- against torch, all dtypes, shapes, strides ------------------------------------------------

SHAPES = {
    "2d": lambda dt: torch.randn(64, 96, dtype=dt),
    "3d": lambda dt: torch.randn(4, 16, 256, dtype=dt),
    "multi-dim normalized": lambda dt: torch.randn(3, 5, 4, 6, dtype=dt),
    "transposed": lambda dt: torch.randn(96, 64, dtype=dt).t(),
    "strided": lambda dt: torch.randn(2, 64, 192, dtype=dt)[:, :, ::2],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_matches_torch(op, shape, dtype):
    torch.manual_seed(0)
    x = SHAPES[shape](dtype)
    ns = x.shape[-2:] if x.dim() == 4 else x.shape[-1:]
    dy = torch.randn(x.shape[::-1], dtype=dtype).permute(*reversed(range(x.dim())))  # non-contiguous dy
    params = [gamma(ns, dtype)] + ([beta(ns, dtype)] if op == "layer_norm" else [])
    fn, ref = (ln, ln_ref) if op == "layer_norm" else (rms, rms_ref)
    ours = run(fn, x, params, dy)
    theirs = run(ref, x, params, dy)
    assert torch.equal(ours[0], theirs[0])  # forward is torch's kernel
    if dtype in (torch.float32, torch.float64):
        rtol = 1e-5 if dtype == torch.float32 else 1e-12
        for a, b in zip(ours[1:], theirs[1:]):
            torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * b.abs().max().item())
    else:
        exact = run(ref, x.double(), [p.double() for p in params], dy.double())
        for a, b in zip(ours, exact):
            assert torch.isfinite(a).all()
            assert rel_err(a, b) <= 4 * U[dtype]
    # Not the fallback: only y and one rstd per row are kept (x is not excluded: it is not kept).
    rows = x.numel() // ns.numel()
    rstd = ln_rstd_size(dtype) if op == "layer_norm" else rms_rstd_size(dtype)
    ps = [p.requires_grad_() for p in params]
    assert saved_bytes(lambda: fn(x.requires_grad_(), *ps), exclude=ps) == x.numel() * x.element_size() + rows * rstd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_rms_composite_forward_matches_torch(dtype):
    from leanact.ops.norms.rms_norm import _composite, _fused

    x, w = torch.randn(3, 5, 4, 6, dtype=dtype), gamma((4, 6), dtype)
    for weight in (w, None):
        y, rstd = _composite(x, (4, 6), weight, None)
        y2, rstd2 = _fused(x, (4, 6), weight, None)
        assert torch.equal(y, F.rms_norm(x, (4, 6), weight)) and torch.equal(y, y2)
        torch.testing.assert_close(rstd, rstd2)


# --- small γ: exact fallback, no NaN/inf --------------------------------------------------------

def _ln_case(kind, dtype):
    w, b = gamma(64), beta(64)
    if kind == "zero channels":
        w[::7] = 0
    elif kind == "all zero":
        w.zero_()
    elif kind in ("1e-30", "1e-8"):
        w = w.sign() * float(kind)
    elif kind == "small vs beta":
        w = w * 1e-3  # |β/γ| ~ 1e3: exact in fp64 arithmetic, but y's rounding would be amplified
    elif kind == "ratio just above":
        w, b = torch.ones(64), torch.full((64,), 8.5)
    return w.to(dtype), b.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("kind", ["zero channels", "all zero", "1e-30", "1e-8", "small vs beta", "ratio just above"])
def test_layer_norm_small_gamma_falls_back(kind, dtype):
    torch.manual_seed(0)
    x, dy = torch.randn(32, 64, dtype=dtype), torch.randn(32, 64, dtype=dtype)
    w, b = _ln_case(kind, dtype)
    ours, theirs = run(ln, x, [w, b], dy), run(ln_ref, x, [w, b], dy)
    for a, t in zip(ours, theirs):
        assert torch.isfinite(a).all()
        assert torch.equal(a, t)  # the fallback is torch's own layer_norm
    xx, ww, bb = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    rows_stats = 2 * 32 * ln_rstd_size(dtype)  # mean and rstd
    assert saved_bytes(lambda: ln(xx, ww, bb), exclude=[ww, bb]) == x.numel() * x.element_size() + rows_stats


@pytest.mark.parametrize("dtype,value,fallback", [
    (torch.float32, 0.0, True),
    (torch.float32, 1e-40, True),   # subnormal γ: y is subnormal, y/γ inexact
    (torch.float32, 1e-30, False),  # y = x̂·1e-30 is a normal float: y/γ is exact, no fallback needed
    (torch.float16, 1e-8, True),    # underflows to 0 in fp16
    (torch.float64, 1e-30, False),
])
def test_rms_norm_small_gamma(dtype, value, fallback):
    torch.manual_seed(0)
    x, dy = torch.randn(32, 64, dtype=dtype), torch.randn(32, 64, dtype=dtype)
    w = gamma(64)
    w = (w.sign() * value).to(dtype)
    w[::5] = gamma(64)[::5].to(dtype)  # a mix of normal and tiny channels
    ours = run(rms, x, [w], dy)
    exact = run(rms_ref, x.double(), [w.double()], dy.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-12 if dtype == torch.float64 else 4 * U[dtype]
    for a, e in zip(ours, exact):
        assert torch.isfinite(a).all()
        assert rel_err(a, e) <= tol
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    # Both paths keep one tensor of x's size (y, or x itself): exclude x to tell them apart.
    kept = 32 * rms_rstd_size(dtype) + (0 if fallback else x.numel() * x.element_size())
    assert saved_bytes(lambda: rms(xx, ww), exclude=[ww, xx]) == kept
    assert ln_mod.from_output_ok(w, None, 64, dtype, float("inf")) is (not fallback)


def test_decision_cached_per_version(monkeypatch):
    calls = []
    check = ln_mod._check
    monkeypatch.setattr(ln_mod, "_check", lambda *a: calls.append(1) or check(*a))
    m = LayerNorm(64)
    x = torch.randn(8, 64, requires_grad=True)
    for _ in range(3):
        m(x).sum().backward()
    assert len(calls) == 1
    before = saved_bytes(lambda: m(x), m, exclude=[x])
    with torch.no_grad():
        m.weight[3] = 0  # an in-place update (as an optimizer step) bumps _version
    after = saved_bytes(lambda: m(x), m, exclude=[x])
    assert len(calls) == 2
    assert before == 8 * 64 * 4 + 8 * 4  # y + rstd
    assert after == 2 * 8 * 4  # fallback: x (excluded here) + mean + rstd
    assert torch.isfinite(torch.autograd.grad(m(x).sum(), x)[0]).all()


# --- memory ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_saved_bytes_exact(cls, dtype):
    rows, h = 6 * 32, 128
    x = torch.randn(6, 32, h, dtype=dtype, requires_grad=True)
    norm = cls(h, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(gamma(h))
        if getattr(norm, "bias", None) is not None:
            norm.bias.copy_(beta(h))
    lin = nn.Linear(h, 3 * h, dtype=dtype)
    rstd = rows * (ln_rstd_size(dtype) if cls is LayerNorm else rms_rstd_size(dtype))
    y_bytes = x.numel() * x.element_size()
    assert saved_bytes(lambda: norm(x), norm) == y_bytes + rstd
    # Norm → Linear: the Linear keeps y, the same storage; the norm adds only rstd.
    assert saved_bytes(lambda: lin(norm(x)), [norm, lin]) == y_bytes + rstd
    # Fallback: the input is kept as well (and mean, for LayerNorm).
    norm.from_output = False
    extra = y_bytes + (rstd if cls is LayerNorm else 0)
    assert saved_bytes(lambda: lin(norm(x)), [norm, lin]) == y_bytes + rstd + extra
    with torch.no_grad():
        assert saved_bytes(lambda: norm(x), norm) == 0


# --- misuse is loud -------------------------------------------------------------------------------

CASES = [
    ("layer_norm", True), ("layer_norm", False), ("rms_norm", True), ("rms_norm", False),
]


def _make(op):
    x0 = torch.randn(8, 32, requires_grad=True)
    params = [gamma(32).requires_grad_()] + ([beta(32).requires_grad_()] if op == "layer_norm" else [])
    return x0, params, (ln if op == "layer_norm" else rms)


@pytest.mark.parametrize("op,from_output", CASES)
def test_inplace_after_forward_raises(op, from_output):
    x0, params, fn = _make(op)
    x = x0 * 1
    y = fn(x, *params, from_output=from_output)
    (y if from_output else x).mul_(2)  # what each path keeps: y, or the input
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    y = fn(x0 * 1, *params, from_output=from_output)
    with torch.no_grad():
        params[0].add_(1)  # an optimizer step between forward and backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_double_backward_raises(op):
    x0, params, fn = _make(op)
    (dx,) = torch.autograd.grad(fn(x0, *params, from_output=True).pow(2).sum(), x0, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dx.sum().backward()


# --- torch.compile --------------------------------------------------------------------------------

@pytest.mark.parametrize("op,from_output", CASES)
def test_compile_fullgraph_aot_eager(op, from_output):
    torch._dynamo.reset()
    x0, params, fn = _make(op)

    def loss(x, *p):
        return (fn(x, *p, from_output=from_output) * torch.arange(32.0)).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(x0, *params), [x0, *params])
    want = torch.autograd.grad(loss(x0, *params), [x0, *params])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_compile_auto_decision_traces_in_one_graph():
    """The automatic decision is taken when traced (no graph break) and gives eager's gradients."""
    torch._dynamo.reset()
    m = LayerNorm(32)
    x = torch.randn(8, 32, requires_grad=True)
    got = torch.autograd.grad(torch.compile(m, fullgraph=True, backend="aot_eager")(x).pow(2).sum(), x)[0]
    torch.testing.assert_close(got, torch.autograd.grad(m(x).pow(2).sum(), x)[0])


@pytest.mark.slow
def test_compile_inductor():
    torch._dynamo.reset()
    x0, (w, b), _ = _make("layer_norm")
    rw = gamma(32).requires_grad_()

    def loss(x, w, b, rw):
        h = layer_norm(x, (32,), w, b, from_output=True)
        return (rms_norm(h, (32,), rw, from_output=True) * torch.arange(32.0)).sum()

    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(x0, w, b, rw), [x0, w, b, rw])
    want = torch.autograd.grad(loss(x0, w, b, rw), [x0, w, b, rw])
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


# --- modules ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [{}, {"bias": False}, {"elementwise_affine": False}, {"eps": 1e-6}])
def test_layer_norm_module_drop_in(kwargs):
    ref, ours = nn.LayerNorm((4, 8), **kwargs), LayerNorm((4, 8), **kwargs)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(gamma(p.shape))
    ours.load_state_dict(ref.state_dict())
    _same_module(ref, ours, torch.randn(5, 4, 8))


@pytest.mark.parametrize("kwargs", [{}, {"elementwise_affine": False}, {"eps": 1e-6}])
def test_rms_norm_module_drop_in(kwargs):
    ref, ours = nn.RMSNorm((4, 8), **kwargs), RMSNorm((4, 8), **kwargs)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(gamma(p.shape))
    ours.load_state_dict(ref.state_dict())
    _same_module(ref, ours, torch.randn(5, 4, 8))


def _same_module(ref, ours, x):
    assert isinstance(ours, type(ref))
    assert repr(ours) == repr(ref)
    assert list(ours.state_dict()) == list(ref.state_dict())
    dy = torch.randn_like(x)
    a, b = run(lambda t: ours(t), x, [], dy), run(lambda t: ref(t), x, [], dy)
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
