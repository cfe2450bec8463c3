"""Randomized linear backward: dW unbiased (statistical test with a bound that a biased estimator
fails), dX and db exact, kept bytes exact, a fresh seed per call."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leanact.lossy import RandomizedLinear
from leanact.memory import saved_bytes
from leanact.ops.random import draw_seed
from leanact.ops.lossy.randomized_linear import randomized_linear, sketch, sketch_rows, weight_grad


def _problem(n=48, d_in=5, d_out=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    # correlated rows, so dW is large compared to the estimator's noise
    x = torch.randn(n, d_in, generator=g, dtype=dtype) + torch.randn(1, d_in, generator=g, dtype=dtype)
    dy = torch.randn(n, d_out, generator=g, dtype=dtype) + torch.randn(1, d_out, generator=g, dtype=dtype)
    return x, dy


def _t2_statistic(samples: torch.Tensor, exact: torch.Tensor) -> float:
    """Hotelling's T² of the sample mean against ``exact``, with the sample covariance (the
    entries of the estimate are strongly correlated): about chi² with d = exact.numel() degrees
    of freedom for an unbiased estimator and m >> d samples."""
    m = samples.shape[0]
    flat = samples.reshape(m, -1)
    diff = flat.mean(dim=0) - exact.reshape(-1)
    cov = torch.cov(flat.t())
    return (m * diff @ torch.linalg.solve(cov, diff)).item()


def _estimates(x, dy, ratio, block, m, scale=1.0):
    torch.manual_seed(123)
    out = []
    for _ in range(m):
        seed = draw_seed()
        sx = sketch(seed, x, ratio, block)
        out.append(weight_grad(seed, dy, sx, ratio, block) * scale)
    return torch.stack(out)


@pytest.mark.slow
@pytest.mark.parametrize("block", [64, 16])  # one dense S; block-diagonal S (48 rows in 3 blocks)
def test_weight_gradient_is_unbiased(block):
    x, dy = _problem()
    exact = dy.t() @ x
    ratio, m = 0.25, 3000
    samples = _estimates(x, dy, ratio, block, m)
    d = exact.numel()
    bound = d + 6 * (2 * d) ** 0.5  # chi²_d mean + 6 sd: false alarm ~1e-5
    assert _t2_statistic(samples, exact) < bound
    # the same bound rejects a slightly biased estimator (dW scaled by k/(k+1), a 11% bias for k=8..12)
    k = sum(kk for _, _, kk in sketch_rows(x.shape[0], ratio, block))
    biased = samples * (k / (k + 1))
    assert _t2_statistic(biased, exact) > bound
    # and a reused S (the public code's pitfall: one fixed seed) is far from the exact dW
    seed = torch.tensor(7, dtype=torch.int64)
    fixed = weight_grad(seed, dy, sketch(seed, x, ratio, block), ratio, block)
    assert (fixed - exact).norm() > 0.1 * exact.norm()
    # the mean converges: error of the mean shrinks like 1/sqrt(m)
    e_small = (samples[:300].mean(0) - exact).norm()
    e_large = (samples.mean(0) - exact).norm()
    assert e_large < e_small or e_large < 0.02 * exact.norm()


@pytest.mark.slow
def test_rademacher_sketch_is_fair_and_e_sts_is_identity():
    torch.manual_seed(0)
    n, ratio = 32, 0.5
    eye = torch.eye(n, dtype=torch.float64)
    acc = torch.zeros(n, n, dtype=torch.float64)
    m = 2000
    for _ in range(m):
        r = sketch(draw_seed(), eye, ratio, 64)  # R itself (k x n, ±1)
        assert set(r.unique().tolist()) <= {-1.0, 1.0}
        acc += r.t() @ r / r.shape[0]
    est = acc / m  # E[SᵀS] with S = R/sqrt(k): off-diagonal entries ~ N(0, 1/(k m))
    assert torch.allclose(est.diagonal(), torch.ones(n, dtype=torch.float64))
    off = est - torch.diag(est.diagonal())
    assert off.abs().max() < 6 / (16 * m) ** 0.5


@pytest.mark.parametrize("shape", [(2, 24, 8), (50, 8)])
def test_dx_and_bias_grad_exact_and_saved_bytes(shape):
    torch.manual_seed(0)
    lin = nn.Linear(8, 6, dtype=torch.float64)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    rl = RandomizedLinear.from_linear(lin, ratio=0.25)
    y = rl(x)
    y_ref = lin(x_ref)
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert torch.equal(x.grad, x_ref.grad)
    n = x.numel() // 8
    k = sum(kk for _, _, kk in sketch_rows(n, 0.25, rl.block))
    assert saved_bytes(lambda: rl(x), rl) == k * 8 * 8 + 8  # R X (k x in, float64) + the seed


def test_bias_gradient_exact_and_weight_shares_parameters():
    torch.manual_seed(0)
    lin = nn.Linear(8, 6)
    rl = RandomizedLinear.from_linear(lin, ratio=0.5)
    assert rl.weight is lin.weight and rl.bias is lin.bias
    assert rl.state_dict().keys() == lin.state_dict().keys()
    x = torch.randn(4, 10, 8)
    g = torch.randn(4, 10, 6)
    rl(x).backward(g)
    db = lin.bias.grad.clone()
    lin.zero_grad()
    lin(x).backward(g)
    torch.testing.assert_close(db, lin.bias.grad, rtol=1e-6, atol=1e-6)


def test_dx_bitwise_equals_torch():
    torch.manual_seed(1)
    w = nn.Parameter(torch.randn(7, 5, dtype=torch.float64))
    x = torch.randn(3, 9, 5, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 9, 7, dtype=torch.float64)
    (dx,) = torch.autograd.grad(randomized_linear(x, w, None, 0.5), x, g)
    (dx_ref,) = torch.autograd.grad(F.linear(x, w), x, g)
    assert torch.equal(dx, dx_ref)


def test_fresh_seed_per_call():
    torch.manual_seed(0)
    lin = RandomizedLinear(6, 4, ratio=0.5)
    x = torch.randn(16, 6)
    grads = []
    for _ in range(2):
        lin.zero_grad()
        lin(x).sum().backward()
        grads.append(lin.weight.grad.clone())
    assert not torch.equal(grads[0], grads[1])


def test_bf16_matches_float64_estimate_and_frozen_weight_keeps_nothing():
    torch.manual_seed(0)
    x64, dy64 = _problem(n=32, d_in=16, d_out=8)
    seed = torch.tensor(11, dtype=torch.int64)
    w = nn.Parameter(torch.randn(8, 16, dtype=torch.bfloat16))
    x = x64.to(torch.bfloat16).requires_grad_()
    y = randomized_linear(x, w, None, 0.5, seed=seed)
    y.backward(dy64.to(torch.bfloat16))
    ref = weight_grad(seed, dy64.to(torch.bfloat16).double(), sketch(seed, x.detach().double(), 0.5), 0.5)
    torch.testing.assert_close(w.grad.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    w.requires_grad_(False)
    assert saved_bytes(lambda: randomized_linear(x, w, None, 0.5)) == 0  # only W, a parameter


def test_bad_arguments():
    x = torch.randn(4, 3, requires_grad=True)
    w = nn.Parameter(torch.randn(2, 3))
    with pytest.raises(ValueError, match="ratio"):
        randomized_linear(x, w, None, 0.0)
    with pytest.raises(ValueError, match="in_features"):
        randomized_linear(torch.randn(4, 5), w, None, 0.5)
    with pytest.raises(TypeError, match="seed"):
        randomized_linear(x, w, None, 0.5, seed=torch.tensor(1.0))
    y = randomized_linear(x, w, None, 0.5)
    (gx,) = torch.autograd.grad(y, x, torch.ones_like(y, requires_grad=True), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.sum().backward()
