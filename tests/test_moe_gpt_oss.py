"""leanact.ops.moe.clamped.clamped_experts (GPT-OSS's biased, clamped experts keeping only each routed
token's gate/up) and the patched ``GptOssExperts``: float64 gradcheck across the clamps, the clamp
boundary's gradient as torch's, fp32/bf16 against HF's eager and grouped experts, kept bytes exact,
the whole tiny model, and what is left (with its reason) or falls back to HF's forward."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "GptOssForCausalLM"):
    pytest.skip(f"no GPT-OSS in transformers {transformers.__version__}", allow_module_level=True)

import leanact  # noqa: E402
from leanact.memory import SavedTensorMeter  # noqa: E402
from leanact.ops.moe.clamped import clamped_experts  # noqa: E402
from leanact.patching.hf_moe_clamped import hf_clamped_experts_replacement  # noqa: E402
from _tol import assert_same_loss_and_grads  # noqa: E402

T, H, I, E, K = 9, 8, 6, 4, 2  # noqa: E741 (I: the intermediate size, as in the formulas)
LIMIT = 0.7  # small enough that a good share of gate and up values is clamped


def _routing(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randn(T, E, generator=g).topk(K, dim=-1).indices
    idx[0] = torch.tensor([E - 1, 0])  # positions out of expert order
    return idx, torch.rand(T, K, generator=g, dtype=torch.float64).add(0.2).to(dtype)


def _params(seed=1, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    gu = torch.randn(E, H, 2 * I, generator=g, dtype=torch.float64) * scale / H ** 0.5
    gub = torch.randn(E, 2 * I, generator=g, dtype=torch.float64) * 0.5
    down = torch.randn(E, I, H, generator=g, dtype=torch.float64) / I ** 0.5
    db = torch.randn(E, H, generator=g, dtype=torch.float64) * 0.5
    return x, gu, gub, down, db


@pytest.mark.slow
@pytest.mark.parametrize("grouped", [False, True])
def test_gradcheck_float64(grouped):
    idx, w = _routing()
    x, gu, gub, down, db = _params()
    pre = torch.stack([torch.einsum("th,thi->ti", x, gu[idx[:, j]]) + gub[idx[:, j]] for j in range(K)])
    assert (pre[..., ::2] > LIMIT).any() and (pre[..., 1::2].abs() > LIMIT).any()  # the clamps bite
    assert (pre[..., ::2] < LIMIT).any() and (pre[..., 1::2].abs() < LIMIT).any()
    fn = lambda *a: clamped_experts(a[0], idx, a[1], *a[2:], 1.702, LIMIT, grouped=grouped)  # noqa: E731
    assert torch.autograd.gradcheck(fn, tuple(t.requires_grad_() for t in (x, w, gu, gub, down, db)))


def _config(impl, **kw):
    cfg = transformers.GptOssConfig(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                    num_experts_per_tok=2, max_position_embeddings=64, **kw)
    cfg._experts_implementation = impl
    return cfg


def _experts(dtype, impl, seed=0):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    m = GptOssExperts(_config(impl))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            fan_in = p.shape[1] if name.endswith("proj") else 2
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / fan_in ** 0.5)
    m.limit = LIMIT  # transformers 5.17 fixes α and the limit on the module; 5.23 takes them from the config
    return m.to(dtype)


def _inputs(dtype, h):
    idx, w = _routing(dtype=dtype)
    x = torch.randn(T, h, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x[1] = 0  # gu = the bias: exactly on the clamp boundaries below
    return x.to(dtype), idx, w


def _run(mod, x0, idx, w0):
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    mod.zero_grad()
    y = mod(x, idx, w)
    y.backward(torch.linspace(-1, 1, y.numel(), dtype=torch.float64).reshape(y.shape).to(y.dtype))
    return [y, x.grad, w.grad, *(p.grad for p in mod.parameters())]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype, impl", [(d, i) for d in (torch.float32, torch.bfloat16)
                                         for i in ("eager", "grouped_mm")]
                         + [(torch.float64, "eager")])  # torch's grouped_mm has no float64 kernel
def test_patched_experts_match_hf(dtype, impl):
    """Output bitwise HF's (same implementation); gradients of x, the routing weights and all four
    parameters: float64 within 1e-12 of HF's (the clamp boundary included), fp32 within 1e-5, bf16
    at most twice HF's own error against the float64 truth."""
    ref = _experts(torch.float64, impl)
    with torch.no_grad():  # put gate and up values of token 1 (x = 0) exactly on the clamp bounds
        ref.gate_up_proj_bias[:, 0], ref.gate_up_proj_bias[:, 1], ref.gate_up_proj_bias[:, 3] = LIMIT, LIMIT, -LIMIT
    truth_mod, ref = ref, copy.deepcopy(ref).to(dtype)
    truth_mod.config._experts_implementation = "eager"
    lean, reason = hf_clamped_experts_replacement(copy.deepcopy(ref))
    assert reason is None and type(lean).__name__ == "LeanGptOssExperts"
    x, idx, w = _inputs(dtype, ref.gate_up_proj.shape[1])
    hf, got = _run(ref, x, idx, w), _run(lean, x, idx, w)
    assert got[0].dtype == hf[0].dtype and torch.equal(got[0], hf[0])
    if dtype == torch.bfloat16:
        truth = _run(truth_mod, x.double(), idx, w.double())
        for name, a, b, t in zip(["out", "x", "w", "gu", "gub", "down", "db"], got, hf, truth):
            assert _rel(a, t) <= 2 * _rel(b, t), (name, _rel(a, t), _rel(b, t))
    else:
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        for name, a, b in zip(["out", "x", "w", "gu", "gub", "down", "db"], got, hf):
            assert _rel(a, b) <= tol, (name, _rel(a, b))


def test_clamp_boundary_passes_gradient():
    """torch's clamp passes the gradient at a bound itself; the rebuilt backward does too. One token
    with x = 0 (gu = the bias) on one expert, gate and up placed on the bounds."""
    _, gu, gub, down, db = (t[:1] for t in _params())
    x, idx, w = torch.zeros(1, H, dtype=torch.float64), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1)
    gub[0, 0], gub[0, 1], gub[0, 3] = LIMIT, LIMIT, -LIMIT
    got = gub.clone().requires_grad_()
    clamped_experts(x, idx, w.double(), gu, got, down, db, 1.702, LIMIT).sum().backward()
    ref = gub.clone().requires_grad_()
    gate, up = ref[0, ::2].clamp(max=LIMIT), ref[0, 1::2].clamp(min=-LIMIT, max=LIMIT)
    ((up + 1) * gate * torch.sigmoid(1.702 * gate) @ down[0] + db[0]).sum().backward()
    assert (ref.grad[0, :4] != 0).all()  # torch's convention: a bound passes
    assert torch.allclose(got.grad, ref.grad, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_bytes_exact(dtype):
    """Kept: gu for every routed token (T·k·2I in the parameters' dtype), x and the routing indices
    (inputs here: excluded) and the routing weights (T·k)."""
    ref = _experts(dtype, "grouped_mm")
    lean, _ = hf_clamped_experts_replacement(copy.deepcopy(ref))
    x, idx, w = _inputs(dtype, ref.gate_up_proj.shape[1])
    x.requires_grad_()
    w.requires_grad_()
    e = torch.finfo(dtype).bits // 8
    two_i = ref.gate_up_proj.shape[2]
    for mod, expected in ((lean, T * K * two_i * e + T * K * e), (ref, None)):
        meter = SavedTensorMeter(mod, exclude=[x, idx])
        with meter:
            mod(x, idx, w)
        if expected is not None:
            assert meter.total_bytes == expected, meter.total_bytes
        else:
            assert meter.total_bytes > 3 * T * K * two_i * e  # HF: gathered x, clamps, σ, glu, product, outputs


def test_falls_back_to_hf_forward():
    """No autograd, autocast: HF's forward itself (bitwise, and nothing kept by leanact's op)."""
    ref = _experts(torch.float32, "eager")
    lean, _ = hf_clamped_experts_replacement(copy.deepcopy(ref))
    x, idx, w = _inputs(torch.float32, ref.gate_up_proj.shape[1])
    with torch.no_grad():
        assert torch.equal(lean(x, idx, w), ref(x, idx, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = lean(x.requires_grad_(), idx, w), ref(x, idx, w)
    assert torch.equal(a, b) and "Clamped" not in type(a.grad_fn).__name__


def test_left_with_reason():
    ref = _experts(torch.float32, "batched_mm")
    new, reason = hf_clamped_experts_replacement(ref)
    assert new is None and "batched_mm" in reason

    class OtherGate(type(ref)):
        def _apply_gate(self, gate_up):
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            return up * torch.sigmoid(gate)

    ref = _experts(torch.float32, "eager")
    ref.__class__ = OtherGate
    new, reason = hf_clamped_experts_replacement(ref)
    assert new is None and "_apply_gate" in reason


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_whole_model_fp32(impl):
    """Tiny GPT-OSS (top-2 of 4 experts, limit small enough to clamp): loss and every gradient
    within 1e-5 of the unpatched model's; the experts of both layers are patched."""
    torch.manual_seed(0)
    ref = transformers.GptOssForCausalLM(_config(impl, swiglu_limit=LIMIT))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if ".experts." in name:
                p.normal_(0, 0.3)
    for layer in ref.model.layers:
        layer.mlp.experts.limit = LIMIT
    lean = leanact.patch(copy.deepcopy(ref))
    assert all(type(layer.mlp.experts).__name__ == "LeanGptOssExperts" for layer in lean.model.layers)
    ids = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    assert_same_loss_and_grads(ref, lean, 1e-5, input_ids=ids, labels=ids)
    assert not any(old == "GptOssExperts" for _, old, _ in leanact.summary(lean).left)


# ---- under torch.compile: the custom op ---------------------------------------------------------------
@pytest.mark.parametrize("grouped", [False, True])
def test_custom_op_opcheck(grouped):
    from leanact.ops.moe import clamped

    x, gu, gub, down, db = (t.float() for t in _params())
    idx, w = _routing(dtype=torch.float32)
    args = (x, idx, w, gu, gub, down, db, 1.702, LIMIT, grouped)
    torch.library.opcheck(clamped._clamped_op, tuple(a.requires_grad_() if isinstance(a, torch.Tensor)
                                                            and a.is_floating_point() else a for a in args))
    _, gu_all = clamped._clamped_op(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    torch.library.opcheck(clamped._clamped_op_backward, (torch.randn(T, H), x.detach(), idx, w.detach(), gu_all,
                                                        gu.detach(), down.detach(), db.detach(), 1.702, LIMIT,
                                                        grouped, [True, True, False, True, True, False]))


@pytest.mark.slow
def test_compiled_experts_match_eager_and_keep_the_same():
    """``torch.compile`` (inductor, fullgraph) of the patched experts: the eager patched experts' output
    and gradients, bitwise, and the same bytes kept."""
    lean, _ = hf_clamped_experts_replacement(_experts(torch.float32, "grouped_mm"))
    x0, idx, w0 = _inputs(torch.float32, lean.gate_up_proj.shape[1])
    torch._dynamo.reset()
    compiled = torch.compile(lean, fullgraph=True)
    runs, kept = [], []
    for fn in (lean, compiled):
        meter = SavedTensorMeter(lean, exclude=[idx])
        with meter:
            runs.append([t.detach() for t in _run(fn, x0, idx, w0)])
        kept.append(meter.total_bytes)
        meter.release()
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert kept[0] == kept[1] > 0, kept
