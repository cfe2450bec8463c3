"""leanact.patch on the LLaMA-family SwiGLU MLP (LlamaMLP, Qwen2MLP, Qwen3MLP, MistralMLP): the
replacement keeps g = gate_proj(x) and u = up_proj(x) only (HF keeps g, silu(g), u and the product).
Tiny configs, random weights, CPU."""
import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from leanact.memory import SavedTensorMeter  # noqa: E402
from leanact.patching import patch, summary, unpatch  # noqa: E402
from leanact.patching.hf_swiglu import hf_swiglu_replacement  # noqa: E402

from test_patch_families import _assert_grads_close  # noqa: E402
from test_patch_llama import FAMILIES, _batch, _build  # noqa: E402


def _mlp(family, dtype=torch.float32, ffn=48):
    model = _build(family, h=32, layers=1, heads=4, kv=2, ffn=ffn, dtype=dtype)
    return model.model.layers[0].mlp


def _x(dtype, s=5, b=3, h=32):
    return torch.randn(b, s, h, generator=torch.Generator().manual_seed(2)).to(dtype).requires_grad_()


@pytest.mark.parametrize("family", FAMILIES)
def test_summary_lists_mlp_replaced_and_state_dict_unchanged(family):
    ref = _build(family)
    lean = patch(copy.deepcopy(ref))
    s = summary(lean)
    mlps = [(n, old, new) for n, old, new in s.replaced if old.endswith("MLP")]
    assert [n for n, _, _ in mlps] == ["model.layers.0.mlp", "model.layers.1.mlp"], s.replaced
    assert all(new == f"leanact.patching.Lean{old}" for _, old, new in mlps)
    assert [old for _, old, _ in s.left] == [type(ref.model.rotary_emb).__name__], s.left  # SiLU no longer left
    mlp = lean.model.layers[0].mlp
    assert isinstance(mlp, type(ref.model.layers[0].mlp))
    assert mlp.gate_proj.weight is lean.model.layers[0].mlp.gate_proj.weight
    sd_ref, sd_lean = ref.state_dict(), lean.state_dict()
    assert list(sd_ref) == list(sd_lean)
    assert all(torch.equal(sd_ref[k], sd_lean[k]) for k in sd_ref)
    unpatch(lean)
    assert type(lean.model.layers[0].mlp) is type(ref.model.layers[0].mlp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_mlp_output_and_gradients_bitwise(family, dtype):
    """Same kernels in the same order as HF: output, dx and every weight gradient bitwise equal."""
    ref = _mlp(family, dtype)
    lean, reason = hf_swiglu_replacement(copy.deepcopy(ref))
    assert reason is None
    x_ref, x_lean = _x(dtype), _x(dtype)
    y_ref, y_lean = ref(x_ref), lean(x_lean)
    assert torch.equal(y_ref, y_lean)
    dy = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    y_ref.backward(dy)
    y_lean.backward(dy)
    assert torch.equal(x_ref.grad, x_lean.grad)
    for (name, p), q in zip(ref.named_parameters(), lean.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_saved_bytes_exact(dtype):
    """HF keeps g, silu(g), u, silu(g)*u (4·s·b·I); leanact keeps g and u (2·s·b·I). x excluded."""
    s, b, h, ffn = 5, 3, 32, 48
    ref = _mlp("llama", dtype, ffn)
    lean, _ = hf_swiglu_replacement(copy.deepcopy(ref))
    item = torch.finfo(dtype).bits // 8
    for mod, n in ((ref, 4), (lean, 2)):
        x = _x(dtype, s, b, h)
        meter = SavedTensorMeter(mod, exclude=[x])
        with meter:
            y = mod(x)
        meter.attribute(y)
        assert meter.total_bytes == n * s * b * ffn * item, meter.by_op()
    assert dict(meter.by_op()) == {"GatedDownFunction": 2 * s * b * ffn * item}
    # x (gate_proj's and up_proj's input, one storage) when counted:
    x = _x(dtype, s, b, h)
    meter = SavedTensorMeter(lean)
    with meter:
        lean(x * 1)
    assert meter.total_bytes == (2 * ffn + h) * s * b * item


def test_in_place_modification_of_kept_tensor_raises():
    for which in ("gate_proj", "up_proj"):
        lean, _ = hf_swiglu_replacement(_mlp("llama"))
        kept = []
        h = getattr(lean, which).register_forward_hook(lambda m, a, out: kept.append(out))
        y = lean(_x(torch.float32))
        h.remove()
        kept[0].add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


@pytest.mark.parametrize("reentrant", [False, True])
def test_no_grad_and_checkpoint(reentrant):
    ref = _mlp("qwen2")
    lean, _ = hf_swiglu_replacement(copy.deepcopy(ref))
    x = _x(torch.float32)
    with torch.no_grad():
        assert torch.equal(ref(x), lean(x))
    x_ref = _x(torch.float32)
    y = torch.utils.checkpoint.checkpoint(lean, x, use_reentrant=reentrant)
    assert torch.equal(y, ref(x_ref))
    y.sum().backward()
    ref(x_ref).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_logits_bit_identical(family):
    ref = _build(family).eval()
    lean = patch(copy.deepcopy(ref)).eval()
    b = _batch()
    b.pop("labels")
    with torch.no_grad():
        assert torch.equal(ref(**b).logits, lean(**b).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_loss_and_gradients(family):
    ref = _build(family)
    lean = patch(copy.deepcopy(ref))
    b = _batch()
    l_ref, l_lean = ref(**b).loss, lean(**b).loss
    torch.testing.assert_close(l_lean, l_ref, rtol=1e-6, atol=0)
    l_ref.backward()
    l_lean.backward()
    _assert_grads_close(ref, lean, 1e-5)


# ---- what is left, and why ----------------------------------------------------------------------

def _reason(mlp):
    new, reason = hf_swiglu_replacement(mlp)
    assert new is None
    return reason


def test_left_other_activation():
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="relu2")
    from transformers.models.llama.modeling_llama import LlamaMLP

    assert "not SiLU or GELU" in _reason(LlamaMLP(cfg))


def test_left_with_hooks_or_changed_forward():
    mlp = _mlp("llama")
    h = mlp.register_forward_hook(lambda *a: None)
    assert "hooks" in _reason(mlp)
    h.remove()
    mlp.act_fn.register_forward_pre_hook(lambda *a: None)
    assert "activation has hooks" in _reason(mlp)

    base = type(_mlp("llama"))

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 2)

    variant = type("ScaledMLP", (base,), {"forward": forward, "__module__": "transformers.models.fake"})
    mlp = _mlp("llama")
    mlp.__class__ = variant
    assert "forward is not" in _reason(mlp)
    model = _build("llama")
    for layer in model.model.layers:
        layer.mlp.__class__ = variant
    s = summary(patch(model))
    assert ("model.layers.0.mlp", "ScaledMLP", "forward is not down_proj(act_fn(gate_proj(x)) * up_proj(x))") in s.left
    assert type(model.model.layers[0].mlp) is variant


def test_left_non_linear_projection():
    mlp = _mlp("llama")
    mlp.up_proj = nn.Sequential(mlp.up_proj)
    assert "not plain nn.Linear" in _reason(mlp)


def test_keyword_call_and_torch_compile():
    """Called by keyword it keeps g and u too; under torch.compile (aot_eager: AOTAutograd's
    partitioner decides what is kept) HF's forward is traced: same output and gradients."""
    ref = _mlp("llama")
    lean, _ = hf_swiglu_replacement(copy.deepcopy(ref))
    x = _x(torch.float32)
    meter = SavedTensorMeter(lean, exclude=[x])
    with meter:
        y = lean(x=x)
    meter.attribute(y)
    assert dict(meter.by_op()) == {"GatedDownFunction": 2 * x.shape[0] * x.shape[1] * 48 * 4}
    y.sum().backward()
    x_ref = _x(torch.float32)
    ref(x_ref).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)

    torch._dynamo.reset()
    compiled = torch.compile(lean, backend="aot_eager", fullgraph=True)
    x_c = _x(torch.float32)
    y_c = compiled(x_c)
    torch.testing.assert_close(y_c, ref(_x(torch.float32)), rtol=1e-6, atol=1e-7)
    y_c.sum().backward()
    torch.testing.assert_close(x_c.grad, x_ref.grad, rtol=1e-6, atol=1e-7)
    torch._dynamo.reset()


def test_equivalent_forward_spelling_is_recognised():
    """Docstring, comments, another argument name and a one-line return are the same forward."""
    def forward(self, hidden_state):
        """SwiGLU.

        (multi-line docstring)"""
        # comment
        return self.down_proj(self.act_fn(self.gate_proj(hidden_state)) * self.up_proj(hidden_state))  # tail

    base = type(_mlp("llama"))
    variant = type("RenamedMLP", (base,), {"forward": forward, "__module__": "transformers.models.fake"})
    mlp = _mlp("llama")
    mlp.__class__ = variant
    new, reason = hf_swiglu_replacement(mlp)
    assert reason is None and type(new).__name__ == "LeanRenamedMLP"
    x, x_ref = _x(torch.float32), _x(torch.float32)
    new(hidden_state=x).sum().backward()
    _mlp("llama")(x_ref).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
