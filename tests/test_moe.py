"""leanact.ops.moe.gated_experts (Mixtral / Qwen2-MoE experts keeping only [g | u] per routed token)
and the patched HF experts modules: float64 gradcheck, fp32/bf16 against HF's eager and grouped
experts, kept bytes exact, real top-k < E routing."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from leanact.memory import SavedTensorMeter  # noqa: E402
from leanact.ops.moe import gated_experts  # noqa: E402
from leanact.patching.hf_moe import hf_experts_replacement  # noqa: E402

from _tol import assert_same_loss_and_grads, within_rounding_bound  # noqa: E402

T, H, I, E, K = 7, 8, 6, 4, 2  # noqa: E741 (I: the intermediate size, as in the formulas)


def _routing(seed=0, dtype=torch.float64, k=K):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g, dtype=torch.float64)
    w, idx = logits.softmax(-1).topk(k, dim=-1)
    return idx, (w / w.sum(-1, keepdim=True)).to(dtype)


def _params(dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype)
    gu = (torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) / H ** 0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=g, dtype=torch.float64) / I ** 0.5).to(dtype)
    return x, gu, down


@pytest.mark.slow
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
def test_gradcheck_float64(kind, grouped):
    idx, w = _routing()
    x, gu, down = (t.requires_grad_() for t in _params(torch.float64))
    w.requires_grad_()
    fn = lambda x, w, gu, down: gated_experts(x, idx, w, gu, down, kind, grouped=grouped)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w, gu, down))


def _experts(family, dtype, impl):
    import _families as F

    model = F.build(family)
    experts = model.model.layers[0].mlp.experts.to(dtype)
    experts.config._experts_implementation = impl
    return experts


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_patched_experts_match_hf(family, dtype, impl):
    """Outputs: bitwise HF's eager loop, within rounding of HF's grouped matmuls; gradients of x,
    the routing weights and both expert weights within rounding of the float64 truth, as HF's."""
    ref = _experts(family, dtype, impl)
    lean, reason = hf_experts_replacement(copy.deepcopy(ref))
    assert reason is None
    idx, w0 = _routing(dtype=torch.float32 if family == "mixtral" else dtype, k=2)
    E_ = ref.gate_up_proj.shape[0]
    idx = idx % E_
    idx[:, 1] = (idx[:, 0] + 1) % E_  # two distinct experts per token
    x0 = torch.randn(T, ref.gate_up_proj.shape[2], generator=torch.Generator().manual_seed(3)).to(dtype)
    runs = []
    for mod in (ref, lean):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        mod.zero_grad()
        y = mod(x, idx, w)
        y.backward(torch.ones_like(y))
        runs.append((y, x.grad, w.grad, mod.gate_up_proj.grad, mod.down_proj.grad))
    if impl == "eager":
        assert torch.equal(runs[0][0], runs[1][0])
    truth = copy.deepcopy(ref).double()
    x, w = x0.double().requires_grad_(), w0.double().requires_grad_()
    truth.config._experts_implementation = "eager"
    y = truth(x, idx, w)
    y.backward(torch.ones_like(y))
    exact = (y, x.grad, w.grad, truth.gate_up_proj.grad, truth.down_proj.grad)
    n = 4 * (H + I + T)  # the longest chains of roundings: two matmuls, the reductions over tokens
    for got, hf, ex in zip(runs[1], runs[0], exact):
        ok, err, bound = within_rounding_bound(got, ex, dtype, n)
        assert ok, (err, bound, within_rounding_bound(hf, ex, dtype, n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_bytes_exact(dtype):
    """Kept: [g | u] for every routed token (T·k·2I in the compute dtype), x (an input here: excluded),
    the routing indices (excluded) and weights (T·k, fp32)."""
    ref = _experts("mixtral", dtype, "grouped_mm")
    lean, _ = hf_experts_replacement(copy.deepcopy(ref))
    E_, two_i, h = ref.gate_up_proj.shape
    idx, w = _routing(dtype=torch.float32, k=2)
    idx = idx % E_
    idx[:, 1] = (idx[:, 0] + 1) % E_
    x = torch.randn(T, h).to(dtype).requires_grad_()
    w.requires_grad_()
    e = torch.finfo(dtype).bits // 8
    for mod, expected in ((lean, T * 2 * two_i * e + T * 2 * 4), (ref, None)):
        meter = SavedTensorMeter(mod, exclude=[x, idx])
        with meter:
            mod(x, idx, w)
        if expected is not None:
            assert meter.total_bytes == expected, meter.total_bytes
        else:
            assert meter.total_bytes > 2 * T * 2 * two_i * e  # HF: dispatch buffer, act, product, outputs too


def test_left_with_reason():
    ref = _experts("mixtral", torch.float32, "batched_mm")
    new, reason = hf_experts_replacement(ref)
    assert new is None and "batched_mm" in reason
    ref = _experts("mixtral", torch.float32, "eager")
    ref.act_fn = torch.nn.ReLU()
    new, reason = hf_experts_replacement(ref)
    assert new is None and "not SiLU or GELU" in reason


def _tiny():
    T = transformers
    cfg = T.Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    return T.Qwen3MoeForCausalLM(cfg)


def test_qwen3_moe_top2_of_4_fp32():
    """Real routing (top-2 of 4 experts): loss and every gradient within 1e-5 of HF's (GPT-OSS's
    biased, clamped experts: tests/test_moe_gpt_oss.py)."""
    import leanact

    torch.manual_seed(0)
    ref = _tiny()
    lean = leanact.patch(copy.deepcopy(ref))
    assert all(type(layer.mlp.experts).__name__ == "LeanQwen3MoeExperts" for layer in lean.model.layers)
    ids = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    assert_same_loss_and_grads(ref, lean, 1e-5, input_ids=ids, labels=ids)


# ---- under torch.compile: the custom op ---------------------------------------------------------------
@pytest.mark.parametrize("grouped", [False, True])
def test_custom_op_opcheck(grouped):
    from leanact.ops.moe import gated

    idx, w = _routing(dtype=torch.float32)
    x, gu, down = (t.float() for t in _params(torch.float64))
    args = (x.requires_grad_(), idx, w.requires_grad_(), gu.requires_grad_(), down.requires_grad_(), "silu",
            torch.float32, grouped)
    torch.library.opcheck(gated._op, args)
    dfinal = torch.randn(T, H)
    _, gu_all = gated._op(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    torch.library.opcheck(gated._op_backward, (dfinal, x.detach(), idx, w.detach(), gu_all, gu.detach(),
                                                down.detach(), "silu", [True, False, True, True]))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_experts_match_eager_and_keep_the_same(dtype):
    """``torch.compile`` (inductor, fullgraph) of the patched experts: the eager patched experts' output
    and gradients, bitwise (the same op, one opaque node each way), and the same bytes kept."""
    ref = _experts("mixtral", dtype, "grouped_mm")
    lean, _ = hf_experts_replacement(ref)
    E_, two_i, h = lean.gate_up_proj.shape
    idx, w0 = _routing(dtype=torch.float32, k=2)
    idx = idx % E_
    idx[:, 1] = (idx[:, 0] + 1) % E_
    x0 = torch.randn(T, h, generator=torch.Generator().manual_seed(3)).to(dtype)
    torch._dynamo.reset()
    compiled = torch.compile(lean, fullgraph=True)
    runs, kept = [], []
    for fn in (lean, compiled):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        lean.zero_grad()
        meter = SavedTensorMeter(lean, exclude=[x, idx])
        with meter:
            y = fn(x, idx, w)
        kept.append(meter.total_bytes)
        y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(dtype))
        runs.append((y.detach(), x.grad, w.grad, lean.gate_up_proj.grad.clone(), lean.down_proj.grad.clone()))
        meter.release()
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    e = torch.finfo(dtype).bits // 8
    assert kept[0] == kept[1] == T * 2 * two_i * e + T * 2 * 4, kept
