"""leanact::linear_cross_entropy, the fused linear + cross-entropy as a torch.library custom op
(what torch.compile sees of the fused head): opcheck-clean, float64 gradcheck, fp32 and bf16 against
plain PyTorch, one node under torch.compile, and the memory of eager's grad_in_forward."""
import pytest
import torch
import torch.nn.functional as F

from leanact.ops.cross_entropy import linear_cross_entropy
from leanact.ops.cross_entropy.custom_op import _forward, linear_cross_entropy_op


def _inputs(dtype, bias=True, n=14, h=8, v=21, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g, dtype=torch.float64) / 2).to(dtype).requires_grad_()
    b = torch.randn(v, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    y = torch.randint(0, v, (n,), generator=g)
    y[2] = y[9] = -100
    return x, w, b, y


OPTIONS = [dict(), dict(label_smoothing=0.1), dict(scale=0.5, softcap=3.0)]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_opcheck(options, reduction):
    x, w, b, y = _inputs(torch.float32)
    full = dict(dict(label_smoothing=0.0, scale=1.0, softcap=None), **options)
    torch.library.opcheck(_forward, (x, w, y, b, -100, reduction, full["label_smoothing"], full["scale"],
                                     full["softcap"], torch.float32, [True, True, True]))
    torch.library.opcheck(_forward, (x.detach(), w, y, None, -100, reduction, full["label_smoothing"], full["scale"],
                                     full["softcap"], torch.float32, [False, True, False]))


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradcheck_float64(options, reduction):
    x, w, b, y = _inputs(torch.float64)

    def f(x, w, b):
        return linear_cross_entropy_op(x, w, y, b, ignore_index=-100, reduction=reduction, cdtype=torch.float64,
                                       **dict(dict(label_smoothing=0.0, scale=1.0, softcap=None), **options))

    assert torch.autograd.gradcheck(f, (x, w, b))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, None)])
def test_matches_plain_pytorch(dtype, tol):
    """Bitwise the eager fused op with grad_in_forward (the same chunks: tests/test_linear_cross_entropy.py
    holds it to plain PyTorch in every dtype); fp32 also within 1e-5 of F.cross_entropy(F.linear(...).float())."""
    x, w, b, y = _inputs(dtype)
    kw = dict(ignore_index=-100, reduction="mean", label_smoothing=0.1, scale=1.0, softcap=None)
    got = linear_cross_entropy_op(x, w, y, b, cdtype=dtype, **kw)
    grads = torch.autograd.grad(got, (x, w, b))
    eager = linear_cross_entropy(x, w, y, b, grad_in_forward=True, ignore_index=-100, label_smoothing=0.1)
    assert torch.equal(got, eager)
    assert all(torch.equal(a, e) for a, e in zip(grads, torch.autograd.grad(eager, (x, w, b))))
    if tol is not None:
        want = F.cross_entropy(F.linear(x, w, b).float(), y, label_smoothing=0.1)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        for a, e in zip(grads, torch.autograd.grad(want, (x, w, b))):
            torch.testing.assert_close(a, e, rtol=tol, atol=tol)


def test_keeps_the_gradients_only():
    """Kept for backward: dx, dW, db (computed in forward, as eager's grad_in_forward), not x or logits."""
    x, w, b, y = _inputs(torch.float32)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        linear_cross_entropy_op(x, w, y, b, ignore_index=-100, reduction="sum", label_smoothing=0.0, scale=1.0,
                                softcap=None, cdtype=torch.float32)
    assert sorted(tuple(t.shape) for t in kept) == sorted([tuple(x.shape), tuple(w.shape), tuple(b.shape)])
    assert all(getattr(t, "_leanact_gradient", False) for t in kept)


@pytest.mark.slow
def test_one_node_under_compile():
    x, w, b, y = _inputs(torch.float32)

    def f(x, w, b):
        return linear_cross_entropy_op(x, w, y, b, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                                       scale=1.0, softcap=2.0, cdtype=torch.float32)

    want = f(x, w, b)
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(x, w, b)
    assert torch.equal(got, want)
    for a, e in zip(torch.autograd.grad(got, (x, w, b)), torch.autograd.grad(want, (x, w, b))):
        assert torch.equal(a, e)


def test_bad_reduction_is_refused():
    x, w, b, y = _inputs(torch.float32)
    with pytest.raises(ValueError, match="reduction 'mean' or 'sum'"):
        linear_cross_entropy_op(x, w, y, b, ignore_index=-100, reduction="none", label_smoothing=0.0, scale=1.0,
                                softcap=None, cdtype=torch.float32)
