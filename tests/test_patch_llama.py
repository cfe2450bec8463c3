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
    assert left <= {"SiLUActivation", "SiLU", f"{type(ref.model.rotary_emb).__name__}"}, s.left
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


def test_saved_bytes_per_layer_lower():
    from leanact.memory import measure_layer_cost

    s, b, h = 64, 1, 64
    ids = lambda: (torch.randint(1, 100, (b, s), generator=torch.Generator().manual_seed(0)),)  # noqa: E731

    def build(lean):
        def f(n):
            m = _build("llama", "eager", h=h, layers=n, heads=4, kv=2, ffn=4 * h, dtype=torch.bfloat16).train()
            return patch(m) if lean else m
        return f

    eager = measure_layer_cost(build(False), ids, s, b, h)
    lean = measure_layer_cost(build(True), ids, s, b, h)
    assert lean.bytes < eager.bytes, (eager.by_op, lean.by_op)
