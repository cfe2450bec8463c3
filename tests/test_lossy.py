"""leanact.lossy.apply / remove on Hugging Face BERT and plain modules."""
import copy
import re

import pytest
import torch
from torch import nn

import leanact.lossy as lossy
from leanact.lossy import CompressTransform, FewBitActivation, RandomizedLinear
from leanact.memory import SavedTensorMeter

transformers = pytest.importorskip("transformers")


def _bert(dtype=torch.float32, layers=2):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                  intermediate_size=128, vocab_size=100, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, attn_implementation="eager")
    return transformers.BertForMaskedLM(cfg).to(dtype).train()


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 100, (2, 16), generator=g)
    return dict(input_ids=ids, labels=ids.clone())


def test_parse_forms():
    assert lossy.parse(None) == {} and lossy.parse("") == {}
    assert lossy.parse("fp8") == {"compress": {"format": "fp8"}}
    assert lossy.parse("fewbit=3,randomized_linear=0.25,compress=int8") == {
        "fewbit": {"bits": 3}, "randomized_linear": {"ratio": 0.25}, "compress": {"format": "int8"}}
    assert lossy.parse({"fewbit": 2, "randomized_linear": 0.5}) == {"fewbit": {"bits": 2},
                                                                    "randomized_linear": {"ratio": 0.5}}
    assert lossy.parse("fewbit") == {"fewbit": {"bits": 2}}
    with pytest.raises(ValueError, match="unknown lossy option"):
        lossy.parse("fp4")
    with pytest.raises(ValueError, match="unknown lossy option"):
        lossy.parse({"quantize": 1})


@pytest.mark.parametrize("spec, message", [
    ("fp8,int8", "lossy='fp8,int8' sets compress twice ('fp8' and 'int8'): keep one"),
    ("int8, compress=fp8", "sets compress twice ('int8' and 'fp8')"),
    ("fewbit=2,fewbit=3", "sets fewbit twice ('2' and '3')")])
def test_parse_rejects_an_option_given_twice(spec, message):
    """Conflicting options used to resolve silently to the last one (``'fp8,int8'`` -> int8)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        lossy.parse(spec)
    model = _bert(layers=1)
    with pytest.raises(ValueError, match=re.escape(message)):
        lossy.apply(model, spec)
    assert lossy.state(model) is None
    with pytest.raises(TypeError, match="dict or a string"):
        lossy.parse(3)


def test_apply_swaps_and_remove_restores():
    model = _bert()
    ref = copy.deepcopy(model)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    lossy.apply(model, {"fewbit": 2, "randomized_linear": 0.5, "compress": "fp8"})
    st = lossy.state(model)
    kinds = [type(m) for m in model.modules()]
    assert kinds.count(FewBitActivation) == 3  # one GELU per layer and the MLM head's (every activation)
    assert kinds.count(RandomizedLinear) == 2 * 6  # q, k, v, attention out, intermediate, output
    assert model.cls.predictions.decoder.__class__ is nn.Linear  # tied to the embedding: left
    assert model.state_dict().keys() == sd.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())
    assert isinstance(st.transform, CompressTransform)
    lossy.remove(model)
    assert lossy.state(model) is None
    assert [type(m) for m in model.modules()] == [type(m) for m in ref.modules()]
    model.eval(), ref.eval()
    b = _batch()
    assert torch.equal(model(**b).logits, ref(**b).logits)
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_gradients_close_to_exact_and_loss_unchanged():
    exact = _bert()
    approx = copy.deepcopy(exact)
    lossy.apply(approx, {"fewbit": 4, "randomized_linear": 1.0})
    b = _batch()
    l1, l2 = exact(**b).loss, approx(**b).loss
    assert torch.equal(l1, l2)  # forward exact
    l1.backward()
    l2.backward()
    ps = dict(approx.named_parameters())
    for name, p in exact.named_parameters():
        if p.grad is None or p.grad.norm() < 1e-6:
            continue
        rel = ((ps[name].grad - p.grad).norm() / p.grad.norm()).item()
        assert rel < 1.5, (name, rel)  # ρ = 1 still randomises (R is k x N, not orthogonal)
    emb = "bert.embeddings.word_embeddings.weight"
    assert ((ps[emb].grad - dict(exact.named_parameters())[emb].grad).norm()
            / dict(exact.named_parameters())[emb].grad.norm()) < 0.5


def test_compress_reduces_saved_bytes_and_nests_outside_patch():
    import leanact

    def measure(m):
        meter = SavedTensorMeter(m, exclude=[b["input_ids"]])
        with meter:
            out = m(**b)
        return meter.total_bytes, out.loss

    b = _batch()
    base = leanact.patch(_bert(torch.bfloat16))
    n_base, _ = measure(base)
    comp = lossy.apply(leanact.patch(_bert(torch.bfloat16)), {"compress": {"format": "fp8", "min_numel": 1024}})
    n_comp, loss = measure(comp)
    assert n_comp < 0.62 * n_base
    loss.backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in comp.parameters())
    tr = lossy.state(comp).transform
    assert tr.compressed > 0 and tr.reused > 0  # a Linear's input kept by the norm too: one copy
    with torch.no_grad():
        comp(**b)  # no grad: the transform is not entered
    assert not any(t is tr for t in __import__("leanact.saved", fromlist=["x"]).active_transforms())


def test_fewbit_replaces_patched_gelu_and_nothing_is_lossy_by_default():
    import leanact

    m = leanact.patch(_bert())
    assert not any(isinstance(x, (FewBitActivation, RandomizedLinear)) for x in m.modules())
    lossy.apply(m, "fewbit=1")
    assert sum(isinstance(x, FewBitActivation) for x in m.modules()) == 3
    lossy.remove(m)
    leanact.unpatch(m)
    assert not any(type(x).__module__.startswith("leanact") for x in m.modules())


def test_plain_model_selection_and_silu():
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 4))  # no ModuleList: all Linear
    lossy.apply(model, {"fewbit": 2, "randomized_linear": {"ratio": 0.5, "block": 64}})
    assert isinstance(model[0], RandomizedLinear) and isinstance(model[2], RandomizedLinear)
    assert model[1].function == "silu" and model[0].block == 64
    model(torch.randn(5, 8)).sum().backward()
    lossy.apply(model, {"randomized_linear": {"ratio": 0.5, "modules": lambda name, m: name == "2"}})
    assert type(model[0]) is nn.Linear and isinstance(model[2], RandomizedLinear)
    lossy.apply(model, None)
    assert type(model[2]) is nn.Linear and type(model[1]) is nn.SiLU


def test_fewbit_leaves_the_lean_swiglu_exact():
    """leanact.patch(..., lossy={"fewbit": 2}) on a LLaMA model: the lean SwiGLU MLP keeps g and u
    only; a few-bit SiLU in act_fn would send it back to HF's forward, which keeps silu(g) and the
    product besides the few-bit index (more than the exact patch): fewbit leaves it exact."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import leanact

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 100, (2, 16))
    exact = leanact.patch(model)
    exact(ids, labels=ids).loss.backward()
    g_exact = model.model.layers[0].mlp.gate_proj.weight.grad.clone()
    model.zero_grad()
    leanact.patch(model, lossy={"fewbit": 2})
    assert type(model.model.layers[0].mlp.act_fn).__name__ == "SiLUActivation"
    model(ids, labels=ids).loss.backward()
    g_lossy = model.model.layers[0].mlp.gate_proj.weight.grad
    assert torch.equal(g_exact, g_lossy)  # the exact SiLU derivative
    leanact.unpatch(model)
    assert type(model.model.layers[0].mlp.act_fn).__name__ == "SiLUActivation"


def test_patch_with_a_bad_lossy_spec_raises_and_leaves_the_model_unpatched():
    from transformers import BertConfig, BertForMaskedLM

    import leanact

    model = BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=64, vocab_size=50))
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match="unknown lossy option"):
        leanact.patch(model, lossy="bogus")
    assert leanact.summary(model) is None
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert model.config._attn_implementation != "leanact"
