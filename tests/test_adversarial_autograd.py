"""Higher-order autograd through leanact's lean ops: a gradient taken with ``create_graph=True`` and
then differentiated again (a gradient penalty, a Hessian-vector product) either gives torch's result
or raises an error naming leanact; never a gradient silently treated as a constant (torch's
``once_differentiable`` misses results that depend on the op's inputs when the incoming gradient is
a constant)."""
from __future__ import annotations

import copy

import pytest
import torch

import leanact
from leanact.ops.norms import verdict as LN

from _families import batch, build


@pytest.mark.parametrize("make", [lambda: leanact.nn.LayerNorm(8), lambda: leanact.nn.RMSNorm(8)],
                         ids=["LayerNorm", "RMSNorm"])
def test_a_gradient_penalty_through_a_lean_norm_raises(make):
    LN.clear_decision_cache()
    m = make()
    x = torch.randn(3, 8, requires_grad=True)
    loss = m(x).sum()  # the incoming gradient is ones: a constant
    (gw,) = torch.autograd.grad(loss, m.weight, create_graph=True)
    assert gw.requires_grad  # (torch's once_differentiable returns a constant here)
    with pytest.raises(RuntimeError, match="leanact's .*Norm.* has no double backward"):
        (loss + gw.pow(2).sum()).backward()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_a_gradient_penalty_on_a_patched_model_raises_or_is_exact(family):
    """The final norm's γ: its create_graph gradient, then a penalty on it; the unpatched model gives
    the penalty's gradient, the patched one raises leanact's error (or gives the same)."""
    LN.clear_decision_cache()
    lean = build(family, attn="eager")  # (torch's CPU sdpa has no double backward)
    ref = copy.deepcopy(lean)
    leanact.patch(lean, fused_loss=False)
    inputs = batch(family)

    def penalty_grads(model):
        model.zero_grad()
        loss = model(**inputs).loss
        norms = [p for n, p in model.named_parameters() if "norm" in n.lower() and p.dim() == 1]
        grads = torch.autograd.grad(loss, norms, create_graph=True)
        (loss + sum(g.pow(2).sum() for g in grads)).backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want = penalty_grads(ref)
    try:
        got = penalty_grads(lean)
    except RuntimeError as e:
        assert "leanact" in str(e) and "unpatch" in str(e), e
        return
    for a, b in zip(want, got):
        assert (a - b).norm() <= 1e-5 * a.norm() + 1e-12
