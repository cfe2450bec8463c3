"""leanact GELU: exact gradient rebuilt from the output and one bit, checked against its bound.

The reference is the exact derivative (float64 formulas free of cancellation, mpmath for float64
storage). Torch's own float64 gradient agrees with it except in the far left tail, where torch
cancels even in float64 (``1 + erf(x/sqrt 2)``), and torch's float32 gradient is off by many ulps
already for x < -3 (see ``test_torch_float32_gradient_cancels_in_the_left_tail``).

The bound (docs/gelu_bound.md): the stored y is the true output rounded, so the true output lies
in the interval of reals that round to y, and no rebuild from y can do better than return a
derivative between the extremes of GELU' over that interval. Each element is checked against its
own interval, computed in float64 (mpmath for float64), plus a few ulps of the gradient's dtype.
"""
import importlib
import math

import mpmath as mp
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leanact.memory import saved_bytes
from leanact.nn.activation import GELU
from leanact.ops.bitpack import pack_bits, packed_nbytes, unpack_bits
from leanact.ops.gelu import GeluFunction, gelu, gelu_grad_from_output, gelu_minimum

# the package's files (leanact.ops.gelu re-exports only the public names)
buffers, function, erfcx32, minimum, rebuild32, rebuild64, slope32, tables = (
    importlib.import_module(f"leanact.ops.gelu.{name}")
    for name in ("buffers", "function", "erfcx32", "minimum", "rebuild32", "rebuild64", "slope32", "tables"))

MODES = ["none", "tanh"]
K1, A = 2.0 * math.sqrt(2.0 / math.pi), 0.044715


# -- references, written independently of the implementation -----------------------------------

def _sig(v):
    e = torch.exp(-v.abs())
    return torch.where(v < 0, e / (1 + e), 1 / (1 + e))


def f64(x, mode):
    """GELU in float64 without cancellation (accurate to ~x^2 1e-16 relative)."""
    if mode == "none":
        return x * 0.5 * torch.special.erfc(-x * math.sqrt(0.5))
    return x * _sig(K1 * (x + A * x**3))


def g64(x, mode):
    """GELU' in float64 without cancellation away from x* (absolute error ~1e-16 there)."""
    if mode == "none":
        return 0.5 * torch.special.erfc(-x * math.sqrt(0.5)) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    v = K1 * (x + A * x**3)
    s, sm = _sig(v), _sig(-v)
    return s + x * s * sm * K1 * (1 + 3 * A * x * x)


def inv64(t, right, mode, near=None, iters=64):
    """x on the branch with f64(x) = t, by bisection (float64). ``near``: a point the root is
    within 0.3 (+1%) of, to start from a short bracket (checked; else the whole branch)."""
    xs = gelu_minimum(mode)[0]
    lo = torch.where(right, torch.full_like(t, xs), torch.full_like(t, -45.0))
    hi = torch.where(right, t.clamp_min(0) + 3.0, torch.full_like(t, xs))
    if near is not None:
        r = 0.3 + 0.01 * near.abs()
        a, b = torch.maximum(lo, near - r), torch.minimum(hi, near + r)
        fa, fb = f64(a, mode), f64(b, mode)
        ok = torch.where(right, (fa <= t) & (fb >= t), (fa >= t) & (fb <= t))
        lo, hi = torch.where(ok, a, lo), torch.where(ok, b, hi)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        go_right = torch.where(right, f64(mid, mode) < t, f64(mid, mode) > t)
        lo, hi = torch.where(go_right, mid, lo), torch.where(go_right, hi, mid)
    return 0.5 * (lo + hi)


def ulp(v, dtype):
    """Spacing of ``dtype`` numbers at |v| (float64 tensor)."""
    a = v.abs().to(dtype)
    return torch.nextafter(a, torch.full_like(a, math.inf)).double() - a.double()


def rounding_interval(y):
    """The reals that round to y: (lower, upper) midpoints to the neighbours (float64)."""
    lo = torch.nextafter(y, torch.full_like(y, -math.inf)).double()
    hi = torch.nextafter(y, torch.full_like(y, math.inf)).double()
    yd = y.double()
    hi = torch.where(torch.isinf(hi) & torch.isfinite(yd), 2 * yd - lo, hi)  # y = largest float
    lo = torch.where(torch.isinf(lo) & torch.isfinite(yd), 2 * yd - hi, lo)
    return (yd + lo) / 2, (yd + hi) / 2


def grad_interval(y, right, mode, x=None):
    """[min, max] of the exact GELU' over the outputs that round to y (16-bit and float32 y);
    ``x``: the inputs, only to shorten the bisection brackets."""
    ys = gelu_minimum(mode)[1]
    gs = []
    for t in rounding_interval(y):
        g = g64(inv64(t, right, mode, near=None if x is None else x.double()), mode)
        g = torch.where(t <= ys, 0.0, g)  # below the minimum: clamped to y*, where GELU' = 0
        g = torch.where(~right & (t >= 0), 0.0, g)  # left branch, y -> 0-: x -> -inf, GELU' -> 0
        gs.append(g)
    return torch.minimum(*gs), torch.maximum(*gs)


def leanact_grad(x, mode):
    x = x.detach().clone().requires_grad_()
    y = gelu(x, mode)
    y.backward(torch.ones_like(y))
    return y.detach(), x.grad


def covering_inputs(mode, dtype):
    """16-bit: every finite value. float32: [-1e4, 1e4] log-spaced both signs, dense around the
    minimum, and Tempo's bad regions: next to the minimum, x < -2.5 (down to where y underflows),
    1.12 < x < 3, y > 3."""
    if dtype in (torch.float16, torch.bfloat16):
        x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
        return x[torch.isfinite(x)]
    xs = gelu_minimum(mode)[0]
    d = torch.float64
    parts = [
        -torch.logspace(-6, 4, 3000, dtype=d), torch.logspace(-6, 4, 3000, dtype=d),
        xs + torch.linspace(-0.5, 0.5, 2001, dtype=d), xs + torch.linspace(-2e-3, 2e-3, 2001, dtype=d),
        xs + torch.logspace(-9, -3, 200, dtype=d), xs - torch.logspace(-9, -3, 200, dtype=d),
        torch.linspace(-15.0, -2.5, 3001, dtype=d), torch.linspace(1.12, 3.0, 1001, dtype=d),
        torch.linspace(3.0, 60.0, 500, dtype=d),
    ]
    return torch.cat(parts).to(dtype).unique()


# -- constants ----------------------------------------------------------------------------------

def test_minimum_constants():
    xs, ys = gelu_minimum("none")
    assert abs(xs - -0.7517915) < 1e-7 and abs(ys - -0.1699712) < 1e-7
    with mp.workdps(40):
        assert abs(mp.ncdf(xs) + xs * mp.npdf(xs)) < 1e-16  # GELU'(x*) = 0
        assert abs(mp.mpf(xs) * mp.ncdf(xs) - ys) < 1e-16
    xt, yt = gelu_minimum("tanh")
    assert abs(xt - -0.7524614) < 1e-7 and abs(yt - -0.1700408) < 1e-7
    for mode in MODES:  # GELU''(x*) = c2; Taylor coefficients reproduce GELU next to x*
        c = minimum._CONSTS[mode]
        x = torch.tensor([c.xs], dtype=torch.float64)
        d = torch.linspace(-0.7, 0.7, 15, dtype=torch.float64)
        assert torch.allclose(rebuild64._taylor(d.clone(), c.taylor, 2) + c.ys, f64(c.xs + d, mode), rtol=0, atol=1e-15)
        assert torch.allclose(rebuild64._taylor(d.clone(), c.dtaylor, 1), g64(c.xs + d, mode), rtol=0, atol=1e-15)
        h = 1e-4
        c2 = (g64(x + h, mode) - g64(x - h, mode)) / (2 * h)
        assert abs(c2.item() - c.c2) < 1e-7


# -- gradcheck and comparisons with torch -------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_gradcheck_float64(mode):
    # Random inputs kept 1e-3 away from x*. Within ~1e-8 of x* the stored y no longer tells how far
    # x is from x*, so the rebuilt derivative is only within W = 3.5e-9 of GELU' (the bound), and a
    # central difference (eps 1e-6) straddling x* averages both branches while the bit names one.
    # Both are far below gradcheck's atol (1e-5): caution, not need. That neighbourhood is checked
    # against the bound itself in test_float64_bound.
    torch.manual_seed(0)
    x = torch.randn(64, dtype=torch.float64) * 3
    xs = gelu_minimum(mode)[0]
    x = torch.where((x - xs).abs() < 1e-3, x + 0.01, x).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: gelu(t, mode), (x,))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_random_shapes_and_strides(mode, dtype):
    torch.manual_seed(1)
    atol = {torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]  # the bound next to x* (8e-5, 2e-2)
    for shape in [(7,), (5, 33), (2, 3, 4, 65)]:
        # above -5.5 torch's float64 kernel is exact to float32 precision (below it cancels too)
        base = (torch.randn(shape, dtype=torch.float64) * 2.5).clamp_min(-5.5).to(dtype)
        base = torch.where(base == 0, torch.ones_like(base), base)  # never zeros
        views = [base, base.transpose(0, -1), base[..., ::2]]
        for v in views:
            x = v.detach().requires_grad_()  # non-contiguous leaf views (transposed / strided)
            y = gelu(x, mode)
            go = torch.randn(y.shape, dtype=torch.float64).to(dtype)
            y.backward(go)
            xt = v.detach().requires_grad_()
            yt = F.gelu(xt, approximate=mode)
            yt.backward(go)
            x64 = v.detach().double().requires_grad_()
            y64 = F.gelu(x64, approximate=mode)
            y64.backward(go.double())
            assert y.shape == yt.shape and x.grad.shape == x.shape
            # forward: torch's float64 result rounded once (16-bit: within an ulp, the float32
            # working value may round differently at a tie); close to torch's own low-precision kernel
            tol = 0 if dtype == torch.float32 else 2 ** -7
            torch.testing.assert_close(y.double(), y64.detach().to(dtype).double(), rtol=tol, atol=0)
            torch.testing.assert_close(y, yt.detach(), rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)
            # gradient: torch's float64 gradient, up to the bound next to the minimum (times |dy|)
            tol = 2 * torch.finfo(dtype).eps * x64.grad.abs() + atol * go.double().abs()
            assert ((x.grad.double() - x64.grad).abs() <= tol).all()
            assert ((x.grad.double() - xt.grad.double()).abs() <= tol + 1e-6).all()  # torch's own kernel


def test_torch_float32_gradient_cancels_in_the_left_tail():
    """Why the reference is float64: torch's float32 GELU' computes 0.5(1+erf(x/sqrt2)) + x phi(x);
    for x < -3 the first term cancels and the result is off by far more than an ulp."""
    x = torch.tensor([-4.0, -5.0, -6.0, -8.0])
    xt = x.clone().requires_grad_()
    F.gelu(xt).backward(torch.ones(4))
    truth = g64(x.double(), "none")
    torch_err = ((xt.grad.double() - truth).abs() / ulp(truth, torch.float32))
    assert torch_err.max() > 100  # many ulps (torch forward at -5: -1.19e-6 vs true -1.433e-6)
    y, g = leanact_grad(x, "none")
    # within an ulp: half from y's own rounding (relative errors of y pass 1:1 to GELU' in the
    # tail), half from rounding the gradient
    assert ((g.double() - truth).abs() / ulp(truth, torch.float32)).max() <= 1.0
    assert torch.equal(y, f64(x.double(), "none").float())


# -- the bound ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gradient_within_output_rounding_bound(mode, dtype):
    x = covering_inputs(mode, dtype)
    y, g = leanact_grad(x, mode)
    xs, ys = gelu_minimum(mode)
    right = x.double() > xs
    gmin, gmax = grad_interval(y, right, mode, x)
    u = ulp(torch.maximum(gmin.abs(), gmax.abs()), dtype)
    g = g.double()
    # 1. the rebuild returns a derivative the stored output allows, plus its final rounding
    excess = torch.maximum(gmin - g, g - gmax).clamp_min(0) / u
    assert excess.max() <= 0.5 + 1e-9, f"{excess.max()} ulps outside the bound at x={x[excess.argmax()]}"
    # 2. the forward rounds the true output once (float32: from float64, always correct; 16-bit:
    #    from float32, as specified, which misses by one ulp for a few in 10^4 values: double
    #    rounding at ties, erfc's own float32 error), so the truth at x lies in the same interval
    yt = f64(x.double(), mode)
    lo, hi = rounding_interval(y)
    ok = (yt >= lo) & (yt <= hi)
    if dtype == torch.float32:
        assert ok.all()
    else:
        assert (~ok).sum() <= 10 and torch.equal(y[~ok], yt[~ok].to(dtype).nextafter(y[~ok]))
    gt = g64(x.double(), mode)
    assert ((gt >= gmin - 1e-3 * u) & (gt <= gmax + 1e-3 * u))[ok].all()
    # 3. hence against the reference (torch's gradient in float64, exact, rounded): the bound's width
    #    plus one ulp; away from the minimum that is an ulp of the gradient
    ref = gt.to(dtype).double()
    assert ((g - ref).abs() <= (gmax - gmin) + u)[ok].all()
    far = ok & (x.double() > xs + 0.5)  # right branch: insensitive to y's rounding: within an ulp
    assert ((g - ref).abs()[far] <= u[far]).all()
    # 4. next to the minimum the width is sqrt(2 c ulp(y*)/2) (derived in docs/gelu_bound.md) and
    #    the rebuild reaches it: its error is at most the width
    c2 = minimum._CONSTS[mode].c2
    width = math.sqrt(2 * c2 * ulp(torch.tensor([ys]), dtype).item() / 2)
    near = (x.double() - xs).abs() < 4 * width / c2  # where |GELU'| is within a few widths of 0
    assert near.sum() >= 3
    assert (gmax - gmin)[near].max() <= 1.01 * math.sqrt(2) * width
    assert (g - gt).abs()[near].max() <= 1.01 * width + u[near].max()


def _mp_funcs(mode):
    if mode == "none":
        return (lambda x: x * mp.ncdf(x)), (lambda x: mp.ncdf(x) + x * mp.npdf(x))
    k, a = 2 * mp.sqrt(2 / mp.pi), mp.mpf("0.044715")

    def f(x):
        return x / (1 + mp.exp(-k * (x + a * x**3)))

    def g(x):
        s = 1 / (1 + mp.exp(-k * (x + a * x**3)))
        return s + x * s * (1 - s) * k * (1 + 3 * a * x * x)
    return f, g


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_float64_bound(mode):
    """float64 storage: interval endpoints and truth in mpmath (30 digits)."""
    xs_f, ys_f = gelu_minimum(mode)
    d = torch.float64
    x = torch.cat([
        -torch.logspace(-6, math.log10(36.0), 120, dtype=d), torch.logspace(-6, 4, 100, dtype=d),
        xs_f + torch.linspace(-0.8, 0.8, 81, dtype=d), xs_f + torch.logspace(-9, -2, 20, dtype=d),
        xs_f - torch.logspace(-9, -2, 20, dtype=d), torch.linspace(-20.0, -2.5, 40, dtype=d),
        torch.linspace(1.12, 3.0, 20, dtype=d), torch.linspace(3.0, 30.0, 10, dtype=d),
    ])
    y, g = leanact_grad(x, mode)
    right = x > xs_f
    lo, hi = rounding_interval(y)  # float64 midpoints are not float64 numbers: use mpmath below
    ylo = torch.nextafter(y, torch.full_like(y, -math.inf))
    yhi = torch.nextafter(y, torch.full_like(y, math.inf))
    guess_lo, guess_hi = inv64(lo, right, mode, x), inv64(hi, right, mode, x)
    with mp.workdps(30):
        f, gp = _mp_funcs(mode)  # constants at 30 digits: |v| err(K1) would be ~40 ulps at x=-20
        xs = mp.findroot(gp, mp.mpf(-0.75))
        ys, c2 = f(xs), mp.diff(f, xs, 2)

        def grad_at_output(t, r, x0):
            if t <= ys or (not r and t >= 0):
                return mp.mpf(0)
            x = mp.mpf(x0)
            if abs(x - xs) < 1e-2:  # square-root start next to the minimum
                x = xs + (1 if r else -1) * mp.sqrt(2 * (t - ys) / c2)
            for _ in range(8):
                gx = gp(x)
                if gx == 0:  # at x* itself (t within 1e-30 of y*)
                    break
                x = x - (f(x) - t) / gx
                x = max(x, xs) if r else min(x, xs)
            return gp(x)

        worst, worst_truth = 0.0, 0.0
        for i in range(x.numel()):
            yi, r = mp.mpf(float(y[i])), bool(right[i])
            ga = grad_at_output((yi + mp.mpf(float(ylo[i]))) / 2, r, float(guess_lo[i]))
            gb = grad_at_output((yi + mp.mpf(float(yhi[i]))) / 2, r, float(guess_hi[i]))
            gi, u = mp.mpf(float(g[i])), float(ulp(torch.tensor([float(max(abs(ga), abs(gb)))], dtype=d), d)[0])
            worst = max(worst, float(max(min(ga, gb) - gi, gi - max(ga, gb), 0)) / u)
            if abs(float(x[i]) - xs_f) > 0.1:  # truth at x (the float64 forward is within ~2 ulps)
                gt = gp(mp.mpf(float(x[i])))
                worst_truth = max(worst_truth, float(max(abs(gi - gt) - abs(ga - gb), 0)) / u)
    assert worst <= 4.0, worst  # measured: 2.7 (erf), 1.9 (tanh) ulps beyond the interval
    assert worst_truth <= 4.0, worst_truth  # measured: the same


# -- special values, underflow ------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_special_values_like_torch(mode, dtype):
    vals = [math.inf, -math.inf, math.nan, 0.0, -0.0, 1e4, -1e4]
    x = torch.tensor(vals, dtype=dtype)
    y, g = leanact_grad(x, mode)
    x64 = torch.tensor(vals, dtype=torch.float64, requires_grad=True)
    y64 = F.gelu(x64, approximate=mode)  # torch's float64 kernel (its fp32 erf kernel maps +inf to nan)
    y64.backward(torch.ones_like(y64))
    torch.testing.assert_close(y, y64.detach().to(dtype), equal_nan=True, rtol=0, atol=0)
    num = ~torch.isnan(y)  # -0 stays -0 (a nan's sign bit means nothing)
    assert torch.equal(torch.signbit(y)[num], torch.signbit(y64.detach().to(dtype))[num])
    torch.testing.assert_close(g, x64.grad.to(dtype), equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_underflow_tail(mode):
    # y underflows to -0 on the left branch: the exact derivative is then between 0 and
    # GELU'(x(-ulp/2)) (|.| < |x| * half the smallest subnormal for erf); leanact returns 0, as torch.
    x = torch.tensor([-40.0, -1e3, -30.0], requires_grad=True)
    y = gelu(x, mode)
    y.backward(torch.ones_like(y))
    assert (y == 0).all() and torch.signbit(y).all() and (x.grad == 0).all()
    # y subnormal: the gradient is still what the output allows (covered densely by the bound test)
    xs = torch.linspace(-14.4 if mode == "none" else -10.9, -13.0 if mode == "none" else -10.0, 200)
    y, g = leanact_grad(xs, mode)
    gmin, gmax = grad_interval(y, torch.zeros_like(y, dtype=torch.bool), mode, xs)
    u = ulp(torch.maximum(gmin.abs(), gmax.abs()), torch.float32)
    assert ((g.double() >= gmin - u / 2) & (g.double() <= gmax + u / 2)).all()


# -- memory -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bytes_alone(dtype):
    x = torch.randn(37, 29, dtype=dtype, requires_grad=True)  # 1073 elements: packing pads
    n = x.numel()
    assert saved_bytes(lambda: GELU()(x)) == n * x.element_size() + packed_nbytes(n)
    assert packed_nbytes(n) == 135
    assert saved_bytes(lambda: nn.GELU()(x)) == n * x.element_size()


@pytest.mark.parametrize("mode", MODES)
def test_saved_bytes_in_linear_gelu_linear(mode):
    torch.manual_seed(0)
    x = torch.randn(64, 16)

    def model(act):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 48), act, nn.Linear(48, 8))

    ref, lean = model(nn.GELU(mode)), model(GELU(mode))
    kept_ref = saved_bytes(lambda: ref(x), ref)
    kept_lean = saved_bytes(lambda: lean(x), lean)
    hidden = 64 * 48
    # the second Linear keeps GELU's output either way; leanact's GELU keeps that same storage
    assert kept_ref == 4 * (64 * 16 + hidden + hidden)
    assert kept_lean == kept_ref - 4 * hidden + packed_nbytes(hidden)
    torch.testing.assert_close(lean(x), ref(x), rtol=1e-6, atol=1e-6)


def test_no_grad_paths_keep_nothing():
    x = torch.randn(100, requires_grad=True)
    with torch.no_grad():
        assert saved_bytes(lambda: gelu(x)) == 0
        y0 = gelu(x)
    assert y0.grad_fn is None
    xd = x.detach()
    assert saved_bytes(lambda: gelu(xd)) == 0
    assert torch.equal(gelu(xd), y0) and torch.equal(gelu(x).detach(), y0)


def test_inplace_modification_of_output_raises():
    x = torch.randn(10, requires_grad=True)
    y = gelu(x)
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_double_backward_raises_clearly():
    x = torch.randn(10, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(gelu(x).sum(), x, create_graph=True)
    (g_plain,) = torch.autograd.grad(gelu(x).sum(), x)
    assert torch.equal(g.detach(), g_plain)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        g.sum().backward()


# -- plumbing -----------------------------------------------------------------------------------

def test_slices_agree_and_bits_pack(monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(3 * 1000 + 5) * 3
    y_ref, g_ref = leanact_grad(x, "none")
    monkeypatch.setattr(buffers, "CHUNK", 64)  # many slices, last one ragged
    y, g = leanact_grad(x, "none")
    assert torch.equal(y, y_ref) and torch.equal(g, g_ref)
    y2, bits = function._forward(x, "none", with_bits=True)
    right = x > gelu_minimum()[0]
    assert bits.numel() == packed_nbytes(x.numel())
    assert torch.equal(gelu_grad_from_output(y2, right), g_ref)


def test_invalid_approximate():
    with pytest.raises(ValueError):
        gelu(torch.randn(3), "fast")


def test_module_is_a_drop_in():
    for mode in MODES:
        ref, lean = nn.GELU(mode), GELU(mode)
        assert lean.approximate == ref.approximate == mode
        assert repr(lean) == repr(ref) and lean.extra_repr() == ref.extra_repr()
        assert lean.state_dict() == {} and dict(lean.named_parameters()) == {}
        lean.load_state_dict(ref.state_dict())
        x = torch.randn(4, 50)
        torch.testing.assert_close(lean(x), ref(x), rtol=1e-6, atol=1e-6)
    assert repr(GELU()) == "GELU(approximate='none')"
    y = GELU()(torch.randn(3, requires_grad=True))
    assert y.grad_fn.name() == GeluFunction.__name__ + "Backward"


# -- fast paths: lookup tables (16-bit storage), table guess + one float64 step (float32) -------

def _scatter_eval(fn, n, seed):
    """Evaluate ``fn(perm)`` on a random permutation of 0..n-1 and put the results back in order,
    so a result could not come out right merely because of where its element sat in the tensor."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    vals = fn(perm)
    out = torch.empty_like(vals)
    out[perm] = vals
    return out


def _same_bits(a, b):
    """Bitwise equal, except that any NaN matches any NaN (payloads are not part of the contract)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_tables_are_the_exact_path_bitwise(mode, dtype):
    """16-bit storage looks up forward and backward; the tables hold what the exact working-precision
    path computes, so the results are bitwise those of that path, for every input: all 65536
    patterns (infinities, NaNs, signed zeros, subnormals) forward, and every output pattern on both
    branches backward, with random incoming gradients."""
    n = 1 << 16
    p = torch.arange(n, dtype=torch.int32).to(torch.int16).view(dtype)
    y, bits = function._forward(p, mode, with_bits=True)
    ref_y = _scatter_eval(lambda i: rebuild64._forward_w(p[i].float(), mode, False).to(dtype), n, 1)
    assert _same_bits(y, ref_y)
    # the branch bit: x > x*, decided as the float32 comparison of the forward (NaN: no derivative)
    xs = gelu_minimum(mode)[0]
    num = ~torch.isnan(p)
    assert torch.equal(unpack_bits(bits, n)[num], (p.float() > torch.tensor(xs, dtype=torch.float32))[num])
    # backward: (y pattern, branch) -> rebuilt derivative (float32) times dy, rounded once
    yy = p.repeat(2)
    rr = torch.arange(2 * n) >= n
    torch.manual_seed(2)
    dy = (torch.randn(2 * n, dtype=torch.float64) * 4).to(dtype)
    out = function._backward(yy, pack_bits(rr), dy, mode)
    ref = _scatter_eval(lambda i: (rebuild64._grad_from_output(yy[i], rr[i], mode) * dy[i]).to(dtype), 2 * n, 3)
    assert _same_bits(out, ref)
    assert _same_bits(gelu_grad_from_output(yy, rr, mode), rebuild64._grad_from_output(yy, rr, mode).to(dtype))
    # built once per (dtype, mode, device) and cached
    assert tables._table("g16", str(dtype)[6:], mode, "cpu") is tables._table("g16", str(dtype)[6:], mode, "cpu")


def _float32_samples(mode, n=1 << 16):
    """x over every region: both tails (down to where y underflows), next to x*, around 0, large."""
    xs = gelu_minimum(mode)[0]
    torch.manual_seed(4)
    d = torch.float64
    parts = [
        torch.randn(n, dtype=d) * 3, -torch.logspace(-8, math.log10(15.0), n, dtype=d),
        torch.logspace(-40, 1, n // 4, dtype=d), xs + torch.randn(n // 4, dtype=d) * 1e-3,
        xs + (torch.rand(n // 4, dtype=d) - 0.5) * 1e-6, torch.logspace(1, 38, n // 8, dtype=d),
    ]
    return torch.cat(parts).float()


@pytest.mark.parametrize("mode", MODES)
def test_float32_fast_path_agrees_with_the_exact_path(mode):
    """float32 storage: initial guess from a table (error ~1e-7), one float64 step whose
    second-order coefficient comes from the table (to ~1e-3 of a term ~1e-14), against the previous
    rebuild (analytic guess, float32 step, float64 Chebyshev step). Their float64 derivatives differ
    by far less than an ulp of float32, so the float32 results are equal but where the product
    lies at a rounding tie within that difference: then they differ by one ulp. That happens
    mostly next to x*, where both are well inside the (wide) bound; away from it the ties checked
    (x = 0.0878 tanh, x = 0.2612 erf, against mpmath) are rounded correctly by the new path and
    not by the previous one, whose float64 value was off by ~1e-12 there."""
    x = _float32_samples(mode)
    y, bits = function._forward(x, mode, with_bits=True)
    right = unpack_bits(bits, x.numel())
    ref64 = rebuild64._grad_from_output(y, right, mode)
    torch.manual_seed(5)
    for dy in (torch.ones_like(y), torch.randn(y.shape)):
        out = function._backward(y, bits, dy, mode)
        ref = (ref64 * dy).float()
        fin = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(out), fin)
        diff = out[fin] != ref[fin]
        assert diff.float().mean() < 5e-4
        far = (x[fin].double() - gelu_minimum(mode)[0]).abs() > 0.01
        assert diff[far].sum() <= 3
        gap = (out[fin].double() - ref[fin].double()).abs()
        assert (gap <= ulp(ref[fin].double(), torch.float32) * 1.0001).all()


@pytest.mark.parametrize("mode", MODES)
def test_float32_table_guess(mode):
    """The table guess is within ~3e-7 of the solution relative to |x - x*| (capped at 1), plus its
    float32 evaluation (a + b t: up to ~1.5 ulp of x), which dominates next to the minimum, where
    |x - x*| is small: the float64 step
    converges cubically from there (next to x* to a relative ~((6e-8/|x - x*|)**3, far inside the
    bound there). Above y = 32 the guess is x = 32 (f is linear there)."""
    x = _float32_samples(mode, 1 << 15)
    x = x[x < 30]
    y, bits = function._forward(x, mode, with_bits=True)
    keep = (y.double() > gelu_minimum(mode)[1]) & ((y < 0) | (x.double() > gelu_minimum(mode)[0]))
    x, y = x[keep], y[keep]
    n = y.numel()
    right = x.double() > gelu_minimum(mode)[0]
    ws = buffers._Workspace(n, "cpu", rebuild32._WS32)
    ab, h = rebuild32._guess_tables(mode)
    rebuild32._guess32(y, right.to(torch.uint8), torch.ones(n), ws, ab, h, rebuild32._C32[mode])
    xt = inv64(y.double(), right, mode, near=x.double())
    xs = gelu_minimum(mode)[0]
    err = (ws.x - xt).abs() / (3e-7 * (xt - xs).abs().clamp_max(1.0) + 2 * ulp(xt, torch.float32))
    assert err.max() < 1.0, (err.max(), x[err.argmax()])


def _slope_eval(y, right, mode, table):
    """The CUDA kernel's float32 backward (:mod:`leanact.ops.gelu.kernels32`) in PyTorch: the
    float32 path's key, its cell's cubic; the cubic evaluated from the float32 coefficients in
    float64 (so what remains is the table's own error)."""
    n = y.numel()
    ws = buffers._Workspace(n, "cpu", rebuild32._WS32)
    ab, h = rebuild32._guess_tables(mode)
    rebuild32._guess32(y, right.to(torch.uint8), torch.ones(n), ws, ab, h, rebuild32._C32[mode])
    kb = ws.key.view(torch.int32)
    c = table[(kb >> slope32.SHIFT) & (slope32.NCELL - 1)].double()
    s = (kb & ((1 << slope32.SHIFT) - 1)).double() * 2.0 ** -slope32.SHIFT
    return c[:, 0] + s * (c[:, 1] + s * (c[:, 2] + s * c[:, 3]))


@pytest.mark.parametrize("mode", MODES)
def test_float32_slope_table(mode):
    """The CUDA float32 backward's table (:mod:`leanact.ops.gelu.slope32`): each cell's cubic, read
    with the float32 key, is GELU' of the stored output within B(y) plus 1.5 ulps (1.17 seen: the
    float32 key's roundings, up to two in the left tail, and the float32 coefficients'); next to
    the minimum inside B(y). The check can fail: the same table
    with one coefficient dropped (a quadratic's cells) is hundreds of ulps off."""
    x = _float32_samples(mode, 1 << 14)
    x = x[x < 30]
    y, bits = function._forward(x, mode, with_bits=True)
    keep = (y.double() > gelu_minimum(mode)[1]) & ((y < 0) | (x.double() > gelu_minimum(mode)[0]))
    x, y = x[keep], y[keep]
    right = x.double() > gelu_minimum(mode)[0]
    lo, hi = grad_interval(y, right, mode, x=x)
    table = slope32.slope_table(mode)
    assert table.shape == (slope32.NCELL, 4) and table.dtype == torch.float32

    def beyond(g):
        return torch.clamp(torch.maximum(lo - g, g - hi), min=0.0) / ulp(g, torch.float32)

    g = _slope_eval(y, right, mode, table)
    assert beyond(g).max() <= 1.5, (beyond(g).max(), x[beyond(g).argmax()])
    near = (x.double() - gelu_minimum(mode)[0]).abs() < 0.05
    assert (g - hi)[near].max() <= 0 and (lo - g)[near].max() <= 0
    cut = table.clone()
    cut[:, 3] = 0
    assert beyond(_slope_eval(y, right, mode, cut)).max() > 100


def _mills_eval(a, table):
    """The CUDA float32 erf forward's ``Phi(-a) exp(a^2/2)`` from the Mills table (float32 ``a``):
    its cell's cubic in float64 from the float32 coefficients."""
    ab = a.view(torch.int32)
    c = table[ab >> erfcx32.SHIFT].double()
    s = (ab & ((1 << erfcx32.SHIFT) - 1)).double() * 2.0 ** -erfcx32.SHIFT
    return c[:, 0] + s * (c[:, 1] + s * (c[:, 2] + s * c[:, 3]))


def test_float32_mills_table():
    """The CUDA float32 erf forward's table (:mod:`leanact.ops.gelu.erfcx32`): each cell's cubic is
    ``erfcx(a/sqrt 2)/2`` within 1.25 ulps (float32, relative) for ``0 <= a <= 20``, float32
    subnormals included (mpmath: 30 digits): the cubic itself is within 0.09 ulps (float64
    coefficients), the float32 coefficients' rounding adds half an ulp of their binade, a whole one
    of the truth's where a cell straddles a power of two (1.02 seen). The check can fail: one
    coefficient dropped is far off."""
    torch.manual_seed(5)
    a = torch.cat([torch.rand(4000, dtype=torch.float64) * 20, torch.logspace(-45, 1.3, 2000, dtype=torch.float64),
                   torch.tensor([0.0, 1e-45, 2.0 ** -126, 1.0, 20.0], dtype=torch.float64)]).float()
    mp.mp.dps = 30
    truth = torch.tensor([float(mp.erfc(mp.mpf(float(v)) / mp.sqrt(2)) * mp.exp(mp.mpf(float(v)) ** 2 / 2) / 2)
                          for v in a], dtype=torch.float64)
    table = erfcx32.mills_table()
    assert table.shape == (erfcx32.NCELL, 4) and table.dtype == torch.float32

    def ulps(r):
        return ((r - truth).abs() / ulp(truth, torch.float32)).max()

    assert ulps(_mills_eval(a, table)) <= 1.25
    cut = table.clone()
    cut[:, 3] = 0
    assert ulps(_mills_eval(a, cut)) > 10


def test_cuda_float32_tables_build_for_real_under_fake_tensors(monkeypatch):
    """The CUDA float32 kernels' tables are per-process CPU constants: first asked for under
    ``FakeTensorMode`` (``leanact.estimate`` on a fresh process), they are built from real tensors
    (no fake one cached for later real use), equal to a build outside it."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    ref = slope32.slope_table("tanh"), erfcx32.mills_table()
    monkeypatch.setattr(slope32, "_SLOPE_CPU", {})
    monkeypatch.setattr(erfcx32, "_MILLS_CPU", None)
    with FakeTensorMode():
        built = slope32.slope_table("tanh"), erfcx32.mills_table()
    for b, r in zip(built, ref):
        assert not isinstance(b, FakeTensor) and torch.equal(b, r)
    assert slope32.slope_table("tanh") is built[0] and erfcx32.mills_table() is built[1]


def test_bit_packing_layout():
    """The packing and unpacking used on the fast paths give bitpack's layout."""
    spread = tables._table("spread", "uint8", "none", "cpu")
    every_byte = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool().reshape(-1)
    torch.manual_seed(6)
    for b in [every_byte] + [torch.rand(n) > 0.5 for n in (1, 7, 8, 9, 64, 1001)]:
        n = b.numel()
        r = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8)
        r[:n] = b
        packed = buffers._pack(r, n)
        assert torch.equal(packed, pack_bits(b))
        ws = buffers._Workspace(n, "cpu", {})
        assert torch.equal(buffers._unpack_into(packed, spread, ws)[:n].bool(), b)


# -- torch.compile ------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compile_aot_eager_fullgraph(mode, dtype):
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = (torch.randn(4, 33, dtype=torch.float64) * 3).to(dtype)
    go = torch.randn(4, 33).to(dtype)
    fn = torch.compile(lambda t: gelu(t, mode), fullgraph=True, backend="aot_eager")
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    fn(xc).backward(go)
    gelu(xe, mode).backward(go)
    assert torch.equal(xc.grad, xe.grad)


@pytest.mark.slow
def test_compile_several_gelus_in_one_graph():
    """Tables enter the graph as constants, one per (table, dtype, mode): several GELUs of mixed
    dtypes and modes trace together."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(6, 40) * 3

    def f(t):
        a = gelu(t, "none") + gelu(t * 0.5, "none")
        b = gelu(t.bfloat16(), "tanh").float() + gelu(t.half(), "none").float()
        return a * b + gelu(t.bfloat16(), "none").float()

    fn = torch.compile(f, fullgraph=True, backend="aot_eager")
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    fn(xc).sum().backward()
    f(xe).sum().backward()
    assert torch.equal(xc.grad, xe.grad)


@pytest.mark.slow
def test_compile_inductor():
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(8, 65) * 3
    go = torch.randn(8, 65)
    fn = torch.compile(lambda t: gelu(t), fullgraph=True, backend="inductor")
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    yc = fn(xc)
    yc.backward(go)
    ye = gelu(xe)
    ye.backward(go)
    torch.testing.assert_close(yc, ye, rtol=0, atol=0)
    torch.testing.assert_close(xc.grad, xe.grad, rtol=2e-7, atol=1e-12)
