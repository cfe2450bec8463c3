"""Bytes kept for backward: functional dropouts (BART), PEFT LoRA (patch before / after), attention variants (Gemma 2).

    python benchmarks/variants.py [--markdown]

Memory only (exact, independent of the machine): ``SavedTensorMeter`` totals, fp32, random weights.

* BART encoder layer (d=256, FFN 1024, 4 heads, dropout 0.1 everywhere), s=128, b=2: HF (sdpa),
  leanact with the layer's ``nn.functional.dropout`` calls left to torch, leanact.
* LoRA (r=8, all linear layers, lora_dropout 0.1) on a 1-layer Llama (h=256, I=688, 4/2 heads), s=128,
  b=2, forward + loss: no leanact, ``leanact.patch`` before ``get_peft_model``, after it.
* Gemma 2 layer (h=256, 4/2 heads of 64, logit softcap 50, sliding window 256), s=512, b=1, as the
  2-layer minus the 1-layer model: HF (eager: Gemma 2 has no sdpa), leanact without its attention
  (``attention=False``), leanact.
"""
from __future__ import annotations

import argparse
import copy
import warnings

import torch

import leanact
from leanact.memory import SavedTensorMeter
from leanact.patching import functional_dropout


def _kept(model, fn) -> int:
    with SavedTensorMeter(model) as meter:
        fn()
    return meter.total_bytes


def bart_layer() -> list[tuple[str, int, float]]:
    import transformers as T

    s, b, h = 128, 2, 256
    cfg = T.BartConfig(vocab_size=1000, d_model=h, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                       decoder_attention_heads=4, encoder_ffn_dim=4 * h, decoder_ffn_dim=4 * h, dropout=0.1,
                       activation_dropout=0.1, attention_dropout=0.1)
    torch.manual_seed(0)
    model = T.BartForConditionalGeneration(cfg).train()
    x = torch.randn(b, s, h, requires_grad=True)

    def layer_kept(m):
        layer = m.model.encoder.layers[0]
        return _kept(layer, lambda: layer(x, attention_mask=None))

    rows = [("HF (sdpa)", layer_kept(model))]
    lean = leanact.patch(copy.deepcopy(model))
    full = layer_kept(lean)
    functional_dropout.uninstall(lean)
    rows += [("leanact, functional dropouts left to torch", layer_kept(lean)), ("leanact", full)]
    return [(name, v, v / (s * b * h)) for name, v in rows]


def peft_llama() -> list[tuple[str, int, float]]:
    import peft
    import transformers as T

    def llama():
        torch.manual_seed(0)
        return T.LlamaForCausalLM(T.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=1,
                                                num_attention_heads=4, num_key_value_heads=2,
                                                vocab_size=1000)).train()

    def lora(m):
        return peft.get_peft_model(m, peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.1))

    ids = torch.randint(0, 1000, (2, 128), generator=torch.Generator().manual_seed(1))
    models = [("LoRA, no leanact", lora(llama())), ("leanact.patch, then get_peft_model", lora(leanact.patch(llama()))),
              ("get_peft_model, then leanact.patch", leanact.patch(lora(llama())))]
    rows = [(name, _kept(m, lambda m=m: m(input_ids=ids, labels=ids))) for name, m in models]
    return [(name, v, v / rows[0][1]) for name, v in rows]


def gemma2_layer() -> list[tuple[str, int, float]]:
    import transformers as T

    s, h = 512, 256
    ids = torch.randint(0, 1000, (1, s), generator=torch.Generator().manual_seed(1))

    def cost(layers, patch):
        torch.manual_seed(0)
        m = T.Gemma2ForCausalLM(T.Gemma2Config(
            vocab_size=1000, hidden_size=h, intermediate_size=4 * h, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, sliding_window=256, attn_logit_softcapping=50.0)).train()
        if patch is not None:
            leanact.patch(m, attention=patch)
        return _kept(m, lambda: m(input_ids=ids, labels=ids))

    rows = [(name, cost(2, p) - cost(1, p)) for name, p in
            (("HF (eager)", None), ("leanact, attention=False", False), ("leanact", "recompute"))]
    return [(name, v, v / (s * h)) for name, v in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    for title, unit, rows in (("BART encoder layer", "B/sbh", bart_layer()),
                              ("LoRA on Llama, forward + loss", "vs no leanact", peft_llama()),
                              ("Gemma 2 layer", "B/sbh", gemma2_layer())):
        if args.markdown:
            print(f"\n{title}\n\n| | bytes | {unit} |\n|---|---|---|")
            for name, v, r in rows:
                print(f"| {name} | {v} | {r:.3f}{'x' if unit.startswith('vs') else ''} |")
        else:
            print(title)
            for name, v, r in rows:
                print(f"  {name:40s} {v:>10d}  {r:.3f}")


if __name__ == "__main__":
    main()
