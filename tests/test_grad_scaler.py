"""fp16 autocast with ``torch.amp.GradScaler``: a patched model's scaled backward overflows exactly
when the unpatched model's does, so the scaler sees the inf/nan and skips the step for both.

The overflow must survive leanact's backward paths: the GELU rebuilt from its output and branch
bit, the norms' from-output backward (x̂ = (y − β)/γ), the attention core, the cast recipes and the
fused loss. Tiny BERT (GELU, LayerNorm) and LLaMA (RMSNorm, SwiGLU), fp32 weights, CPU fp16 autocast.
"""
import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import leanact  # noqa: E402
from _tiny import tiny_batch, tiny_hf  # noqa: E402


def _step(model, batch, scale):
    """One GradScaler step; (found_inf, parameters changed, scale after)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.float16):
        warnings.simplefilter("ignore")
        loss = model(**batch).loss
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    found = sum(v.item() for v in scaler._found_inf_per_device(opt).values())
    scaler.step(opt)
    scaler.update()
    changed = any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    return found, changed, scaler.get_scale()


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_overflow_skips_the_step_as_unpatched(family):
    ref = tiny_hf(family)
    lean = leanact.patch(copy.deepcopy(ref))
    batch = tiny_batch()
    found_ref, changed_ref, scale_ref = _step(ref, batch, 2.0 ** 40)
    found, changed, scale = _step(lean, batch, 2.0 ** 40)
    assert found_ref > 0 and not changed_ref  # the scale overflows fp16 in the unpatched model
    assert found > 0 and not changed  # ... and in the patched one: the step is skipped
    assert scale == scale_ref == 2.0 ** 39


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_moderate_scale_steps_as_unpatched(family):
    ref = tiny_hf(family)
    lean = leanact.patch(copy.deepcopy(ref))
    batch = tiny_batch()
    assert _step(ref, batch, 2.0 ** 8) == (0, True, 2.0 ** 8)
    assert _step(lean, batch, 2.0 ** 8) == (0, True, 2.0 ** 8)


@pytest.mark.parametrize("kind", ["gelu", "layer_norm", "rms_norm"])
def test_nonfinite_gradient_propagates_through_from_output_backward(kind):
    """An inf in the incoming gradient comes out non-finite, never silently finite."""
    torch.manual_seed(0)
    x = torch.randn(4, 32, requires_grad=True)
    if kind == "gelu":
        op = leanact.nn.GELU()
        xin = x.half().detach().requires_grad_()
    else:
        op = leanact.nn.LayerNorm(32) if kind == "layer_norm" else leanact.nn.RMSNorm(32)
        xin = x
    y = op(xin)
    g = torch.zeros_like(y)
    g[1, 3] = float("inf")
    y.backward(g)
    assert not torch.isfinite(xin.grad[1]).all()
    assert torch.isfinite(xin.grad[[0, 2, 3]]).all()
