"""Hugging Face RMSNorm variants (LLaMA's, OLMo 2's fp32 multiply, Gemma's (1 + w), T5's) patched to
keep y and rstd only: recognised from the forward, whatever the class name; outputs bit-identical;
gradients: float64 gradcheck of the backward, fp32/bf16 against HF's; kept bytes exact."""
import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from leanact.memory import SavedTensorMeter  # noqa: E402
from leanact.patching import patch, summary  # noqa: E402
from leanact.patching.hf_rms_norm import _HFRMSNormFunction, _LeanHFRMSNorm, hf_rms_norm_replacement  # noqa: E402
from leanact.patching.modules import lean_subclass  # noqa: E402

import _families as F  # noqa: E402

from _tol import within_rounding_bound  # noqa: E402

H = 16
CLASSES = {  # variant -> an HF class computing it
    "llama": "transformers.models.llama.modeling_llama.LlamaRMSNorm",
    "fp32_mul": "transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm",
    "offset": "transformers.models.gemma.modeling_gemma.GemmaRMSNorm",
    "t5": "transformers.models.t5.modeling_t5.T5LayerNorm",
    "cohere_ln": "transformers.models.cohere.modeling_cohere.CohereLayerNorm",
}


def _cls(path):
    mod, name = path.rsplit(".", 1)
    return getattr(__import__(mod, fromlist=[name]), name)


def _norm(variant, dtype=torch.float32, seed=0):
    m = _cls(CLASSES[variant])(H, eps=1e-6)
    with torch.no_grad():
        m.weight.copy_(torch.empty(H).uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(seed)))
    return m.to(dtype)


def _reference64(variant, x, w, eps=1e-6):
    """The variant's function in float64."""
    if variant == "cohere_ln":
        x = x - x.mean(-1, keepdim=True)
    xh = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return xh * (1 + w) if variant == "offset" else xh * w


@pytest.mark.parametrize("from_output", [True, False])
@pytest.mark.parametrize("variant", list(CLASSES))
def test_gradcheck_float64(variant, from_output):
    """The backward formulas, with a float64 forward (HF's own computes in fp32)."""
    base = type(f"F64{variant}", (nn.Module,), {"forward": lambda self, x: _reference64(variant, x, self.weight)})
    mod = lean_subclass(_LeanHFRMSNorm, base).__new__(lean_subclass(_LeanHFRMSNorm, base))
    nn.Module.__init__(mod)
    mod.weight = nn.Parameter(torch.empty(H, dtype=torch.float64).uniform_(0.5, 1.5))
    x = torch.randn(3, 4, H, dtype=torch.float64, requires_grad=True)
    fn = lambda x, w: _HFRMSNormFunction.apply(x, w, mod, 1e-6, from_output, variant)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, mod.weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", list(CLASSES))
def test_output_bitwise_gradients_within_rounding(variant, dtype):
    ref = _norm(variant, dtype)
    lean, reason = hf_rms_norm_replacement(copy.deepcopy(ref))
    assert reason is None and lean._leanact_variant == variant
    g = torch.Generator().manual_seed(1)
    x0 = (torch.randn(4, 6, H, generator=g, dtype=torch.float64) * 3).to(dtype)
    x_ref, x_lean = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    y_ref, y_lean = ref(x_ref), lean(x_lean)
    assert torch.equal(y_ref, y_lean)
    dy = torch.randn(y_ref.shape, generator=g).to(y_ref.dtype)
    y_ref.backward(dy)
    y_lean.backward(dy)
    # float64 truth from the same rounded inputs
    x64, w64 = x0.double().requires_grad_(), ref.weight.detach().double().requires_grad_()
    _reference64(variant, x64, w64).backward(dy.double())
    n = 4 * H  # reductions over the row, and the rounding of y for the from-output rebuild
    for got, hf, truth in ((x_lean.grad, x_ref.grad, x64.grad), (lean.weight.grad, ref.weight.grad, w64.grad)):
        ok, err, bound = within_rounding_bound(got, truth, dtype, n if dtype == torch.float32 else 2 * n)
        assert ok, (err, bound)
        if dtype == torch.float32:
            ok, err, bound = within_rounding_bound(got, hf, dtype, n)
            assert ok, (err, bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", list(CLASSES))
def test_kept_bytes_exact(variant, dtype):
    """Kept: y (rows·H in the output dtype) + one fp32 rstd per row."""
    lean, _ = hf_rms_norm_replacement(_norm(variant, dtype))
    x = torch.randn(4, 6, H).to(dtype).requires_grad_()
    meter = SavedTensorMeter(lean, exclude=[x])
    with meter:
        y = lean(x)
    assert meter.total_bytes == 24 * H * y.element_size() + 24 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cohere_qk_norm_per_head_weight(dtype):
    """Cohere's q/k norms: a (heads, d) weight, normalised over d; kept y + rstd; gradients as HF's."""
    ref = _cls(CLASSES["cohere_ln"])(hidden_size=(4, H), eps=1e-5)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
    ref = ref.to(dtype)
    lean, reason = hf_rms_norm_replacement(copy.deepcopy(ref))
    assert reason is None
    x0 = torch.randn(2, 3, 4, H).to(dtype)
    x_ref, x_lean = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    meter = SavedTensorMeter(lean, exclude=[x_lean])
    with meter:
        y = lean(x_lean)
    assert meter.total_bytes == 24 * H * y.element_size() + 24 * 4
    y_ref = ref(x_ref)
    assert torch.equal(y, y_ref)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    y.backward(dy)
    y_ref.backward(dy)
    x64, w64 = x0.double().requires_grad_(), ref.weight.detach().double().requires_grad_()
    _reference64("cohere_ln", x64, w64, 1e-5).backward(dy.double())
    for got, truth in ((x_lean.grad, x64.grad), (lean.weight.grad, w64.grad)):
        ok, err, bound = within_rounding_bound(got, truth, dtype, 8 * H)
        assert ok, (err, bound)


def test_recognised_from_forward_not_name():
    """A class of another name computing Gemma's norm is recognised; one named *RMSNorm computing
    something else is left with the reason."""
    gemma = _cls(CLASSES["offset"])
    renamed = type("ScaleNorm", (gemma,), {"__module__": "transformers.models.fake"})
    m = renamed(H)
    new, reason = hf_rms_norm_replacement(m)
    assert reason is None and new._leanact_variant == "offset"

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight * 2

    odd = type("OddRMSNorm", (gemma,), {"forward": forward, "__module__": "transformers.models.fake"})
    new, reason = hf_rms_norm_replacement(odd(H))
    assert new is None and "none of the RMSNorm variants" in reason


@pytest.mark.parametrize("family", ["gemma", "gemma3", "olmo2", "qwen3", "t5", "cohere"])
def test_no_norm_left_in_family(family):
    """Every norm of these families (OLMo 2's post-norms and q/k norms, Qwen 3's and Gemma 3's q/k
    norms, T5's) is replaced."""
    def build():
        if family == "cohere":  # with its per-head q/k norms
            return transformers.CohereForCausalLM(transformers.CohereConfig(
                vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, use_qk_norm=True, max_position_embeddings=64))
        try:
            return F.build(family)
        except F.Unsupported:
            return F.build(family, "eager")

    model = build()
    s = summary(patch(model))
    assert not [r for r in s.left if "Norm" in r[1]], s.left
    norms = [r for r in s.replaced if "Norm" in r[1]]
    expected = [n for n, m in build().named_modules() if "Norm" in type(m).__name__]
    assert sorted(n for n, _, _ in norms) == sorted(expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", list(CLASSES))
def test_forward_is_hfs_operations_and_keeps_their_rstd(variant, dtype):
    """The patched forward runs HF's operations and nothing more (the rstd it keeps is the one HF's
    forward computes: no second pass over x for it; Cohere's x − mean, which HF computes twice,
    once), and that rstd is HF's statistic bitwise."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in ("detach", "alias", "view", "promote_types"):
                self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    ref = _norm(variant, dtype)
    lean, _ = hf_rms_norm_replacement(copy.deepcopy(ref))
    x = (torch.randn(4, 6, H, generator=torch.Generator().manual_seed(2)) * 3).to(dtype).requires_grad_()
    lean(x)  # (the first call decides from-output for this weight: its checks are not the forward's)
    with Ops() as a:
        y_ref = ref(x)
    with Ops() as b:
        y = lean(x)
    from collections import Counter

    fewer = Counter(a.ops) - Counter(b.ops)  # HF's operations the patched forward does not run
    assert not Counter(b.ops) - Counter(a.ops), (a.ops, b.ops)
    assert fewer == (Counter(sub=1) if variant == "cohere_ln" else Counter()), fewer  # (Cohere's x − mean: once)
    assert torch.equal(y, y_ref)
    rstd = y.grad_fn.saved_tensors[1]
    xf = x.detach().float()
    if variant == "cohere_ln":
        xf = xf - xf.mean(-1, keepdim=True)
    assert torch.equal(rstd, torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("variant", ["llama", "cohere_ln"])
def test_cuda_float64_rstd_is_the_composite_one(variant):
    """On CUDA float64 inputs (HF computes in fp32; the backward in float64) take rstd from torch's
    fused norm kernel (one pass) instead of the float64 composite: the same statistic (eps inside
    the square root; the mean removed for Cohere's LayerNorm), within rounding. Checked here on the
    CPU with the same torch ops in float32."""
    from leanact.patching.hf_rms_norm import _rstd

    if variant == "llama" and not hasattr(torch.ops.aten, "_fused_rms_norm"):
        pytest.skip("this torch has no fused RMSNorm kernel (the CUDA forward then takes the composite too)")
    x = torch.randn(5, 7, 96, generator=torch.Generator().manual_seed(3)) * 4 + 1
    eps = 1e-5
    fused = (torch.native_layer_norm(x, [96], None, None, eps)[2] if variant == "cohere_ln"
             else torch.ops.aten._fused_rms_norm(x, [96], None, eps)[1])
    composite = _rstd(x, eps, variant)  # (CPU tensors: the composite)
    assert fused.shape == composite.shape == (5, 7, 1)
    # a float32 sum of 96 squares is within 96·u of the truth in any order, the mean and eps add 2·u,
    # rsqrt halves the relative error and rounds once more: both within (48 + 2)·u of the truth
    torch.testing.assert_close(fused, composite, rtol=2 * 50 * 2**-24, atol=0)


def test_gemma_norms_decide_in_the_one_batch_per_step(monkeypatch):
    """Gemma's γ = 1 + w norms join the other norms' one batch per optimizer step (one sync), the
    same verdicts as alone; a w set to -1 (γ = 0) by a step moves its norm to the fallback."""
    import leanact.ops.norms.verdict as L

    L.clear_decision_cache()
    norms = nn.ModuleList([hf_rms_norm_replacement(_norm("offset", seed=i))[0] for i in range(3)]
                          + [hf_rms_norm_replacement(_norm("llama", seed=3))[0]])
    opt = torch.optim.SGD(norms.parameters(), lr=0.0)
    x = torch.randn(2, H, requires_grad=True)
    batches, singles = [], []
    check_many, check = L.check_many, L._check
    monkeypatch.setattr(L, "check_many",
                        lambda items, **kw: batches.append([it[-1] for it in items]) or check_many(items, **kw))
    monkeypatch.setattr(L, "_check", lambda *a: singles.append(1) or check(*a))

    def step():
        sum(m(x).sum() for m in norms).backward()
        opt.step()

    for _ in range(3):
        step()
    assert len(singles) == 4 and batches == [[True, True, True, False]] * 2  # (offset flags, per norm)
    with torch.no_grad():
        norms[1].weight[2] = -1.0
    L._STEPS[0] += 1  # (as the step post-hook counts)
    assert norms[0](x).grad_fn.from_output and not norms[1](x).grad_fn.from_output
    assert len(batches) == 3 and len(singles) == 4


@pytest.mark.parametrize("variant", ["llama", "offset"])
def test_decided_once_per_step_and_once_when_frozen(monkeypatch, variant):
    """The from-output decision of a patched HF norm is cached: once per optimizer step (not once
    per forward: each decision reads γ on the host, a sync), and once while γ is frozen (PEFT)."""
    import leanact.ops.norms.verdict as L

    calls = []
    check, check_many = L._check, L.check_many
    lean, _ = hf_rms_norm_replacement(_norm(variant))
    monkeypatch.setattr(L, "_check", lambda *a: calls.append(1) or check(*a))
    monkeypatch.setattr(L, "check_many", lambda items, **kw: calls.extend(
        1 for it in items if it[0] is lean.weight) or check_many(items, **kw))
    x = torch.randn(2, H, requires_grad=True)
    opt = torch.optim.SGD(lean.parameters(), lr=0.1)
    for step in range(2):
        for _ in range(3):  # e.g. gradient accumulation
            lean(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert len(calls) == 2
    lean.weight.requires_grad_(False)
    for step in range(2):
        for _ in range(3):
            lean(x).sum().backward()
        opt.step()
    assert len(calls) == 3
    with torch.no_grad():
        lean.weight[0] = 0.0 if variant == "llama" else -1.0  # γ = 0: its _version moves, decided again
    lean(x).sum().backward()
    assert len(calls) == 4 and lean(x).grad_fn.from_output is False
