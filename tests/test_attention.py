"""Attention core without s² tensors kept for backward: values, gradients, memory, dropout, compile."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import leanact.ops.attention.core as core
from leanact.memory import SavedTensorMeter
from leanact.nn.attention import AttentionCore
from leanact.ops.attention import attention, compose, default_block_size
from leanact.ops.random import keep_mask, keep_mask_like

from _tol import within_rounding_bound

SEED = torch.tensor(20240611)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny ops: one thread avoids OpenMP barrier stalls (ms each) when the cores are shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def reference(q, k, v, mask=None, p=0.0, causal=False, scale=None, seed=SEED):
    """The plain composition softmax(q k^T * scale + mask) -> dropout (same mask) -> @ v, in q's dtype."""
    b, h, s_q, d = q.shape
    g = h // k.size(1)
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * (1 / math.sqrt(d) if scale is None else scale)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask
    if causal:
        s = s.masked_fill(torch.ones(s_q, k.size(2), dtype=torch.bool).triu(1), -math.inf)
    a = torch.softmax(s, -1)
    if p > 0:
        a = a * keep_mask_like(seed, a.shape, p) / (1 - p)
    return a @ v


def make_qkv(b, h, s, d, dtype=torch.float32, fused=False, hkv=None, s_k=None, generator=None):
    """q (b, h, s, d), k/v (b, hkv, s_k, d); ``fused``: views of one (b, s, 3*h*d) projection output."""
    if fused:
        qkv = torch.randn(b, s, 3 * h * d, generator=generator).to(dtype).requires_grad_()
        return qkv, *qkv.view(b, s, 3, h, d).permute(2, 0, 3, 1, 4)
    hkv, s_k = hkv or h, s_k or s
    q = torch.randn(b, h, s, d, generator=generator).to(dtype).requires_grad_()
    k, v = (torch.randn(b, hkv, s_k, d, generator=generator).to(dtype).requires_grad_() for _ in range(2))
    return None, q, k, v


def make_mask(kind, b, h, s_q, s_k, dtype=torch.float64, generator=None):
    if kind == "pad":  # (b, 1, 1, s_k), at least one key per batch element
        m = torch.rand(b, 1, 1, s_k, generator=generator) > 0.3
        m[..., 0] = True
        return m
    if kind == "full":
        m = torch.rand(b, h, s_q, s_k, generator=generator) > 0.4
        m[..., 0] = True
        return m
    if kind == "float":
        return torch.randn(s_q, s_k, generator=generator, dtype=torch.float64).to(dtype)
    return None


def grads(out, inputs, seed=0):
    # drawn on the CPU (the same values for every device), then put where the output lives
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    return torch.autograd.grad(out, inputs, go)


def test_grads_helper_puts_the_output_gradient_on_the_outputs_device():
    """The CUDA test's gradients go through this helper: a CPU grad_output for a device output is
    refused by autograd ("expected device cuda:0 but got cpu"). The meta device shows it here."""
    x = torch.randn(3, 4, device="meta", requires_grad=True)
    (g,) = grads(x * 2, (x,))
    assert g.device == x.device and g.shape == x.shape


# ---- float64 gradcheck ------------------------------------------------------------------------
GC_CASES = [  # (mask kind, causal, G, p, s_q, s_k)
    (None, False, 1, 0.3, 7, 7),
    ("pad", False, 1, 0.2, 9, 6),
    ("full", False, 1, 0.25, 5, 8),
    (None, True, 1, 0.3, 8, 8),
    (None, True, 2, 0.2, 7, 9),
    ("pad", False, 2, 0.0, 7, 7),
    ("float", False, 1, 0.2, 7, 5),
]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "tempo"])
@pytest.mark.parametrize("case", GC_CASES, ids=str)
def test_gradcheck_float64(mode, case):
    kind, causal, g, p, s_q, s_k = case
    gen = torch.Generator().manual_seed(1)
    b, h, d = 2, 2 * g if g > 1 else 2, 4
    _, q, k, v = make_qkv(b, h, s_q, d, torch.float64, hkv=h // g, s_k=s_k, generator=gen)
    mask = make_mask(kind, b, h, s_q, s_k, generator=gen)
    inputs = (q, k, v)
    if kind == "float":
        mask.requires_grad_()
        inputs = (q, k, v, mask)

    def fn(q, k, v, m=mask):
        return attention(q, k, v, m, p, causal, mode=mode, block_size=3, seed=SEED, enable_gqa=g > 1)

    assert torch.autograd.gradcheck(fn, inputs, fast_mode=kind == "full")


# ---- equality with the plain torch composition ------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.15])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kind", [None, "pad", "causal"])
@pytest.mark.parametrize("fused", [False, True])
def test_matches_plain_composition(dtype, p, d, kind, fused):
    """Output and gradients within the worst-case rounding bound of ``dtype`` from the float64 truth.

    The longest chain of roundings behind an element: the scores (a sum over d), the softmax and
    P @ v (sums over s_k) in forward, dP (over d), the row correction and dS @ k or dS^T @ q (over
    s_k) in backward: n = d + 2 s_k. The plain torch composition is held to the same bound, so the
    test checks the bound is not vacuous for the inputs used.
    """
    gen = torch.Generator().manual_seed(d + int(fused))
    b, h, s = 2, 3, 70
    base, q, k, v = make_qkv(b, h, s, d, dtype, fused=fused, generator=gen)
    mask, causal = make_mask(kind, b, h, s, s, generator=gen), kind == "causal"
    leaves = (base,) if fused else (q, k, v)
    modes = ["recompute", "tempo"] if p > 0 else ["recompute"]
    ref = reference(q, k, v, mask, p, causal)
    g_ref = grads(ref, leaves)
    truth = reference(*(t.double() for t in (q, k, v)), mask, p, causal)  # float64 from the same inputs
    g_truth = grads(truth, leaves)
    n = d + 2 * s
    for x, t in zip((ref, *g_ref), (truth, *g_truth)):
        assert within_rounding_bound(x, t, dtype, n)[0]
    for mode in modes:
        out = attention(q, k, v, mask, p, causal, mode=mode, block_size=32, seed=SEED)
        assert out.shape == (b, h, s, d) and out.dtype == dtype
        got = grads(out, leaves)
        for i, (x, t) in enumerate(zip((out, *got), (truth, *g_truth))):
            ok, err, bound = within_rounding_bound(x, t, dtype, n)
            assert ok, (mode, i, err, bound)


@pytest.mark.parametrize("mode", ["recompute", "tempo"])
def test_gqa_and_cross_lengths_match_reference(mode):
    gen = torch.Generator().manual_seed(3)
    _, q, k, v = make_qkv(2, 8, 13, 16, torch.float64, hkv=2, s_k=21, generator=gen)
    mask = make_mask("pad", 2, 8, 13, 21, generator=gen)
    out = attention(q, k, v, mask, 0.3, mode=mode, block_size=4, seed=SEED, enable_gqa=True)
    ref = reference(q, k, v, mask, 0.3)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-13)
    for a, r in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        assert torch.allclose(a, r, rtol=1e-12, atol=1e-13)
    assert k.grad is None  # nothing leaked into .grad
    with pytest.raises(ValueError, match="enable_gqa"):
        attention(q, k, v)


def test_block_size_invariance_and_causal_long_keys():
    gen = torch.Generator().manual_seed(4)
    _, q, k, v = make_qkv(1, 2, 11, 8, torch.float64, s_k=17, generator=gen)
    outs = [attention(q, k, v, None, 0.4, True, block_size=bs, seed=SEED) for bs in (1, 4, 11, None)]
    gs = [grads(o, (q, k, v)) for o in outs]
    ref = reference(q, k, v, None, 0.4, True)
    for o, g in zip(outs, gs):
        assert torch.allclose(o, ref, rtol=1e-12, atol=1e-13)
        for a, r in zip(g, gs[0]):
            assert torch.allclose(a, r, rtol=1e-12, atol=1e-13)


# ---- fully masked rows --------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["recompute", "tempo"])
@pytest.mark.parametrize("float_mask", [False, True])
def test_fully_masked_rows_match_sdpa_math(mode, float_mask):
    gen = torch.Generator().manual_seed(5)
    _, q, k, v = make_qkv(2, 2, 6, 4, torch.float64, generator=gen)
    mask = torch.rand(2, 2, 6, 6, generator=gen) > 0.3
    mask[0, 1, 2] = False
    mask[1, :, 4] = False
    if float_mask:
        mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, -math.inf)
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q, k, v, mask)
    g_ref = grads(ref, (q, k, v))
    p = 0.0 if mode == "recompute" else 1e-9  # tempo runs with dropout only; p tiny: nothing dropped here
    out = attention(q, k, v, mask, p, mode=mode, block_size=4, seed=SEED)
    got = grads(out, (q, k, v))
    assert (out[0, 1, 2] == 0).all() and (out[1, :, 4] == 0).all()
    for a, r in zip((out, *got), (ref, *g_ref)):
        assert not a.isnan().any()
        assert torch.allclose(a, r, rtol=1e-8 if p else 1e-12, atol=1e-13)


def test_dropout_one_gives_zeros():
    _, q, k, v = make_qkv(1, 2, 5, 4, torch.float64)
    for mode in ("recompute", "tempo"):
        out = attention(q, k, v, None, 1.0, mode=mode)
        gq, gk, gv = grads(out, (q, k, v))
        assert (out == 0).all() and (gq == 0).all() and (gk == 0).all() and (gv == 0).all()


# ---- dropout masks --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["recompute", "tempo"])
def test_forward_and_backward_use_the_seed_mask(mode):
    """q = 0 makes P uniform (1/s_k) and v = identity reads the mask off the output; the gradient of
    v then gives the mask's column sums: both equal keep_mask of the documented indices."""
    b, h, s, p = 2, 3, 96, 0.25
    q = torch.zeros(b, h, s, s, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, h, s, s, dtype=torch.float64)
    v = torch.eye(s, dtype=torch.float64).expand(b, h, s, s).clone().requires_grad_()
    out = attention(q, k, v, None, p, mode=mode, block_size=40, seed=SEED)
    keep = keep_mask_like(SEED, (b, h, s, s), p)
    assert torch.equal(out * (s * (1 - p)), keep.double())
    (gv,) = torch.autograd.grad(out.sum(), v)
    assert torch.allclose(gv * (s * (1 - p)), keep.double().sum(2, keepdim=True).transpose(-1, -2).expand_as(gv))
    assert abs(keep.double().mean().item() - (1 - p)) < 0.01


def test_seeds_generator_and_eval():
    _, q, k, v = make_qkv(1, 2, 16, 8)
    torch.manual_seed(0)
    a = attention(q, k, v, dropout_p=0.5)
    b = attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    assert torch.equal(attention(q, k, v, dropout_p=0.5), a) and not torch.equal(a, b)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert torch.equal(attention(q, k, v, dropout_p=0.5, generator=g1), attention(q, k, v, dropout_p=0.5, generator=g2))
    ev = attention(q, k, v, dropout_p=0.5, training=False)
    assert torch.allclose(ev, F.scaled_dot_product_attention(q, k, v), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("i0,i1,kend", [(0, 9, 12), (3, 7, 12), (3, 7, 7), (8, 9, 9)])
@pytest.mark.parametrize("fast", [True, False])
def test_block_masks_equal_keep_mask(monkeypatch, i0, i1, kend, fast):
    monkeypatch.setattr(core, "CHUNK", 16)  # force several chunks, rows and columns
    b, h, s_q, s_k, p = 2, 3, 9, 12, 0.3
    dropper = core._Dropper(SEED, p, b, h, s_q, s_k, torch.device("cpu"))
    dropper.fast = fast and dropper.fast
    if dropper.fast != fast:
        pytest.skip("fast path unavailable")
    full = keep_mask(SEED, torch.arange(b * h * s_q * s_k).view(b * h, s_q, s_k), p)
    assert torch.equal(dropper(i0, i1, kend), full[:, i0:i1, :kend].to(torch.uint8))


# ---- memory: exactly what is kept --------------------------------------------------------------
def _kept(fn, *, linear=None):
    meter = SavedTensorMeter(linear)
    with meter:
        out = fn()
        if linear is not None:
            b, h, s, d = out.shape
            linear(out.transpose(1, 2).reshape(b, s, h * d))
    return meter.total_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
def test_saved_bytes_recompute_exact(dtype, fused):
    b, h, s, d, p = 2, 4, 64, 16, 0.1
    base, q, k, v = make_qkv(b, h, s, d, dtype, fused=fused)
    es = q.element_size()
    qkv_bytes = 3 * b * h * s * d * es  # one storage when fused, three otherwise: same bytes
    expect = qkv_bytes + b * h * s * 4 + 8  # q, k, v, fp32 lse, seed (not the output)
    assert _kept(lambda: attention(q, k, v, dropout_p=p, block_size=16)) == expect
    assert _kept(lambda: attention(q, k, v, None, p, True, block_size=16)) == expect  # causal: no mask tensor
    out = attention(q, k, v, dropout_p=p)
    flat = out.transpose(1, 2).reshape(b, s, h * d)  # what the output projection consumes: a view
    assert flat._is_view() and flat.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    lin = nn.Linear(h * d, 8).to(dtype)  # the projection keeps the output as its input, once
    assert _kept(lambda: attention(q, k, v, dropout_p=p, block_size=16), linear=lin) == expect + b * h * s * d * es
    mask = make_mask("pad", b, h, s, s)  # the caller's mask is kept (shared by all layers)
    assert _kept(lambda: attention(q, k, v, mask, p, block_size=16)) == expect + mask.numel()


def test_saved_bytes_recompute_gqa_and_no_s2():
    def kept(s, hkv=4):
        _, q, k, v = make_qkv(1, 4, s, 8, hkv=hkv)
        return _kept(lambda: attention(q, k, v, None, 0.2, enable_gqa=True))

    assert kept(64, hkv=2) == (64 * 32 + 2 * 64 * 16) * 4 + 4 * 64 * 4 + 8
    assert kept(128) - 8 == 2 * (kept(64) - 8)  # linear in s: nothing s² is kept
    assert kept(256) - 8 == 4 * (kept(64) - 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bytes_tempo_exact(dtype):
    b, h, s, d = 2, 4, 32, 16
    base, q, k, v = make_qkv(b, h, s, d, dtype, fused=True)
    es = q.element_size()
    expect = 3 * b * h * s * d * es + b * h * s * s * es + 8  # q, k, v, P, seed
    assert _kept(lambda: attention(q, k, v, dropout_p=0.1, mode="tempo")) == expect
    mask = make_mask("full", b, h, s, s)  # not kept: backward needs only P
    assert _kept(lambda: attention(q, k, v, mask, 0.1, mode="tempo")) == expect


LEAN_SDPA_CASES = [None, "pad", "causal", "float", "gqa"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("kind", LEAN_SDPA_CASES)
def test_no_dropout_dispatches_to_lean_sdpa(dtype, kind):
    """dropout 0 with q in (b, s, H, d) layout: torch's CPU flash kernel, which keeps q, k, v, out and
    lse (the SDPA-converted float copy of a bool padding mask, b*s_k elements, besides); bf16: the
    recompute core, which keeps the same (and the caller's bool mask as it is)."""
    b, h, s, d = 2, 4, 48, 16
    hkv = 2 if kind == "gqa" else h
    q = torch.randn(b, s, h, d, dtype=dtype).transpose(1, 2).requires_grad_()
    kv = torch.randn(b, s, 2, hkv, d, dtype=dtype).requires_grad_()
    k, v = kv.permute(2, 0, 3, 1, 4)
    mask = make_mask("pad" if kind == "pad" else "float" if kind == "float" else None, b, h, s, s, dtype)
    causal = kind == "causal"
    es = q.element_size()
    lse = b * h * s * (8 if dtype == torch.float64 else 4)
    expect = (b * h * s * d + 2 * b * hkv * s * d + b * h * s * d) * es + lse
    flash = dtype != torch.bfloat16  # 16-bit on the CPU: leanact's core (fp32 accumulation) instead
    expect += 0 if mask is None else mask.numel() * (es if flash or mask.is_floating_point() else 1)
    lin = nn.Linear(h * d, 8).to(dtype)
    outs = []

    def fn():
        outs.append(attention(q, k, v, mask, 0.3, causal, training=False, enable_gqa=kind == "gqa"))
        return outs[-1]

    assert _kept(fn, linear=lin) == expect
    assert (outs[0].grad_fn.name() == "ScaledDotProductFlashAttentionForCpuBackward0") == flash
    ref = reference(q, k, v, mask, 0.0, causal)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype != torch.bfloat16 else dict(rtol=3e-2, atol=3e-2)
    assert torch.allclose(outs[0], ref, **tol)


def test_no_dropout_falls_back_to_recompute():
    """(b, H, s, d) layout or a bool mask with a query dimension: SDPA would keep an s² float mask or
    an output whose transpose is not a view: the recompute path (no seed) is used."""
    b, h, s, d = 1, 2, 32, 8
    _, q, k, v = make_qkv(b, h, s, d)
    expect = 3 * b * h * s * d * 4 + b * h * s * 4  # q, k, v, lse
    assert _kept(lambda: attention(q, k, v)) == expect
    assert _kept(lambda: attention(q, k, v, mode="tempo")) == expect
    mask = make_mask("full", b, h, s, s)
    qt = torch.randn(b, s, h, d).transpose(1, 2).requires_grad_()
    assert _kept(lambda: attention(qt, k, v, mask)) == expect + mask.numel()
    with sdpa_kernel(SDPBackend.MATH):  # flash disabled by the caller: no dispatch either
        assert _kept(lambda: attention(qt, k, v)) == expect


# ---- autograd safety, compile, module ------------------------------------------------------------
@pytest.mark.parametrize("mode,which", [(m, w) for m in ("recompute", "tempo") for w in "qkv"])
def test_inplace_after_forward_raises(mode, which):
    _, q, k, v = make_qkv(1, 2, 8, 4)
    x = {"q": q, "k": k, "v": v}
    out = attention(q, k, v, dropout_p=0.1, mode=mode)
    with torch.no_grad():
        x[which].add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_inplace_on_the_output_is_fine():
    """The output is not kept (backward reads q, k, v and lse): an in-place op on it is differentiated."""
    _, q, k, v = make_qkv(1, 2, 8, 4, torch.float64)
    go = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    plain = torch.autograd.grad(attention(q, k, v, dropout_p=0.1, seed=SEED), (q, k, v), go)
    out = attention(q, k, v, dropout_p=0.1, seed=SEED)
    out.mul_(2)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), go), plain):
        torch.testing.assert_close(a, 2 * b)


@pytest.mark.parametrize("mode", ["recompute", "tempo"])
def test_double_backward_raises(mode):
    _, q, k, v = make_qkv(1, 2, 6, 4, torch.float64)
    out = attention(q, k, v, dropout_p=0.1, mode=mode)
    go = torch.randn(out.shape, dtype=out.dtype, requires_grad=True)
    (gq,) = torch.autograd.grad(out, q, go, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gq.sum().backward()


def test_errors():
    _, q, k, v = make_qkv(1, 2, 6, 4)
    with pytest.raises(ValueError, match="mode"):
        attention(q, k, v, mode="flash")
    # (unlike SDPA, is_causal may come with a mask: the triangle on top of it, tests/test_patch_alibi.py)
    keys = torch.tensor([False, True, True, True, True, True])
    torch.testing.assert_close(attention(q, k, v, keys, is_causal=True),
                               attention(q, k, v, keys & torch.ones(6, 6, dtype=torch.bool).tril()))
    with pytest.raises(ValueError, match="between 0 and 1"):
        attention(q, k, v, dropout_p=1.5)
    assert default_block_size(1, 16, 512, 512) == 128


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode,p,fused",
    [("recompute", 0.2, True), ("tempo", 0.2, True), ("recompute", 0.0, True), ("recompute", 0.0, False)],
)
def test_compile_aot_eager_matches_eager(mode, p, fused):
    """Dropout (python block loops unroll; masks from the seed) and the dropout-0 paths (fused q:
    SDPA; (b, H, s, d) q: the recompute Function)."""
    base, q, k, v = make_qkv(2, 2, 12, 8, fused=fused)
    mask = make_mask("pad", 2, 2, 12, 12)
    leaves = (base,) if fused else (q, k, v)

    def fn(q, k, v, mask):
        return attention(q, k, v, mask, p, mode=mode, block_size=5, seed=SEED)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    eager, comp = fn(q, k, v, mask), compiled(q, k, v, mask)
    # fp32, a softmax over 12 keys: the two may run different SDPA kernels (with one intra-op thread the
    # outputs of size ~1 differ by up to 4 ulps), so a few ulps, as for the gradients below
    assert torch.allclose(eager, comp, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads(eager, leaves), grads(comp, leaves)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_compile_inductor_matches_eager():
    _, q, k, v = make_qkv(1, 2, 20, 8)

    def fn(q, k, v):
        return attention(q, k, v, None, 0.2, True, block_size=8, seed=SEED)

    eager, comp = fn(q, k, v), torch.compile(fn, fullgraph=True)(q, k, v)
    assert torch.allclose(eager, comp, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads(eager, (q, k, v)), grads(comp, (q, k, v))):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_module():
    m = AttentionCore(0.2, mode="tempo", block_size=8)
    assert list(m.parameters()) == [] and "tempo" in repr(m)
    _, q, k, v = make_qkv(1, 2, 10, 4)
    torch.manual_seed(0)
    a = m(q, k, v)
    assert not torch.allclose(a, F.scaled_dot_product_attention(q, k, v), atol=1e-3)
    m.eval()
    assert torch.allclose(m(q, k, v), F.scaled_dot_product_attention(q, k, v), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        AttentionCore(mode="x")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_cuda_matches_reference(p):
    dev = torch.device("cuda")
    q, k, v = (torch.randn(2, 4, 64, 32, device=dev, requires_grad=True) for _ in range(3))
    out = attention(q, k, v, None, p, seed=SEED.to(dev))  # explicit seed: the recompute path
    s = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(32), -1)
    ref = (s * keep_mask_like(SEED.to(dev), s.shape, p, dev) / (1 - p) if p else s) @ v
    assert torch.allclose(out, ref, rtol=1e-3, atol=1e-4)
    for a, r in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        assert torch.allclose(a, r, rtol=1e-3, atol=1e-4)
    assert attention(q, k, v, None, p).shape == out.shape  # fused-kernel dispatch


@pytest.mark.parametrize("seed", [0, 1, -1, 2**63 - 1, 0x0123456789ABCDEF, -(2**40) + 17])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.97])
def test_fast_int32_masks_equal_keep_mask_at_large_indices(seed, p):
    """The eager CPU fast path hashes in int32 lanes (wrapping products, masked shifts); it must
    give keep_mask's int64 words exactly, also for indices near 2^31 and odd (scalar-tail) sizes."""
    b, h, s_q, s_k = 8, 16, 4099, 4093  # 2,146,418,176 elements: just below 2^31
    seed_t = torch.tensor(seed, dtype=torch.int64)
    dropper = core._Dropper(seed_t, p, b, h, s_q, s_k, torch.device("cpu"))
    assert dropper.fast
    for i0, i1, kend in [(s_q - 3, s_q, s_k), (s_q - 2, s_q, 1001), (0, 2, 37)]:
        got = dropper(i0, i1, kend)
        bh = torch.arange(b * h).view(-1, 1, 1) * s_q
        idx = ((bh + torch.arange(i0, i1).view(1, -1, 1)) * s_k + torch.arange(kend).view(1, 1, -1))
        assert idx.max().item() < 2**31
        assert torch.equal(got, keep_mask(seed_t, idx, p).to(torch.uint8))


@pytest.mark.parametrize("mode", ["recompute", "tempo"])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("additive", [False, True])
def test_causal_on_top_of_a_mask_equals_the_combined_mask(mode, p, additive):
    """is_causal together with a (per-key) mask, as the Bloom/Falcon patch calls it: output and
    gradients equal those of the one mask combining both (same seed: same dropout mask), float64."""
    g = torch.Generator().manual_seed(0)
    _, q, k, v = make_qkv(2, 3, 7, 4, dtype=torch.float64, generator=g)
    keys = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    keys[0, ..., :2] = False  # left padding: query row 0 of batch 0 sees no key
    keys[1, ..., 5:] = False
    tril = torch.ones(7, 7, dtype=torch.bool).tril()
    if additive:
        bias = torch.randn(2, 3, 1, 7, generator=g, dtype=torch.float64).masked_fill(~keys, -math.inf)
        both, combined = bias, bias.masked_fill(~tril, -math.inf)
    else:
        both, combined = keys, keys & tril
    dy = torch.randn(2, 3, 7, 4, generator=g, dtype=torch.float64)
    results = []
    for mask, causal in ((both, True), (combined, False)):
        qi, ki, vi = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = attention(qi, ki, vi, mask, p, causal, mode=mode, seed=123)
        out.backward(dy)
        results.append((out.detach(), qi.grad, ki.grad, vi.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rows", [True, False])
def test_a_lone_view_of_a_fused_projection_is_kept_alone(rows):
    """v as the value third of a fused QKV output whose q and k were replaced (RoPE): kept as its own
    copy (v's bytes), not the whole projection; q, k, v all views of one buffer: the buffer, once,
    no copy."""
    b, s, h, d = 2, 16, 4, 8
    qkv = torch.randn(b, s, 3, h, d, requires_grad=True)
    parts = qkv.unbind(2) if rows else qkv.permute(0, 2, 3, 1, 4).unbind(1)  # (b, s, h, d) or (b, h, s, d)
    q, k, v = ((t.transpose(1, 2) if rows else t) for t in parts)
    rotated_q, rotated_k = q * 1.5, k * 0.5  # new storages, as RoPE makes
    alone = v.detach().clone().requires_grad_()  # a value tensor of its own storage (same layout)

    def kept(*qkv_):
        with SavedTensorMeter() as meter:
            out = attention(*qkv_, is_causal=True)
        return meter.total_bytes, out

    own, _ = kept(rotated_q, rotated_k, alone)
    got, out = kept(rotated_q, rotated_k, v)
    assert got == own  # v's own copy: not the (3x) projection
    got, shared = kept(q, k, v)
    assert got == own  # the buffer, once
    want = compose(rotated_q, rotated_k, v, is_causal=True)
    assert torch.allclose(out, want, atol=1e-6) and torch.allclose(shared, compose(q, k, v, is_causal=True), atol=1e-6)
    g1 = torch.autograd.grad(out.sum(), qkv, retain_graph=True)[0]
    g2 = torch.autograd.grad(compose(rotated_q, rotated_k, v, is_causal=True).sum(), qkv)[0]
    assert torch.allclose(g1, g2, atol=1e-5)
