"""The custom ops that stand in for leanact's autograd Functions under ``torch.compile``
(``leanact::recompute_attention``, ``leanact::gated_down``): registered correctly (``opcheck``:
schema, fake implementation, autograd registration), exact (float64 ``gradcheck``, same results as
the eager Function), and keeping under compile what the Function keeps eagerly (traced instead,
AOTAutograd kept the s² probabilities / the product act(g)·u)."""
from __future__ import annotations

import pytest
import torch

from leanact.memory.meter import SavedTensorMeter
from leanact.ops.attention import function as A
from leanact.ops.attention import custom_op as attention_op
from leanact.ops.gated_mlp import function as G

pytestmark = pytest.mark.timeout(600)


def _qkv(dtype=torch.float64, gqa=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, h, hk, s, d = 2, 4, 2 if gqa else 4, 6, 8
    return [torch.randn(*shape, generator=g, dtype=dtype, requires_grad=True)
            for shape in ((b, h, s, d), (b, hk, s, d), (b, hk, s, d))]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["plain", "mask", "softcap", "sinks", "dropout"])
def test_recompute_attention_op(variant):
    q, k, v = _qkv()
    mask = sinks = seed = softcap = None
    p = 0.0
    if variant == "mask":
        mask = torch.ones(2, 1, 6, 6, dtype=torch.float64).tril().log().requires_grad_()  # additive, learned
    if variant == "softcap":
        softcap = 5.0
    if variant == "sinks":
        sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    if variant == "dropout":
        p, seed = 0.3, torch.tensor(7 << 40 | 11, dtype=torch.int64)
    args = (q, k, v, mask, seed, sinks, p, variant != "mask", 8 ** -0.5, 4, softcap)
    torch.library.opcheck(attention_op._forward, args)
    inputs = [t for t in (q, k, v, mask, sinks) if t is not None]

    def op(*ts):
        it = iter(ts)
        q_, k_, v_ = next(it), next(it), next(it)
        m_ = next(it) if mask is not None else None
        s_ = next(it) if sinks is not None else None
        return attention_op.recompute_attention(q_, k_, v_, m_, seed, p, variant != "mask", 8 ** -0.5, 4, softcap,
                                                s_)

    assert torch.autograd.gradcheck(op, inputs)
    got = op(*inputs)
    ref = A.RecomputeAttention.apply(q, k, v, mask, seed, p, variant != "mask", 8 ** -0.5, 4, softcap, sinks)
    assert torch.equal(got, ref)
    go = torch.randn_like(got)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(got, inputs, go),
                                                 torch.autograd.grad(ref, inputs, go)))


def _kept(fn, *args):
    """(output, what autograd keeps, the inputs' gradients for a fixed grad_output)."""
    meter = SavedTensorMeter()
    with meter:
        out = fn(*args)
    kept = sorted((tuple(r.shape), str(r.dtype)) for r in meter.counted())
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
    grads = torch.autograd.grad(out, args, go)
    meter.release()
    return out.detach(), kept, grads


@pytest.mark.parametrize("masked", [False, True])
def test_compiled_attention_keeps_what_eager_keeps(masked):
    torch._dynamo.reset()
    q, k, v = _qkv(torch.float32)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril() if masked else None

    def f(q, k, v):
        return A.attention(q, k, v, mask, is_causal=not masked, enable_gqa=True)

    out_e, kept_e, grads_e = _kept(f, q, k, v)
    out_c, kept_c, grads_c = _kept(torch.compile(f, backend="aot_eager", fullgraph=True), q, k, v)
    assert kept_c == kept_e, (kept_e, kept_c)
    assert not any(s[-2:] == (6, 6) and d != "torch.bool" for s, d in kept_c)  # no s x s probabilities
    assert torch.equal(out_c, out_e)
    for a, b in zip(grads_c, grads_e):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", G.GATED_ACTIVATIONS)
def test_gated_down_op(kind):
    gen = torch.Generator().manual_seed(1)
    g, u = (torch.randn(3, 5, 6, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.randn(4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(G._gated_down_op, (g, u, w, b, kind, None))
    torch.library.opcheck(G._gated_down_op, (g, u, w, None, kind, None))
    assert torch.autograd.gradcheck(lambda *t: G._gated_down_op(*t, kind, None), (g, u, w, b))
    got, ref = G._gated_down_op(g, u, w, b, kind, None), G.GatedDownFunction.apply(g, u, w, b, kind, None)
    assert torch.equal(got, ref)


def test_compiled_gated_down_keeps_g_and_u():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(2)
    g, u = (torch.randn(2, 5, 16, generator=gen, requires_grad=True) for _ in range(2))
    w = torch.nn.Parameter(torch.randn(8, 16, generator=gen))  # a parameter: not counted

    def f(g, u):
        return G.gated_down(g, u, w, None, "silu")

    out_e, kept_e, grads_e = _kept(f, g, u)
    out_c, kept_c, grads_c = _kept(torch.compile(f, backend="aot_eager", fullgraph=True), g, u)
    assert kept_e == kept_c == [((2, 5, 16), "torch.float32")] * 2
    assert torch.equal(out_c, out_e)
    assert all(torch.equal(a, b) for a, b in zip(grads_c, grads_e))


@pytest.mark.parametrize("transposed", [False, True])
def test_recast_linear_op(transposed):
    """``leanact::recast_linear`` (a Linear under autocast while compiling): opcheck-clean, float64
    gradcheck (the cast is then the identity), and bitwise autocast's Linear in bf16."""
    from leanact.ops import recast_linear as R

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(*((6, 4) if transposed else (4, 6)), generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(R._recast_linear_op, (x, w, b, transposed))
    torch.library.opcheck(R._recast_linear_op, (x, w, None, transposed))
    assert torch.autograd.gradcheck(lambda *t: R._recast_linear_op(*t, transposed), (x, w, b))
    xs, ws, bs = (t.detach().float().requires_grad_() for t in (x, w, b))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.addmm(bs, xs, ws) if transposed else torch.nn.functional.linear(xs, ws, bs)
    want_g = torch.autograd.grad(want.float().sum(), (xs, ws, bs))
    got = R.compiled_recast_linear(xs, ws, bs, torch.bfloat16, transposed)
    got_g = torch.autograd.grad(got.float().sum(), (xs, ws, bs))
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
    assert all(a.dtype == c.dtype and torch.equal(a, c) for a, c in zip(got_g, want_g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_backward_op(dtype):
    """``leanact::gelu_backward`` (GELU's backward while compiling): opcheck-clean and bitwise the
    eager backward."""
    from leanact.ops.gelu import function as Gl

    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(4)).to(dtype).requires_grad_()
    y, bits = Gl._forward(x.detach(), "none", with_bits=True)
    dy = torch.randn_like(y)
    torch.library.opcheck(Gl._gelu_backward_op, (y, bits, dy, "none"))
    want = torch.autograd.grad(Gl.gelu(x), x, dy)[0]
    assert torch.equal(Gl._gelu_backward_op(y, bits, dy, "none"), want)
