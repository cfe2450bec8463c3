"""Dropout that keeps only an 8-byte seed: values, gradients, statistics, memory, compile."""
import math

import pytest
import torch
from torch import nn

import leanact.ops.dropout.function as D
from leanact.memory import SavedTensorMeter, saved_bytes
from leanact.nn.dropout import Dropout
from leanact.ops.dropout.function import dropout, dropout_seeded
from leanact.ops.random import CHUNK, keep_mask_like

TOL = {torch.float64: dict(rtol=1e-12, atol=0), torch.float32: dict(rtol=1e-6, atol=0),
       torch.bfloat16: dict(rtol=2**-7, atol=0)}


def _nonzero(*shape, dtype=torch.float32, requires_grad=False):
    """Random values bounded away from 0 (so the mask can be read off the output)."""
    x = torch.rand(*shape, dtype=torch.float64) + 0.5
    x = torch.where(torch.rand(*shape) < 0.5, -x, x).to(dtype)
    return x.requires_grad_(requires_grad)


# ---- values --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(7,), (3, 5, 7), (257, 1031), (2, 3, CHUNK + 1)])
def test_matches_plain_torch(dtype, shape):
    p, seed = 0.3, torch.tensor(123456789)
    x = torch.randn(shape, dtype=dtype)
    mask = keep_mask_like(seed, x.shape, p)
    assert torch.allclose(dropout_seeded(x, seed, p), x * mask / (1 - p), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs(dtype):
    p, seed = 0.4, torch.tensor(-987)
    base = torch.randn(300, 520, dtype=dtype)
    views = (lambda t: t.t(), lambda t: t[::2, 1::3], lambda t: t.t()[:, :200],
             lambda t: t.unsqueeze(0).expand(2, 300, 520))
    for view in views:
        x = view(base)
        assert not x.is_contiguous()
        ref = x * keep_mask_like(seed, x.shape, p) / (1 - p)
        assert torch.allclose(dropout_seeded(x, seed, p), ref, **TOL[dtype])
        if x.stride(0) != 0:  # in place on a non-contiguous view of a fresh buffer
            v = view(base.clone())
            assert dropout_seeded(v, seed, p, inplace=True) is v
            assert torch.allclose(v, ref, **TOL[dtype])


def test_inplace_non_contiguous_large():
    p, seed = 0.25, torch.tensor(5)
    x = torch.randn(600, 300).t()  # non-contiguous, > CHUNK elements (the chunked path)
    assert x.numel() > CHUNK
    ref = x * keep_mask_like(seed, x.shape, p) / (1 - p)
    out = dropout_seeded(x, seed, p, inplace=True)
    assert out is x and torch.allclose(x, ref, rtol=1e-6, atol=0)


def test_chunked_and_single_expression_paths_agree(monkeypatch):
    x, seed = torch.randn(3, CHUNK + 777), torch.tensor(31337)
    chunked = dropout_seeded(x, seed, 0.6)
    monkeypatch.setattr(D, "_eager_chunks", lambda *args: False)
    assert torch.equal(dropout_seeded(x, seed, 0.6), chunked)


# ---- gradients ------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_backward_is_dy_times_forward_mask(p):
    x = _nonzero(129, 1025, requires_grad=True)
    y = dropout(x, p)
    mask = y.detach() != 0
    dy = torch.randn_like(y)
    y.backward(dy)
    assert torch.allclose(x.grad, dy * mask / (1 - p), rtol=1e-6, atol=0)
    assert torch.allclose(y.detach(), x.detach() * mask / (1 - p), rtol=1e-6, atol=0)


def test_mask_regenerated_despite_other_random_calls():
    x = _nonzero(64, 2000, requires_grad=True)
    y = dropout(x, 0.5)
    mask = y.detach() != 0
    torch.rand(1000)  # other random calls between forward and backward
    other = dropout(torch.randn(64, 2000, requires_grad=True), 0.5)
    torch.manual_seed(999)
    torch.randn(10)
    y.sum().backward()
    assert torch.equal(x.grad, mask * 2.0)
    assert not torch.equal(other != 0, mask)


def test_gradcheck_float64():
    x = torch.randn(6, 11, dtype=torch.float64, requires_grad=True)
    fn = lambda t: dropout_seeded(t, torch.tensor(77), 0.35)  # noqa: E731  fixed seed: one mask
    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


def test_double_backward_random_seed():
    x = _nonzero(50, 40, dtype=torch.float64, requires_grad=True)
    y = dropout(x, 0.3)
    mask, s = (y.detach() != 0).double(), 1 / 0.7
    (g,) = torch.autograd.grad((y**2).sum(), x, create_graph=True)  # 2 x m s^2
    assert torch.allclose(g, 2 * x.detach() * mask * s * s)
    g.sum().backward()
    assert torch.allclose(x.grad, 2 * mask * s * s)


def test_inplace_changes_after_forward_do_not_corrupt_gradient():
    x = _nonzero(300, 400, requires_grad=True)
    a = x * 1.0  # non-leaf input
    y = dropout(a, 0.4)
    mask = y.detach() != 0
    a.add_(1)  # dropout kept no input, so this is allowed and harmless
    (y * 3).sum().backward()
    assert torch.allclose(x.grad, 3 * mask / 0.6, rtol=1e-6)
    x.grad = None
    y = dropout(x * 1.0, 0.4)
    mask = y.detach() != 0
    y.mul_(2)  # in place on the output
    y.sum().backward()
    assert torch.allclose(x.grad, 2 * mask / 0.6, rtol=1e-6)


# ---- modes, p edge cases, in place ------------------------------------------------------------
def test_eval_and_p0_are_identity():
    x = torch.randn(10, 10, requires_grad=True)
    assert dropout(x, 0.5, training=False) is x and dropout(x, 0.0) is x
    assert saved_bytes(lambda: dropout(x, 0.5, training=False)) == 0
    m = Dropout(0.5).eval()
    assert m(x) is x


def test_p1_zeros_and_zero_gradient():
    x = torch.randn(10, 10, requires_grad=True)
    y = dropout(x, 1.0)
    assert torch.equal(y, torch.zeros_like(x)) and saved_bytes(lambda: dropout(x, 1.0)) == 0
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    a = torch.randn(5)
    assert dropout(a, 1.0, inplace=True) is a and torch.equal(a, torch.zeros(5))


@pytest.mark.parametrize("p", [-0.1, 1.1, 2])
def test_bad_p(p):
    x = torch.randn(3)
    for fn in (lambda: dropout(x, p), lambda: dropout(x, p, training=False), lambda: dropout_seeded(x, 1, p),
               lambda: Dropout(p)):
        with pytest.raises(ValueError, match=f"between 0 and 1, but got {p}"):
            fn()


def test_inplace_like_torch():
    x = _nonzero(100, 700, requires_grad=True)
    a = x * 1.0
    out = dropout(a, 0.5, inplace=True)
    assert out is a and a.grad_fn is not None
    mask = a.detach() != 0
    a.sum().backward()
    assert torch.equal(x.grad, mask * 2.0)
    # torch's errors for a leaf (or a view of one) requiring grad, raised before x is touched
    before = x.detach().clone()
    for bad in (x, x[:, :10]):
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            dropout(bad, 0.5, inplace=True)
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            nn.functional.dropout(bad, 0.5, inplace=True)
    assert torch.equal(x.detach(), before)
    with torch.no_grad():  # allowed without grad, like torch
        assert dropout(x, 0.5, inplace=True) is x and bool((x == 0).any())
    # in place on a view of a non-leaf
    x = _nonzero(100, 700, requires_grad=True)
    b = x * 1.0
    v = dropout(b[:, 3:9], 0.5, inplace=True)
    w = torch.arange(700.0)
    (b * w).sum().backward()
    expected = w.expand(100, 700).clone()
    expected[:, 3:9] *= (v.detach() != 0) * 2.0
    assert torch.equal(x.grad, expected)


# ---- randomness ------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_fraction_kept(p):
    x = torch.ones(1 << 20)
    kept = float((dropout(x, p) != 0).double().mean())
    assert abs(kept - (1 - p)) < 5 * math.sqrt(p * (1 - p) / x.numel())


def test_masks_differ_and_reproducible():
    x = torch.ones(1000, 100)
    torch.manual_seed(0)
    a, b = dropout(x, 0.5), dropout(x, 0.5)
    assert not torch.equal(a, b)
    torch.manual_seed(0)
    assert torch.equal(dropout(x, 0.5), a)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(dropout(x, 0.5, generator=g1), dropout(x, 0.5, generator=g2))
    # correlation between two calls' masks is small
    ma, mb = (a != 0).double().flatten(), (b != 0).double().flatten()
    r = float(((ma - ma.mean()) * (mb - mb.mean())).mean() / (ma.std() * mb.std()))
    assert abs(r) * math.sqrt(ma.numel()) < 5


# ---- memory ----------------------------------------------------------------------------------
def test_saves_exactly_one_int64_seed():
    x = torch.randn(512, 1024, requires_grad=True)
    assert saved_bytes(lambda: dropout(x * 1.0, 0.1), exclude=[x]) == 8
    meter = SavedTensorMeter(exclude=[x])
    with meter:
        y = dropout(x, 0.1)
    [rec] = meter.records
    assert rec.shape == () and rec.dtype == torch.int64 and rec.storage_nbytes == 8
    assert saved_bytes(lambda: nn.functional.dropout(x, 0.1), exclude=[x]) >= x.numel()  # torch keeps a mask
    del y


def test_linear_dropout_linear_keeps_nothing_of_input_size():
    x = torch.randn(64, 256)
    with_drop = nn.Sequential(nn.Linear(256, 512), Dropout(0.1), nn.Linear(512, 256))
    without = nn.Sequential(with_drop[0], nn.Identity(), with_drop[2])
    b_drop = saved_bytes(lambda: with_drop(x), model=with_drop)
    b_none = saved_bytes(lambda: without(x), model=without)
    assert b_drop - b_none == 8  # the seed; the 2nd linear keeps its input in both cases
    torch_drop = nn.Sequential(with_drop[0], nn.Dropout(0.1), with_drop[2])
    assert saved_bytes(lambda: torch_drop(x), model=torch_drop) - b_none >= 64 * 512


def test_meta_and_fake_tensors():
    """Shape-only runs (meta device, FakeTensorMode) work and keep the same 8 bytes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(1000, 1000, device="meta", requires_grad=True)
    assert saved_bytes(lambda: Dropout(0.1)(x)) == 8
    with FakeTensorMode():
        x = torch.randn(1000, 1000, requires_grad=True)
        y = dropout(x, 0.1)
        y.sum().backward()
        assert y.shape == x.grad.shape == (1000, 1000)


# ---- module ----------------------------------------------------------------------------------
def test_module_is_drop_in():
    m, ref = Dropout(0.25, inplace=True), nn.Dropout(0.25, inplace=True)
    assert isinstance(m, nn.Dropout) and repr(m) == repr(ref) == "Dropout(p=0.25, inplace=True)"
    assert m.p == 0.25 and m.inplace is True and m.state_dict() == {} and list(m.parameters()) == []
    assert repr(Dropout()) == repr(nn.Dropout())
    x = torch.ones(10000)
    y = Dropout(0.5)(x)
    assert set(y.unique().tolist()) == {0.0, 2.0}
    assert Dropout(0.5).eval()(x) is x
    a = torch.ones(100)
    assert m(a) is a


# ---- compile ---------------------------------------------------------------------------------
def _model_fn(x):
    return dropout(torch.tanh(x) * 2, 0.3).sin()


@pytest.mark.slow
def test_compile_aot_eager_matches_eager():
    x = torch.randn(300, 500, requires_grad=True)
    torch.manual_seed(1)
    y = _model_fn(x)
    y.sum().backward()
    g, x.grad = x.grad, None
    compiled = torch.compile(_model_fn, fullgraph=True, backend="aot_eager")
    torch.manual_seed(1)
    yc = compiled(x)
    yc.sum().backward()
    assert torch.equal(yc, y) and torch.equal(x.grad, g)


@pytest.mark.slow
@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
def test_compile_saves_only_the_seed(partitioner):
    """Under AOTAutograd (min-cut is inductor's partitioner) the mask is recomputed, not saved."""
    from functorch.compile import default_partition, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    saved = []

    def fw_compiler(gm, _):
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        saved.extend(o.meta["val"] for o in outputs[1:])  # outputs[0] is the user's output
        return gm.forward

    part = {"default": default_partition, "min_cut": min_cut_rematerialization_partition}[partitioner]
    backend = aot_autograd(fw_compiler=fw_compiler, bw_compiler=lambda gm, _: gm.forward, partition_fn=part)
    x = torch.randn(100, 200, requires_grad=True)
    torch.compile(lambda t: dropout(t, 0.3).sum(), backend=backend, fullgraph=True)(x).backward()
    assert [(tuple(t.shape), t.dtype) for t in saved] == [((), torch.int64)]
    assert set(x.grad.unique().tolist()) <= {0.0, torch.tensor(1 / 0.7).item()}


@pytest.mark.slow
def test_compile_inductor_matches_eager():
    def fn(x, seed):
        return dropout_seeded(torch.tanh(x) * 2, seed, 0.3).sin()

    x, seed = torch.randn(300, 500, requires_grad=True), torch.tensor(2**50 + 3)
    y = fn(x, seed)
    y.sum().backward()
    g, x.grad = x.grad, None
    yc = torch.compile(fn, fullgraph=True, backend="inductor")(x, seed)
    yc.sum().backward()
    assert torch.equal(yc != 0, y != 0)
    assert torch.allclose(yc, y, rtol=1e-5, atol=1e-6) and torch.allclose(x.grad, g, rtol=1e-5, atol=1e-6)
