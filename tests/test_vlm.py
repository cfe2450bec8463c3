"""Vision-language models, patched, against the unpatched model of identical weights:

- LLaVA: a CLIP vision tower, a projector, a Llama language model;
- Qwen2-VL: a tower with 2-D rotary embeddings and patch merging, M-RoPE in the language model;
- Qwen2.5-VL: the same with windowed attention in the tower;
- Gemma 3: a SigLIP tower, image tokens attending to each other in a causal language model;
- PaliGemma: a prefix language model;
- Idefics3 (SmolVLM's architecture): pixel shuffle, a Llama language model;
- Mllama (Llama 3.2 Vision): tiles, a language model reading the image through cross-attention layers.

fp32 loss and every gradient, the fused head (``*ForConditionalGeneration``: logits None, the model's
own loss with its image-token masking), eval and ``generate`` bit-identical; images made in the test."""
import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import leanact  # noqa: E402
from _tol import assert_grads_close  # noqa: E402

IMAGE_TOKEN = 100


def _model(cls, cfg, attn, length):
    """(the model with random weights and ``attn``, a generator for its inputs, 2 x ``length`` token ids)."""
    torch.manual_seed(0)
    model = cls(cfg).float()
    model.set_attn_implementation(attn)
    with torch.no_grad():  # a zero-initialised projection (Gemma 3's image input) passes no gradient back
        for name, p in model.named_parameters():  # (and Mllama's zero cross-attention gates)
            if (p.dim() == 2 or name.endswith("gate")) and not p.any():
                p.normal_(0.0, 0.1)
    g = torch.Generator().manual_seed(1)
    return model, g, torch.randint(1, 90, (2, length), generator=g)


def _llava(attn):
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=16, patch_size=4)
    text = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=120)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN,
                                   projector_hidden_act="gelu", vision_feature_layer=-1)
    model, g, ids = _model(transformers.LlavaForConditionalGeneration, cfg, attn, 30)
    ids[:, 2:2 + 16] = IMAGE_TOKEN  # one 16x16 image of 4x4 patches per sample
    return model, dict(input_ids=ids, pixel_values=torch.randn(2, 3, 16, 16, generator=g))


def _qwen_vl(name, vision, patches):
    """Qwen2-VL or Qwen2.5-VL (``name``) with the ``vision`` config, one image of ``patches`` x ``patches``
    patches per sample (merged 2x2 into tokens), M-RoPE in the language model."""
    if not hasattr(transformers, f"{name}ForConditionalGeneration"):
        pytest.skip(f"no {name} in transformers {transformers.__version__}")
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=160, max_position_embeddings=256,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    cfg = getattr(transformers, f"{name}Config")(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN,
                                                 video_token_id=101, vision_start_token_id=102)
    tokens = patches * patches // 4
    return cfg, tokens, torch.tensor([[1, patches, patches]] * 2)


def _qwen_vl_model(name, vision, patches, attn, length):
    cfg, tokens, grid = _qwen_vl(name, vision, patches)
    model, g, ids = _model(getattr(transformers, f"{name}ForConditionalGeneration"), cfg, attn, length)
    ids[:, 3] = 102
    ids[:, 4:4 + tokens] = IMAGE_TOKEN
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4, generator=g)  # (t=2) x 4x4-pixel patches
    return model, dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grid,
                       mm_token_type_ids=(ids == IMAGE_TOKEN).long())


def _qwen2_vl(attn):
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    return _qwen_vl_model("Qwen2VL", vision, 4, attn, 24)


def _qwen2_5_vl(attn):  # windowed attention in block 0 (8x8 patches, windows of 16 pixels)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=4, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=16, fullatt_block_indexes=[1])
    return _qwen_vl_model("Qwen2_5_VL", vision, 8, attn, 40)


def _gemma3(attn):
    if not hasattr(transformers, "Gemma3ForConditionalGeneration"):
        pytest.skip(f"no Gemma 3 in transformers {transformers.__version__}")
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=16, patch_size=4)
    text = transformers.Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=160,
                                         sliding_window=8)
    cfg = transformers.Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=4,
                                    image_token_index=IMAGE_TOKEN, boi_token_index=101, eoi_token_index=102)
    model, g, ids = _model(transformers.Gemma3ForConditionalGeneration, cfg, attn, 24)
    ids[:, 3], ids[:, 4:8], ids[:, 8] = 101, IMAGE_TOKEN, 102  # the image's 4 tokens attend to each other
    return model, dict(input_ids=ids, pixel_values=torch.randn(2, 3, 16, 16, generator=g),
                       token_type_ids=(ids == IMAGE_TOKEN).long())


def _paligemma(attn):
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=16, patch_size=4, projection_dim=64)
    text = transformers.GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, vocab_size=160)
    cfg = transformers.PaliGemmaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                                       projection_dim=64)
    model, g, ids = _model(transformers.PaliGemmaForConditionalGeneration, cfg, attn, 30)
    ids[:, :16] = IMAGE_TOKEN  # the image, then the prefix (bidirectional), then the suffix (causal)
    kinds = torch.zeros_like(ids)
    kinds[:, 20:] = 1
    return model, dict(input_ids=ids, pixel_values=torch.randn(2, 3, 16, 16, generator=g), token_type_ids=kinds)


def _idefics3(attn):
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
                  patch_size=4)
    text = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=160)
    cfg = transformers.Idefics3Config(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN,
                                      scale_factor=2)
    model, g, ids = _model(transformers.Idefics3ForConditionalGeneration, cfg, attn, 30)
    ids[:, 2:6] = IMAGE_TOKEN  # 4x4 patches, pixel-shuffled by 2: 4 tokens per image
    return model, dict(input_ids=ids, pixel_values=torch.randn(2, 1, 3, 16, 16, generator=g))


def _mllama(attn):
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, attention_heads=4,
                  image_size=16, patch_size=4, max_num_tiles=1, intermediate_layers_indices=[0], vision_output_dim=64,
                  num_channels=3, supported_aspect_ratios=[[1, 1]])
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=160, cross_attention_layers=[1], pad_token_id=0)
    cfg = transformers.MllamaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    model, g, ids = _model(transformers.MllamaForConditionalGeneration, cfg, attn, 20)
    ids[:, 1] = IMAGE_TOKEN  # one tile per image, seen by the text through a cross-attention layer
    return model, dict(input_ids=ids, pixel_values=torch.randn(2, 1, 1, 3, 16, 16, generator=g),
                       aspect_ratio_ids=torch.ones(2, 1, dtype=torch.long),
                       aspect_ratio_mask=torch.ones(2, 1, 1, dtype=torch.long),
                       cross_attention_mask=torch.ones(2, 20, 1, 1, dtype=torch.long))


MODELS = {"llava": _llava, "qwen2_vl": _qwen2_vl, "qwen2_5_vl": _qwen2_5_vl, "gemma3": _gemma3,
          "paligemma": _paligemma, "idefics3": _idefics3, "mllama": _mllama}
#: family -> (the vision tower's path, the language model's path)
PARTS = {"llava": ("model.vision_tower.", "model.language_model."),
         "qwen2_vl": ("model.visual.", "model.language_model."),
         "qwen2_5_vl": ("model.visual.", "model.language_model."),
         "gemma3": ("model.vision_tower.", "model.language_model."),
         "paligemma": ("model.vision_tower.", "model.language_model."),
         "idefics3": ("model.vision_model.", "model.text_model."),
         "mllama": ("model.vision_model.", "model.language_model.")}


def _with_labels(batch, padding):
    ids = batch["input_ids"]
    mask = torch.ones_like(ids)
    if padding:
        mask[1, -5:] = 0
    labels = ids.masked_fill((ids >= IMAGE_TOKEN) | (mask == 0), -100)
    if "token_type_ids" in batch and (batch["token_type_ids"] != (ids == IMAGE_TOKEN)).any():  # PaliGemma: the suffix
        labels = labels.masked_fill(batch["token_type_ids"] == 0, -100)
    return dict(batch, attention_mask=mask, labels=labels)


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(**batch)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _grads_close_or_truer(ref, batch, r_grads, l_grads):
    """Every gradient within 1e-5 of the unpatched model's (:func:`assert_grads_close`), or, for one that
    is not (a scalar gate's gradient: one sum whose terms cancel, Mllama's positional-embedding gate),
    at least as close to the float64 truth (the same model and batch in float64) as the unpatched one's."""
    try:
        assert_grads_close(r_grads, l_grads)
        return
    except AssertionError:
        pass
    wide = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    truth = _step(copy.deepcopy(ref).double(), wide)[1]
    floor = 1e-6 * torch.stack([g.norm() for g in truth.values()]).median()  # (gradients zero in exact arithmetic)
    for name, g in truth.items():
        scale = torch.maximum(g.norm(), floor)
        e_ref, e_lean = ((r_grads[name] - g).norm() / scale).item(), ((l_grads[name] - g).norm() / scale).item()
        assert e_lean <= max(e_ref, 1e-5), (name, e_ref, e_lean)


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", MODELS)
def test_fp32_exact_and_fused(family, attn, padding):
    ref, batch = MODELS[family](attn)
    ref.train()
    lean = leanact.patch(copy.deepcopy(ref)).train()
    batch = _with_labels(batch, padding)
    (r_out, r_grads), (l_out, l_grads) = _step(ref, batch), _step(lean, batch)
    assert l_out.logits is None and r_out.logits is not None  # the fused head ran
    assert leanact.summary(lean).loss_states[""].fused_calls == 1
    assert abs(l_out.loss - r_out.loss) <= 1e-5 * abs(r_out.loss)
    _grads_close_or_truer(ref, batch, r_grads, l_grads)
    summary = leanact.summary(lean)
    assert summary.attention and all(after.startswith("leanact") for _, _, after in summary.attention)  # towers too
    replaced = [path for path, _, _ in summary.replaced]
    tower, language = PARTS[family]
    assert any(p.startswith(tower) for p in replaced) and any(p.startswith(language) for p in replaced)


@pytest.mark.parametrize("family", MODELS)
def test_eval_and_generate_bit_identical(family):
    ref, batch = MODELS[family]("sdpa")
    ref.eval()
    lean = leanact.patch(copy.deepcopy(ref)).eval()
    batch = dict(batch, attention_mask=torch.ones_like(batch["input_ids"]))
    with torch.no_grad():
        assert torch.equal(ref(**batch).logits, lean(**batch).logits)
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(ref.generate(**batch, **kw), lean.generate(**batch, **kw))


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_lora_gradients_exact(family):
    """PEFT LoRA on every linear layer (tower, projector, language model): patched after
    ``get_peft_model``, the loss and every LoRA gradient as the unpatched LoRA model's (fp32)."""
    peft = pytest.importorskip("peft")
    base, batch = MODELS[family]("sdpa")
    batch = _with_labels(batch, True)
    torch.manual_seed(3)  # init_lora_weights=False: random B, so that A's gradient is not zero
    cfg = peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    ref = peft.get_peft_model(base.train(), cfg)
    lean = leanact.patch(copy.deepcopy(ref))
    (r_out, r_grads), (l_out, l_grads) = _step(ref, batch), _step(lean, batch)
    assert l_out.logits is None and abs(l_out.loss - r_out.loss) <= 1e-5 * abs(r_out.loss)
    assert r_grads and all("lora_" in name for name in r_grads)
    assert_grads_close(r_grads, l_grads)


def _idefics3_with_a_padding_image(attn):
    """Idefics3's batch with two images in the first sample and, in the second, one and an all-zero
    (padding) one, which the model drops by reading the pixels."""
    model, batch = MODELS["idefics3"](attn)
    batch["input_ids"][0, 10:14] = IMAGE_TOKEN
    pixels = torch.randn(2, 2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    pixels[1, 1] = 0
    return model, dict(batch, pixel_values=pixels)


@pytest.mark.parametrize("patched", [False, True])
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "llava", "gemma3", "mllama", "idefics3"])
def test_estimate_equals_a_measured_step(family, patched):
    """leanact.estimate on fake tensors: what the step keeps to the byte, its peak within 5% of a
    measured one. Qwen2-VL and Qwen2.5-VL read the values of their token ids and image grid (M-RoPE
    positions, the tower's windows): the estimate keeps their integer inputs real and computes what
    comes from them for real. Idefics3 reads its pixels (padding images are dropped): the estimate
    keeps them real too, and says so."""
    from leanact.estimate import estimate, measure

    model, batch = _idefics3_with_a_padding_image("sdpa") if family == "idefics3" else MODELS[family]("sdpa")
    batch = _with_labels(batch, True)
    if patched:
        leanact.patch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        predicted, real = estimate(model, batch), measure(model, batch)
    assert predicted.saved == real.saved
    assert abs(predicted.peak - real.peak) <= 0.05 * real.peak
    reads_pixels = any("reads the values of its floating-point inputs" in n for n in predicted.notes)
    assert reads_pixels == (family == "idefics3")


def test_estimate_of_a_model_reading_its_weights_says_so():
    """A model whose control flow reads its weights' values cannot be traced on fake tensors: a clear
    error naming the fix, not a wrong number."""
    from leanact.estimate import estimate

    class Reads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x) if self.lin.weight.sum() > 0 else -self.lin(x)

    with pytest.raises(ValueError, match="measure a real step instead"):
        estimate(Reads(), (torch.randn(2, 8),), loss_fn=lambda out, *_: out.sum())


def test_estimate_config_where_an_initialiser_reads_the_weights():
    """SigLIP's truncated-normal initialiser reads values a fake weight does not have: estimate_config
    builds the model again with initialisers skipped and weights tied, and predicts what the model
    built for real does: the same parameters (tied), gradients, optimizer state and kept bytes; the
    peak within 5%, as for other estimates (a per-process cache warmed by earlier tests in the same
    worker moved it by 512 bytes)."""
    from leanact.estimate import estimate, estimate_config

    model, batch = MODELS["gemma3"]("sdpa")
    batch = _with_labels(batch, False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fake = estimate_config(model.config, batch, model_class=type(model))
        real = estimate(model, batch)
    same = ("params", "grads", "optimizer_state", "saved", "per_layer", "buffers")
    assert {k: getattr(fake, k) for k in same} == {k: getattr(real, k) for k in same}
    assert abs(fake.peak - real.peak) <= 0.05 * real.peak
