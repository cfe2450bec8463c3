"""The lossy options never keep more than the exact patch: a lossy transform that would duplicate a
tensor the lean path keeps anyway skips it (compression leaves tensors it does not compress to the
recipes; a randomized Linear whose input is a norm/GELU output kept anyway, or a recipe, runs the
exact Linear; a lean SwiGLU keeps its SiLU). Tiny BERT and LLaMA, fp32, bf16 weights, fp32 weights
with bf16 autocast.

Not covered: ``fewbit=b`` with b > 1 alone, on a GELU whose output the next (exact) Linear keeps:
its b-bit index then replaces leanact's 1-bit branch mark, b − 1 more bits per element (the
option pays with a randomized next Linear, or where nothing else keeps the output)."""
import contextlib
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import leanact  # noqa: E402
from leanact.memory import SavedTensorMeter  # noqa: E402
from _tiny import tiny_batch, tiny_hf  # noqa: E402

OPTIONS = {
    "fp8": {"compress": {"format": "fp8", "min_numel": 64}},
    "int8": {"compress": {"format": "int8", "min_numel": 64}},
    "fewbit=1": {"fewbit": 1},
    "randomized_linear": {"randomized_linear": 0.5},
    "fewbit=2 + randomized_linear": {"fewbit": 2, "randomized_linear": 0.5},
    "all": {"fewbit": 2, "randomized_linear": 0.5, "compress": {"format": "fp8", "min_numel": 64}},
}


def _kept(family, precision, lossy):
    model = tiny_hf(family)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    leanact.patch(model, lossy=lossy)
    ac = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "autocast" else contextlib.nullcontext()
    meter = SavedTensorMeter(model)
    with warnings.catch_warnings(), meter, ac:
        warnings.simplefilter("ignore")
        out = model(**tiny_batch())
    meter.release()
    del out
    return meter.total_bytes


@pytest.mark.parametrize("precision", ["fp32", "bf16", "autocast"])
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_lossy_keeps_at_most_the_exact_patch(family, precision):
    exact = _kept(family, precision, None)
    kept = {name: _kept(family, precision, spec) for name, spec in OPTIONS.items()}
    assert all(v <= exact for v in kept.values()), (exact, kept)
    if precision != "fp32":  # 16-bit tensors are there to compress: it does save
        assert kept["fp8"] < exact and kept["all"] < exact, (exact, kept)


@pytest.mark.parametrize("precision", ["fp32", "autocast"])
def test_randomized_down_projection_of_a_lean_gated_mlp_is_exact(precision):
    """With randomized_linear, the lean gated MLP takes its down projection's weight directly (its input
    is rebuilt there, so R X would be a second copy): that weight's gradient is the exact patch's, and
    so is every input gradient (a randomized Linear's dX is exact). Under autocast its exact path
    recasts the weight as the patch's Linears do."""
    grads = {}
    for lossy in (None, {"randomized_linear": 0.5}):
        model = tiny_hf("llama")
        leanact.patch(model, lossy=lossy)
        ac = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "autocast" else contextlib.nullcontext()
        with warnings.catch_warnings(), ac:
            warnings.simplefilter("ignore")
            loss = model(**tiny_batch()).loss
        loss.backward()
        grads[lossy is None] = {n: p.grad for n, p in model.named_parameters() if "down_proj" in n or "embed" in n}
        if lossy:
            assert any(type(m).__name__ == "RandomizedLinear" for m in model.modules())
    assert grads[True].keys() == grads[False].keys() and grads[True]
    for n, g in grads[True].items():  # the same ops in the same order: equal up to fp32 summation order
        torch.testing.assert_close(grads[False][n], g, rtol=1e-5, atol=1e-7, msg=n)
