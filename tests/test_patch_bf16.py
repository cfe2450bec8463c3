"""bf16 equivalence of leanact.patch on every covered family (BERT, RoBERTa, GPT-2, ViT, Llama,
Qwen2, Qwen3, Mistral): tiny configs, random weights, CPU, dropout 0.

Tolerance rationale: in bf16 neither model computes "the" gradient; both round differently
(leanact's kernels recompute or accumulate in another order), so patched vs unpatched bf16 is the
wrong comparison. Both are compared with an fp32 reference (the same bf16 weights, cast to fp32,
unpatched): the patched model's relative error (norm-wise, per parameter gradient, and on the
loss) must be at most twice the unpatched model's own bf16 error, floored at one bf16 ulp
(2^-8) where the unpatched error happens to be tiny. A norm that recovers x̂ from its rounded
output (leanact's from-output norms) adds one rounding of y per element to its γ gradient: at most
u·Σ_rows |dy|·(|x̂| + |β/γ|) per channel (u = 2^-8, bf16's unit roundoff), a bound computed from the
fp32 reference's dy and x̂ (twice it, for the second-order terms) and added to those parameters'
allowance: how much of it a machine's rounding uses varies with its kernels (AVX2 and AVX-512 CPUs
accumulate differently), the bound does not. A patch that changes the math (a wrong gradient term,
a dropped scale) fails this by orders of magnitude; rounding noise does not.
Eval (no-grad) outputs must be bitwise equal: the patch then runs the original kernels.
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from leanact.patching import patch  # noqa: E402

import test_patch_families as fam  # noqa: E402
import test_patch_llama as llama  # noqa: E402

FAMILIES = ["bert", "roberta", "gpt2", "vit", "llama", "qwen2", "qwen3", "mistral"]
ULP = 2.0 ** -8


def _model(family, dtype=torch.bfloat16):
    if family in llama.FAMILIES:
        return llama._build(family, dtype=dtype)
    return fam._build(family).to(dtype)


def _batch(family, dtype=torch.bfloat16):
    b = llama._batch() if family in llama.FAMILIES else fam._batch(family)
    if "pixel_values" in b:
        b["pixel_values"] = b["pixel_values"].to(dtype)
    return b


def _run(model, batch):
    model.train()
    loss = model(**batch).loss
    loss.backward()
    return loss.float().item(), {n: p.grad.float() for n, p in model.named_parameters()}


def _rel(a, b, scale):
    return ((a - b).norm() / b.norm().clamp_min(scale)).item()


def _norm_kind(m: torch.nn.Module):
    """("ln" | "rms", eps) for a LayerNorm / RMSNorm module with a weight, else None."""
    if isinstance(m, torch.nn.LayerNorm):
        return "ln", m.eps
    if type(m).__name__.endswith("RMSNorm"):
        eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
        return ("rms", eps) if eps is not None else None
    return None


def _recovery_bounds(model, batch):
    """Run ``model`` (fp32) forward and backward on ``batch``; return, for each norm's γ (by
    parameter name), the bound of the error that recovering x̂ from the bf16-rounded output adds to
    its gradient, relative to the gradient's norm: ||u·Σ_rows |dy|·(|x̂| + |β/γ|)|| / ||Σ_rows dy·x̂||
    (x̂ and dy from this run, in float64)."""
    seen, handles = {}, []
    for name, m in model.named_modules():
        kind = _norm_kind(m)
        w = getattr(m, "weight", None)
        if kind is None or not isinstance(w, torch.nn.Parameter) or w.dim() != 1:
            continue

        def hook(mod, args, out, name=name, kind=kind):
            x = args[0].detach().double()
            k, eps = kind
            if k == "ln":
                xh = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
            else:
                xh = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            out.register_hook(lambda g: seen.setdefault(name, []).append((xh, g.detach().double())))

        handles.append(m.register_forward_hook(hook))
    try:
        loss, grads = _run(model, batch)
    finally:
        for h in handles:
            h.remove()
    bounds = {}
    modules = dict(model.named_modules())
    for name, pairs in seen.items():
        m = modules[name]
        w = m.weight.detach().double()
        b = getattr(m, "bias", None)
        shift = (b.detach().double() / w).abs() if isinstance(b, torch.Tensor) else torch.zeros_like(w)
        extra = sum((dy.abs() * (xh.abs() + shift)).reshape(-1, w.numel()).sum(0) for xh, dy in pairs)
        exact = sum((dy * xh).reshape(-1, w.numel()).sum(0) for xh, dy in pairs)
        bounds[f"{name}.weight"] = (ULP * extra.norm() / exact.norm().clamp_min(1e-30)).item()
    return loss, grads, bounds


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_no_worse_than_unpatched_vs_fp32(family):
    ref = _model(family)
    lean = patch(copy.deepcopy(ref))
    fp32 = copy.deepcopy(ref).float()  # the same (bf16-representable) weights, fp32 arithmetic
    l32, g32, recovery = _recovery_bounds(fp32, _batch(family, torch.float32))
    assert recovery  # every family has norms
    l_ref, g_ref = _run(ref, _batch(family))
    l_lean, g_lean = _run(lean, _batch(family))

    assert abs(l_lean - l32) <= 2 * max(abs(l_ref - l32), ULP * abs(l32)), (l32, l_ref, l_lean)
    # Gradients that are 0 in exact arithmetic (key biases: softmax ignores a per-row shift) are
    # rounding noise everywhere; their floor is relative to the model's median gradient norm.
    median = torch.stack([g.norm() for g in g32.values()]).median()
    worst = 0.0
    for name, g in g32.items():
        e_ref = _rel(g_ref[name], g, 1e-3 * median)
        e_lean = _rel(g_lean[name], g, 1e-3 * median)
        allowed = 2 * max(e_ref, ULP) + 2 * recovery.get(name, 0.0)  # (γ of a norm: its recovery from y)
        assert e_lean <= allowed, (name, e_ref, e_lean, allowed)
        worst = max(worst, e_lean / max(e_ref, ULP))
    assert worst > 0  # the comparison did run on non-trivial gradients


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_eval_outputs_identical(family):
    ref = _model(family).eval()
    lean = patch(copy.deepcopy(ref)).eval()
    batch = _batch(family)
    batch.pop("labels")
    with torch.no_grad():
        assert torch.equal(ref(**batch).logits, lean(**batch).logits)
