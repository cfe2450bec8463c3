"""Per-layer activation memory of Hugging Face model families: HF eager vs HF sdpa vs leanact.patch.

    python benchmarks/families.py [--families bert-large gpt2-medium vit-base llama-1b] [--seq N]
                                  [--batch 1] [--dtype bf16] [--markdown]

For each family (random weights, real geometry and real dropout settings, vocabulary shrunk to 1000:
embeddings and heads are outside the layers and cancel), bytes kept for backward per layer =
(2-layer model) − (1-layer model) (``leanact.memory.measure_layer_cost``; storages deduplicated,
parameters and inputs excluded), divided by s·b·h (REFERENCE.md's B/sbh). Modes: HF ``eager``,
HF ``sdpa``, ``leanact.patch(model)`` (attention "recompute": no s² tensor kept) and
``leanact.patch(model, attention="tempo")`` (keeps the softmax output). Memory only: the numbers
do not depend on the device; the run takes a few minutes on CPU (LLaMA-1B at s=2048 dominates:
pass --seq to shrink every family's sequence, or pick families).
"""
from __future__ import annotations

import argparse

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODES = ("eager", "sdpa", "recompute", "tempo")
VOCAB = 1000


def _bert(n, attn):
    import transformers as T

    cfg = T.BertConfig(hidden_size=1024, num_hidden_layers=n, num_attention_heads=16, intermediate_size=4096,
                       vocab_size=VOCAB, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                       attn_implementation=attn)
    return T.BertModel(cfg, add_pooling_layer=False)


def _gpt2(n, attn):
    import transformers as T

    cfg = T.GPT2Config(n_embd=1024, n_layer=n, n_head=16, vocab_size=VOCAB, n_positions=1024, resid_pdrop=0.1,
                       embd_pdrop=0.1, attn_pdrop=0.1, use_cache=False, bos_token_id=1, eos_token_id=2,
                       attn_implementation=attn)
    return T.GPT2Model(cfg)


def _vit(n, attn):
    import transformers as T

    cfg = T.ViTConfig(hidden_size=768, num_hidden_layers=n, num_attention_heads=12, intermediate_size=3072,
                      image_size=224, patch_size=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      attn_implementation=attn)
    return T.ViTModel(cfg, add_pooling_layer=False)


def _llama(h, heads, kv, ffn):
    def build(n, attn):
        import transformers as T

        cfg = T.LlamaConfig(hidden_size=h, num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=kv,
                            intermediate_size=ffn, vocab_size=VOCAB, max_position_embeddings=4096,
                            attention_dropout=0.0, use_cache=False, attn_implementation=attn)
        return T.LlamaModel(cfg)
    return build


# name: (builder, h, heads, default s, geometry label, input kind)
FAMILIES = {
    "bert-large": (_bert, 1024, 16, 512, "h=1024 a=16 I=4096, dropout 0.1", "ids"),
    "gpt2-medium": (_gpt2, 1024, 16, 1024, "h=1024 a=16 I=4096, dropout 0.1", "ids"),
    "vit-base": (_vit, 768, 12, 197, "h=768 a=12 I=3072, 224px/16 (197 tokens), dropout 0", "pixels"),
    "llama-1b": (_llama(2048, 32, 8, 8192), 2048, 32, 2048, "h=2048 a=32 kv=8 I=8192, dropout 0", "ids"),
    "llama-h1024": (_llama(1024, 16, 4, 2816), 1024, 16, 512, "h=1024 a=16 kv=4 I=2816, dropout 0", "ids"),
}
DEFAULT = ["bert-large", "gpt2-medium", "vit-base", "llama-1b"]


def measure(family: str, mode: str, s: int, b: int, dtype: torch.dtype) -> float:
    """B/sbh of one layer of ``family`` in ``mode`` (one of :data:`MODES`)."""
    import leanact
    from leanact.memory import measure_layer_cost

    builder, h, _, _, _, kind = FAMILIES[family]

    def build(n):
        torch.manual_seed(0)
        m = builder(n, "eager" if mode == "eager" else "sdpa").to(dtype).train()
        if mode in ("recompute", "tempo"):
            leanact.patch(m, attention=mode)
        return m

    if kind == "pixels":
        if s != 197:
            raise SystemExit(f"vit-base has 197 tokens (224px, patch 16); got --seq {s}")

        def inputs():
            return (torch.randn(b, 3, 224, 224, generator=torch.Generator().manual_seed(0)).to(dtype),)
    else:
        def inputs():
            return (torch.randint(1, VOCAB, (b, s), generator=torch.Generator().manual_seed(0)),)
    return measure_layer_cost(build, inputs, s, b, h).per_sbh


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=DEFAULT)
    ap.add_argument("--seq", type=int, default=None, help="sequence length for every text family (default: real)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    torch.set_grad_enabled(True)
    rows = []
    for fam in args.families:
        _, h, heads, s_default, _, kind = FAMILIES[fam]
        s = s_default if (args.seq is None or kind == "pixels") else args.seq
        res = {m: measure(fam, m, s, args.batch, DTYPES[args.dtype]) for m in args.modes}
        base = res.get("eager")
        for m, v in res.items():
            rows.append((fam, s, m if m in ("eager", "sdpa") else f"leanact.patch ({m})", v,
                         None if base is None else v / base))
    header = ("family", "s", "mode", "B/sbh", "vs HF eager")
    fmt = lambda r: [r[0], str(r[1]), r[2], f"{r[3]:.2f}", "" if r[4] is None else f"{r[4]:.3f}x"]  # noqa: E731
    title = f"bytes kept per layer / (s·b·h), {args.dtype}, b={args.batch}, 2-layer minus 1-layer models"
    legend = [f"{fam}: {FAMILIES[fam][4]}" for fam in args.families]
    if args.markdown:
        print(title + "\n")
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for r in rows:
            print("| " + " | ".join(fmt(r)) + " |")
        print("\n" + "; ".join(legend))
        return
    from rich.console import Console
    from rich.table import Table

    tab = Table(title=title)
    for c in header:
        tab.add_column(c, justify="right" if c in ("s", "B/sbh", "vs HF eager") else "left")
    for r in rows:
        tab.add_row(*fmt(r))
    console = Console()
    console.print(tab)
    for line in legend:
        console.print(line)


if __name__ == "__main__":
    main()
