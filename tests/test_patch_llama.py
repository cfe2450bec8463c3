"""leanact.patch on the LLaMA family (Llama, Qwen2, Mistral, Qwen3): RMSNorm, SwiGLU, RoPE and
grouped-query attention (2 kv heads for 4 query heads). Tiny configs, random weights, CPU, fp32,
dropout 0: patched vs unpatched."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from leanact.patching import patch, summary, unpatch  # noqa: E402

from test_patch_families import _assert_grads_close, _no_dropout  # noqa: E402

FAMILIES = ["llama", "qwen2", "mistral", "qwen3"]
_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "mistral": ("MistralConfig", "MistralForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def _build(family, attn="sdpa", h=64, layers=2, heads=4, kv=2, ffn=128, dtype=torch.float32):
    cfg_name, cls_name = _CLASSES[family]
    if not hasattr(transformers, cls_name):
        pytest.skip(f"{cls_name} not in this transformers")
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_name)(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                                          num_key_value_heads=kv, intermediate_size=ffn, vocab_size=100,
                                          max_position_embeddings=1024, attn_implementation=attn)
    if family == "qwen3":
        cfg.head_dim = h // heads
    _no_dropout(cfg)
    model = getattr(transformers, cls_name)(cfg)
    with torch.no_grad():  # non-trivial norm weights (HF initialises them to 1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.to(dtype)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 100, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_summary(family):
    ref = _build(family)
    lean = patch(copy.deepcopy(ref))
    s = summary(lean)
    assert s.attention == [("", "sdpa", "leanact (recompute)")]
    assert lean.config._attn_implementation == "leanact"
    norms = [n for n, old, new in s.replaced if old.endswith("RMSNorm")]
    per_layer = 4 if family == "qwen3" else 2  # Qwen3 adds q_norm / k_norm
    assert len(norms) == 2 * per_layer + 1, s.replaced
    assert all(new.startswith("leanact.patching.Lean") for _, _, new in s.replaced)
    left = {old for _, old, _ in s.left}
    assert left == {type(ref.model.rotary_emb).__name__}, s.left  # the SwiGLU MLP (and its SiLU) is covered
    mlps = [n for n, old, new in s.replaced if old.endswith("MLP")]
    assert mlps == ["model.layers.0.mlp", "model.layers.1.mlp"], s.replaced
    assert list(ref.state_dict()) == list(lean.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(v, lean.state_dict()[k]), k
    unpatch(lean)
    assert [type(m) for m in lean.modules()] == [type(m) for m in ref.modules()]
    assert lean.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_train_loss_and_grads(family, attn):
    ref = _build(family, attn)
    lean = patch(copy.deepcopy(ref))
    ref.train()
    lean.train()
    b = _batch()
    l_ref = ref(**b).loss
    l_lean = lean(**b).loss
    assert abs(l_lean.item() - l_ref.item()) <= 1e-6 * abs(l_ref.item()), (l_ref.item(), l_lean.item())
    l_ref.backward()
    l_lean.backward()
    _assert_grads_close(ref, lean, 1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_logits_identical(family):
    ref = _build(family).eval()
    lean = patch(copy.deepcopy(ref)).eval()
    b = _batch()
    b.pop("labels")
    with torch.no_grad():
        assert torch.equal(ref(**b).logits, lean(**b).logits)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bf16_within_tolerance(family):
    ref = _build(family, dtype=torch.bfloat16)
    lean = patch(copy.deepcopy(ref))
    b = _batch()
    l_ref, l_lean = ref(**b).loss, lean(**b).loss
    assert abs(l_lean.item() - l_ref.item()) <= 2e-2 * abs(l_ref.item())
    l_ref.backward()
    l_lean.backward()
    lean_params = dict(lean.named_parameters())
    for name, p in ref.named_parameters():
        g, gl = p.grad.float(), lean_params[name].grad.float()
        assert (gl - g).norm() <= 5e-2 * g.norm().clamp_min(1e-4), name


def test_gqa_goes_through_leanact():
    """Grouped-query attention runs leanact's core with enable_gqa (no repeated k/v)."""
    from leanact.patching import attention_hf

    calls = []
    orig = attention_hf._lean_attention

    def spy(q, k, v, *a, **kw):
        calls.append((q.shape[1], k.shape[1], kw.get("enable_gqa")))
        return orig(q, k, v, *a, **kw)

    lean = patch(_build("llama"))
    attention_hf._lean_attention = spy
    try:
        lean(**_batch()).loss.backward()
    finally:
        attention_hf._lean_attention = orig
    assert calls and all(c == (4, 2, True) for c in calls), calls


def test_saved_bytes_per_layer_exact():
    """One patched LLaMA layer keeps exactly, per token (bf16, e = 2 bytes; fp32 statistics):
    2 RMSNorms: y + rstd each (2·(e·h + 4)); attention: q, k, v, output + one fp32 statistic per
    row and head (e·(2h + 2·kv·d) + 4·H); SwiGLU MLP: g and u (2·e·I). Nothing else (RoPE's cos/sin
    are shared by all layers; q/k/v/o/gate/up/down projections keep tensors listed above)."""
    from leanact.memory import measure_layer_cost

    s, b, h, heads, kv, ffn = 64, 2, 64, 4, 2, 176
    d, e = h // heads, 2
    ids = lambda: (torch.randint(1, 100, (b, s), generator=torch.Generator().manual_seed(0)),)  # noqa: E731

    def build(lean, attn):
        def f(n):
            m = _build("llama", attn, h=h, layers=n, heads=heads, kv=kv, ffn=ffn, dtype=torch.bfloat16).train()
            return patch(m) if lean else m
        return f

    per_token = 2 * (e * h + 4) + e * (2 * h + 2 * kv * d) + 4 * heads + 2 * e * ffn
    lean = measure_layer_cost(build(True, "eager"), ids, s, b, h)
    assert lean.bytes == s * b * per_token, dict(lean.by_op)
    assert lean.by_op["GatedDownFunction"] == s * b * 2 * e * ffn
    assert measure_layer_cost(build(True, "sdpa"), ids, s, b, h).bytes == lean.bytes
    eager = measure_layer_cost(build(False, "eager"), ids, s, b, h)
    # HF eager keeps, among others, g, silu(g), u, silu(g)*u: 4·e·I per token in the MLP alone.
    assert eager.bytes - lean.bytes >= s * b * 2 * e * ffn, (dict(eager.by_op), dict(lean.by_op))


@pytest.mark.parametrize("from_output", [True, False])
def test_rms_norm_from_output_knob(from_output):
    """``m.from_output`` fixes what the lean HF RMSNorm keeps (y or x, + rstd); gradients unchanged."""
    from leanact.memory import SavedTensorMeter
    from leanact.patching.hf_rms_norm import hf_rms_norm_replacement

    ref = _build("llama", h=32, layers=1, heads=4, kv=2, ffn=48).model.norm
    lean, _ = hf_rms_norm_replacement(copy.deepcopy(ref))
    lean.from_output = from_output
    x_ref, x = (torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(4)).requires_grad_() for _ in "ab")
    meter = SavedTensorMeter(lean, exclude=[x])
    with meter:
        y = lean(x)
    assert torch.equal(y, ref(x_ref))
    kept = [r for r in meter.counted()]
    assert sum(r.counted_bytes for r in kept) == (0 if not from_output else 3 * 5 * 32 * 4) + 3 * 5 * 4
    dy = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(5))
    y.backward(dy)
    ref(x_ref).backward(dy)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lean.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-6)


def test_outer_saved_tensor_hooks_keep_the_lean_layer():
    """Inside a user's saved-tensor hooks (a counting hook, as torch's save_on_cpu sees them) a
    patched LLaMA layer keeps what it keeps without them (the bytes of test_saved_bytes_per_layer_exact),
    not HF's MLP tensors."""
    s, b, h, heads, kv, ffn = 16, 2, 64, 4, 2, 176
    d, e = h // heads, 2
    ids = torch.randint(1, 100, (b, s), generator=torch.Generator().manual_seed(0))

    def kept(n):
        m = patch(_build("llama", "sdpa", h=h, layers=n, heads=heads, kv=kv, ffn=ffn, dtype=torch.bfloat16).train())
        params = {p.untyped_storage()._cdata for p in m.parameters()} | {ids.untyped_storage()._cdata}
        seen = {}

        def pack(t):
            key = t.untyped_storage()._cdata
            if key not in params:
                seen[key] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(input_ids=ids)
        return sum(seen.values())

    per_token = 2 * (e * h + 4) + e * (2 * h + 2 * kv * d) + 4 * heads + 2 * e * ffn
    assert kept(2) - kept(1) == s * b * per_token
    with torch.autograd.graph.save_on_cpu():
        model = patch(_build("llama", "sdpa", h=h, layers=2, heads=heads, kv=kv, ffn=ffn))
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    ref = _build("llama", "sdpa", h=h, layers=2, heads=heads, kv=kv, ffn=ffn)
    ref(input_ids=ids, labels=ids).loss.backward()
    _assert_grads_close(ref, model, 1e-5)
