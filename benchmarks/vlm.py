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

``--predict``: instead, ``leanact.estimate_config`` of the whole model at full depth in bf16 for a
CUDA device, on fake tensors (the token ids and the image grid stay real: the model reads them),
HF sdpa vs leanact: bytes kept for backward and the step's peak (AdamW).
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


def sample(image_tokens: int, text_tokens: int) -> dict:
    side = int(round((image_tokens * 4) ** 0.5))  # patches per side: (side/2)² merged tokens
    if side * side != image_tokens * 4:
        raise SystemExit(f"--image-tokens must be a square number (merged tokens per side squared), got {image_tokens}")
    g = torch.Generator().manual_seed(1)
    half = text_tokens // 2
    text = torch.randint(0, 150000, (text_tokens,), generator=g)
    ids = torch.cat([text[:half], torch.tensor([START]), torch.full((image_tokens,), IMAGE), torch.tensor([END]),
                     text[half:]])[None]
    labels = ids.masked_fill((ids == IMAGE) | (ids == START) | (ids == END), -100)
    grid = torch.tensor([[1, side, side]])
    pixels = torch.randn(side * side, 3 * 2 * 14 * 14, generator=g)
    return dict(input_ids=ids, labels=labels, pixel_values=pixels, image_grid_thw=grid,
                mm_token_type_ids=(ids == IMAGE).long())


def kept(model, batch) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with SavedTensorMeter(model, exclude=[v for v in batch.values() if isinstance(v, torch.Tensor)]) as meter:
            out = model(**batch)
    del out
    return meter.activation_bytes


def predict(batch: dict, markdown: bool) -> None:
    import transformers

    from leanact.estimate import estimate_config

    cfg = transformers.Qwen2_5_VLConfig(vision_config=VISION, text_config=TEXT, image_token_id=IMAGE,
                                        video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    cfg._attn_implementation = "sdpa"
    rows = []
    for mode in ("HF sdpa", "leanact"):
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est = estimate_config(lambda: transformers.Qwen2_5_VLForConditionalGeneration(cfg), batch, None, "cuda",
                                  patch=mode == "leanact", dtype=torch.bfloat16)
        rows.append((mode, est))
        print(f"{mode}: predicted in {time.perf_counter() - t0:.0f} s", flush=True)
    hf = rows[0][1].saved
    if markdown:
        print("\n| Qwen2.5-VL-7B geometry, bf16, predicted for CUDA | kept for backward | step peak (AdamW) |")
        print("|---|---:|---:|")
    for mode, est in rows:
        cells = (f"{est.saved / MIB:,.0f} MiB ({est.saved / hf:.3f}x)", f"{est.peak / 2**30:.2f} GiB")
        print(f"| {mode} | " + " | ".join(cells) + " |" if markdown else f"{mode}: " + ", ".join(cells))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--image-tokens", type=int, default=1024)
    ap.add_argument("--text-tokens", type=int, default=1024)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--predict", action="store_true", help="the whole model's bf16 step predicted on fake tensors")
    args = ap.parse_args(argv)
    batch = sample(args.image_tokens, args.text_tokens)
    if args.predict:
        predict(batch, args.markdown)
        return
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
