"""`leanact profile --model <vision-language config.json>`: the whole model's training step predicted
on fake tensors (``leanact.estimate_config``, for a CUDA device), HF sdpa vs ``leanact.patch``, on one
sample of one image and ``--seq`` text tokens (:func:`leanact.models.vlm_batches.vlm_sample`):
bytes kept for backward and the step's peak (AdamW). Nothing is built for real, so a 7B geometry
answers in a minute on a CPU; the per-layer and timing tables of text models are not made."""
from __future__ import annotations

import time
import warnings

import torch

from leanact._format import format_bytes
from leanact.models.geometries import Geometry
from leanact.models.vlm_batches import vlm_sample

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def run_vlm_profile(geo: Geometry, text_tokens: int, dtype: str = "bf16") -> dict:
    """{"model", "model_class", "text_tokens", "tokens", "dtype", "modes": [{"mode", "kept", "peak",
    "seconds"}]} for HF sdpa and leanact."""
    import transformers

    from leanact.estimate import estimate_config

    cls = getattr(transformers, geo.model_cls)
    cfg = geo.make_config(attn="sdpa")
    sample = vlm_sample(cfg, text_tokens, DTYPES[dtype])
    modes = []
    for label, patch in (("HF sdpa", False), ("leanact", True)):
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est = estimate_config(lambda: cls(cfg), sample, None, "cuda", patch=patch, dtype=DTYPES[dtype])
        modes.append(dict(mode=label, kept=est.saved, peak=est.peak, seconds=round(time.perf_counter() - t0, 1)))
    return dict(model=geo.name, model_class=geo.model_cls, text_tokens=text_tokens,
                tokens=int(sample["input_ids"].shape[1]), dtype=dtype, modes=modes)


def render_vlm(result: dict) -> str:
    hf = result["modes"][0]["kept"]
    lines = [f"{result['model']} ({result['model_class']}): one image + {result['text_tokens']:,} text tokens "
             f"({result['tokens']:,} in the language model), {result['dtype']}, whole training step predicted "
             "for a CUDA device (fake tensors, AdamW)", "",
             f"{'mode':<10} {'kept for backward':>24} {'step peak':>12}"]
    for m in result["modes"]:
        kept = f"{format_bytes(m['kept'])} ({m['kept'] / hf:.2f}x)"
        lines.append(f"{m['mode']:<10} {kept:>24} {format_bytes(m['peak']):>12}")
    return "\n".join(lines)
