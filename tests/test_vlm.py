"""Vision-language models (LLaVA: a CLIP vision tower, a projector, a Llama language model), patched
against the unpatched model of identical weights: fp32 loss and every gradient, the fused head
(``*ForConditionalGeneration``: logits None, the model's own loss with its image-token masking), eval
and ``generate`` bit-identical, with the images made in the test."""
import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import leanact  # noqa: E402
from _tol import assert_grads_close  # noqa: E402

IMAGE, PATCH, IMAGE_TOKEN = 16, 4, 100


def _llava(attn):
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=IMAGE, patch_size=PATCH)
    text = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=120)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN,
                                   projector_hidden_act="gelu", vision_feature_layer=-1)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(cfg).float()
    model.set_attn_implementation(attn)
    return model


def _batch(padding):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 90, (2, 30), generator=g)
    ids[:, 2:2 + (IMAGE // PATCH) ** 2] = IMAGE_TOKEN  # one image's tokens per sample
    mask = torch.ones_like(ids)
    if padding:
        mask[1, -5:] = 0
    labels = ids.masked_fill((ids == IMAGE_TOKEN) | (mask == 0), -100)
    return dict(input_ids=ids, pixel_values=torch.randn(2, 3, IMAGE, IMAGE, generator=g), attention_mask=mask,
                labels=labels)


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_llava_fp32_exact_and_fused(attn, padding):
    ref = _llava(attn).train()
    lean = leanact.patch(copy.deepcopy(ref)).train()
    batch = _batch(padding)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (r_out, r_grads), (l_out, l_grads) = _step(ref, batch), _step(lean, batch)
    assert l_out.logits is None and r_out.logits is not None  # the fused head ran
    assert leanact.summary(lean).loss_states[""].fused_calls == 1
    assert abs(l_out.loss - r_out.loss) <= 1e-5 * abs(r_out.loss)
    assert_grads_close(r_grads, l_grads)
    replaced = {path for path, _, _ in leanact.summary(lean).replaced}
    assert any(p.startswith("model.vision_tower.") for p in replaced)
    assert any(p.startswith("model.language_model.") for p in replaced)


def test_llava_eval_and_generate_bit_identical():
    ref = _llava("sdpa").eval()
    lean = leanact.patch(copy.deepcopy(ref)).eval()
    batch = _batch(False)
    batch.pop("labels")
    with torch.no_grad():
        assert torch.equal(ref(**batch).logits, lean(**batch).logits)
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(ref.generate(**batch, **kw), lean.generate(**batch, **kw))
