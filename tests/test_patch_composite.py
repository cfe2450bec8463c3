"""Composite models, copies and saving, and attention features outside leanact's core.

* Composite models (CLIP: text on eager, vision on sdpa): each sub-config keeps its own original
  implementation (eval outputs bit-identical), the summary has a row per part, unpatch restores
  each part's implementation.
* ``copy.deepcopy`` keeps the patched state (``torch.save`` / ``torch.load`` in a fresh process:
  tests/test_patch_copies.py).
* T5's relative position bias goes through the core (exact, its gradient included); so do Gemma 2's
  logit softcapping and GPT-OSS's attention sinks, and the summary says so (more in
  tests/test_attention_variants.py).
"""
import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import leanact  # noqa: E402
from leanact.patching import attention_hf  # noqa: E402

from test_patch_families import _assert_grads_close  # noqa: E402

T = transformers


def _clip():
    torch.manual_seed(0)
    cfg = T.CLIPConfig(text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, vocab_size=99, max_position_embeddings=16,
                                        bos_token_id=0, eos_token_id=1, pad_token_id=1),
                       vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=4, image_size=16, patch_size=8),
                       projection_dim=16)
    m = T.CLIPModel(cfg)
    m.set_attn_implementation({"text_config": "eager", "vision_config": "sdpa"})
    return m


def _clip_batch():
    g = torch.Generator().manual_seed(3)
    return dict(input_ids=torch.randint(2, 99, (2, 7), generator=g),
                pixel_values=torch.randn(2, 3, 16, 16, generator=g), return_loss=True)


def _states(model):
    return [m.__dict__.get(attention_hf.ATTR) for m in model.modules() if type(m).__name__ == "CLIPAttention"]


def test_composite_model_keeps_each_part():
    ref = _clip()
    lean = leanact.patch(copy.deepcopy(ref))
    assert [s.original for s in _states(lean)] == ["eager", "sdpa"]
    rows = {path: after for path, _, after in leanact.summary(lean).attention}
    assert rows["text_model"] == rows["vision_model"] == "leanact (recompute)", rows
    ref.eval(), lean.eval()
    with torch.no_grad():
        a, b = ref(**_clip_batch()), lean(**_clip_batch())
    assert torch.equal(a.logits_per_image, b.logits_per_image)  # eager text, sdpa vision: bit-identical
    ref.train(), lean.train()
    ref(**_clip_batch()).loss.backward()
    lean(**_clip_batch()).loss.backward()
    _assert_grads_close(ref, lean)
    leanact.unpatch(lean)
    assert (lean.config.text_config._attn_implementation, lean.config.vision_config._attn_implementation) == (
        "eager", "sdpa")
    assert _states(lean) == [None, None]


def test_deepcopy_keeps_mode_and_original():
    lean = leanact.patch(_clip(), attention="tempo")
    twin = copy.deepcopy(lean)
    assert [(s.original, s.mode) for s in _states(twin)] == [("eager", "tempo"), ("sdpa", "tempo")]
    assert leanact.summary(twin) is not None
    leanact.unpatch(twin)
    assert twin.config.text_config._attn_implementation == "eager"
    assert lean.config.text_config._attn_implementation == attention_hf.NAME  # the original is untouched


def _t5(attn):
    torch.manual_seed(0)
    cfg = T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
                     attn_implementation=attn)
    return T.T5ForConditionalGeneration(cfg)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_t5_position_bias_through_the_core(attn, padded, monkeypatch):
    ref = _t5(attn)
    lean = leanact.patch(copy.deepcopy(ref))
    calls = []
    core = attention_hf._lean_attention
    monkeypatch.setattr(attention_hf, "_lean_attention", lambda *a, **k: calls.append(1) or core(*a, **k))
    g = torch.Generator().manual_seed(2)
    ids, dec = torch.randint(1, 64, (2, 9), generator=g), torch.randint(1, 64, (2, 6), generator=g)
    batch = dict(input_ids=ids, decoder_input_ids=dec, labels=dec)
    if padded:
        batch["attention_mask"] = torch.ones(2, 9, dtype=torch.long)
        batch["attention_mask"][1, 5:] = 0
    for m in (ref, lean):
        m.train()
        m(**batch).loss.backward()
    assert len(calls) == 6  # encoder self, decoder self and cross attention, 2 layers
    _assert_grads_close(ref, lean)
    bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert dict(lean.named_parameters())[bias].grad.abs().max() > 0
    assert all(after == "leanact (recompute)" for _, _, after in leanact.summary(lean).attention)


def _gemma2():
    torch.manual_seed(0)
    cfg = T.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    return T.Gemma2ForCausalLM(cfg)


def _gpt_oss():
    torch.manual_seed(0)
    cfg = T.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=64)
    return T.GptOssForCausalLM(cfg)


@pytest.mark.parametrize("build, feature", [(_gemma2, "logit softcap"), (_gpt_oss, "attention sinks")])
def test_softcap_and_sinks_run_the_core_and_say_so(build, feature):
    ref = build()
    lean = leanact.patch(copy.deepcopy(ref))
    (path, was, after), = leanact.summary(lean).attention
    assert after.startswith("leanact (recompute") and feature in after, after
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in (ref, lean):
            m.train()
            m(input_ids=ids, labels=ids).loss.backward()
    _assert_grads_close(ref, lean)
    assert not leanact.summary(lean).attention_fallbacks()
    sinks = [n for n, _ in ref.named_parameters() if n.endswith("sinks")]
    for n in sinks:
        assert dict(lean.named_parameters())[n].grad is not None
