"""`leanact profile --model <vision-language config.json>`: the whole step predicted for one image and
--seq text tokens, HF sdpa vs leanact (tiny configs written to tmp_path, saved as transformers saves them)."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from leanact.cli.main import main  # noqa: E402
from leanact.estimate import estimate  # noqa: E402
from leanact.models.geometries import resolve  # noqa: E402
from leanact.models.vlm_batches import vlm_sample  # noqa: E402

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=200, max_position_embeddings=4096)


def _configs():
    T = transformers
    return {
        "qwen2_vl": T.Qwen2VLConfig(
            vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=4,
                               spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
            text_config=dict(TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
            image_token_id=199, video_token_id=198, vision_start_token_id=197, vision_end_token_id=196,
            architectures=["Qwen2VLForConditionalGeneration"]),
        "llava": T.LlavaConfig(
            vision_config=T.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=16, patch_size=4),
            text_config=T.LlamaConfig(**TEXT), image_token_id=199, vision_feature_layer=-1,
            architectures=["LlavaForConditionalGeneration"]),
        "mllama": T.MllamaConfig(
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                               attention_heads=4, image_size=16, patch_size=4, max_num_tiles=4,
                               intermediate_layers_indices=[0], vision_output_dim=64, num_channels=3),
            text_config=dict(TEXT, cross_attention_layers=[1], pad_token_id=0, bos_token_id=1, eos_token_id=2),
            image_token_index=200, architectures=["MllamaForConditionalGeneration"]),
        "idefics3": T.Idefics3Config(
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                               image_size=16, patch_size=8),
            text_config=dict(model_type="llama", **TEXT), image_token_id=199, scale_factor=2,
            architectures=["Idefics3ForConditionalGeneration"]),
    }


@pytest.mark.parametrize("family", ["qwen2_vl", "llava", "mllama", "idefics3"])
def test_profile_predicts_the_whole_step(family, tmp_path, capsys):
    config = _configs()[family]
    config.save_pretrained(tmp_path)
    assert main(["profile", "--model", str(tmp_path / "config.json"), "--seq", "24", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    hf, lean = out["modes"]
    assert (hf["mode"], lean["mode"]) == ("HF sdpa", "leanact") and out["dtype"] == "bf16"
    assert 0 < lean["kept"] < hf["kept"]
    geo = resolve(str(tmp_path / "config.json"))
    sample = vlm_sample(geo.make_config(attn="sdpa"), 24, torch.bfloat16)
    assert out["tokens"] == sample["input_ids"].shape[1] > 24  # the image's tokens came in
    model = getattr(transformers, geo.model_cls)(geo.make_config(attn="sdpa")).to(torch.bfloat16)
    assert hf["kept"] == estimate(model, sample, None, "cuda").saved  # the same as the real model's estimate
    assert main(["profile", "--model", str(tmp_path / "config.json"), "--seq", "24"]) == 0
    assert "kept for backward" in capsys.readouterr().out


def test_mllama_sample_is_laid_out_as_its_processor_lays_it_out():
    """One image of the most tiles (the squarest such aspect ratio), its token first; the cross-attention
    mask is the one Mllama's processor builds from the token ids and the tile count."""
    from transformers.models.mllama.processing_mllama import (convert_sparse_cross_attention_mask_to_dense,
                                                              get_cross_attention_token_mask)

    cfg = _configs()["mllama"]
    sample = vlm_sample(cfg, 24)
    ratios = cfg.vision_config.supported_aspect_ratios
    assert ratios[int(sample["aspect_ratio_ids"]) - 1] == [2, 2]
    ids = sample["input_ids"][0].tolist()
    assert ids[0] == cfg.image_token_index and cfg.image_token_index not in ids[1:] and len(ids) == 25
    dense = convert_sparse_cross_attention_mask_to_dense([get_cross_attention_token_mask(ids, cfg.image_token_index)],
                                                         [[4]], max_num_tiles=4, length=25)
    assert torch.equal(sample["cross_attention_mask"], torch.as_tensor(dense))
    assert sample["aspect_ratio_mask"].tolist() == [[[1, 1, 1, 1]]]
    assert sample["pixel_values"].shape == (1, 1, 4, 3, 16, 16)
    assert (sample["labels"] == -100).sum() == 1
    model = transformers.MllamaForConditionalGeneration(cfg)
    assert torch.isfinite(model(**sample).loss)


def test_profile_refuses_text_options_and_unknown_families(tmp_path, capsys):
    _configs()["llava"].save_pretrained(tmp_path)
    with pytest.raises(SystemExit):
        main(["profile", "--model", str(tmp_path / "config.json"), "--budget", "8GiB"])
    assert "--budget are for text and image models" in capsys.readouterr().err
    other = transformers.LlavaNextConfig(
        vision_config=transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                    num_attention_heads=4, image_size=16, patch_size=4),
        text_config=transformers.LlamaConfig(**TEXT), architectures=["LlavaNextForConditionalGeneration"])
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(SystemExit):
        main(["profile", "--model", str(tmp_path / "other" / "config.json")])
    assert "leanact makes image batches for qwen2_vl" in capsys.readouterr().err
