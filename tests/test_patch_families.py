"""leanact.patch on RoBERTa, GPT-2 and ViT (tiny configs, random weights, CPU), and HF's gradient
checkpointing on a patched BERT: patched vs unpatched, fp32, dropout 0."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import leanact.nn as lnn  # noqa: E402
from leanact.patching import patch, summary, tied_embedding  # noqa: E402


def _no_dropout(cfg):
    """Every float *dropout* / *pdrop* field of the config set to 0."""
    for k in list(cfg.to_dict()):
        if ("dropout" in k or "pdrop" in k) and isinstance(getattr(cfg, k, None), float):
            setattr(cfg, k, 0.0)
    return cfg


def _build(family, attn="sdpa", dropout=0.0):
    torch.manual_seed(0)
    T = transformers
    if family == "roberta":
        cfg = T.RobertaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                              vocab_size=100, max_position_embeddings=40, attn_implementation=attn)
        cls = T.RobertaForMaskedLM
    elif family == "gpt2":
        cfg = T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=40, bos_token_id=1,
                           eos_token_id=2, attn_implementation=attn)
        cls = T.GPT2LMHeadModel
    elif family == "vit":
        cfg = T.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                          image_size=32, patch_size=8, num_labels=5, attn_implementation=attn)
        cls = T.ViTForImageClassification
    elif family == "bert":
        cfg = T.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                           vocab_size=100, attn_implementation=attn)
        cls = T.BertForMaskedLM
    else:
        raise ValueError(family)
    if dropout == 0.0:
        _no_dropout(cfg)
    else:
        cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = dropout
    return cls(cfg)


def _pair(family, attn="sdpa"):
    ref = _build(family, attn)
    return ref, patch(copy.deepcopy(ref))


def _batch(family):
    g = torch.Generator().manual_seed(1)
    if family == "vit":
        return dict(pixel_values=torch.randn(3, 3, 32, 32, generator=g), labels=torch.tensor([0, 3, 4]))
    ids = torch.randint(3, 100, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    if family == "gpt2":  # causal LM: labels are the inputs (shifted inside), padding ignored
        labels = ids.masked_fill(mask == 0, -100)
    else:
        labels = torch.where(torch.rand(3, 12, generator=g) < 0.3, ids, torch.full_like(ids, -100))
        labels[0, 0] = ids[0, 0]
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _assert_grads_close(ref, lean, tol=1e-5):
    """Every parameter gradient within ``tol`` relative (norm-wise; norm floored at 1e-4 as in
    test_patch_bert). Gradients that are 0 in exact arithmetic -- key biases: softmax is invariant
    to a per-row shift -- are rounding noise on both sides (~1e-9 here); for those (norm below 1e-6
    of the model's median gradient norm) the difference must be below 1e-6 of that median instead.
    Returns the worst relative error over the other parameters."""
    lean_params = dict(lean.named_parameters())
    grads = [(name, p.grad, lean_params[name].grad) for name, p in ref.named_parameters()]
    for name, g_ref, g_lean in grads:
        assert g_ref is not None and g_lean is not None, name
    scale = torch.stack([g.norm() for _, g, _ in grads]).median()
    worst = 0.0
    for name, g_ref, g_lean in grads:
        diff = (g_lean - g_ref).norm()
        if g_ref.norm() < 1e-6 * scale:
            assert diff <= 1e-6 * scale, (name, diff.item(), scale.item())
            continue
        err = (diff / g_ref.norm().clamp_min(1e-4)).item()
        assert err <= tol, (name, err)
        worst = max(worst, err)
    return worst


FAMILIES = ["roberta", "gpt2", "vit"]


def test_no_dropout_helper_zeroes_every_field():
    for family in FAMILIES:
        cfg = _build(family).config
        fields = {k: v for k, v in cfg.to_dict().items() if ("dropout" in k or "pdrop" in k) and v is not None}
        assert fields and all(v == 0.0 for v in fields.values()), (family, fields)


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_replaces_modules(family):
    _, lean = _pair(family)
    s = summary(lean)
    assert s.attention == [("", "sdpa", "leanact (recompute)")]
    assert s.left == []  # GPT-2's Conv1D projections are neutral (like Linear), not "not covered"
    assert lean.config._attn_implementation == "leanact"
    kinds = {new for _, _, new in s.replaced}
    gelu = "leanact.nn.GELU('tanh')" if family == "gpt2" else "leanact.nn.GELU('none')"
    fused = {f"leanact.patching.Lean{was}" for _, was, _ in s.replaced if was.endswith("Output")}  # dropout+add+norm
    assert fused == ({"leanact.patching.LeanRobertaOutput", "leanact.patching.LeanRobertaSelfOutput"}
                     if family == "roberta" else set()), fused
    tied = {tied_embedding.LABEL} if family != "vit" else set()  # (the word embedding: tied to the head)
    assert kinds == {"leanact.nn.LayerNorm", "leanact.nn.Dropout", gelu} | fused | tied, kinds
    for m in lean.modules():
        assert type(m) not in (torch.nn.LayerNorm, torch.nn.Dropout)
        assert type(m).__module__ != "transformers.activations"
    assert any(isinstance(m, lnn.GELU) for m in lean.modules())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_loss_and_gradients_match(family, attn):
    ref, lean = _pair(family, attn)
    ref.train(), lean.train()
    batch = _batch(family)
    l_ref, l_lean = ref(**batch).loss, lean(**batch).loss
    torch.testing.assert_close(l_lean, l_ref, rtol=1e-6, atol=0)
    l_ref.backward()
    l_lean.backward()
    _assert_grads_close(ref, lean)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_eval_outputs_identical(family, attn):
    ref, lean = _pair(family, attn)
    ref.eval(), lean.eval()
    batch = _batch(family)
    with torch.no_grad():
        a, b = ref(**batch), lean(**batch)
    assert torch.equal(a.logits, b.logits)
    assert torch.equal(a.loss, b.loss)


def test_state_dict_unchanged_gpt2_tied_embeddings():
    ref, lean = _pair("gpt2")
    sd_ref, sd_lean = ref.state_dict(), lean.state_dict()
    assert list(sd_ref) == list(sd_lean)
    assert all(torch.equal(sd_ref[k], sd_lean[k]) for k in sd_ref)
    assert lean.lm_head.weight is lean.transformer.wte.weight


# ---- HF gradient checkpointing on a patched BERT -------------------------------------------------

def _ckpt_model(patched, use_reentrant=None, dropout=0.0, checkpoint=True):
    m = _build("bert", dropout=dropout)
    if patched:
        patch(m)
    if checkpoint:
        ckpt_kwargs = None if use_reentrant is None else dict(use_reentrant=use_reentrant)
        if hasattr(m, "activation_checkpointing_enable"):  # transformers >= 5.23 (the old name is deprecated)
            m.activation_checkpointing_enable(ckpt_kwargs)
            assert m.is_activation_checkpointing
        else:  # transformers 5.17
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt_kwargs)
            assert m.is_gradient_checkpointing
    return m.train()


def _step(m):
    torch.manual_seed(5)
    loss = m(**_batch("bert")).loss
    loss.backward()
    return loss


@pytest.mark.parametrize("use_reentrant", [None, True, False])
def test_gradient_checkpointing_matches_unpatched(use_reentrant):
    ref, lean = _ckpt_model(False, use_reentrant), _ckpt_model(True, use_reentrant)
    l_ref, l_lean = _step(ref), _step(lean)
    torch.testing.assert_close(l_lean, l_ref, rtol=1e-6, atol=0)
    _assert_grads_close(ref, lean)
    # And the same as the patched model without checkpointing.
    plain = _ckpt_model(True, checkpoint=False)
    torch.testing.assert_close(_step(plain), l_lean, rtol=1e-6, atol=0)
    _assert_grads_close(plain, lean)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_with_dropout_replays_the_same_masks(use_reentrant):
    """Dropout 0.1: the checkpointed patched model gives the loss and gradients of the plain patched
    model (same seed). With use_reentrant=True the first forward runs under no_grad; leanact's
    attention must then draw the same dropout mask as in the recompute."""
    plain = _ckpt_model(True, dropout=0.1, checkpoint=False)
    ckpt = _ckpt_model(True, use_reentrant, dropout=0.1)
    l_plain, l_ckpt = _step(plain), _step(ckpt)
    torch.testing.assert_close(l_ckpt, l_plain, rtol=1e-6, atol=0)
    _assert_grads_close(plain, ckpt)
