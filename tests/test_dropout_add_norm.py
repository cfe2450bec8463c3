"""leanact.ops.norms.dropout_add_norm: LayerNorm(dropout(h) + residual) as one op keeping y, rstd and a seed.

On the PyTorch path (the CPU) the op must be bitwise leanact's dropout, ``+`` and LayerNorm run one
after the other (the same mask, the same roundings, the same random stream afterwards), keep
exactly y, rstd and the seed, and fall back to that composition wherever it does not apply. Its
Function has a float64 gradcheck; the Triton kernels are tested under the interpreter in
tests/test_triton_kernels.py.
"""
import pytest
import torch
import torch.nn.functional as F

from leanact.memory.meter import saved_bytes
from leanact.ops.dropout.function import dropout
from leanact.ops.norms.dropout_add_norm import DropoutAddLayerNorm, dropout_add_layer_norm
from leanact.ops.norms.layer_norm import layer_norm
from leanact.ops.random import keep_mask_like

from _tol import within_rounding_bound

DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.float16, torch.float32), (torch.float64, torch.float64)]


def _inputs(h_dtype, r_dtype, shape=(3, 5, 24), affine="wb", seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.promote_types(h_dtype, r_dtype)
    h = torch.randn(shape, generator=g).to(h_dtype).requires_grad_()
    r = (torch.randn(shape, generator=g) * 2).to(r_dtype).requires_grad_()
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(z).requires_grad_() if "w" in affine else None
    b = (torch.randn(shape[-1], generator=g) * 0.3).to(z).requires_grad_() if "b" in affine else None
    dy = torch.randn(shape, generator=g).to(z)
    return h, r, w, b, dy


def _run(fn, h, r, w, b, dy, seed=5):
    torch.manual_seed(seed)
    y = fn(h, r, w, b)
    after = torch.randint(0, 1 << 30, ())  # the random stream after the op
    leaves = [t for t in (h, r, w, b) if t is not None and t.requires_grad]
    return y, torch.autograd.grad(y, leaves, dy), after, y.grad_fn


@pytest.mark.parametrize("h_dtype,r_dtype", DTYPES)
@pytest.mark.parametrize("affine", ["wb", "w", "none"])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_bitwise_the_three_lean_ops(h_dtype, r_dtype, affine, p):
    n = 24
    args = _inputs(h_dtype, r_dtype, affine=affine)
    fused = _run(lambda h, r, w, b: dropout_add_layer_norm(h, r, n, w, b, 1e-5, p), *args)
    ref = _run(lambda h, r, w, b: layer_norm(dropout(h, p) + r, (n,), w, b, 1e-5), *args)
    assert type(fused[3]).__name__ == "DropoutAddLayerNormBackward"
    assert fused[0].dtype == ref[0].dtype == torch.promote_types(h_dtype, r_dtype)
    assert torch.equal(fused[0], ref[0])
    assert len(fused[1]) == len(ref[1]) and all(torch.equal(a, c) for a, c in zip(fused[1], ref[1]))
    assert torch.equal(fused[2], ref[2])  # one seed drawn (p > 0), as the dropout draws it


@pytest.mark.parametrize("h_dtype,r_dtype", DTYPES[:4])
def test_against_torch_with_the_same_mask(h_dtype, r_dtype):
    """F.dropout's mask is torch's RNG: with leanact's mask applied by hand, torch's ops in float64
    are the truth. Bounds (tests/_tol.py: chain length x u x magnitude): y rounds the sum once, then
    two reductions over the n channels and a few elementwise steps (2n + 8); h's and the residual's
    gradients add the backward's two reductions over n (4n + 8); dγ, dβ sum that over the rows, so
    their magnitude is Σ_rows |dy·x̂| (|dy|), not the result's."""
    n, p = 24, 0.3
    h, r, w, b, dy = _inputs(h_dtype, r_dtype)
    torch.manual_seed(9)
    y = dropout_add_layer_norm(h, r, n, w, b, 1e-5, p)
    grads = torch.autograd.grad(y, (h, r, w, b), dy)
    torch.manual_seed(9)
    keep = keep_mask_like(torch.randint(-(1 << 63), (1 << 63) - 1, (), dtype=torch.int64), h.shape, p)
    h64, r64, w64, b64 = (t.detach().double().requires_grad_() for t in (h, r, w, b))
    d64 = (h64 * keep / (1 - p)).to(h_dtype).double() if h_dtype != torch.float64 else h64 * keep / (1 - p)
    y64 = F.layer_norm(d64 + r64, (n,), w64, b64, 1e-5)
    truth = torch.autograd.grad(y64, (h64, r64, w64, b64), dy.double())
    z = torch.promote_types(h_dtype, r_dtype)
    ok, err, bound = within_rounding_bound(y, y64, z, 2 * n + 8)
    assert ok, (err, bound)
    for g, t, dt in zip(grads[:2], truth[:2], (h_dtype, r_dtype)):
        ok, err, bound = within_rounding_bound(g, t, dt, 4 * n + 8)
        assert ok, (err, bound)
    rows = h.numel() // n
    xhat = ((y64 - b64) / w64).detach()
    dy64 = dy.double().reshape(rows, n)
    u = torch.finfo(z).eps / 2
    for g, t, mag in ((grads[2], truth[2], (dy64 * xhat.reshape(rows, n)).abs().sum(0)),
                      (grads[3], truth[3], dy64.abs().sum(0))):
        assert bool(((g.double() - t).abs() <= (4 * n + 8 + rows) * u * mag).all())


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    h, r = (torch.randn(2, 3, 6, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    w = (torch.rand(6, dtype=torch.float64, generator=g) + 0.5).requires_grad_()
    b = torch.randn(6, dtype=torch.float64, generator=g).requires_grad_()
    f64 = torch.float64
    for seed in (torch.tensor(123), None):
        def fn(h, r, w, b, seed=seed):
            return DropoutAddLayerNorm.apply(h, r, w, b, seed, 0.3, (6,), 1e-5, f64, f64)

        assert torch.autograd.gradcheck(fn, (h, r, w, b))
        assert torch.autograd.gradcheck(lambda h, r: fn(h, r, None, None), (h, r))


@pytest.mark.parametrize("h_dtype,r_dtype", DTYPES[:3])
def test_keeps_y_rstd_and_the_seed_only(h_dtype, r_dtype):
    """Kept (storages, parameters excluded): y, one rstd per row (the CPU kernel's: the input dtype),
    the 8-byte seed. Not h, the residual, their sum or a mask."""
    h, r, w, b, _ = _inputs(h_dtype, r_dtype, shape=(4, 8, 32))
    z = torch.promote_types(h_dtype, r_dtype)
    rows = 32
    got = saved_bytes(lambda: dropout_add_layer_norm(h, r, 32, w, b, 1e-5, 0.1), exclude=[w, b])
    assert got == rows * 32 * z.itemsize + rows * z.itemsize + 8
    composite = saved_bytes(lambda: layer_norm(dropout(h, 0.1) + r, (32,), w, b), exclude=[w, b])
    assert got == composite


def test_falls_back_to_the_composition():
    h, r, w, b, dy = _inputs(torch.float32, torch.float32)
    with torch.no_grad():  # no autograd: nothing kept, the same values
        torch.manual_seed(2)
        a = dropout_add_layer_norm(h, r, 24, w, b, 1e-5, 0.3)
        torch.manual_seed(2)
        assert torch.equal(a, layer_norm(dropout(h, 0.3) + r, (24,), w, b))
    y = dropout_add_layer_norm(h, r[:1], 24, w, b, 1e-5, 0.3)  # a broadcast residual
    assert type(y.grad_fn).__name__ == "LayerNormFromOutputBackward"
    y = dropout_add_layer_norm(h, r, 24, w, b, 1e-5, 1.0)  # p = 1: the residual alone
    assert torch.equal(y, layer_norm(r, (24,), w, b))
    y = dropout_add_layer_norm(h, r, 24, w, b, 1e-5, 0.3, training=False)  # eval: no dropout, still fused
    assert torch.equal(y, layer_norm(h + r, (24,), w, b))
    assert type(y.grad_fn).__name__ == "DropoutAddLayerNormBackward"
    w0 = w.detach().clone()
    w0[3] = 0.0  # x̂ not recoverable from y in that channel: the norm keeps its input
    w0.requires_grad_()
    y = dropout_add_layer_norm(h, r, 24, w0, b, 1e-5, 0.3)
    assert type(y.grad_fn).__name__ == "NativeLayerNormBackward0"
    with pytest.raises(ValueError, match="between 0 and 1"):
        dropout_add_layer_norm(h, r, 24, w, b, 1e-5, 1.5)
