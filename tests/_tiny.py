"""Tiny Hugging Face models (1 layer, hidden 32) with non-trivial norm weights, for quick checks."""
import torch


def tiny_hf(family: str):
    """An unpatched BertForMaskedLM / LlamaForCausalLM in train mode, dropout 0, seed 0."""
    import transformers

    torch.manual_seed(0)
    if family == "bert":
        cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                      vocab_size=50, max_position_embeddings=16, attn_implementation="sdpa",
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = transformers.BertForMaskedLM(cfg)
    elif family == "llama":
        cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=1, intermediate_size=64, vocab_size=50,
                                       max_position_embeddings=16, attn_implementation="sdpa")
        model = transformers.LlamaForCausalLM(cfg)
    else:
        raise ValueError(family)
    with torch.no_grad():  # non-trivial norm weights and biases (HF initialises them to 1 and 0)
        for name, p in model.named_parameters():
            if "norm" in name.lower():
                p.add_(0.1 * torch.randn_like(p))
    return model.train()


def tiny_batch(padded: bool = True):
    """Token ids (2, 8) in [3, 50), labels; the second row right-padded after 5 tokens if ``padded``."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 50, (2, 8), generator=g)
    mask = torch.ones(2, 8, dtype=torch.long)
    if padded:
        mask[1, 5:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
