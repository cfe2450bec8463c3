"""Per-layer activation memory of Hugging Face model families: HF eager / sdpa vs leanact.patch.

    python benchmarks/families.py [--families llama gemma ...] [--seq N] [--batch 1] [--dtype bf16]
                                  [--modes sdpa recompute] [--markdown]

Every family of the differential matrix (tests/test_matrix.py) at the geometry of one of its real
checkpoints (named in the table's legend), random weights, the config's default dropout unless the
legend says otherwise, vocabulary shrunk to 1000 (embeddings and heads are outside the layers and
cancel). Bytes kept for backward per layer = (2-layer model) − (1-layer model)
(``leanact.memory.measure_layer_cost``: storages deduplicated, parameters and inputs excluded),
divided by s·b·h (B/sbh). Encoder-decoders (T5, BART, Whisper) count one encoder layer and one
decoder layer together (both run over s tokens). Modes: HF ``eager``, HF ``sdpa``,
``leanact.patch(model)`` (attention "recompute") and ``leanact.patch(model, attention="tempo")``.
The "patched" / "left" columns come from ``leanact.summary`` of the patched 1-layer model (RoPE
tables, which keep nothing, are not listed). Memory only: the numbers do not depend on the device.
``--predict``: the same difference on fake tensors (``leanact.estimate_config``, nothing computed).
Decoders run at a shortened sequence by default (``--seq`` overrides): with sdpa and no dropout
nothing kept grows faster than s, so B/sbh does not depend on s.
"""
from __future__ import annotations

import argparse

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODES = ("eager", "sdpa", "recompute", "tempo")
VOCAB = 1000


def _llm(cfg_cls, model_cls, **kw):
    def build(n, attn):
        import transformers as T

        cfg = getattr(T, cfg_cls)(vocab_size=VOCAB, num_hidden_layers=n, max_position_embeddings=4096,
                                  use_cache=False, attn_implementation=attn, **kw)
        return getattr(T, model_cls)(cfg)
    return build


def _cfg(cfg_cls, model_cls, layers_key="num_hidden_layers", model_kw=None, **kw):
    def build(n, attn):
        import transformers as T

        cfg = getattr(T, cfg_cls)(**{layers_key: n}, attn_implementation=attn, **kw)
        return getattr(T, model_cls)(cfg, **(model_kw or {}))
    return build


def _seq2seq(cfg_cls, model_cls, layer_keys, **kw):
    def build(n, attn):
        import transformers as T

        cfg = getattr(T, cfg_cls)(**dict.fromkeys(layer_keys, n), attn_implementation=attn, **kw)
        return getattr(T, model_cls)(cfg)
    return build


_BERT = dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, vocab_size=VOCAB)
_LLAMA_1B = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192)

# name: (builder, h, default s, input kind, checkpoint / geometry)
FAMILIES = {
    "bert": (_cfg("BertConfig", "BertModel", model_kw=dict(add_pooling_layer=False), **_BERT), 768, 512, "ids",
             "bert-base: h=768 a=12 I=3072, dropout 0.1"),
    "roberta": (_cfg("RobertaConfig", "RobertaModel", model_kw=dict(add_pooling_layer=False), pad_token_id=1,
                     max_position_embeddings=514, **_BERT), 768, 512, "ids",
                "roberta-base: h=768 a=12 I=3072, dropout 0.1"),
    "distilbert": (_cfg("DistilBertConfig", "DistilBertModel", "n_layers", dim=768, n_heads=12, hidden_dim=3072,
                        vocab_size=VOCAB), 768, 512, "ids", "distilbert-base: h=768 a=12 I=3072, dropout 0.1"),
    "albert": (_cfg("AlbertConfig", "AlbertModel", model_kw=dict(add_pooling_layer=False), embedding_size=128,
                    **_BERT), 768, 512, "ids", "albert-base-v2: h=768 a=12 I=3072, dropout 0 (its config)"),
    "electra": (_cfg("ElectraConfig", "ElectraModel", embedding_size=768, **_BERT), 768, 512, "ids",
                "electra-base: h=768 a=12 I=3072, dropout 0.1"),
    "gpt2": (_cfg("GPT2Config", "GPT2Model", "n_layer", n_embd=768, n_head=12, vocab_size=VOCAB, n_positions=1024,
                  use_cache=False, bos_token_id=1, eos_token_id=2), 768, 1024, "ids",
             "gpt2: h=768 a=12 I=3072, dropout 0.1"),
    "gpt_neox": (_llm("GPTNeoXConfig", "GPTNeoXModel", hidden_size=768, num_attention_heads=12,
                      intermediate_size=3072), 768, 256, "ids", "pythia-160m: h=768 a=12 I=3072, dropout 0"),
    "opt": (_cfg("OPTConfig", "OPTModel", hidden_size=768, num_attention_heads=12, ffn_dim=3072, vocab_size=VOCAB,
                 word_embed_proj_dim=768, max_position_embeddings=2048, use_cache=False, pad_token_id=1,
                 bos_token_id=2, eos_token_id=2), 768, 256, "ids", "opt-125m: h=768 a=12 I=3072 ReLU, dropout 0.1"),
    "llama": (_llm("LlamaConfig", "LlamaModel", **_LLAMA_1B), 2048, 256, "ids",
              "Llama-3.2-1B: h=2048 a=32 kv=8 I=8192"),
    "qwen2": (_llm("Qwen2Config", "Qwen2Model", hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                   intermediate_size=4864), 896, 256, "ids", "Qwen2.5-0.5B: h=896 a=14 kv=2 I=4864"),
    "qwen3": (_llm("Qwen3Config", "Qwen3Model", hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                   head_dim=128, intermediate_size=3072), 1024, 256, "ids",
              "Qwen3-0.6B: h=1024 a=16 kv=8 d=128 I=3072"),
    "mistral": (_llm("MistralConfig", "MistralModel", hidden_size=4096, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=14336), 4096, 128, "ids",
                "Mistral-7B: h=4096 a=32 kv=8 I=14336"),
    "phi": (_llm("PhiConfig", "PhiModel", hidden_size=2560, num_attention_heads=32, intermediate_size=10240,
                 partial_rotary_factor=0.4), 2560, 256, "ids", "phi-2: h=2560 a=32 I=10240"),
    "phi3": (_llm("Phi3Config", "Phi3Model", hidden_size=3072, num_attention_heads=32, num_key_value_heads=32,
                  intermediate_size=8192, pad_token_id=0), 3072, 256, "ids", "Phi-3-mini: h=3072 a=32 I=8192"),
    "gemma": (_llm("GemmaConfig", "GemmaModel", hidden_size=2048, num_attention_heads=8, num_key_value_heads=1,
                   head_dim=256, intermediate_size=16384), 2048, 256, "ids",
              "gemma-2b: h=2048 a=8 kv=1 d=256 I=16384"),
    "gemma2": (_llm("Gemma2Config", "Gemma2Model", hidden_size=2304, num_attention_heads=8, num_key_value_heads=4,
                    head_dim=256, intermediate_size=9216), 2304, 256, "ids",
               "gemma-2-2b: h=2304 a=8 kv=4 d=256 I=9216"),
    "gemma3": (_llm("Gemma3TextConfig", "Gemma3TextModel", hidden_size=1152, num_attention_heads=4,
                    num_key_value_heads=1, head_dim=256, intermediate_size=6912), 1152, 256, "ids",
               "gemma-3-1b: h=1152 a=4 kv=1 d=256 I=6912"),
    "olmo2": (_llm("Olmo2Config", "Olmo2Model", **{**_LLAMA_1B, "num_attention_heads": 16,
                                                    "num_key_value_heads": 16}), 2048, 256, "ids",
              "OLMo-2-1B: h=2048 a=16 I=8192"),
    "mixtral": (_llm("MixtralConfig", "MixtralModel", hidden_size=4096, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=14336, num_local_experts=2, num_experts_per_tok=2),
                4096, 128, "ids", "Mixtral-8x7B: h=4096 a=32 kv=8 I=14336, top-2 of 2 experts (8 in the "
                "checkpoint: every token still runs 2, so the bytes per token are the same)"),
    "qwen2_moe": (_llm("Qwen2MoeConfig", "Qwen2MoeModel", hidden_size=2048, num_attention_heads=16,
                       num_key_value_heads=16, intermediate_size=5632, moe_intermediate_size=1408,
                       shared_expert_intermediate_size=5632, num_experts=4, num_experts_per_tok=4), 2048, 256, "ids",
                  "Qwen1.5-MoE-A2.7B: h=2048 a=16 I_moe=1408 shared I=5632, top-4 of 4 experts (60 in the "
                  "checkpoint)"),
    "gpt_oss": (_llm("GptOssConfig", "GptOssModel", hidden_size=2880, num_attention_heads=64, num_key_value_heads=8,
                     head_dim=64, intermediate_size=2880, num_local_experts=4, num_experts_per_tok=4,
                     sliding_window=128), 2880, 256, "ids",
                "gpt-oss-20b: h=2880 a=64 kv=8 d=64 I=2880, top-4 of 4 experts (32 in the checkpoint)"),
    "bloom": (_cfg("BloomConfig", "BloomModel", "n_layer", hidden_size=1024, n_head=16, vocab_size=VOCAB,
                   use_cache=False), 1024, 256, "ids", "bloom-560m: h=1024 a=16 I=4096 ALiBi, dropout 0"),
    "falcon": (_llm("FalconConfig", "FalconModel", hidden_size=4544, num_attention_heads=71), 4544, 256, "ids",
               "falcon-7b: h=4544 a=71 multi-query I=18176 rotary, parallel attention/MLP"),
    "falcon_rw": (_llm("FalconConfig", "FalconModel", hidden_size=2048, num_attention_heads=32, alibi=True,
                       multi_query=False, parallel_attn=False, bias=True), 2048, 256, "ids",
                  "falcon-rw-1b: h=2048 a=32 I=8192 ALiBi"),
    "vit": (_cfg("ViTConfig", "ViTModel", model_kw=dict(add_pooling_layer=False), hidden_size=768,
                 num_attention_heads=12, intermediate_size=3072, image_size=224, patch_size=16), 768, 197, "pixels",
            "vit-base: h=768 a=12 I=3072, 224 px / 16 (197 tokens), dropout 0"),
    "clip": (_cfg("CLIPVisionConfig", "CLIPVisionModel", hidden_size=768, num_attention_heads=12,
                  intermediate_size=3072, image_size=224, patch_size=32), 768, 50, "pixels",
             "clip-vit-base-patch32, vision tower: h=768 a=12 I=3072 quick_gelu, 50 tokens"),
    "t5": (_seq2seq("T5Config", "T5Model", ("num_layers", "num_decoder_layers"), vocab_size=VOCAB, d_model=768,
                    d_kv=64, d_ff=2048, num_heads=12, feed_forward_proj="gated-gelu"), 768, 512, "seq2seq",
           "flan-t5-base: d=768 a=12 I=2048 gated-gelu, dropout 0.1; one encoder + one decoder layer"),
    "bart": (_seq2seq("BartConfig", "BartModel", ("encoder_layers", "decoder_layers"), vocab_size=VOCAB, d_model=768,
                      encoder_attention_heads=12, decoder_attention_heads=12, encoder_ffn_dim=3072,
                      decoder_ffn_dim=3072), 768, 512, "seq2seq",
             "bart-base: d=768 a=12 I=3072, dropout 0.1; one encoder + one decoder layer"),
    "whisper": (_seq2seq("WhisperConfig", "WhisperModel", ("encoder_layers", "decoder_layers"), vocab_size=VOCAB,
                         d_model=512, encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048,
                         decoder_ffn_dim=2048, num_mel_bins=80, max_source_positions=256, max_target_positions=256,
                         decoder_start_token_id=1, pad_token_id=0), 512, 256, "speech",
                "whisper-base: d=512 a=8 I=2048, dropout 0; one encoder + one decoder layer (s=256 both)"),
    # larger geometries (docs/benchmarks.md, all four modes)
    "gpt2-medium": (_cfg("GPT2Config", "GPT2Model", "n_layer", n_embd=1024, n_head=16, vocab_size=VOCAB,
                         n_positions=1024, use_cache=False, bos_token_id=1, eos_token_id=2), 1024, 1024, "ids",
                    "gpt2-medium: h=1024 a=16 I=4096, dropout 0.1"),
    "vit-base": (_cfg("ViTConfig", "ViTModel", model_kw=dict(add_pooling_layer=False), hidden_size=768,
                      num_attention_heads=12, intermediate_size=3072, image_size=224, patch_size=16), 768, 197,
                 "pixels", "vit-base: h=768 a=12 I=3072, 224 px / 16 (197 tokens), dropout 0"),
    "llama-h1024": (_llm("LlamaConfig", "LlamaModel", hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
                         intermediate_size=2816), 1024, 512, "ids", "llama-h1024: h=1024 a=16 kv=4 I=2816"),
    "bert-large": (_cfg("BertConfig", "BertModel", model_kw=dict(add_pooling_layer=False), hidden_size=1024,
                        num_attention_heads=16, intermediate_size=4096, vocab_size=VOCAB), 1024, 512, "ids",
                   "bert-large: h=1024 a=16 I=4096, dropout 0.1"),
    "llama-1b": (_llm("LlamaConfig", "LlamaModel", **_LLAMA_1B), 2048, 2048, "ids",
                 "llama-1b: h=2048 a=32 kv=8 I=8192"),
}
MATRIX = list(FAMILIES)[:list(FAMILIES).index("gpt2-medium")]
EAGER_ONLY = ("gemma2", "gpt_oss", "bloom")  # HF has no sdpa path for them: "sdpa" measures eager there
BERT_LIKE = ("bert", "roberta", "distilbert", "albert", "electra")


class _Call(torch.nn.Module):
    """Calls an encoder-decoder with its inputs by name (measure_layer_cost passes them by position)."""

    def __init__(self, model, kind):
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, a, ids):
        key = "input_features" if self.kind == "speech" else "input_ids"
        return self.model(**{key: a, "decoder_input_ids": ids}).last_hidden_state


def _inputs(kind, b, s, dtype):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (b, s), generator=g)
    if kind == "pixels":
        return (torch.randn(b, 3, 224, 224, generator=g).to(dtype),)
    if kind == "seq2seq":
        return (ids, torch.randint(3, VOCAB, (b, s), generator=g))
    if kind == "speech":
        return (torch.randn(b, 80, 2 * s, generator=g).to(dtype), ids)
    return (ids,)


def _build(family, n, mode, dtype):
    import leanact

    builder, _, _, kind, _ = FAMILIES[family]
    torch.manual_seed(0)
    attn = "eager" if mode == "eager" or family in EAGER_ONLY else "sdpa"
    m = builder(n, attn)
    m = (m if dtype is None else m.to(dtype)).train()  # None: estimate_config casts its fake model
    if mode in ("recompute", "tempo"):
        leanact.patch(m, attention=mode)
    return _Call(m, kind) if kind in ("seq2seq", "speech") else m


def measure(family: str, mode: str, s: int, b: int, dtype: torch.dtype) -> float:
    """B/sbh of one layer of ``family`` in ``mode`` (one of :data:`MODES`)."""
    from leanact.memory import measure_layer_cost

    _, h, _, kind, _ = FAMILIES[family]
    return measure_layer_cost(lambda n: _build(family, n, mode, dtype), lambda: _inputs(kind, b, s, dtype),
                              s, b, h).per_sbh


def _sum(out, _inputs):
    return (out if isinstance(out, torch.Tensor) else out.last_hidden_state).sum()


def predict(family: str, mode: str, s: int, b: int, dtype: torch.dtype) -> float:
    """:func:`measure` on fake tensors (``leanact.estimate_config``, CPU kernels): the same 2-layer minus
    1-layer difference of the bytes kept for backward, without running the model."""
    from leanact.estimate import estimate_config

    _, h, _, kind, _ = FAMILIES[family]
    patch = mode if mode in ("recompute", "tempo") else False

    def kept(n: int) -> int:
        def build():
            return _build(family, n, "eager" if mode == "eager" else "sdpa", None)
        return estimate_config(build, _inputs(kind, b, s, dtype), None, "cpu", patch=patch, dtype=dtype,
                               optimizer=None, loss_fn=_sum).saved

    return (kept(2) - kept(1)) / (s * b * h)


def patched_and_left(family: str, dtype: torch.dtype) -> tuple[str, str]:
    """What ``leanact.patch`` replaced and what it left (and why), from its summary."""
    import leanact

    m = _build(family, 1, "recompute", dtype)
    s = leanact.summary(m.model if isinstance(m, _Call) else m)
    done = sorted({old for _, old, _ in s.replaced})
    if any(not after.startswith("left") for _, _, after in s.attention):
        done.append("attention")
    left = sorted({f"{old} ({why})" for _, old, why in s.left if not old.endswith("RotaryEmbedding")})
    left += [f"attention ({after[len('left: '):]})" for _, _, after in s.attention if after.startswith("left")]
    return ", ".join(done), "; ".join(left) or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", choices=list(FAMILIES), default=MATRIX)
    ap.add_argument("--seq", type=int, default=None, help="sequence length for every text family (default: "
                                                           "the family's)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=["sdpa", "recompute"])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--predict", action="store_true", help="predict on fake tensors (leanact.estimate_config) "
                    "instead of measuring: the same bytes, without the bf16 matrix products a CPU without "
                    "AVX512-BF16 takes minutes for")
    args = ap.parse_args()
    torch.set_grad_enabled(True)
    dtype = DTYPES[args.dtype]
    header = ("family", "s", *args.modes, "leanact / sdpa", *(("leanact / eager",) if "eager" in args.modes else ()),
              "patched", "left")
    rows = []
    for fam in args.families:
        _, _, s_default, kind, _ = FAMILIES[fam]
        s = s_default if (args.seq is None or kind == "pixels") else args.seq
        try:
            res = {m: (predict if args.predict else measure)(fam, m, s, args.batch, dtype) for m in args.modes}
        except ValueError as e:  # --predict: a model whose routing reads values (MoE) needs a measured step
            if not args.predict:
                raise
            print(f"{fam}: not predicted ({e}); run it without --predict", flush=True)
            continue
        ratio = [f"{res['recompute'] / res[m]:.3f}x" if {m, "recompute"} <= res.keys() else ""
                 for m in ("sdpa", "eager")[:1 + ("eager" in args.modes)]]
        patched, left = patched_and_left(fam, dtype) if set(args.modes) - {"eager", "sdpa"} else ("", "")
        rows.append([fam, str(s), *(f"{res[m]:.2f}" for m in args.modes), *ratio, patched, left])
        print(" | ".join(rows[-1]), flush=True)
    title = (f"bytes kept per layer / (s·b·h), {args.dtype}, b={args.batch}, 2-layer minus 1-layer models"
             + (", predicted on fake tensors" if args.predict else ""))
    legend = [f"{fam}: {FAMILIES[fam][4]}" + (" (HF has no sdpa path: eager)" if fam in EAGER_ONLY else "")
              for fam in args.families]
    if args.markdown:
        print("\n" + title + "\n")
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for r in rows:
            print("| " + " | ".join(r) + " |")
        print("\n" + "; ".join(legend))


if __name__ == "__main__":
    main()
