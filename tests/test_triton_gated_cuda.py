"""The gated MLP's compiled Triton kernels on a CUDA device against torch's CUDA kernels (the
PyTorch path of leanact.ops.gated_mlp) on the same device: what the interpreter tests cannot see
(``tl.erf`` lowered to libdevice's ``erff``, nvcc's FMA contractions in torch's kernels, torch's
``expf`` / ``tanhf``). Within the bound of gated_kernels' module doc everywhere; bitwise but for
the few elements that bound allows to flip where it is a small part of an ulp (tests/_ulp.py).
Skipped without CUDA or Triton.
"""
import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.triton,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from leanact.ops.gated_mlp import GATED_ACTIVATIONS, act_grad, gated_act, gated_down  # noqa: E402
from leanact.ops.gated_mlp import launchers as gated  # noqa: E402
from leanact.ops.triton import dispatch  # noqa: E402

from _ulp import rare_flips, ulp, within  # noqa: E402

U32 = 2.0 ** -24
BOUND = 48  # leanact.ops.gated_mlp.kernels.BOUND


@pytest.fixture(autouse=True)
def _kernels_present(monkeypatch):
    if not dispatch.available():
        pytest.skip("Triton does not import here")
    monkeypatch.setenv("LEANACT_TRITON", "strict")  # a failing kernel raises (no silent fallback)


def _check(what, x, ref, bound, apart, at=None):
    """Within ``bound`` plus one ulp of the storage dtype everywhere; where the float32 values before
    the last rounding that can differ are at most ``apart`` apart, and that is a small part of an
    ulp, no more elements differ than that allows (tests/_ulp.py)."""
    assert within(x, ref, bound), what
    differing, allowed = rare_flips(x, ref, apart, at)
    assert differing <= allowed, (what, differing, allowed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", GATED_ACTIVATIONS)
def test_kernels_match_torch_on_cuda(kind, dtype):
    torch.manual_seed(0)
    n = 1 << 20
    g = torch.cat([torch.randn(n, device="cuda") * 3, torch.empty(n, device="cuda").uniform_(-12, 12)])
    g = g.to(dtype).view(-1, 1000 + 24)  # a column count off the block size
    u, dh = (torch.randn(g.shape, device="cuda").to(dtype) for _ in range(2))
    h = gated.glu_forward(g, u, kind)
    dg, du, hh = gated.glu_backward(g, u, dh, kind, True, True, True)
    a0 = gated_act(kind, g)
    h0, du0, dg0 = a0 * u, dh * a0, act_grad(kind, dh * u, g)
    ga = g.double().abs()
    # act(g) in float32: torch's expf / tanhf / erff within 2 ulp of the correctly rounded value, the
    # kernel's erff too, its exp / tanh (leanact.ops.triton.math32) within 1.35 / 3 ulps of the truth
    apart = BOUND * U32 * ga
    act_err = apart + ulp(a0, dtype)  # ... and round(act(g)) one ulp more where a boundary lies between
    t = (dh * u).double().abs()
    dg_apart = BOUND * U32 * (1 + ga) * t
    assert torch.equal(h, hh)
    # Not a bitwise fraction: for g < -2, 1 + erf(g / sqrt 2) cancels and one ulp of erf moves
    # round(act(g)) by many 16-bit ulps. On an H200 (torch 2.11+cu130, Triton 3.6) 1.3% (bf16) and
    # 1.8% (fp16) of GeGLU's h and du differed: what one-ulp erf differences on about a quarter of the
    # arguments give (Triton's bundled libdevice erff against the toolkit's that torch was built with).
    _check("h", h, h0, act_err * u.double().abs(), apart, a0)
    _check("du", du, du0, act_err * dh.double().abs(), apart, a0)
    _check("dg", dg, dg0, dg_apart, dg_apart)


@pytest.mark.parametrize("fused", [False, True])
def test_op_on_cuda_keeps_the_same_and_runs_the_kernels(monkeypatch, fused):
    torch.manual_seed(1)
    src = torch.randn(4, 64, 2 * 1000, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(256, 1000, device="cuda") / 32).to(torch.bfloat16)
    dy = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16)

    def run():
        s, ww = src.clone().requires_grad_(), w.clone().requires_grad_()
        g, u = s.chunk(2, -1) if fused else (s[..., :1000].contiguous(), s[..., 1000:].contiguous())
        y = gated_down(g, u, ww, None, "silu")
        kept = [(t.dtype, t.shape, t.stride()) for t in y.grad_fn.saved_tensors]
        y.backward(dy)
        return y.detach(), s.grad, ww.grad, kept

    y, gs, gw, kept = run()
    monkeypatch.setenv("LEANACT_TRITON", "0")
    y0, gs0, gw0, kept0 = run()
    assert kept == kept0
    g, u = src.chunk(2, -1)
    monkeypatch.setenv("LEANACT_TRITON", "strict")
    assert torch.equal(y, torch.nn.functional.linear(gated.glu_forward(g, u, "silu"), w))
    for a, b in ((y, y0), (gs, gs0), (gw, gw0)):  # bf16: the kernels' h, dg, du are torch's to one ulp
        torch.testing.assert_close(a, b, rtol=2 ** -6, atol=2 ** -6 * b.abs().max().item())
