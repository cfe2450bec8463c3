"""Hugging Face model geometries for profiling: config class + sizes, random weights, no hub.

Each :class:`Geometry` builds the model from its config with random weights at any number of
layers (the profiler builds 1- and 2-layer copies, so even large geometries are cheap) and makes a
random training batch (inputs + labels, so the model computes its own loss). The vocabulary is the
real one: the logits and the loss are a large part of what a model keeps outside its layers.
"""
from __future__ import annotations

import copy
import json
import math
import pathlib
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Geometry", "GEOMETRIES", "resolve", "set_dropout"]


@dataclass
class Geometry:
    """A model family + sizes. ``config_cls``/``model_cls`` name classes of ``transformers``.

    ``seq``/``batch``/``repeats``: defaults of ``leanact profile`` for this geometry (small for big
    geometries at long sequences, so the default run finishes in reasonable time on a CPU).
    """

    name: str
    config_cls: str
    model_cls: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    seq: int = 512
    batch: int = 1
    repeats: int = 3
    config: Any = None  # a ready config object (from a config.json), used instead of config_cls(**kwargs)
    vlm: bool = False  # a vision-language model (leanact profile predicts it whole: leanact.cli.vlm_profile)

    # -- config ----------------------------------------------------------------------------
    def make_config(self, layers: int | None = None, attn: str = "eager", dropout: float | None = None,
                    seq: int | None = None):
        """The config with ``layers`` layers (None: as given), attention implementation ``attn``,
        every dropout probability set to ``dropout`` (None: as given) and, for image models, the
        image size that gives ``seq`` tokens."""
        import transformers

        cfg = (copy.deepcopy(self.config) if self.config is not None
               else getattr(transformers, self.config_cls)(**self.kwargs))
        if layers is not None:
            cfg.num_hidden_layers = layers
            if isinstance(getattr(cfg, "layer_types", None), list):
                cfg.layer_types = (cfg.layer_types * layers)[:layers]
        if dropout is not None:
            set_dropout(cfg, dropout)
        if seq is not None and self.is_image:
            cfg.image_size = self.image_size_for(seq)
        cfg._attn_implementation = attn
        return cfg

    @property
    def base(self):
        return self.make_config()

    @property
    def is_image(self) -> bool:
        import transformers

        return getattr(transformers, self.model_cls).main_input_name == "pixel_values"

    @property
    def hidden(self) -> int:
        return int(self.base.hidden_size)

    @property
    def layers(self) -> int:
        return int(self.base.num_hidden_layers)

    @property
    def heads(self) -> int:
        return int(self.base.num_attention_heads)

    @property
    def vocab(self) -> int | None:
        return getattr(self.base, "vocab_size", None)

    def dropout_probabilities(self, dropout: float | None = None) -> list[float]:
        """The distinct dropout probabilities of the config (after setting them all to ``dropout``)."""
        cfg = self.make_config(1, dropout=dropout)
        return sorted({float(v) for k, v in cfg.to_dict().items() if _is_dropout(k, v)})

    # -- sequence length ---------------------------------------------------------------------
    def max_seq(self) -> int | None:
        """The longest sequence the config's position embeddings allow (None: no limit known)."""
        cfg = self.base
        if self.is_image:
            return None
        if cfg.model_type in ("roberta", "xlm-roberta", "camembert"):  # positions start after the padding index
            return int(cfg.max_position_embeddings) - int(cfg.pad_token_id) - 1
        for attr in ("max_position_embeddings", "n_positions"):
            if getattr(cfg, attr, None):
                return int(getattr(cfg, attr))
        return None

    def image_size_for(self, seq: int) -> int:
        """Image side that gives ``seq`` tokens: (side/patch)² patches + [CLS]."""
        n = math.isqrt(seq - 1) if seq > 1 else 0
        if seq < 2 or n * n != seq - 1:
            raise ValueError(f"{self.name} is an image model: --seq must be (patches per side)² + 1 "
                             f"(e.g. 197 for 14x14 patches), got {seq}.")
        return n * int(self.base.patch_size)

    def check_seq(self, seq: int) -> None:
        """Raise ValueError naming the limit if ``seq`` does not fit the model."""
        if self.is_image:
            self.image_size_for(seq)
            return
        limit = self.max_seq()
        if limit is not None and seq > limit:
            raise ValueError(f"--seq {seq} is longer than {self.name}'s {limit} positions; use --seq {limit} or less.")

    # -- model and batch ---------------------------------------------------------------------
    def build(self, layers: int, attn: str = "eager", dtype: torch.dtype = torch.float32,
              dropout: float | None = None, seq: int | None = None, seed: int = 0) -> torch.nn.Module:
        """A ``layers``-layer model with random weights (seeded), in training mode, in ``dtype``."""
        import transformers

        torch.manual_seed(seed)
        model = getattr(transformers, self.model_cls)(self.make_config(layers, attn, dropout, seq))
        return model.to(dtype).train()

    def batch_inputs(self, batch: int, seq: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> dict:
        """A random training batch: token ids (or pixels) and labels, no padding."""
        g = torch.Generator().manual_seed(seed)
        cfg = self.base
        if self.is_image:
            side = self.image_size_for(seq)
            pixels = torch.randn(batch, getattr(cfg, "num_channels", 3), side, side, generator=g).to(dtype)
            labels = torch.randint(0, max(int(getattr(cfg, "num_labels", 2)), 1), (batch,), generator=g)
            return dict(pixel_values=pixels, labels=labels)
        ids = torch.randint(0, int(cfg.vocab_size), (batch, seq), generator=g)
        return dict(input_ids=ids, labels=ids.clone())


def set_dropout(cfg, p: float):
    """Set every float ``*dropout*`` / ``*pdrop*`` probability of a HF config to ``p``."""
    for k in list(cfg.to_dict()):
        if _is_dropout(k, getattr(cfg, k, None)):
            setattr(cfg, k, p)
    return cfg


def _is_dropout(key: str, value) -> bool:
    return ("dropout" in key or "pdrop" in key) and isinstance(value, float)


def _g(name, config_cls, model_cls, seq, batch, repeats, **kwargs) -> Geometry:
    return Geometry(name, config_cls, model_cls, kwargs, seq, batch, repeats)


GEOMETRIES: dict[str, Geometry] = {g.name: g for g in [
    _g("bert-base", "BertConfig", "BertForMaskedLM", 128, 2, 4, hidden_size=768, num_hidden_layers=12,
       num_attention_heads=12, intermediate_size=3072, vocab_size=30522, max_position_embeddings=512),
    _g("bert-large", "BertConfig", "BertForMaskedLM", 512, 1, 3, hidden_size=1024, num_hidden_layers=24,
       num_attention_heads=16, intermediate_size=4096, vocab_size=30522, max_position_embeddings=512),
    _g("roberta-base", "RobertaConfig", "RobertaForMaskedLM", 512, 1, 3, hidden_size=768, num_hidden_layers=12,
       num_attention_heads=12, intermediate_size=3072, vocab_size=50265, max_position_embeddings=514,
       pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1, layer_norm_eps=1e-5),
    _g("gpt2", "GPT2Config", "GPT2LMHeadModel", 1024, 1, 3, n_embd=768, n_layer=12, n_head=12,
       vocab_size=50257, n_positions=1024),
    _g("gpt2-medium", "GPT2Config", "GPT2LMHeadModel", 1024, 1, 3, n_embd=1024, n_layer=24, n_head=16,
       vocab_size=50257, n_positions=1024),
    _g("vit-base", "ViTConfig", "ViTForImageClassification", 197, 4, 3, hidden_size=768, num_hidden_layers=12,
       num_attention_heads=12, intermediate_size=3072, image_size=224, patch_size=16, num_labels=1000),
    # Llama-3.2-1B's geometry: GQA (32 query / 8 key-value heads), SwiGLU 8192, 128k vocabulary.
    _g("llama-1b-like", "LlamaConfig", "LlamaForCausalLM", 1024, 1, 2, hidden_size=2048, num_hidden_layers=16,
       num_attention_heads=32, num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
       max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001),
    # Llama-3.1-8B's geometry: GQA (32 query / 8 key-value heads of 128), SwiGLU 14336, untied head.
    _g("llama-8b-like", "LlamaConfig", "LlamaForCausalLM", 1024, 1, 2, hidden_size=4096, num_hidden_layers=32,
       num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
       max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000,
       eos_token_id=128001),
]}


def resolve(name_or_path: str) -> Geometry:
    """A built-in geometry by name, or one read from a Hugging Face ``config.json`` (file or folder).

    Raises ValueError with the known names / the problem with the file.
    """
    if name_or_path in GEOMETRIES:
        return GEOMETRIES[name_or_path]
    path = pathlib.Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not (path.suffix == ".json" or path.exists()):
        raise ValueError(f"unknown model {name_or_path!r}: use one of {', '.join(GEOMETRIES)} "
                         "or a path to a Hugging Face config.json")
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {str(path)!r} as JSON: {e}") from None
    return _from_config_dict(data, str(path))


def _from_config_dict(data: dict, label: str) -> Geometry:
    import transformers

    model_type = data.get("model_type")
    if not model_type:
        raise ValueError(f"{label} has no \"model_type\" (e.g. \"bert\", \"gpt2\", \"llama\")")
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in data.items() if k != "model_type"})
    except (ValueError, KeyError) as e:
        raise ValueError(f"{label}: transformers does not know model_type {model_type!r} ({e})") from None
    model_cls = None
    for arch in data.get("architectures") or []:
        if hasattr(transformers, arch):
            model_cls = arch
            break
    from .vlm_batches import is_vlm_config

    if is_vlm_config(cfg):
        if model_cls is None:
            from transformers.models.auto import modeling_auto as ma

            name = getattr(ma, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", {}).get(model_type)
            model_cls = name if isinstance(name, str) and hasattr(transformers, name) else None
        if model_cls is None:
            raise ValueError(f"{label}: no vision-language class for model_type {model_type!r}; add "
                             "\"architectures\": [\"<Name>ForConditionalGeneration\"] to the file")
        return Geometry(label, type(cfg).__name__, model_cls, config=cfg, seq=1024, vlm=True)
    if model_cls is None:
        from transformers.models.auto import modeling_auto as ma

        for mapping in ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
                        "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"):
            name = getattr(ma, mapping, {}).get(model_type)
            if isinstance(name, str) and hasattr(transformers, name):
                model_cls = name
                break
    if model_cls is None:
        raise ValueError(f"{label}: no masked-LM, causal-LM or image-classification class for model_type "
                         f"{model_type!r}; add \"architectures\": [\"<ClassName>\"] to the file")
    for attr in ("hidden_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(getattr(cfg, attr, None), int):
            raise ValueError(f"{label}: the config has no integer {attr}")
    geo = Geometry(label, type(cfg).__name__, model_cls, config=cfg, batch=1, repeats=3)
    if geo.is_image:
        side, patch = int(getattr(cfg, "image_size", 224)), int(getattr(cfg, "patch_size", 16))
        geo.seq = (side // patch) ** 2 + 1
    else:
        geo.seq = min(512, geo.max_seq() or 512)
    return geo
