"""Every rule :func:`leanact.patch` applies, in order; :func:`leanact.unpatch` undoes the steps in reverse.

* ``MODULE_ADAPTERS``: the Hugging Face modules replaced by a lean twin (after torch's own modules and
  Hugging Face's activations, :mod:`leanact.patching.generic`), the first that recognises a module wins.
* ``MODEL_STEPS``: the changes to the whole model. The first swaps the modules.
* ``FAMILIES``: the model families (Hugging Face ``model_type``) that the differential matrix checks;
  the README's supported-models table names each (``tests/test_registry.py`` holds both to it).

A new family's module gets its :class:`~leanact.patching.adapter.ModuleAdapter` (or
:class:`~leanact.patching.adapter.ModelStep`) and one line here.
"""
from __future__ import annotations

from torch import nn

from . import (amp, attention_config, functional_dropout, generic, hf_alibi, hf_fc_mlp, hf_head, hf_moe,
               hf_moe_clamped, hf_residual_norm, hf_rms_norm, hf_rotary, hf_swiglu, peft_lora, tied_embedding,
               training_cache, trl_head)
from .adapter import ModelStep, ModuleAdapter, PatchRun

__all__ = ["MODULE_ADAPTERS", "MODEL_STEPS", "FAMILIES"]

MODULE_ADAPTERS: tuple[ModuleAdapter, ...] = (
    hf_rms_norm.ADAPTER,
    hf_swiglu.ADAPTER,
    hf_residual_norm.ADAPTER,
    hf_fc_mlp.ADAPTER,
    hf_moe_clamped.ADAPTER,  # (before hf_moe: GPT-OSS's experts are experts with biases and clamps)
    hf_moe.ADAPTER,
)


def _swap_modules(model: nn.Module, run: PatchRun) -> None:
    generic.swap_modules(model, run, MODULE_ADAPTERS)


MODEL_STEPS: tuple[ModelStep, ...] = (
    ModelStep("modules", _swap_modules),
    hf_alibi.STEP,  # (before attention: Bloom's and Falcon's configs then stay as they are)
    attention_config.STEP,
    hf_head.STEP,
    peft_lora.STEP,
    functional_dropout.STEP,
    training_cache.STEP,
    trl_head.STEP,
    tied_embedding.STEP,
    hf_rotary.STEP,
    amp.STEP,  # (last: its forward wrapper is the outermost)
)

#: Hugging Face ``model_type`` -> the family's name in the README's table.
FAMILIES: dict[str, str] = {
    "bert": "BERT", "roberta": "RoBERTa", "electra": "ELECTRA", "distilbert": "DistilBERT", "albert": "ALBERT",
    "gpt2": "GPT-2", "gpt_neox": "GPT-NeoX", "opt": "OPT", "phi": "Phi", "phi3": "Phi-3",
    "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
    "gemma": "Gemma", "gemma2": "Gemma 2", "gemma3_text": "Gemma 3", "olmo2": "OLMo 2",
    "mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE", "gpt_oss": "GPT-OSS",
    "bloom": "Bloom", "falcon": "Falcon", "t5": "T5", "bart": "BART", "whisper": "Whisper",
    "vit": "ViT", "clip": "CLIP", "llava": "LLaVA", "qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2.5-VL",
    "gemma3": "Gemma 3", "paligemma": "PaliGemma", "idefics3": "Idefics3", "mllama": "Mllama",
}
