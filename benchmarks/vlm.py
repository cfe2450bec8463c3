"""Whole-model activation memory of a vision-language model at a real checkpoint's geometry: HF sdpa
vs leanact.patch, measured on real tensors.

    python benchmarks/vlm.py [--image-tokens 1024] [--text-tokens 1024] [--markdown] [--predict]

The Qwen2.5-VL-7B geometry (vision tower: 32 blocks of width 1280, windowed attention but in blocks
7, 15, 23, 31, 2x2 patch merging; language model: 28 layers of width 3584, vocabulary 152,064,
M-RoPE), random weights, one sample: one image of ``--image-tokens`` tokens after merging (4x as many
14-pixel patches in the tower) and ``--text-tokens`` text tokens, labels on the text. What is
measured: bytes kept for backward at the end of the forward of one training step (storages
deduplicated, parameters and inputs excluded: ``leanact.memory.SavedTensorMeter``), which is the
activation memory of the step. A 7B step does not fit this benchmark's CPU at full depth, so it
runs three shallow models -- (tower blocks, language layers) = (1, 1), (2, 1), (1, 2) -- with the
same widths: every block of the tower (and every language layer) keeps the same bytes, so the
full-depth bytes are the (1, 1) model's plus 31 tower increments and 27 language increments
(each increment read off the shallow pairs; the windowed and full-attention blocks keep the same
tensors). fp32 on the CPU (bf16 matrix products are too slow without AVX512-BF16).

``--predict [GEOMETRY ...]``: instead, ``leanact.estimate_config`` of whole models at full depth in
bf16 for a CUDA device, on fake tensors (Qwen's token ids and image grid stay real: the model reads
them), HF sdpa vs leanact: bytes kept for backward and the step's peak (AdamW), for Qwen2.5-VL-7B,
Qwen2-VL-7B, LLaVA-1.5-7B, Gemma 3 4B, PaliGemma 3B, Llama 3.2 11B Vision and Idefics3-8B geometries (the sizes are
in the builders); then the bytes kept per block of the vision tower and of the language model over
tokens × width (B/sbh, averaged over the blocks: ``Estimate.saved_under``).
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import leanact  # noqa: E402
from leanact.memory import SavedTensorMeter  # noqa: E402
from leanact.models.vlm_batches import vlm_sample  # noqa: E402

MIB = 2**20
VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, out_hidden_size=3584, num_heads=16,
              patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=112,
              fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu")
TEXT = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
            num_key_value_heads=4, vocab_size=152064, max_position_embeddings=128000, rope_theta=1e6,
            rms_norm_eps=1e-6, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})
IMAGE, VIDEO, START, END = 151655, 151656, 151652, 151653


def build(blocks: int, layers: int, attn: str):
    import transformers

    vision = dict(VISION, depth=blocks, fullatt_block_indexes=[b for b in VISION["fullatt_block_indexes"]
                                                                if b < blocks] or [blocks - 1])
    cfg = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=dict(TEXT, num_hidden_layers=layers),
                                        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                                        vision_end_token_id=END)
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    model.set_attn_implementation(attn)
    return model.train()


def kept(model, batch) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with SavedTensorMeter(model, exclude=[v for v in batch.values() if isinstance(v, torch.Tensor)]) as meter:
            out = model(**batch)
    del out
    return meter.activation_bytes


def _qwen2_vl_7b():
    import transformers

    vision = dict(depth=32, embed_dim=1280, hidden_size=3584, num_heads=16, mlp_ratio=4, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, hidden_act="quick_gelu")
    cfg = transformers.Qwen2VLConfig(vision_config=vision, text_config=TEXT, image_token_id=IMAGE,
                                     video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    return cfg, transformers.Qwen2VLForConditionalGeneration


def _qwen2_5_vl_7b():
    import transformers

    cfg = transformers.Qwen2_5_VLConfig(vision_config=VISION, text_config=TEXT, image_token_id=IMAGE,
                                        video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    return cfg, transformers.Qwen2_5_VLForConditionalGeneration


def _llava_1_5_7b():
    import transformers as T

    vision = T.CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                                image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu")
    text = T.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096)
    cfg = T.LlavaConfig(vision_config=vision, text_config=text, image_token_id=32000, vision_feature_layer=-2,
                        vision_feature_select_strategy="default")
    return cfg, T.LlavaForConditionalGeneration


def _siglip_so400m(image_size: int):
    import transformers as T

    return T.SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                                image_size=image_size, patch_size=14)


def _gemma3_4b():
    import transformers as T

    text = T.Gemma3TextConfig(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                              num_key_value_heads=4, head_dim=256, vocab_size=262208, sliding_window=1024)
    image, boi, eoi = 262144, 255999, 256000
    cfg = T.Gemma3Config(vision_config=_siglip_so400m(896), text_config=text, mm_tokens_per_image=256,
                         image_token_index=image, boi_token_index=boi, eoi_token_index=eoi)
    return cfg, T.Gemma3ForConditionalGeneration


def _paligemma_3b():
    import transformers as T

    text = T.GemmaConfig(hidden_size=2048, intermediate_size=16384, num_hidden_layers=18, num_attention_heads=8,
                         num_key_value_heads=1, head_dim=256, vocab_size=257216)
    vision = _siglip_so400m(224)
    vision.projection_dim = 2048
    image = 257152
    cfg = T.PaliGemmaConfig(vision_config=vision, text_config=text, image_token_index=image, projection_dim=2048)
    return cfg, T.PaliGemmaForConditionalGeneration


def _llama_3_2_11b_vision():
    import transformers as T

    vision = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_global_layers=8,
                  attention_heads=16, image_size=560, patch_size=14, max_num_tiles=4, vision_output_dim=7680,
                  intermediate_layers_indices=[3, 7, 15, 23, 30], num_channels=3,
                  supported_aspect_ratios=[[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]])
    text = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=40, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, cross_attention_layers=[3, 8, 13, 18, 23, 28, 33, 38],
                rope_theta=500000.0, max_position_embeddings=131072, pad_token_id=128004, bos_token_id=128000,
                eos_token_id=128001, rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"})
    cfg = T.MllamaConfig(vision_config=vision, text_config=text, image_token_index=128256)
    return cfg, T.MllamaForConditionalGeneration


def _idefics3_8b():
    import transformers as T

    vision = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                  image_size=364, patch_size=14)
    text = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128259, rope_theta=500000.0,
                max_position_embeddings=10240, rms_norm_eps=1e-5)
    cfg = T.Idefics3Config(vision_config=vision, text_config=text, image_token_id=128257, scale_factor=2)
    return cfg, T.Idefics3ForConditionalGeneration


#: name -> (what the geometry is, a builder () -> (config, model class), tokens the vision tower runs on);
#: the sample: vlm_sample(config, ...)
GEOMETRIES = {
    "qwen2.5-vl-7b": ("Qwen2.5-VL-7B, one 1,024-token image (4,096 patches in the tower)", _qwen2_5_vl_7b, 4096),
    "qwen2-vl-7b": ("Qwen2-VL-7B, one 1,024-token image (4,096 patches)", _qwen2_vl_7b, 4096),
    "llava-1.5-7b": ("LLaVA-1.5-7B, one 336-pixel image (576 tokens)", _llava_1_5_7b, 577),
    "gemma-3-4b": ("Gemma 3 4B, one 896-pixel image (4,096 patches, 256 tokens)", _gemma3_4b, 4096),
    "paligemma-3b": ("PaliGemma 3B, one 224-pixel image (256 tokens)", _paligemma_3b, 256),
    "llama-3.2-11b-vision": ("Llama 3.2 11B Vision, one image as 4 tiles of 560 pixels (4 × 1,601 patches)",
                             _llama_3_2_11b_vision, 4 * 1608),
    "idefics3-8b": ("Idefics3-8B (SmolVLM's architecture), one image as 4 × 4 tiles + the whole (17 × 169 tokens)",
                    _idefics3_8b, 17 * 676),
}
#: model_type -> (the vision tower's path, the language model's path)
PARTS = {"qwen2_vl": ("model.visual", "model.language_model"), "qwen2_5_vl": ("model.visual", "model.language_model"),
         "llava": ("model.vision_tower", "model.language_model"),
         "gemma3": ("model.vision_tower", "model.language_model"),
         "paligemma": ("model.vision_tower", "model.language_model"),
         "mllama": ("model.vision_model", "model.language_model"),
         "idefics3": ("model.vision_model", "model.text_model")}


def blocks_under(model, prefix: str) -> list[str]:
    """Names of the repeated blocks under ``prefix``: the entries of its ModuleLists named ``layers`` or
    ``blocks`` (Mllama's tower has two: local and global layers)."""
    return [f"{name}.{i}" for name, mod in model.named_modules()
            if name.startswith(prefix + ".") and name.rsplit(".", 1)[-1] in ("layers", "blocks")
            and isinstance(mod, torch.nn.ModuleList) for i in range(len(mod))]


def per_block(est, blocks: list[str], tokens: int, width: int) -> float:
    """Bytes kept per block over tokens × width (B/sbh), averaged over the blocks."""
    return sum(est.saved_under(b) for b in blocks) / (len(blocks) * tokens * width)


def predict(names: list[str], text_tokens: int, markdown: bool) -> None:
    from leanact.estimate import estimate_config

    parts = []
    if markdown:
        print(f"| geometry, + {text_tokens:,} text tokens, bf16, predicted for CUDA | HF sdpa kept | leanact kept | "
              "step peak (AdamW), HF → leanact |")
        print("|---|---:|---:|---:|")
    for name in names:
        label, make, tower_tokens = GEOMETRIES[name]
        cfg, cls = make()
        batch = vlm_sample(cfg, text_tokens)
        cfg._attn_implementation = "sdpa"
        got = {}
        for patch in (False, True):
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got[patch] = estimate_config(lambda: cls(cfg), batch, None, "cuda", patch=patch, dtype=torch.bfloat16)
            print(f"  ({label}, {'leanact' if patch else 'HF sdpa'}: {time.perf_counter() - t0:.0f} s)", flush=True)
        hf, lean = got[False], got[True]
        cells = (f"{hf.saved / MIB:,.0f} MiB", f"**{lean.saved / MIB:,.0f} MiB ({lean.saved / hf.saved:.3f}x)**",
                 f"{hf.peak / 2**30:.2f} → {lean.peak / 2**30:.2f} GiB")
        print(f"| {label} | " + " | ".join(cells) + " |" if markdown else f"{label}: " + ", ".join(cells), flush=True)
        parts.append(_part_cells(label, cfg, cls, tower_tokens, int(batch["input_ids"].shape[1]), hf, lean))
    print("\n| geometry, bf16, predicted for CUDA | vision tower: blocks × tokens × width | tower B/sbh, HF → leanact "
          "| language model: layers × tokens × width | language model B/sbh, HF → leanact |")
    print("|---|---|---:|---|---:|")
    for row in parts:
        print("| " + " | ".join(row) + " |", flush=True)


def _part_cells(label: str, cfg, cls, tower_tokens: int, text_tokens: int, hf, lean) -> tuple[str, ...]:
    """The per-block B/sbh of the vision tower and of the language model (names from a meta-device build)."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls(cfg)
    vision, text = cfg.vision_config, cfg.text_config
    tower, lm = PARTS[cfg.model_type]
    cells = [label.split(",")[0]]
    for prefix, tokens, width in ((tower, tower_tokens, getattr(vision, "embed_dim", None) or vision.hidden_size),
                                  (lm, text_tokens, text.hidden_size)):
        blocks = blocks_under(model, prefix)
        a, b = per_block(hf, blocks, tokens, width), per_block(lean, blocks, tokens, width)
        cells += [f"{len(blocks)} × {tokens:,} × {width:,}", f"{a:.1f} → **{b:.1f}** ({b / a:.2f}x)"]
    return tuple(cells)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--image-tokens", type=int, default=1024)
    ap.add_argument("--text-tokens", type=int, default=1024)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--predict", nargs="*", choices=list(GEOMETRIES), default=None, metavar="GEOMETRY",
                    help="instead: the whole model's bf16 step predicted on fake tensors, for these geometries "
                         f"(default all: {', '.join(GEOMETRIES)})")
    args = ap.parse_args(argv)
    if args.predict is not None:
        predict(args.predict or list(GEOMETRIES), args.text_tokens, args.markdown)
        return
    batch = vlm_sample(_qwen2_5_vl_7b()[0], args.text_tokens, image_tokens=args.image_tokens)
    got = {}
    for depths in ((1, 1), (2, 1), (1, 2)):
        for mode in ("HF sdpa", "leanact"):
            t0 = time.perf_counter()
            model = build(*depths, "sdpa")
            if mode == "leanact":
                leanact.patch(model)
            got[mode, depths] = kept(model, copy.copy(batch))
            del model
            print(f"{mode}, {depths[0]} tower block(s), {depths[1]} language layer(s): "
                  f"{got[mode, depths] / MIB:,.1f} MiB kept ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows = []
    for mode in ("HF sdpa", "leanact"):
        base = got[mode, (1, 1)]
        block, layer = got[mode, (2, 1)] - base, got[mode, (1, 2)] - base
        total = base + (VISION["depth"] - 1) * block + (TEXT["num_hidden_layers"] - 1) * layer
        rows.append((mode, block, layer, total))
    hf = rows[0][3]
    tokens = batch["input_ids"].shape[1]
    patches = 4 * args.image_tokens  # the tower runs on the unmerged patches
    if args.markdown:
        print(f"\n| Qwen2.5-VL-7B geometry, one {args.image_tokens}-token image + {args.text_tokens} text tokens "
              f"({tokens} in the language model), fp32 | per tower block (B/sbh) | per language layer (B/sbh) "
              "| whole model |")
        print("|---|---:|---:|---:|")
    for mode, block, layer, total in rows:
        cells = (f"{block / MIB:,.1f} MiB ({block / (patches * VISION['hidden_size']):.2f})",
                 f"{layer / MIB:,.1f} MiB ({layer / (tokens * TEXT['hidden_size']):.2f})",
                 f"{total / MIB:,.0f} MiB ({total / hf:.2f}x)")
        print(f"| {mode} | " + " | ".join(cells) + " |" if args.markdown else f"{mode}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
