"""Training samples for vision-language models built from their configs: one image (random pixels)
and text tokens, the image's tokens placed as the model's processor places them, labels on the text.

``vlm_sample(config, text_tokens)`` -> keyword arguments of ``*ForConditionalGeneration.forward``.
Families: Qwen2-VL and Qwen2.5-VL (one image of 1,024 tokens after 2x2 merging: 4,096 patches),
LLaVA (the tower's image size; one token per patch), Gemma 3 (``mm_tokens_per_image`` tokens between
its begin/end tokens, attending to each other), PaliGemma (image, prefix, then the suffix with the
loss), Mllama (one image as the tiles of its squarest largest aspect ratio, its token first, the
text after it reading it through cross-attention), Idefics3 (SmolVLM's architecture: one large image
as the processor splits it, a 4 x 4 grid of tiles and the whole image downscaled, each tile's tokens
after its two marker tokens). Others raise ValueError naming these.
"""
from __future__ import annotations

import torch

__all__ = ["VLM_TYPES", "is_vlm_config", "vlm_sample"]

VLM_TYPES = ("qwen2_vl", "qwen2_5_vl", "llava", "gemma3", "paligemma", "mllama", "idefics3")
IDEFICS3_GRID = 4  # a large image: split into 4 x 4 tiles (the processor's default longest edge), plus the global one
QWEN_IMAGE_TOKENS = 1024  # one image of this many tokens after merging


def is_vlm_config(config) -> bool:
    """Whether ``config`` is a vision-language model's (a vision and a text sub-config)."""
    return getattr(config, "vision_config", None) is not None and getattr(config, "text_config", None) is not None


def _text(g: torch.Generator, n: int, vocab: int, specials: set) -> torch.Tensor:
    top = max(min(vocab, min(specials)) if specials else vocab, 2)
    return torch.randint(0, top, (n,), generator=g)


def _image_id(config) -> int:
    for name in ("image_token_id", "image_token_index"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    raise ValueError(f"{type(config).__name__} names no image token (image_token_id)")


def vlm_sample(config, text_tokens: int, dtype: torch.dtype = torch.float32, seed: int = 1,
               image_tokens: int = QWEN_IMAGE_TOKENS) -> dict:
    """One training sample for the vision-language ``config`` (module doc); floating inputs in ``dtype``;
    ``image_tokens``: Qwen's image size in tokens after merging (a square number)."""
    kind = getattr(config, "model_type", None)
    if kind not in VLM_TYPES:
        raise ValueError(f"vision-language model type {kind!r}: leanact makes image batches for "
                         f"{', '.join(VLM_TYPES)}")
    g = torch.Generator().manual_seed(seed)
    vision, text = config.vision_config, config.text_config
    image = _image_id(config)
    vocab = int(text.vocab_size)
    half = text_tokens // 2
    extra: dict = {}
    if kind in ("qwen2_vl", "qwen2_5_vl"):
        merge, patch, frames = int(vision.spatial_merge_size), int(vision.patch_size), int(vision.temporal_patch_size)
        per_side = round(image_tokens ** 0.5)
        if per_side * per_side != image_tokens:
            raise ValueError(f"image_tokens must be a square number (tokens per side squared), got {image_tokens}")
        side = merge * per_side
        start = int(config.vision_start_token_id)
        end = int(getattr(config, "vision_end_token_id", None) or start + 1)
        specials = {image, start, end, int(getattr(config, "video_token_id", image))}
        body = [start] + [image] * image_tokens + [end]
        channels = int(getattr(vision, "in_channels", 3))
        extra = dict(pixel_values=torch.randn(side * side, channels * frames * patch * patch, generator=g),
                     image_grid_thw=torch.tensor([[1, side, side]]))
    elif kind == "llava":
        n = (int(vision.image_size) // int(vision.patch_size)) ** 2
        if getattr(config, "vision_feature_select_strategy", "default") == "full":
            n += 1
        specials, body = {image}, [image] * n
        extra = dict(pixel_values=torch.randn(1, 3, vision.image_size, vision.image_size, generator=g))
    elif kind == "gemma3":
        boi, eoi = int(config.boi_token_index), int(config.eoi_token_index)
        specials, body = {image, boi, eoi}, [boi] + [image] * int(config.mm_tokens_per_image) + [eoi]
        extra = dict(pixel_values=torch.randn(1, 3, vision.image_size, vision.image_size, generator=g))
    elif kind == "mllama":
        return _mllama(config, g, text_tokens, dtype)
    elif kind == "idefics3":
        tiles = IDEFICS3_GRID * IDEFICS3_GRID + 1
        per_tile = (int(vision.image_size) // int(vision.patch_size)) ** 2 // int(config.scale_factor) ** 2
        marks = _text(g, 2 * tiles + 1, vocab, {image}).tolist()  # <fake_token_around_image>, <row_i_col_j>, ...
        specials, body = {image}, [t for i in range(tiles) for t in marks[2 * i: 2 * i + 2] + [image] * per_tile]
        body.append(marks[-1])
        extra = dict(pixel_values=torch.randn(1, tiles, int(getattr(vision, "num_channels", 3)), vision.image_size,
                                              vision.image_size, generator=g))
    else:  # paligemma: the image first, then a prefix (bidirectional), then the suffix (causal, with the loss)
        n = (int(vision.image_size) // int(vision.patch_size)) ** 2
        ids = torch.cat([torch.full((n,), image), _text(g, text_tokens, vocab, {image})])[None]
        kinds = torch.zeros_like(ids)
        kinds[:, n + half:] = 1
        return dict(input_ids=ids, labels=ids.masked_fill(kinds == 0, -100), token_type_ids=kinds,
                    pixel_values=torch.randn(1, 3, vision.image_size, vision.image_size, generator=g).to(dtype))
    words = _text(g, text_tokens, vocab, specials)
    ids = torch.cat([words[:half], torch.tensor(body), words[half:]])[None]
    is_text = torch.zeros(ids.shape[1], dtype=torch.bool)
    is_text[:half], is_text[half + len(body):] = True, True
    out = dict(input_ids=ids, labels=ids.masked_fill(~is_text[None], -100))
    out.update({k: v.to(dtype) if v.is_floating_point() else v for k, v in extra.items()})
    if kind == "gemma3":
        out["token_type_ids"] = (ids == image).long()
    if kind in ("qwen2_vl", "qwen2_5_vl"):
        out["mm_token_type_ids"] = (ids == image).long()
    return out


def _mllama(config, g: torch.Generator, text_tokens: int, dtype: torch.dtype) -> dict:
    """Mllama's sample: the image token, then the text (labels on it) attending to the image's tiles;
    the image fills the most tiles an aspect ratio of the config allows (the squarest of them), as
    the processor tiles a large square image."""
    vision, image = config.vision_config, _image_id(config)
    ratios = [tuple(r) for r in vision.supported_aspect_ratios]
    index, (rows, cols) = max(enumerate(ratios), key=lambda ir: (ir[1][0] * ir[1][1], -abs(ir[1][0] - ir[1][1])))
    tiles, most = rows * cols, int(vision.max_num_tiles)
    words = _text(g, text_tokens, int(config.text_config.vocab_size), {image})
    ids = torch.cat([torch.tensor([image]), words])[None]
    cross = torch.zeros(1, ids.shape[1], 1, most, dtype=torch.long)
    cross[:, :, 0, :tiles] = 1
    size = int(vision.image_size)
    pixels = torch.randn(1, 1, most, int(getattr(vision, "num_channels", 3)), size, size, generator=g)
    pixels[:, :, tiles:] = 0  # the processor pads unused tiles with zeros
    return dict(input_ids=ids, labels=ids.masked_fill(ids == image, -100), pixel_values=pixels.to(dtype),
                aspect_ratio_ids=torch.tensor([[index + 1]]), cross_attention_mask=cross,
                aspect_ratio_mask=(torch.arange(most) < tiles).long()[None, None])
