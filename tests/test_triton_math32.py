"""leanact/ops/triton/math32.py (float32 exp and tanh of the kernels) under Triton's interpreter,
against float64, over the float32 range: within 1.35 ulps (exp) and 3 (tanh) of the true value,
special values as torch's. Compiled, they compute the same bits (correctly rounded operations
only: tests/test_triton_ptx.py), so this measures the GPU's values too.

Interpreter setup as in test_triton_kernels.py.
"""
import pytest
import torch

from _triton_run import interpreter_setup  # noqa: E402

triton, INTERPRETED = interpreter_setup()

from _triton_run import interpreter_marks, run_interpreted  # noqa: E402

pytestmark, interp = interpreter_marks(INTERPRETED)


import triton.language as tl  # noqa: E402

from leanact.ops.triton.math32 import exp as _exp, exp_half_neg_parts as _exp_half_neg_parts  # noqa: E402
from leanact.ops.triton.math32 import exp_parts as _exp_parts, quotient as _quotient, recip12 as _recip12  # noqa: E402
from leanact.ops.triton.math32 import tanh as _tanh  # noqa: E402


@triton.jit
def _kernel(x_ptr, y_ptr, n, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    tl.store(y_ptr + offs, _tanh(x) if TANH else _exp(x), mask=m)


def _run(name: str, x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    _kernel[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), TANH=name == "tanh", BLOCK=4096, enable_fp_fusion=False)
    return y


def _ulps(got: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """|got - truth| in ulps of the float32 value nearest the (float64) truth."""
    t32 = truth.float().abs()
    spacing = (torch.nextafter(t32, torch.tensor(float("inf"))) - t32).double()
    return ((got.double() - truth).abs() / spacing).nan_to_num(0.0)


def _samples(lo: float, hi: float, n: int = 1 << 20) -> torch.Tensor:
    torch.manual_seed(0)
    edge = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-30, -1e-30, 2.0 ** -10, -(2.0 ** -10), 0.34657, -0.34657])
    return torch.cat([torch.empty(n).uniform_(lo, hi), torch.randn(n // 4) * 1e-3, edge]).float()


@interp
def test_exp_within_the_bound():
    x = _samples(-103.0, 88.7)
    got = _run("exp", x)
    truth = torch.exp(x.double())
    # r's rounding (1/4 ulp), the polynomial (1/10), the last fma and the + 1 (1/2 each): 1.35
    assert _ulps(got, truth).max().item() <= 1.35
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 89.0, -110.0, 0.0])
    assert torch.equal(_run("exp", specials).isnan(), specials.isnan())
    assert _run("exp", specials)[1:].tolist() == [float("inf"), 0.0, float("inf"), 0.0, 1.0]


@interp
def test_tanh_within_the_bound():
    x = _samples(-10.0, 10.0)
    got = _run("tanh", x)
    truth = torch.tanh(x.double())
    # expm1 (1.35 ulps, as exp's) grows by the cancellation in 2^k (e^r - 1) + 2^k - 1 (at most
    # 1.3x, k = -1), then the division and the sum (1/2 each, the sum's scaled by 2/(2 + m) <= 1.5)
    assert _ulps(got, truth).max().item() <= 3.0
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 50.0, -50.0])
    y = _run("tanh", specials)
    assert y[0].isnan() and y[1:].tolist() == [1.0, -1.0, 0.0, -0.0, 1.0, -1.0]
    assert y[4].signbit() and not y[3].signbit()


@triton.jit
def _parts_kernel(h_ptr, l_ptr, q_ptr, s_ptr, n, BIAS: tl.constexpr, HALF_NEG: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    h = tl.load(h_ptr + offs, mask=m, other=0.0)
    lo = tl.load(l_ptr + offs, mask=m, other=0.0)
    if HALF_NEG:
        q, s = _exp_half_neg_parts(h, lo, BIAS)
    else:
        q, s = _exp_parts(h, lo, BIAS)
    tl.store(q_ptr + offs, q, mask=m)
    tl.store(s_ptr + offs, s, mask=m)


def _parts(hi: torch.Tensor, lo: torch.Tensor, bias: int, half_neg: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = torch.empty_like(hi), torch.empty_like(hi)
    _parts_kernel[(triton.cdiv(hi.numel(), 4096),)](hi, lo, q, s, hi.numel(), BIAS=bias, HALF_NEG=half_neg,
                                                    BLOCK=4096, enable_fp_fusion=False)
    return q, s


@interp
@pytest.mark.parametrize("bias", [64, 96])
def test_exp_parts(bias):
    """``e^(hi - lo) = q s 2^-bias``: ``q`` in [0.7, 1.42] within 1.35 ulps (r's two roundings, up to
    0.39 ulps of q; h's, times |r| <= 0.35: 0.35; the polynomial's 0.08; the last fma's 1/2), ``s`` a normal
    power of two, over the whole range of ``k`` (``hi log2 e`` in [-126 - bias, 127 - bias]);
    ``exp_half_neg_parts(a, b)`` (``e^(-(a + b)/2)``) the same bits for ``a = -2 hi``, ``b = 2 lo``;
    nan stays nan."""
    torch.manual_seed(1)
    kmin, kmax = -126 - bias, 127 - bias
    hi = torch.cat([torch.empty(1 << 20).uniform_((kmin + 0.5) * 0.6931, min(0.0, (kmax - 0.5) * 0.6931)),
                    torch.randn(1 << 16) * 1e-3, torch.tensor([0.0, -0.0, -0.34657, 0.34657, 1e-30])]).float()
    lo = (torch.randn(hi.shape) * 1e-6).float()
    q, s = _parts(hi, lo, bias, False)
    truth = torch.exp(hi.double() - lo.double())
    assert bool(((q >= 0.7) & (q <= 1.42)).all())
    e = torch.frexp(s)[1] - 1  # s = 2^e
    assert torch.equal(s, torch.ldexp(torch.ones_like(s), e)) and bool((s >= 2.0 ** -126).all())
    exact_q = truth / s.double() * 2.0 ** bias  # the q that would make the product exact
    assert _ulps(q, exact_q).max().item() <= 1.35
    keep = hi <= 0  # (its range: a >= 0)
    q2, s2 = _parts(-2 * hi[keep], 2 * lo[keep], bias, True)
    assert torch.equal(q2, q[keep]) and torch.equal(s2, s[keep])
    for half_neg in (False, True):
        qn, _ = _parts(torch.tensor([float("nan")] * 4), torch.zeros(4), bias, half_neg)
        assert bool(qn.isnan().all())


@pytest.mark.slow
def test_in_subprocess():
    """When this process cannot run the interpreter (see the module doc), run the file in one that can."""
    if INTERPRETED:
        pytest.skip("the interpreter runs in this process")
    run_interpreted(__file__)


@triton.jit
def _recip_kernel(d_ptr, r_ptr, n, BLOCK: tl.constexpr, EXACT: tl.constexpr = True):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(r_ptr + offs, _recip12(tl.load(d_ptr + offs, mask=m, other=1.0), EXACT), mask=m)


@interp
def test_recip12_is_the_correctly_rounded_reciprocal_on_all_of_one_to_two():
    """Every float32 d in [1, 2]: the same bits as IEEE division (torch's float32 1/d, correctly
    rounded), which the tanh-form GELU forward computed with div_rn before."""
    d = torch.arange(0x3F800000, 0x40000001, dtype=torch.int32).view(torch.float32)  # 1.0 ... 2.0
    assert d[0].item() == 1.0 and d[-1].item() == 2.0
    r = torch.empty_like(d)
    _recip_kernel[(triton.cdiv(d.numel(), 1 << 16),)](d, r, d.numel(), BLOCK=1 << 16, enable_fp_fusion=False)
    want = torch.full_like(d, 1.0) / d
    bad = (r.view(torch.int32) != want.view(torch.int32)).nonzero()
    assert bad.numel() == 0, (bad.numel(), d[bad[:5, 0]].tolist(), r[bad[:5, 0]].tolist(), want[bad[:5, 0]].tolist())
    # EXACT=False (the tanh-form forward): two Newton steps, relative error 1.1e-8 before the last
    # fma's rounding: within 0.5 + 0.19 ulps of 1/d, every d
    _recip_kernel[(triton.cdiv(d.numel(), 1 << 16),)](d, r, d.numel(), BLOCK=1 << 16, EXACT=False,
                                                      enable_fp_fusion=False)
    truth = 1.0 / d.double()
    assert _ulps(r, truth).max().item() <= 0.69
    for exact in (True, False):
        nan = torch.tensor([float("nan")])
        out = torch.empty_like(nan)
        _recip_kernel[(1,)](nan, out, 1, BLOCK=16, EXACT=exact, enable_fp_fusion=False)
        assert out.isnan().all()


@triton.jit
def _quotient_kernel(a_ptr, b_ptr, q_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(a_ptr + offs, mask=m, other=1.0)
    tl.store(q_ptr + offs, _quotient(a, tl.load(b_ptr + offs, mask=m, other=1.0)), mask=m)


def _quotients(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    q = torch.empty_like(a)
    _quotient_kernel[(triton.cdiv(a.numel(), 1 << 16),)](a, b, q, a.numel(), BLOCK=1 << 16, enable_fp_fusion=False)
    return q


def _bits(n: int, lo_exp: int, hi_exp: int, g: torch.Generator) -> torch.Tensor:
    """float32 with uniformly random mantissas, exponents in [lo_exp, hi_exp] and signs."""
    mant = torch.randint(0, 1 << 23, (n,), generator=g, dtype=torch.int32)
    exp = torch.randint(lo_exp + 127, hi_exp + 128, (n,), generator=g, dtype=torch.int32)
    sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.int32) << 31
    return (sign | (exp << 23) | mant).view(torch.float32)


@interp
def test_quotient_is_the_correctly_rounded_quotient():
    """``quotient(a, b)`` against IEEE division (torch's float32 a / b) wherever its doc promises
    ``div_rn``'s bits: random mantissas over the whole normal range of b (below 2^126) and of the
    quotient, numerators down to the smallest subnormal, divisors with mantissas next to 1 and 2
    (where the reciprocal's rounding changes binade), and the float32 GELU backward's own operands
    (y in (c32, 0) over kr = ((y - c32) - 2^-52) 2^-77)."""
    g = torch.Generator().manual_seed(0)
    n = 1 << 21
    b = _bits(n, -126, 125, g)
    a = torch.cat([_bits(n // 2, -126, 127, g), _bits(n // 2, -149, -100, g)])  # normal, then tiny (and subnormal)
    edge = torch.tensor([1.0, 2.0 - 2.0 ** -23, 1.0 + 2.0 ** -23, 1.5, 3.0, 1.0 - 2.0 ** -24]).repeat(n // 6 + 1)[:n]
    b2 = edge * 2.0 ** torch.randint(-100, 100, (n,), generator=g).float()
    from leanact.ops.gelu import rebuild32
    c32 = rebuild32._C32["none"]
    y = -torch.rand(n, generator=g) ** 8 * -c32  # (c32, 0], dense near 0
    y = torch.cat([y, -torch.rand(n // 4, generator=g) * 1e-38, torch.tensor([-1e-45, -2e-45, c32 / 2])])
    kr = ((y - c32) - 2.0 ** -52) * 2.0 ** -77
    for num, den in ((a, b), (a, b2), (y, kr)):
        want = num / den
        ok = want.isfinite() & ((want.abs() >= 2.0 ** -126) | (want == 0))  # a normal (or zero) quotient
        got = _quotients(num.contiguous(), den.contiguous())
        bad = (got.view(torch.int32) != want.view(torch.int32)) & ok
        assert ok.float().mean() > 0.5
        assert not bad.any(), (bad.sum().item(), num[bad][:3].tolist(), den[bad][:3].tolist(), got[bad][:3].tolist(),
                               want[bad][:3].tolist())
    # outside the promise: nan in, nan out; a divisor that is subnormal or zero gives the right sign
    # (the GELU backward masks such a key by its sign)
    num = torch.tensor([float("nan"), 1.0, float("nan"), -1.0, 0.5, 1.0, -0.17, 0.3])
    den = torch.tensor([1.0, float("nan"), float("nan"), 1e-40, -2e-41, -0.0, -2.0 ** -129, 0.0])
    got, want = _quotients(num, den), num / den
    assert torch.equal(got.isnan(), want.isnan())
    fin = ~want.isnan()
    assert torch.equal(torch.signbit(got[fin]), torch.signbit(want[fin]))
