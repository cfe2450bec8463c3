"""Config changes made after ``leanact.patch``, as transformers' own common model tests make them.

``config.output_attentions = True`` after patching: accepted where the unpatched model accepts it
(eager; sdpa raises the same error), with the unpatched model's outputs, attentions and gradients.
``model.set_attn_implementation("sdpa" / "eager")`` after patching: respected (the unpatched model's
outputs with that implementation), warned about once, reported by ``leanact.summary``; ``unpatch``
restores the original model, and ``set_attn_implementation("leanact")`` or ``patch`` brings
leanact's attention back. fp32 tiny Llama/GPT-2/BERT, CPU, dropout 0.
"""
import copy
import io
import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from leanact.patching import patch, summary, unpatch  # noqa: E402
from leanact.patching import attention_hf  # noqa: E402

import test_patch_families as fam  # noqa: E402
import test_patch_llama as llama  # noqa: E402
from test_patch_families import _assert_grads_close  # noqa: E402

FAMILIES = ["llama", "gpt2", "bert"]
OFF = "leanact's attention is off"


def _build(family, attn):
    return llama._build(family, attn) if family == "llama" else fam._build(family, attn)


def _batch(family):
    return fam._batch("bert" if family == "bert" else "gpt2")  # (vocabulary 100: Llama's too)


def _inputs(family):
    return {k: v for k, v in _batch(family).items() if k != "labels"}


@pytest.fixture
def core_calls(monkeypatch):
    """Calls of leanact's attention core by the patched models."""
    calls = []
    real = attention_hf._lean_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_hf, "_lean_attention", counting)
    return calls


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out


def _assert_attentions_close(a, b):
    assert a is not None and len(a) == len(b) > 0 and all(x is not None for x in a)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


def _off_warnings(record):
    return [str(w.message) for w in record if OFF in str(w.message)]


# ---- config.output_attentions = True after patch ------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_output_attentions_set_on_the_config_after_patch(family, core_calls):
    ref = _build(family, "eager")
    lean = patch(copy.deepcopy(ref))
    for m in (ref, lean):
        m.config.output_attentions = True
    assert lean.config.output_attentions and lean.config._attn_implementation == "leanact"
    batch = _batch(family)
    out_ref, out_lean = _step(ref, batch), _step(lean, batch)  # training, with gradients
    torch.testing.assert_close(out_lean.loss, out_ref.loss, rtol=1e-6, atol=0)
    _assert_attentions_close(out_lean.attentions, out_ref.attentions)
    _assert_grads_close(ref, lean)
    ref.eval(), lean.eval()
    for grad in (True, False):  # evaluation, with and without autograd
        with torch.set_grad_enabled(grad):
            out_ref, out_lean = ref(**_inputs(family)), lean(**_inputs(family))
        torch.testing.assert_close(out_lean.logits, out_ref.logits, rtol=1e-5, atol=1e-6)
        _assert_attentions_close(out_lean.attentions, out_ref.attentions)
    assert not core_calls  # the probabilities are wanted: the model's eager function ran, as unpatched
    lean.train().config.output_attentions = False
    assert _step(lean, batch).attentions is None and core_calls  # leanact's core again


@pytest.mark.parametrize("family", FAMILIES)
def test_output_attentions_on_an_sdpa_model_raises_as_unpatched(family):
    ref = _build(family, "sdpa")
    lean = patch(copy.deepcopy(ref))
    errors = []
    for m in (ref, lean):
        with pytest.raises(ValueError) as e:
            m.config.output_attentions = True
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "sdpa" in errors[0]
    assert not lean.config.output_attentions and lean.config._attn_implementation == "leanact"


def test_output_attentions_config_through_copies_saving_and_unpatch(tmp_path):
    ref = _build("llama", "eager")
    lean = patch(copy.deepcopy(ref))
    lean.config.output_attentions = ref.config.output_attentions = True
    assert lean.config == ref.config and ref.config == lean.config
    assert lean.config.to_json_string() == ref.config.to_json_string()
    if hasattr(lean.config, "validate"):
        lean.config.validate()  # save_pretrained runs it
    buf = io.BytesIO()
    torch.save(lean, buf)
    buf.seek(0)
    for m in (copy.deepcopy(lean), torch.load(buf, weights_only=False)):
        assert m.config is not lean.config and m.config.output_attentions
        m.config.output_attentions = False
        m.config.output_attentions = True
        _assert_attentions_close(m(**_inputs("llama")).attentions, ref(**_inputs("llama")).attentions)
    lean.save_pretrained(tmp_path / "lean")
    ref.save_pretrained(tmp_path / "ref")
    read = lambda d: json.loads((tmp_path / d / "config.json").read_text())  # noqa: E731
    assert read("lean") == read("ref")
    unpatch(lean)
    assert type(lean.config) is type(ref.config) and lean.config._attn_implementation == "eager"
    assert lean.config.output_attentions


# ---- set_attn_implementation after patch ---------------------------------------------------------
def _assert_reported_off(model, implementation):
    s = summary(model)
    assert s.attention
    for _, _, now in s.attention:
        assert now.startswith("left") and implementation in now and OFF in now, now
        assert 'set_attn_implementation("leanact")' in now and "leanact.patch(model)" in now
    assert set(s.attention_off().values()) == {implementation}
    assert "attention" in s.left_in_layers() and s.to_dict()["attention_off"] == s.attention_off()
    assert all(OFF in now for _, _, now in s.to_dict()["attention"])


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_set_attn_implementation_after_patch(family, implementation, core_calls):
    original = "eager" if implementation == "sdpa" else "sdpa"
    base = _build(family, original)
    ref = copy.deepcopy(base)
    ref.set_attn_implementation(implementation)
    lean = patch(copy.deepcopy(base))
    lean.set_attn_implementation(implementation)
    _assert_reported_off(lean, implementation)  # before any forward
    batch = _batch(family)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            out_ref, out_lean = _step(ref, batch), _step(lean, batch)
            torch.testing.assert_close(out_lean.loss, out_ref.loss, rtol=1e-6, atol=0)
            _assert_grads_close(ref, lean)
    assert not core_calls  # the user's choice runs
    (message,) = _off_warnings(record)  # once
    assert repr(implementation) in message or implementation in message
    _assert_reported_off(lean, implementation)
    unpatch(lean)  # the original model exactly
    assert lean.config._attn_implementation == original and type(lean.config) is type(base.config)
    assert [type(m) for m in lean.modules()] == [type(m) for m in base.modules()]
    assert not lean._forward_pre_hooks.keys() - base._forward_pre_hooks.keys()
    base.eval(), lean.eval()
    with torch.no_grad():
        assert torch.equal(lean(**_inputs(family)).logits, base(**_inputs(family)).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_set_back_to_leanact(family, core_calls):
    base = _build(family, "sdpa")
    lean = patch(copy.deepcopy(base))
    rows = list(summary(lean).attention)
    batch = _batch(family)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        lean.set_attn_implementation("eager")
        _step(lean, batch)
        assert len(_off_warnings(record)) == 1
        lean.set_attn_implementation("leanact")
        assert summary(lean).attention == rows and not summary(lean).attention_off()
        out_ref, out_lean = _step(base, batch), _step(lean, batch)
        torch.testing.assert_close(out_lean.loss, out_ref.loss, rtol=1e-6, atol=0)
        _assert_grads_close(base, lean)
        assert core_calls and len(_off_warnings(record)) == 1
        lean.set_attn_implementation("sdpa")  # a new change: warned about again
        _step(lean, batch)
        assert len(_off_warnings(record)) == 2
    _assert_reported_off(lean, "sdpa")
    patch(lean)  # patching again brings it back too
    assert summary(lean).attention == rows and lean.config._attn_implementation == "leanact"
    core_calls.clear()
    _step(lean, batch)
    assert core_calls


def test_the_generic_eager_attention_is_transformers_eager():
    """The eager fallback for model files without ``eager_attention_forward`` (output_attentions there):
    Llama's eager function's outputs and probabilities, bitwise (grouped queries, a padding mask)."""
    from transformers.models.llama import modeling_llama as ml

    from leanact.patching.attention_hf import _generic_eager

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=1, intermediate_size=64, vocab_size=50)
    attn = ml.LlamaAttention(cfg, 0).eval()
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    mask = torch.zeros(2, 1, 5, 5)
    mask[1, ..., 3:] = torch.finfo(torch.float32).min
    want = ml.eager_attention_forward(attn, q, k, v, mask, scaling=0.3, dropout=0.0)
    got = _generic_eager(attn, q, k, v, mask, dropout=0.0, scaling=0.3)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
