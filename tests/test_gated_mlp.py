"""leanact.ops.gated_mlp: linear(act(g) * u, W, b) keeping g and u only (SwiGLU, GeGLU erf / tanh;
separate or fused gate/up), and the patched gated MLPs of Gemma (GeGLU), Phi-3 (fused gate_up_proj)
and OLMo 2 under outer saved-tensor hooks."""
import copy

import pytest
import torch
import torch.nn.functional as F

from leanact.memory import SavedTensorMeter
from leanact.ops.gated_mlp import GATED_ACTIVATIONS, gated_act, gated_down

from _tol import within_rounding_bound

N, I, H = 6, 12, 8  # noqa: E741 (I: the intermediate size, as in the formulas)


def _inputs(dtype, fused, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    if fused:
        gu = torch.randn(2, N // 2, 2 * I, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
        a, b = gu.chunk(2, dim=-1)
        leaves = [gu]
    else:
        a, b = (torch.randn(2, N // 2, I, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
                for _ in range(2))
        leaves = [a, b]
    w = (torch.randn(H, I, generator=g, dtype=torch.float64) / I ** 0.5).to(dtype).requires_grad_()
    bb = torch.randn(H, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    return a, b, w, bb, leaves + [w] + ([bb] if bias else [])


def _plain(kind, a, b, w, bb):
    return F.linear(gated_act(kind, a) * b, w, bb)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kind", GATED_ACTIVATIONS)
def test_gradcheck_float64(kind, fused):
    a, b, w, bb, _ = _inputs(torch.float64, fused=False)
    assert torch.autograd.gradcheck(lambda a, b, w, bb: gated_down(a, b, w, bb, kind), (a, b, w, bb))
    assert torch.autograd.gradgradcheck(lambda a, b, w, bb: gated_down(a, b, w, bb, kind), (a, b, w, bb))
    if fused:
        gu = torch.cat([a, b], -1).detach().requires_grad_()
        assert torch.autograd.gradcheck(lambda gu, w: gated_down(*gu.chunk(2, -1), w, None, kind), (gu, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kind", GATED_ACTIVATIONS)
def test_matches_plain_torch(kind, fused, dtype):
    """Output and the gradients of g and u bitwise torch's (the same kernels); the weight and bias
    gradients within the rounding of their reduction over the N rows against float64."""
    a, b, w, bb, leaves = _inputs(dtype, fused)
    a2, b2, w2, bb2, leaves2 = _inputs(dtype, fused)
    y, y2 = gated_down(a, b, w, bb, kind), _plain(kind, a2, b2, w2, bb2)
    assert torch.equal(y, y2)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    y.backward(dy)
    y2.backward(dy)
    for p, q in zip(leaves[:-2], leaves2[:-2]):  # g and u (or the fused gu)
        assert torch.equal(p.grad, q.grad)
    a64, b64, w64, bb64 = (t.detach().double().requires_grad_() for t in (a, b, w, bb))
    _plain(kind, a64, b64, w64, bb64).backward(dy.double())
    for got, truth in ((w.grad, w64.grad), (bb.grad, bb64.grad)):
        ok, err, bound = within_rounding_bound(got, truth, dtype, 2 * N + 8)
        assert ok, (err, bound)


def test_autocast_casts_like_linear():
    """Under bf16 autocast (fp32 weight): output bitwise F.linear's under autocast, weight gradient
    in fp32 as autocast's cast backward returns it."""
    a, b, w, bb, leaves = _inputs(torch.bfloat16, False)
    w32, bb32 = w.detach().float().requires_grad_(), bb.detach().float().requires_grad_()
    w32b, bb32b = w32.detach().clone().requires_grad_(), bb32.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = gated_down(a, b, w32, bb32, "silu")
        y2 = _plain("silu", a.detach(), b.detach(), w32b, bb32b)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y2)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y.backward(dy)
    y2.backward(dy)
    assert w32.grad.dtype == torch.float32 and bb32.grad.dtype == torch.float32
    torch.testing.assert_close(w32.grad, w32b.grad, rtol=2 ** -7, atol=0)
    torch.testing.assert_close(bb32.grad, bb32b.grad, rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
def test_kept_bytes_exact(fused, dtype):
    """Kept: g and u (2·N·I elements; one storage when fused); plain torch keeps act(g) and the
    product too (4·N·I)."""
    e = torch.finfo(dtype).bits // 8
    lin = torch.nn.Linear(I, H).to(dtype)  # its parameters are excluded by the meter
    src = torch.randn(2, N // 2, 2 * I).to(dtype).requires_grad_()
    for lean, n in ((True, 2), (False, 4)):
        meter = SavedTensorMeter(lin, exclude=[src])
        with meter:
            if fused:
                a, b = (src * 1).chunk(2, -1)
            else:
                a, b = src[..., :I] * 1, src[..., I:] * 1
            y = (gated_down(a, b, lin.weight, lin.bias, "gelu_tanh") if lean
                 else _plain("gelu_tanh", a, b, lin.weight, lin.bias))
        meter.attribute(y)
        assert meter.total_bytes == n * N * I * e, meter.by_op()
        if lean:
            assert dict(meter.by_op()) == {"GatedDownFunction": 2 * N * I * e}


def _family_mlp(family, dtype=torch.float32):
    import _families as Fam

    try:
        model = Fam.build(family, "sdpa")
    except Fam.Unsupported:
        model = Fam.build(family, "eager")
    return model.model.layers[0].mlp.to(dtype)


@pytest.mark.parametrize("family, kind", [("llama", "silu"), ("gemma", "gelu_tanh"), ("phi3", "silu"),
                                          ("olmo2", "silu")])
def test_family_mlps_are_lean(family, kind):
    from leanact.patching.hf_swiglu import hf_swiglu_replacement

    ref = _family_mlp(family)
    lean, reason = hf_swiglu_replacement(copy.deepcopy(ref))
    assert reason is None and lean._leanact_gated[3] == kind
    x = torch.randn(2, 5, ref.down_proj.out_features, generator=torch.Generator().manual_seed(0))
    meter = SavedTensorMeter(lean, exclude=[x])
    with meter:
        lean(x.requires_grad_())
    inter = ref.down_proj.in_features
    assert meter.total_bytes == 2 * 10 * inter * 4  # g and u


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outer_saved_tensor_hooks_see_what_leanact_keeps(dtype):
    """Inside a user's saved-tensor hooks (a counting hook) the patched MLP still keeps only g and
    u, and the hooks see them; under torch's save_on_cpu, outputs and gradients equal HF's."""
    from leanact.patching.hf_swiglu import hf_swiglu_replacement

    ref = _family_mlp("llama", dtype)
    lean, _ = hf_swiglu_replacement(copy.deepcopy(ref))
    e, inter = torch.finfo(dtype).bits // 8, ref.down_proj.in_features
    x = torch.randn(2, 5, ref.down_proj.out_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    params = {p.untyped_storage()._cdata for m in (ref, lean) for p in m.parameters()}
    for mod, n in ((lean, 2), (ref, 4)):
        seen = {}

        def pack(t):
            key = t.untyped_storage()._cdata
            if key not in params and key != x.untyped_storage()._cdata:
                seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t

        xi = x.clone().requires_grad_()
        x = xi
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mod(xi)
        assert sum(seen.values()) == n * 10 * inter * e, (mod is lean, seen)
    xs = [x.detach().clone().requires_grad_() for _ in range(2)]
    dy = torch.randn(2, 5, x.shape[-1], generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.autograd.graph.save_on_cpu():
        y_lean = lean(xs[0])
    y_ref = ref(xs[1])
    assert torch.equal(y_lean, y_ref)
    y_lean.backward(dy)
    y_ref.backward(dy)
    assert torch.equal(xs[0].grad, xs[1].grad)
