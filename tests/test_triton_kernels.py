"""The Triton kernels (leanact/ops/triton) against the PyTorch path, on CPU under Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before Triton is first imported. Without a CUDA device and with
Triton not yet imported, this module sets it and runs the kernels in process (the ops dispatch to
them on CPU tensors through ``dispatch.use_kernels``). Otherwise (a CUDA machine, where the setting
would also turn inductor's kernels into interpreted ones, or Triton already imported by an earlier
test) the in-process tests skip and :func:`test_in_subprocess` runs this file in a fresh
interpreter-mode process. Skips cleanly without triton or numpy.

Bitwise where the math is the same (dropout masks and values, GELU tables and packed bits); within
float32 rounding for the norms (another reduction order); float32 GELU (float32 arithmetic where the
PyTorch path rounds from float64) against the float64 truth and the interval B(y) of
docs/gelu_bound.md, with the bounds measured here.
"""

import pytest
import torch

from _triton_run import interpreter_setup  # noqa: E402

triton, INTERPRETED = interpreter_setup()

import leanact.ops.gelu.function as G  # noqa: E402  (_forward, _backward, _CONSTS)
import leanact.ops.gelu.minimum as GM  # noqa: E402
from leanact.ops.dropout.function import dropout_seeded  # noqa: E402
from leanact.ops.gelu import gelu  # noqa: E402
from leanact.ops.norms.layer_norm import layer_norm  # noqa: E402
from leanact.ops.random import keep_mask, keep_mask_like, keep_threshold  # noqa: E402
from leanact.ops.norms.rms_norm import rms_norm  # noqa: E402
from leanact.ops.triton import dispatch  # noqa: E402
from leanact.ops.gelu import launchers as TG  # noqa: E402
from leanact.ops.norms import launchers as TN  # noqa: E402
from leanact.ops.dropout import launchers as TD  # noqa: E402

from _triton_run import compile_for_sm90, interpreter_marks, run_interpreted  # noqa: E402

pytestmark, interp = interpreter_marks(INTERPRETED)


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    """The kernels on, whatever the caller's LEANACT_TRITON."""
    monkeypatch.setenv("LEANACT_TRITON", "1")


@pytest.fixture(scope="module")
def K():
    """What the ops' launchers dispatch to (each op's kernel module is loaded from there by name)."""
    from leanact.ops.triton import common

    return common


@pytest.fixture(scope="module")
def DK():
    from leanact.ops.dropout import kernels as dropout_kernels

    return dropout_kernels


@pytest.fixture(scope="module")
def NK():
    from leanact.ops.norms import kernels

    return kernels


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaNs equal to NaNs (their payloads may differ)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    both_nan = a.isnan() & b.isnan() if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
    return (bool(((a == b) & (a.signbit() == b.signbit()) | both_nan).all()) if a.is_floating_point()
            else torch.equal(a, b))


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the last place of b (float32)."""
    spacing = (torch.nextafter(b.abs(), torch.tensor(float("inf"))) - b.abs()).double()
    return ((a.double() - b.double()).abs() / spacing).nan_to_num(0.0)


def _grads(fn, *inputs, kernels=None, dy=None):
    """(output, grads of the inputs, saved tensors) of fn on copies, PyTorch path or kernels."""
    xs = [t.detach().clone().requires_grad_(t.is_floating_point()) if t is not None else None for t in inputs]
    ctx = dispatch.use_kernels(kernels) if kernels is not None else torch.enable_grad()
    with ctx:
        y = fn(*xs)
        saved = [t if t is None else t.detach().clone() for t in y.grad_fn.saved_tensors]
        y.backward(torch.ones_like(y) if dy is None else dy)
    return y.detach(), [None if t is None else t.grad for t in xs], saved


# -- dropout -------------------------------------------------------------------------------------


@interp
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 1e-10])
def test_keep_mask_bitwise(K, DK, p):
    for seed, offset, n in ((torch.tensor(-1234567890123456789), 0, 2000), (torch.tensor(7), (1 << 32) - 300, 700),
                            (torch.tensor(1 << 40), 5 << 32, 257)):
        out = torch.empty(n, dtype=torch.bool)
        DK.keep_mask_range(seed, out, keep_threshold(p), offset, block=256)
        assert torch.equal(out, keep_mask(seed, torch.arange(n) + offset, p))
        with dispatch.use_kernels(K):
            assert torch.equal(keep_mask_like(seed, (n,), p, offset=offset), out)


@interp
def test_keep_mask_rows_bitwise(K):
    """Attention's dropout blocks: rows of consecutive indices from arbitrary starts."""
    seed, p = torch.tensor(-99), 0.15
    starts = torch.tensor([0, 5000, 123456789, (1 << 32) - 7, 7 << 32])
    with dispatch.use_kernels(K):
        out = TD.keep_mask_rows(seed, starts, 300, keep_threshold(p))
    assert torch.equal(out, keep_mask(seed, starts[:, None] + torch.arange(300), p))


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dropout_bitwise(K, dtype):
    seed, p = torch.tensor(998877), 0.3
    x = torch.randn(3, 5, 67).to(dtype)
    x.view(-1)[:3] = torch.tensor([float("inf"), float("nan"), -0.0]).to(dtype)
    ref = dropout_seeded(x, seed, p)
    with dispatch.use_kernels(K):
        assert _same(dropout_seeded(x, seed, p), ref)
        y = x.clone()
        assert dropout_seeded(y, seed, p, inplace=True) is y and _same(y, ref)
        base = x.transpose(0, 2).clone()  # a non-contiguous view, in place
        view = base.transpose(0, 2)
        dropout_seeded(view, seed, p, inplace=True)
        assert _same(view, ref)
    y0, (g0,), s0 = _grads(lambda t: dropout_seeded(t, seed, p), x, dy=torch.randn(x.shape).to(dtype))
    y1, (g1,), s1 = _grads(lambda t: dropout_seeded(t, seed, p), x, kernels=K, dy=torch.randn(x.shape).to(dtype))
    assert _same(y0, y1) and all(_same(a, b) for a, b in zip(s0, s1)) and len(s1) == 1  # the seed only
    torch.manual_seed(0)
    dy = torch.randn(x.shape).to(dtype)
    assert _same(_grads(lambda t: dropout_seeded(t, seed, p), x, dy=dy)[1][0],
                 _grads(lambda t: dropout_seeded(t, seed, p), x, kernels=K, dy=dy)[1][0])


# -- GELU ----------------------------------------------------------------------------------------


@interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["none", "tanh"])
def test_gelu16_every_pattern_bitwise(K, dtype, mode):
    x = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)  # every 16-bit input
    y_ref, bits_ref = G._forward(x, mode, True)
    with dispatch.use_kernels(K):
        y, bits = G._forward(x, mode, True)
    assert _same(y, y_ref) and torch.equal(bits, bits_ref)
    torch.manual_seed(1)
    yy = torch.cat([y_ref, y_ref])  # every output pattern on both branches
    right = torch.arange(1 << 17) >= (1 << 16)
    packed = G.pack_bits(right)
    dy = torch.randn(1 << 17).to(dtype)
    ref = G._backward(yy, packed, dy, mode)
    with dispatch.use_kernels(K):
        assert _same(G._backward(yy, packed, dy, mode), ref)


def _gelu32_inputs(mode: str, n: int = 30000) -> torch.Tensor:
    """test_gelu's covering set (both tails down to underflow, next to x*, around 0, up to 1e4) plus
    random values over every region and the special values."""
    from test_gelu import covering_inputs

    torch.manual_seed(2)
    xs = G._CONSTS[mode].xs
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3e38, -3e38, 1e-45, -1e-45, -13.5,
                             -14.5, -20.5, 40.0])
    k = n // 6
    return torch.cat([covering_inputs(mode, torch.float32), torch.randn(k) * 4, torch.empty(k).uniform_(-16, 16),
                      xs + torch.randn(k) * 1e-3, xs + torch.randn(k) * 0.3, torch.empty(k).uniform_(-14.5, -2.5),
                      torch.randn(k) * 1e-3, specials]).float()


#: The float32 kernels' distance from the float64 truth (float32 arithmetic only), erf / tanh form:
#: forward 3.8 / 3.4 ulps; backward (the slope table's cubic) 1.62 / 1.63 ulps beyond B(y): the
#: largest seen here and on 1.6M more inputs per form (docs/gelu_bound.md, section 8), plus a margin.
_FWD_ULPS = {"none": 4.5, "tanh": 4}
_BWD_ULPS = {"none": 2.5, "tanh": 2.5}


@interp
@pytest.mark.parametrize("mode", ["none", "tanh"])
def test_gelu32(K, mode):
    """float32 storage: the kernels compute in float32 only (:mod:`leanact.ops.gelu.kernels32`).
    Forward within _FWD_ULPS of the float64 truth, the branch bits bitwise; backward (for the
    PyTorch path's y, the correctly rounded one) within the interval B(y) of what the stored output
    allows plus _BWD_ULPS of the gradient; special values as the PyTorch path."""
    from test_gelu import grad_interval

    x = _gelu32_inputs(mode)
    y_ref, bits_ref = G._forward(x, mode, True)
    with dispatch.use_kernels(K):
        y, bits = G._forward(x, mode, True)
    assert torch.equal(bits, bits_ref)
    xd = x.double()
    if mode == "none":
        truth = xd * 0.5 * torch.special.erfc(xd * -GM._SQRT1_2)  # no cancellation down to x = -20
    else:
        truth = xd * torch.sigmoid(xd * GM._K1 * (1 + GM._A * xd * xd))
    fin = truth.isfinite() & x.isfinite()
    spacing = (torch.nextafter(truth.float().abs(), torch.tensor(float("inf"))) - truth.float().abs()).double()
    assert ((y.double() - truth).abs() / spacing)[fin].max().item() <= _FWD_ULPS[mode]
    assert _same(y[~fin], y_ref[~fin])  # +-inf, nan (and huge |x|) as the PyTorch path
    assert _same(y[x.abs() > 1e4], y_ref[x.abs() > 1e4])

    dy = torch.ones_like(x)
    ref = G._backward(y_ref, bits_ref, dy, mode)
    with dispatch.use_kernels(K):
        g = G._backward(y_ref, bits_ref, dy, mode)
    right = G.unpack_bits(bits_ref, x.numel()).bool()
    lo, hi = grad_interval(y_ref, right, mode, x=x)
    gd = g.double()
    beyond = torch.clamp(torch.maximum(lo - gd, gd - hi), min=0.0)
    gspace = (torch.nextafter(g.abs(), torch.tensor(float("inf"))) - g.abs()).double()
    ok = ref.isfinite()
    assert (beyond / gspace)[ok].max().item() <= _BWD_ULPS[mode]
    assert _same(g[~ok], ref[~ok])
    near = (x - G._CONSTS[mode].xs).abs() < 0.05  # where B(y) is wider than float32 evaluation errors
    assert (gd - hi)[near].max().item() <= 0 and (lo - gd)[near].max().item() <= 0  # next to x*: inside B(y)
    # a random incoming gradient: the kernel rounds f' dy once (twice in the left tail, where it
    # works on values times 2^64 and scales back), the reference rounds f', then the product
    dy = torch.randn(x.shape)
    with dispatch.use_kernels(K):
        gr = G._backward(y_ref, bits_ref, dy, mode)
    assert _ulps(gr[ok], (g[ok].double() * dy[ok].double()).float()).max().item() <= 2


@interp
@pytest.mark.parametrize("dtype, mode", [(torch.bfloat16, "none"), (torch.bfloat16, "tanh"), (torch.float16, "none")])
def test_gelu32_forward_rounded_to_16_bits_is_the_table(dtype, mode):
    """The float32 kernel's GELU of every 16-bit value, rounded to 16 bits, is the 16-bit path's
    lookup table, all 65,536 patterns: a 16-bit forward could compute instead of gathering and keep
    every bit (float16, tanh form: one pattern differs, so not there)."""
    from leanact.ops.gelu import erfcx32, tables as GT
    from leanact.ops.gelu import kernels32 as K32

    x = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    y = torch.empty(x.shape)
    K32.gelu32_forward(x.float(), y, None, erfcx32.mills_table() if mode == "none" else None, 0.0)
    assert _same(y.to(dtype), GT._ACCESSORS["y16", str(dtype)[6:], mode]("cpu").view(dtype))


@interp
@pytest.mark.parametrize("mode", ["none", "tanh"])
def test_gelu32_row_reads_agree(mode):
    """The float32 kernels read a table row as two 8-byte loads or as one [BLOCK, 2] load split in
    registers (their ``wide`` 0 / 1; 2, inline PTX, has no interpreter: the SASS test and the GPU's
    benchmarks/gelu_directions.py check it): the same y, bits and dx bitwise, over inputs from
    -20 to 20 (every cell of the tables' busy range) and the tails."""
    from leanact.ops.gelu import erfcx32, rebuild32, slope32
    from leanact.ops.gelu import kernels32 as K32

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.linspace(-20, 20, 3001), torch.randn(2000, generator=g) * 3,
                   torch.tensor([-30.0, -1e-30, 0.0, 1e-30, 30.0])])
    dy = torch.randn(x.shape, generator=g)
    thr = TG._args("forward", x, mode)[0]
    mills = erfcx32.mills_table() if mode == "none" else None
    slope, c32 = slope32.slope_table(mode), rebuild32._C32[mode]
    outs = []
    for wide in (0, 1):
        y, bits, dx = torch.empty_like(x), torch.empty((x.numel() + 7) // 8, dtype=torch.uint8), torch.empty_like(x)
        K32.gelu32_forward(x, y, bits, mills, thr, wide=wide)
        K32.gelu32_backward(y, bits, dy, dx, slope, c32, wide=wide)
        outs.append((y, bits, dx))
    assert all(_same(a, b) for a, b in zip(*outs))


@interp
@pytest.mark.parametrize("mode", ["none", "tanh"])
def test_gelu32_unmasked_blocks_agree(mode):
    """Where BLOCK divides n the float32 kernels run without masks (their ``EVEN``): the same y, bits
    and dx bitwise as the masked kernels give on the same elements with one more after them."""
    from leanact.ops.gelu import erfcx32, rebuild32, slope32
    from leanact.ops.gelu import kernels32 as K32

    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.linspace(-20, 20, 1024), torch.randn(1019, generator=g) * 3,
                   torch.tensor([-30.0, -1e-30, 0.0, float("nan"), 30.0])])  # 2048: two whole blocks
    dy = torch.randn(x.numel() + 1, generator=g)
    thr = TG._args("forward", x, mode)[0]
    mills = erfcx32.mills_table() if mode == "none" else None
    slope, c32 = slope32.slope_table(mode), rebuild32._C32[mode]
    outs = []
    for xs in (x, torch.cat([x, torch.tensor([0.5])])):  # unmasked (EVEN), masked
        y, bits, dx = torch.empty_like(xs), torch.empty((xs.numel() + 7) // 8, dtype=torch.uint8), torch.empty_like(xs)
        K32.gelu32_forward(xs, y, bits, mills, thr)
        K32.gelu32_backward(y, bits, dy[:xs.numel()], dx, slope, c32)
        outs.append((y[:2048], bits[:256], dx[:2048]))
    assert all(_same(a, b) for a, b in zip(*outs))


@interp
@pytest.mark.parametrize("mode", ["none", "tanh"])
def test_gelu32_backward_fma_quotient_agrees(mode):
    """The float32 backward's left key by ``math32.quotient`` (its ``fma_div``) gives the dx of
    ``div_rn``'s bitwise: over the outputs of inputs from -20 to 20, tails to the last subnormal
    outputs, y next to the minimum (c32 and its neighbours, where the key's divisor is subnormal or
    tiny), random bit patterns of y with both branch bits, and specials."""
    from leanact.ops.gelu import rebuild32, slope32
    from leanact.ops.gelu import kernels32 as K32

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.linspace(-20, 20, 4001), torch.randn(4000, generator=g) * 3,
                   -torch.linspace(12, 15, 2000), torch.tensor([-30.0, -1e-30, 0.0, 1e-30, 30.0])])
    thr = TG._args("forward", x, mode)[0]
    mills = K32._mills.mills_table() if mode == "none" else None
    slope, c32 = slope32.slope_table(mode), rebuild32._C32[mode]
    y = torch.empty_like(x)
    bits = torch.empty((x.numel() + 7) // 8, dtype=torch.uint8)
    K32.gelu32_forward(x, y, bits, mills, thr)
    near = torch.tensor(c32).view(torch.int32) + torch.arange(-40, 41, dtype=torch.int32)
    noise = torch.randint(-2 ** 31, 2 ** 31 - 1, (8000,), generator=g, dtype=torch.int64).to(torch.int32)
    extra = torch.cat([near.view(torch.float32), noise.view(torch.float32),
                       torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -1e-45, 1e-45])])
    n_extra = extra.numel()  # each extra y twice: once on each branch
    y = torch.cat([y, extra, extra])
    from leanact.ops.bitpack import pack_bits, unpack_bits
    right = torch.cat([unpack_bits(bits, x.numel()), torch.zeros(n_extra, dtype=torch.bool),
                       torch.ones(n_extra, dtype=torch.bool)])
    bits = pack_bits(right)
    dy = torch.randn(y.shape, generator=g)
    outs = []
    for fma_div in (False, True):
        dx = torch.empty_like(y)
        K32.gelu32_backward(y, bits, dy, dx, slope, c32, fma_div=fma_div)
        outs.append(dx)
    assert torch.equal(outs[0].isnan(), outs[1].isnan())
    ok = ~outs[0].isnan()
    assert torch.equal(outs[0][ok], outs[1][ok])  # (+0 and -0 compare equal: a zero's sign may differ)
    assert (outs[0][ok] != 0).sum() > x.numel() // 2  # most elements carry a gradient


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_autograd_saves_the_same(K, dtype):
    x = (torch.randn(4, 33) * 3).to(dtype)
    dy = torch.randn(4, 33).to(dtype)
    y0, (g0,), s0 = _grads(lambda t: gelu(t), x, dy=dy)
    y1, (g1,), s1 = _grads(lambda t: gelu(t), x, kernels=K, dy=dy)
    assert len(s0) == len(s1) == 2 and _layout(s0) == _layout(s1) and torch.equal(s0[1], s1[1])  # y, bits
    if dtype != torch.float32:  # the same tables
        assert _same(y0, y1) and _same(s0[0], s1[0]) and _same(g0, g1)
        return
    assert _ulps(y1, y0).max().item() <= _FWD_ULPS["none"] + 1  # both within a few ulps of the truth
    # the gradients, each from its own y: within a few ulps, plus next to the minimum what the
    # rounding of y moves there (f''/f' times a few ulps of y*: 8 ulp(y*) / |x - x*|)
    ulp_ys = 2.0 ** -26
    near = torch.clamp(8 * ulp_ys / (x - GM._CONSTS["none"].xs).abs(), max=1e-3)
    tol = 16 * (torch.nextafter(g0.abs(), torch.tensor(float("inf"))) - g0.abs()) + dy.abs() * near
    assert ((g1 - g0).abs() <= tol).all()


# -- LayerNorm / RMSNorm ---------------------------------------------------------------------------


def _layout(saved):
    return [None if t is None else (t.dtype, t.shape, t.stride()) for t in saved]


def _close(a, b, dtype, n):
    """Within the rounding of the two reduction orders: a few ulps times log2(n), relative to max|b|."""
    tol = 8 * torch.finfo(dtype).eps * max(1, int(n).bit_length()) * max(b.float().abs().max().item(), 1.0)
    return (a.float() - b.float()).abs().max().item() <= tol


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("affine", ["wb", "w", "b", "none"])
def test_layer_norm(K, dtype, affine):
    torch.manual_seed(3)
    shape = (4, 24)
    x = (torch.randn(13, *shape) * 2 + 1).to(dtype)
    w = (torch.rand(shape) + 0.5).to(dtype) if "w" in affine else None
    b = (torch.randn(shape) * 0.1).to(dtype) if "b" in affine else None
    dy = torch.randn(x.shape).to(dtype)

    def fn(t, ww, bb):
        return layer_norm(t, shape, ww, bb, from_output=True)

    y0, g0, s0 = _grads(fn, x, w, b, dy=dy)
    y1, g1, s1 = _grads(fn, x, w, b, kernels=K, dy=dy)
    assert _layout(s0) == _layout(s1)  # the same tensors kept
    assert _close(y1, y0, dtype, 96)
    for a, c in zip(g1, g0):
        assert (a is None) == (c is None) and (a is None or _close(a, c, dtype, 13 * 96))


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("from_output", [True, False])
@pytest.mark.parametrize("weight", [True, False])
def test_rms_norm(K, dtype, from_output, weight):
    torch.manual_seed(4)
    x = torch.randn(2, 9, 40).to(dtype)
    w = (torch.rand(40) + 0.5).to(dtype) if weight else None
    dy = torch.randn(x.shape).to(dtype)

    def fn(t, ww):
        return rms_norm(t, (40,), ww, from_output=from_output)

    y0, g0, s0 = _grads(fn, x, w, dy=dy)
    y1, g1, s1 = _grads(fn, x, w, kernels=K, dy=dy)
    assert _layout(s0) == _layout(s1)
    assert _same(s0[0], s1[0]) if not from_output else True  # the input itself on the fallback
    assert _close(y1, y0, dtype, 40)
    for a, c in zip(g1, g0):
        assert (a is None) == (c is None) and (a is None or _close(a, c, dtype, 18 * 40))


@interp
@pytest.mark.parametrize("h_dtype,r_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("needs", ["all", "h", "residual", "params"])
def test_dropout_add_layer_norm(NK, h_dtype, r_dtype, p, needs):
    """The sub-layer end's two kernels (forward: dropout, add, norm; backward: the norm's from the
    output, then the add's and the dropout's) against its PyTorch path: the same tensors kept, y and
    the gradients within float32 rounding of the two reduction orders, the same mask."""
    from leanact.ops.norms.dropout_add_norm import dropout_add_layer_norm

    torch.manual_seed(6)
    n, z = 40, torch.promote_types(h_dtype, r_dtype)
    h = (torch.randn(7, 5, n) * 2).to(h_dtype)
    r = torch.randn(7, 5, n).to(r_dtype)
    w, b = (torch.rand(n) + 0.5).to(z), (torch.randn(n) * 0.1).to(z)
    dy = torch.randn(7, 5, n).to(z)
    grad = {"all": (True,) * 4, "h": (True, False, False, False), "residual": (False, True, False, False),
            "params": (False, False, True, True)}[needs]

    def fn(hh, rr, ww, bb):
        for t, g in zip((hh, rr, ww, bb), grad):
            t.requires_grad_(g)
        torch.manual_seed(11)
        return dropout_add_layer_norm(hh, rr, n, ww, bb, 1e-5, p)

    spy = _Spy(NK)
    y0, g0, s0 = _grads(fn, h, r, w, b, dy=dy)
    y1, g1, s1 = _grads(fn, h, r, w, b, kernels=spy, dy=dy)
    assert spy.calls[:2] == ["norm_forward", "norm_backward"]  # (then the partials' sum, if dγ or dβ is needed)
    assert _layout(s0) == _layout(s1) and (p == 0.0 or torch.equal(s0[-1], s1[-1]))  # y, rstd, γ, β, seed
    assert y1.dtype == y0.dtype == z and _close(y1, y0, z, n)
    for a, c, g in zip(g1, g0, grad):
        assert (a is None) == (c is None) == (not g)
        if a is not None:
            assert _close(a, c, a.dtype, 35 * n)  # (dγ, dβ: sums over the 35 rows of n-channel terms)
    if grad[0] and p:
        assert torch.equal(g1[0] == 0, g0[0] == 0)  # the regenerated mask


@interp
def test_norm_backward_row_loop(NK):
    """More rows than programs: each program loops over its rows and sums its own dγ, dβ."""
    torch.manual_seed(5)
    y, rstd = torch.empty(11, 16), torch.empty(11)
    NK.norm_forward(torch.randn(11, 16), y, rstd, 16, None, None, 1e-5, rms=False)
    dy = torch.randn(11, 16)

    def grads(programs):
        dx, dw, db = torch.empty(11, 16), torch.zeros(programs, 16), torch.zeros(programs, 16)
        NK.norm_backward(dy, y, rstd, None, None, dx, dw, db, 16, rms=False, from_output=True)
        return dx, dw.sum(0), db.sum(0)

    full = grads(1)
    for programs in (3, 11):
        part = grads(programs)
        assert torch.equal(part[0], full[0])
        assert torch.allclose(part[1], full[1], atol=1e-5) and torch.allclose(part[2], full[2], atol=1e-5)
    assert torch.allclose(full[2], dy.sum(0), atol=1e-5)


@interp
def test_norm_backward_without_partials_shares_rows(NK, monkeypatch):
    """γ, β frozen (no partials): launchers.PROGRAMS_WITHOUT_PARTIALS programs share the rows, unevenly
    when they do not divide them; dx is the same whatever their count."""
    torch.manual_seed(6)
    w, b = torch.rand(16) + 0.5, torch.randn(16) * 0.1
    y, rstd = torch.empty(11, 16), torch.empty(11)
    NK.norm_forward(torch.randn(11, 16), y, rstd, 16, w, b, 1e-5, rms=False)
    dy = torch.randn(11, 16)

    def dx(programs):
        monkeypatch.setattr(TN, "PROGRAMS_WITHOUT_PARTIALS", programs)
        out = torch.full((11, 16), float("nan"))
        NK.norm_backward(dy, y, rstd, w, b, out, None, None, 16, rms=False, from_output=True)
        return out

    one = dx(1)
    assert not one.isnan().any()
    for programs in (2, 4, 11, 1024):
        assert torch.equal(dx(programs), one)



@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norm_partials_sum(NK, dtype):
    """dγ, dβ from the backward's per-program partials in one kernel: float32 sums over more
    programs than one tile holds (ragged), ÷ γ for RMSNorm from output, rounded once to the
    parameters' dtype. Bound: a float32 sum of P terms is within (P - 1)·u·Σ|p| of the truth (u =
    2^-24); the division and the final rounding add half an ulp each."""
    torch.manual_seed(6)
    p, n = 71, 100
    pw, pb = torch.randn(2, p, n).unbind(0)
    w = (torch.rand(n) + 0.5).to(dtype)
    u = 2.0 ** -24
    for need_w, need_b, div_w in ((True, True, False), (True, False, True), (False, True, False), (True, False, False)):
        dw = torch.empty(n, dtype=dtype) if need_w else None
        db = torch.empty(n, dtype=dtype) if need_b else None
        NK.norm_partials_sum(pw if need_w else None, pb if need_b else None, dw, db, w, n, div_w)
        for got, parts, div in ((dw, pw, div_w), (db, pb, False)):
            if got is None:
                continue
            truth = parts.double().sum(0)
            err = (p - 1) * u * parts.double().abs().sum(0)
            if div:
                truth, err = truth / w.double(), err / w.double().abs() + u * (truth / w.double()).abs()
            half_ulp = torch.finfo(dtype).eps / 2 * truth.abs()
            assert ((got.double() - truth).abs() <= err + half_ulp).all()


@interp
def test_norm_backward_of_no_rows(K):
    """A batch with no rows: dx is empty, dγ and dβ are zeros (no partial was written)."""
    x = torch.randn(0, 24, requires_grad=True)
    w, b = torch.rand(24).requires_grad_(), torch.randn(24).requires_grad_()
    with dispatch.use_kernels(K):
        layer_norm(x, (24,), w, b, from_output=True).sum().backward()
        assert x.grad.shape == (0, 24) and torch.equal(w.grad, torch.zeros(24)) and torch.equal(b.grad, torch.zeros(24))
        w.grad = None
        rms_norm(x, (24,), w, from_output=True).sum().backward()
        assert torch.equal(w.grad, torch.zeros(24))


class _Spy:
    """A kernel module, recording which of its launchers ran."""

    def __init__(self, k):
        self.k, self.calls = k, []

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.k, name)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["llama", "fp32_mul", "offset", "t5"])
def test_hf_rms_norm_variants_through_the_kernels(NK, variant, dtype):
    """Hugging Face's RMSNorm variants (LLaMA's, OLMo 2's, Gemma's 1 + w, T5's), patched: their
    backward runs the RMSNorm kernels (γ = w, or 1 + w in fp32 for Gemma's), from the output and
    from the input, within float32 rounding of the PyTorch path."""
    transformers = pytest.importorskip("transformers")  # noqa: F841
    import copy

    from leanact.patching.hf_rms_norm import hf_rms_norm_replacement
    paths = {"llama": "llama.modeling_llama.LlamaRMSNorm", "fp32_mul": "olmo2.modeling_olmo2.Olmo2RMSNorm",
             "offset": "gemma.modeling_gemma.GemmaRMSNorm", "t5": "t5.modeling_t5.T5LayerNorm"}
    mod, name = ("transformers.models." + paths[variant]).rsplit(".", 1)
    ref = getattr(__import__(mod, fromlist=[name]), name)(40, eps=1e-6)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(7))
    ref = ref.to(dtype)
    x = (torch.randn(2, 9, 40, generator=torch.Generator().manual_seed(8)) * 2).to(dtype)
    dy = torch.randn(2, 9, 40, generator=torch.Generator().manual_seed(9)).to(dtype)
    for from_output in (True, False):
        lean, reason = hf_rms_norm_replacement(copy.deepcopy(ref))
        assert reason is None
        lean.from_output = from_output
        spy = _Spy(NK)
        y0, g0, _ = _grads(lean, x, dy=dy)
        w0, lean.weight.grad = lean.weight.grad, None
        with dispatch.use_kernels(spy):
            y1, g1, _ = _grads(lean, x, dy=dy)
        w1 = lean.weight.grad
        assert "norm_backward" in spy.calls and "norm_partials_sum" in spy.calls
        assert torch.equal(y1, y0)  # HF's own forward on both paths
        assert _close(g1[0], g0[0], dtype, 40) and _close(w1, w0, dtype, 18 * 40)

# -- dispatch --------------------------------------------------------------------------------------


def test_dispatch_declines_without_cuda_or_when_disabled(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, seed = torch.randn(2, 4), torch.tensor(1)
    assert TD.dropout(x, seed, keep_threshold(0.5), 2.0, False) is None  # CPU tensors: the PyTorch path
    assert TG.gelu_forward(x, "none", True) is None
    assert TN.layer_norm_forward(x, (4,), None, None, 1e-5) is None

    class Boom:
        def __getattr__(self, name):
            raise AssertionError(f"kernel {name} ran")

    with dispatch.use_kernels(Boom()):
        monkeypatch.setenv("LEANACT_TRITON", "0")
        assert not dispatch.enabled()
        assert TD.dropout(x, seed, keep_threshold(0.5), 2.0, False) is None
        assert TN.rms_norm_forward(x, (4,), None, None) is None
        monkeypatch.setenv("LEANACT_TRITON", "1")
        assert TG.gelu_forward(x.double(), "none", True) is None  # float64: the PyTorch path
        assert TN.layer_norm_forward(torch.randn(2, 1 << 16), (1 << 16,), None, None, 1e-5) is None  # too wide
        with FakeTensorMode():
            assert TD.dropout(torch.empty(8), torch.tensor(1), keep_threshold(0.5), 2.0, False) is None
        assert dropout_seeded(x.double(), seed, 0.5).shape == x.shape


def test_a_failing_kernel_warns_once_and_its_op_takes_the_pytorch_path():
    calls = []

    class Broken:
        def dropout_apply(self, *args):
            calls.append(1)
            raise RuntimeError("no such instruction")

    x, seed = torch.randn(3, 40), torch.tensor(5)
    ref = dropout_seeded(x, seed, 0.2)
    with dispatch.use_kernels(Broken(), strict=False):
        with pytest.warns(RuntimeWarning, match="dropout uses its PyTorch path"):
            assert torch.equal(dropout_seeded(x, seed, 0.2), ref)
        assert torch.equal(dropout_seeded(x, seed, 0.2), ref) and len(calls) == 1  # not tried again
    with dispatch.use_kernels(Broken()), pytest.raises(RuntimeError, match="no such instruction"):
        dropout_seeded(x, seed, 0.2)  # strict: raises


@pytest.mark.slow
def test_in_subprocess():
    """When this process cannot run the interpreter (see the module doc), run the file in one that can."""
    if INTERPRETED:
        pytest.skip("the interpreter runs in this process")
    run_interpreted(__file__)


_COMPILE = r'''
from leanact.ops.gelu import kernels16 as K16
from leanact.ops.norms import kernels as NK
from leanact.ops.dropout import kernels as DK
from leanact.ops.triton import common as K

build(DK._dropout_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16", "seed_ptr": "*i64", "n": "i64", "offset": "i64",
      "thr": "i64", "scale": "fp32"}, {"APPLY": True, "BLOCK": 1024}, **K.FUSED)
build(DK._keep_rows_kernel, {"starts_ptr": "*i64", "out_ptr": "*u8", "seed_ptr": "*i64", "length": "i32", "thr": "i64"},
      {"BLOCK": 1024}, **K.FUSED)
build(NK._ln_fwd_kernel, {"x_ptr": "*bf16", "y_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "rstd_ptr": "*fp32",
      "N": "i32", "eps": "fp32", "r_ptr": "*bf16", "seed_ptr": "*i64", "thr": "i64", "scale": "fp32"},
      {"HAS_W": True, "HAS_B": True, "RMS": False, "BLOCK_N": 1024, "RESIDUAL": False, "DROPOUT": False, "Z_KIND": 0},
      **K.FUSED)
# the sub-layer end, dropout(h) + residual -> LayerNorm (leanact.ops.norms.dropout_add_norm): bf16 h, fp32
# residual and y
build(NK._ln_fwd_kernel, {"x_ptr": "*bf16", "y_ptr": "*fp32", "w_ptr": "*fp32", "b_ptr": "*fp32", "rstd_ptr": "*fp32",
      "N": "i32", "eps": "fp32", "r_ptr": "*fp32", "seed_ptr": "*i64", "thr": "i64", "scale": "fp32"},
      {"HAS_W": True, "HAS_B": True, "RMS": False, "BLOCK_N": 1024, "RESIDUAL": True, "DROPOUT": True, "Z_KIND": 0},
      **K.UNFUSED)
build(NK._ln_bwd_kernel, {"dy_ptr": "*fp32", "t_ptr": "*fp32", "w_ptr": "*fp32", "b_ptr": "*fp32", "rstd_ptr": "*fp32",
      "dx_ptr": "*fp32", "dw_ptr": "*fp32", "db_ptr": "*fp32", "M": "i32", "N": "i32", "rows_per_prog": "i32",
      "dh_ptr": "*bf16", "seed_ptr": "*i64", "thr": "i64", "scale": "fp32"},
      {"HAS_W": True, "HAS_B": True, "RMS": False, "FROM_OUTPUT": True, "NEED_DX": True, "NEED_DW": True,
       "NEED_DB": True, "BLOCK_N": 1024, "RESIDUAL": True, "NEED_DH": True, "DROPOUT": True, "Z_KIND": 0}, **K.FUSED)
build(NK._ln_bwd_kernel, {"dy_ptr": "*bf16", "t_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "rstd_ptr": "*fp32",
      "dx_ptr": "*bf16", "dw_ptr": "*fp32", "db_ptr": "*fp32", "M": "i32", "N": "i32", "rows_per_prog": "i32",
      "dh_ptr": "*bf16", "seed_ptr": "*i64", "thr": "i64", "scale": "fp32"},
      {"HAS_W": True, "HAS_B": True, "RMS": False, "FROM_OUTPUT": True, "NEED_DX": True, "NEED_DW": True,
       "NEED_DB": True, "BLOCK_N": 1024, "RESIDUAL": False, "NEED_DH": False, "DROPOUT": False, "Z_KIND": 0},
      **K.FUSED)
build(NK._partials_sum_kernel, {"pw_ptr": "*fp32", "pb_ptr": "*fp32", "w_ptr": "*bf16", "dw_ptr": "*bf16",
      "db_ptr": "*bf16", "P": "i32", "N": "i32"}, {"HAS_DW": True, "HAS_DB": True, "DIV_W": True, "BLOCK_P": 32,
      "BLOCK_N": 64}, **K.FUSED)
build(K16._gelu16_fwd_kernel, {"x_ptr": "*i16", "y_ptr": "*i16", "bits_ptr": "*u8", "tab_ptr": "*i16", "n": "i32",
      "u": "i32"}, {"WITH_BITS": True, "BLOCK": 1024}, **K.FUSED)
from leanact.ops.gelu import kernels32 as G32
for fma_div, even in ((False, False), (True, False), (False, True)):
    build(G32._gelu32f_bwd_kernel, {"y_ptr": "*fp32", "bits_ptr": "*u8", "dy_ptr": "*fp32", "out_ptr": "*fp32",
          "tab_ptr": "*i64", "n": "i32", "c32": "fp32"}, {"WIDE": 0, "FMA_DIV": fma_div, "EVEN": even, "BLOCK": 1024},
          **G32.UNFUSED)
'''


@pytest.mark.slow
def test_kernels_compile_for_a_gpu_without_one():
    """The compiler (not the interpreter) accepts the kernels: compiled for sm_90 (PTX and cubin,
    Triton's bundled ptxas), in a fresh process without TRITON_INTERPRET. No GPU needed."""
    compile_for_sm90(_COMPILE, TRITON_DEFAULT_FP_FUSION="1")
