"""Tiny Hugging Face models of every family leanact claims, and batches for them (random weights,
dropout 0, CPU). Shared by the differential matrix and the family tests.

``build(family, attn)`` -> model in train mode (or raises ``Unsupported`` when this transformers
lacks the family or the attention implementation); ``batch(family, padding)`` -> kwargs with labels.
Padding kinds: "none", "right", "left", "one" (a sequence with one real token, left padded).
"""
from __future__ import annotations

import torch

transformers = __import__("pytest").importorskip("transformers")
T = transformers

V = 96  # vocabulary of every text model
IMAGE_TOKEN = V - 1  # the vision-language models' image token (text ids stay below it)
S = 10  # text length
H, L, HEADS = 32, 2, 4


class Unsupported(Exception):
    pass


def _dec(cls_cfg, **kw):
    """A decoder-only LLaMA-like config."""
    base = dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=L, num_attention_heads=HEADS,
                num_key_value_heads=2, max_position_embeddings=64)
    base.update(kw)
    return cls_cfg(**base)


def _configs():
    bert = dict(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=HEADS, intermediate_size=64,
                max_position_embeddings=64)
    return {
        "bert": (lambda: T.BertConfig(**bert), "BertForMaskedLM", "mlm"),
        "roberta": (lambda: T.RobertaConfig(**bert, pad_token_id=1), "RobertaForMaskedLM", "mlm"),
        "distilbert": (lambda: T.DistilBertConfig(vocab_size=V, dim=H, n_layers=L, n_heads=HEADS, hidden_dim=64,
                                                  max_position_embeddings=64), "DistilBertForMaskedLM", "mlm"),
        "albert": (lambda: T.AlbertConfig(**bert, embedding_size=16), "AlbertForMaskedLM", "mlm"),
        "electra": (lambda: T.ElectraConfig(**bert, embedding_size=16), "ElectraForMaskedLM", "mlm"),
        "gpt2": (lambda: T.GPT2Config(vocab_size=V, n_embd=H, n_layer=L, n_head=HEADS, n_positions=64,
                                      bos_token_id=1, eos_token_id=2), "GPT2LMHeadModel", "clm"),
        "gpt_neox": (lambda: T.GPTNeoXConfig(vocab_size=V, hidden_size=H, num_hidden_layers=L,
                                             num_attention_heads=HEADS, intermediate_size=64,
                                             max_position_embeddings=64), "GPTNeoXForCausalLM", "clm"),
        # OPT and T5 use ReLU by default: where a pre-activation is within rounding of 0, bf16 rounding
        # flips its gradient on or off, and the count of such flips, not the kernels, would decide the
        # 16-bit comparisons. GELU keeps the function smooth (and is what most of these models use).
        "opt": (lambda: T.OPTConfig(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=HEADS,
                                    ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=H,
                                    activation_function="gelu",
                                    pad_token_id=1, bos_token_id=2, eos_token_id=2), "OPTForCausalLM", "clm"),
        "llama": (lambda: _dec(T.LlamaConfig), "LlamaForCausalLM", "clm"),
        "qwen2": (lambda: _dec(T.Qwen2Config), "Qwen2ForCausalLM", "clm"),
        "qwen3": (lambda: _dec(T.Qwen3Config, head_dim=8), "Qwen3ForCausalLM", "clm"),
        "mistral": (lambda: _dec(T.MistralConfig), "MistralForCausalLM", "clm"),
        "phi": (lambda: _dec(T.PhiConfig), "PhiForCausalLM", "clm"),
        "phi3": (lambda: _dec(T.Phi3Config, pad_token_id=0), "Phi3ForCausalLM", "clm"),
        "gemma": (lambda: _dec(T.GemmaConfig, head_dim=8), "GemmaForCausalLM", "clm"),
        "gemma2": (lambda: _dec(T.Gemma2Config, head_dim=8), "Gemma2ForCausalLM", "clm"),
        "gemma3": (lambda: _dec(T.Gemma3TextConfig, head_dim=8), "Gemma3ForCausalLM", "clm"),
        # attention sinks and sliding windows through leanact's core; every token to every expert (as below).
        # (With a window of 4, one autocast case put the router bias's bf16 gradient error at 4.3x the
        # unpatched model's, against 3.2x with leanact's attention off: rounding noise at the 4x rule's edge.)
        "gpt_oss": (lambda: _dec(T.GptOssConfig, head_dim=8, num_local_experts=2, num_experts_per_tok=2,
                                 sliding_window=6), "GptOssForCausalLM", "clm"),
        "olmo2": (lambda: _dec(T.Olmo2Config), "Olmo2ForCausalLM", "clm"),
        # attention written in the modeling code (leanact.patching.hf_alibi): ALiBi (Bloom, Falcon-RW) and
        # Falcon's rotary default (multi-query)
        "bloom": (lambda: T.BloomConfig(vocab_size=V, hidden_size=H, n_layer=L, n_head=HEADS), "BloomForCausalLM",
                  "clm"),
        "falcon": (lambda: T.FalconConfig(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=HEADS),
                   "FalconForCausalLM", "clm"),
        "falcon_alibi": (lambda: T.FalconConfig(vocab_size=V, hidden_size=H, num_hidden_layers=L,
                                                num_attention_heads=HEADS, alibi=True, multi_query=False),
                         "FalconForCausalLM", "clm"),
        # MoE: every token goes to every expert (top-k = all), so that the comparison does not depend on
        # which of two nearly tied experts rounding picks; the routing weights still get gradients.
        "mixtral": (lambda: _dec(T.MixtralConfig, num_local_experts=2, num_experts_per_tok=2), "MixtralForCausalLM",
                    "clm"),
        "qwen2_moe": (lambda: _dec(T.Qwen2MoeConfig, num_experts=2, num_experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=32), "Qwen2MoeForCausalLM", "clm"),
        "qwen3_moe": (lambda: _dec(T.Qwen3MoeConfig, head_dim=8, num_experts=2, num_experts_per_tok=2,
                                   moe_intermediate_size=32), "Qwen3MoeForCausalLM", "clm"),
        "vit": (lambda: T.ViTConfig(hidden_size=H, num_hidden_layers=L, num_attention_heads=HEADS, intermediate_size=64,
                                    image_size=16, patch_size=8, num_labels=3), "ViTForImageClassification", "image"),
        "clip": (lambda: T.CLIPConfig(
            text_config=dict(hidden_size=H, intermediate_size=64, num_hidden_layers=L, num_attention_heads=HEADS,
                             vocab_size=V, max_position_embeddings=S, bos_token_id=0, eos_token_id=1, pad_token_id=1),
            vision_config=dict(hidden_size=H, intermediate_size=64, num_hidden_layers=L, num_attention_heads=HEADS,
                               image_size=16, patch_size=8), projection_dim=16), "CLIPModel", "clip"),
        # vision-language: a CLIP tower (16x16 images of 8x8 patches: 4 image tokens), a Llama language model
        "llava": (lambda: T.LlavaConfig(
            vision_config=T.CLIPVisionConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=L,
                                             num_attention_heads=HEADS, image_size=16, patch_size=8),
            text_config=_dec(T.LlamaConfig), image_token_id=IMAGE_TOKEN, vision_feature_layer=-1),
            "LlavaForConditionalGeneration", "vlm"),
        # the other vision-language families of tests/test_vlm.py at the matrix's sizes (16x16 images,
        # 4 image tokens per sample after the first token; their own inputs: _VLM_INPUTS)
        "qwen2_vl": (lambda: _qwen_vl("Qwen2VLConfig", dict(
            depth=L, embed_dim=H, hidden_size=H, num_heads=HEADS, mlp_ratio=2, patch_size=4, spatial_merge_size=2,
            temporal_patch_size=2, in_channels=3)), "Qwen2VLForConditionalGeneration", "vlm"),
        "qwen2_5_vl": (lambda: _qwen_vl("Qwen2_5_VLConfig", dict(
            depth=L, hidden_size=H, intermediate_size=64, out_hidden_size=H, num_heads=HEADS, patch_size=4,
            spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=8, fullatt_block_indexes=[1])),
            "Qwen2_5_VLForConditionalGeneration", "vlm"),
        "gemma3_vlm": (lambda: T.Gemma3Config(
            vision_config=T.SiglipVisionConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=L,
                                               num_attention_heads=HEADS, image_size=16, patch_size=4),
            text_config=_dec(T.Gemma3TextConfig, head_dim=8, sliding_window=8), mm_tokens_per_image=4,
            image_token_index=IMAGE_TOKEN, boi_token_index=V - 2, eoi_token_index=V - 3),
            "Gemma3ForConditionalGeneration", "vlm"),
        "paligemma": (lambda: T.PaliGemmaConfig(
            vision_config=T.SiglipVisionConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=L,
                                               num_attention_heads=HEADS, image_size=16, patch_size=8,
                                               projection_dim=H),
            text_config=_dec(T.GemmaConfig, head_dim=8), image_token_index=IMAGE_TOKEN, projection_dim=H),
            "PaliGemmaForConditionalGeneration", "vlm"),
        "idefics3": (lambda: T.Idefics3Config(
            vision_config=dict(hidden_size=H, intermediate_size=64, num_hidden_layers=L, num_attention_heads=HEADS,
                               image_size=16, patch_size=8),
            text_config=dict(model_type="llama", vocab_size=V, hidden_size=H, intermediate_size=64,
                             num_hidden_layers=L, num_attention_heads=HEADS, num_key_value_heads=2),
            image_token_id=IMAGE_TOKEN, scale_factor=1), "Idefics3ForConditionalGeneration", "vlm"),
        "mllama": (lambda: T.MllamaConfig(
            vision_config=dict(hidden_size=H, intermediate_size=64, num_hidden_layers=L, num_global_layers=1,
                               attention_heads=HEADS, image_size=16, patch_size=8, max_num_tiles=1,
                               intermediate_layers_indices=[0], vision_output_dim=2 * H, num_channels=3,
                               supported_aspect_ratios=[[1, 1]]),
            text_config=dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=L,
                             num_attention_heads=HEADS, num_key_value_heads=2, cross_attention_layers=[1],
                             pad_token_id=0),
            image_token_index=IMAGE_TOKEN), "MllamaForConditionalGeneration", "vlm"),
        "t5": (lambda: T.T5Config(vocab_size=V, d_model=H, d_kv=8, d_ff=64, num_layers=L, num_heads=HEADS,
                                  feed_forward_proj="gated-gelu"),
               "T5ForConditionalGeneration", "seq2seq"),
        "bart": (lambda: T.BartConfig(vocab_size=V, d_model=H, encoder_layers=L, decoder_layers=L,
                                      encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                                      encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64),
                 "BartForConditionalGeneration", "seq2seq"),
        "whisper": (lambda: T.WhisperConfig(vocab_size=V, d_model=H, encoder_layers=L, decoder_layers=L,
                                            encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                                            encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                                            max_source_positions=8, max_target_positions=32,
                                            decoder_start_token_id=1, pad_token_id=0),
                    "WhisperForConditionalGeneration", "speech"),
    }


FAMILIES = list(_configs())


def _qwen_vl(config: str, vision: dict):
    """Qwen2-VL / Qwen2.5-VL: 4x4 patches of 4 pixels per image, merged 2x2 into 4 tokens; M-RoPE."""
    text = dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=L, num_attention_heads=HEADS,
                num_key_value_heads=2, max_position_embeddings=64,
                rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]})
    return getattr(T, config)(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN,
                              video_token_id=V - 2, vision_start_token_id=V - 3)


def _vlm_inputs(family: str, ids: torch.Tensor, g: torch.Generator) -> dict:
    """The image inputs of a vision-language family (``ids``: image tokens at 1:5, set by the caller)."""
    b = ids.shape[0]
    if family in ("qwen2_vl", "qwen2_5_vl"):
        ids[:, 0] = V - 3  # vision start
        grid = torch.tensor([[1, 4, 4]] * b)
        return dict(pixel_values=torch.randn(b * 16, 3 * 2 * 4 * 4, generator=g), image_grid_thw=grid,
                    mm_token_type_ids=(ids == IMAGE_TOKEN).long())
    if family == "gemma3_vlm":  # the image's 4 tokens attend to each other
        ids[:, 0], ids[:, 5] = V - 2, V - 3
        return dict(pixel_values=torch.randn(b, 3, 16, 16, generator=g), token_type_ids=(ids == IMAGE_TOKEN).long())
    if family == "paligemma":  # image, prefix (bidirectional) up to 7, then the suffix
        kinds = torch.zeros_like(ids)
        kinds[:, 7:] = 1
        return dict(pixel_values=torch.randn(b, 3, 16, 16, generator=g), token_type_ids=kinds)
    if family == "idefics3":
        return dict(pixel_values=torch.randn(b, 1, 3, 16, 16, generator=g))
    if family == "mllama":  # one tile per image, read by the text through a cross-attention layer
        ids[:, 2:5] = torch.randint(3, V - 3, (b, 3), generator=g)  # one image token
        return dict(pixel_values=torch.randn(b, 1, 1, 3, 16, 16, generator=g),
                    aspect_ratio_ids=torch.ones(b, 1, dtype=torch.long),
                    aspect_ratio_mask=torch.ones(b, 1, 1, dtype=torch.long),
                    cross_attention_mask=torch.ones(b, ids.shape[1], 1, 1, dtype=torch.long))
    return dict(pixel_values=torch.randn(b, 3, 16, 16, generator=g))


def no_dropout(cfg):
    """Every float dropout / pdrop / layerdrop field of the config (and its sub-configs) set to 0."""
    for k, v in list(vars(cfg).items()):
        if isinstance(v, T.PretrainedConfig):
            no_dropout(v)
        elif isinstance(v, float) and ("dropout" in k or "pdrop" in k or "layerdrop" in k):
            setattr(cfg, k, 0.0)
    for k in getattr(cfg, "sub_configs", None) or {}:
        sub = getattr(cfg, k, None)
        if sub is not None:
            no_dropout(sub)
    return cfg


def kind(family: str) -> str:
    return _configs()[family][2]


def build(family: str, attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    make, cls_name, _ = _configs()[family]
    if not hasattr(T, cls_name):
        raise Unsupported(f"{cls_name} is not in transformers {T.__version__}")
    cfg = no_dropout(make())
    torch.manual_seed(seed)
    try:
        model = getattr(T, cls_name)(cfg)
        model.set_attn_implementation(attn)
    except (ValueError, ImportError) as e:
        raise Unsupported(f"{cls_name} with attn_implementation={attn!r}: {e}") from e
    if model.config._attn_implementation != attn:
        raise Unsupported(f"{cls_name} does not take attn_implementation={attn!r}")
    with torch.no_grad():  # non-trivial norm weights (HF initialises most to 1 or 0)
        for name, p in model.named_parameters():
            if "norm" in name.lower() and p.dim() == 1:
                p.add_(torch.empty_like(p).uniform_(-0.3, 0.3))
            elif (p.dim() == 2 or name.endswith("gate")) and not p.any():  # zero-initialised projections and
                p.normal_(0.0, 0.1)  # gates (Gemma 3's image input, Mllama's cross-attention): else no gradient
                # would reach the vision tower
    return model.train()


def _mask(b: int, s: int, padding: str) -> torch.Tensor | None:
    if padding == "none":
        return None
    m = torch.ones(b, s, dtype=torch.long)
    if padding == "right":
        m[1, s // 2:] = 0
    elif padding == "left":
        m[1, : s // 2] = 0
    elif padding == "one":
        m[1, : s - 1] = 0
    else:
        raise ValueError(padding)
    return m


def batch(family: str, padding: str = "none", seed: int = 1) -> dict:
    """Inputs with labels for ``family``; padded positions are left in the labels (their rows count)."""
    g = torch.Generator().manual_seed(seed)
    k = kind(family)
    b = 4 if k == "clip" else 2  # a contrastive loss over 2 pairs is too degenerate to compare roundings
    ids = torch.randint(3, V - 1, (b, S), generator=g)
    mask = _mask(b, S, padding)
    out = {}
    if k == "vlm":  # one image per sample, its 4 tokens after the first; the model's loss skips none of them
        ids = ids.clamp_max(V - 4)  # (below the image's special tokens)
        ids[:, 1:5] = IMAGE_TOKEN
        out = _vlm_inputs(family, ids, g)
        out.update(input_ids=ids, labels=ids.masked_fill(ids >= V - 3, -100))
        if family == "paligemma":  # its loss: the suffix only
            out["labels"] = out["labels"].masked_fill(out["token_type_ids"] == 0, -100)
    elif k in ("mlm", "clm"):
        out = dict(input_ids=ids, labels=ids.clone())
        if k == "mlm":
            out["labels"][torch.rand(b, S, generator=g) < 0.5] = -100
    elif k == "image":
        return dict(pixel_values=torch.randn(b, 3, 16, 16, generator=g), labels=torch.tensor([0, 2]))
    elif k == "clip":
        out = dict(input_ids=ids, pixel_values=torch.randn(b, 3, 16, 16, generator=g), return_loss=True)
    elif k == "seq2seq":
        dec = torch.randint(3, V, (b, 6), generator=g)
        out = dict(input_ids=ids, decoder_input_ids=dec, labels=dec)
    elif k == "speech":
        dec = torch.randint(3, V, (b, 6), generator=g)
        out = dict(input_features=torch.randn(b, 8, 16, generator=g), decoder_input_ids=dec, labels=dec)
        if mask is not None:
            out["decoder_attention_mask"] = _mask(b, 6, padding)
        return out
    if mask is not None:
        out["attention_mask"] = mask
    return out


def float_inputs(batch_: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch_.items()}
