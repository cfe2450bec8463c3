"""leanact.patch / unpatch on Hugging Face BERT (random weights, tiny config, CPU)."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import leanact.nn as lnn  # noqa: E402
from leanact.patching import patch, summary, tied_embedding, unpatch  # noqa: E402
from leanact.patching.modules import PatchedGELU  # noqa: E402

BertConfig, BertForMaskedLM, BertModel = transformers.BertConfig, transformers.BertForMaskedLM, transformers.BertModel


def _config(dropout=0.0, layers=2, attn="sdpa", **kw):
    cfg = BertConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=128,
                     vocab_size=100, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                     attn_implementation=attn, **kw)
    return cfg


def _pair(dropout=0.0, attn="sdpa"):
    torch.manual_seed(0)
    ref = BertForMaskedLM(_config(dropout, attn=attn))
    lean = copy.deepcopy(ref)
    patch(lean)
    return ref, lean


def _batch(b=3, s=12, pad=True):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 100, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    if pad:
        mask[1, 7:] = 0
        mask[2, 3:] = 0
    labels = torch.where(torch.rand(b, s, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    labels[0, 0] = ids[0, 0]
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def test_patch_replaces_modules_and_records_summary():
    _, lean = _pair()
    layer = lean.bert.encoder.layer[0]
    assert type(layer.output.LayerNorm) is lnn.LayerNorm
    assert type(layer.output.dropout) is lnn.Dropout
    # dense -> dropout -> LayerNorm(+ residual): one fused op (leanact.patching.hf_residual_norm)
    assert type(layer.output).__name__ == "LeanBertOutput"
    assert type(layer.attention.output).__name__ == "LeanBertSelfOutput"
    assert isinstance(layer.intermediate.intermediate_act_fn, lnn.GELU)
    assert layer.intermediate.intermediate_act_fn.approximate == "none"
    assert lean.config._attn_implementation == "leanact"
    s = summary(lean)
    # LayerNorms (embeddings, head), Dropouts (embeddings, attention), GELUActivations, and the
    # sub-layer ends holding the other 4 LayerNorms and 4 Dropouts, the word embedding (tied to the decoder)
    assert len(s.replaced) == 2 + 3 + 3 + 4 + 1
    assert ("bert.embeddings.word_embeddings", "Embedding", tied_embedding.LABEL) in s.replaced
    assert sorted(new for _, was, new in s.replaced if was in ("BertOutput", "BertSelfOutput")) == (
        ["leanact.patching.LeanBertOutput"] * 2 + ["leanact.patching.LeanBertSelfOutput"] * 2)
    assert s.attention == [("", "sdpa", "leanact (recompute)")]
    # No torch LayerNorm / Dropout / HF GELU left anywhere.
    for m in lean.modules():
        assert type(m) not in (torch.nn.LayerNorm, torch.nn.Dropout)
        assert type(m).__name__ != "GELUActivation"


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_fp32_loss_and_gradients_match(attn):
    ref, lean = _pair(attn=attn)
    ref.train(), lean.train()
    batch = _batch()
    l_ref = ref(**batch).loss
    l_lean = lean(**batch).loss
    torch.testing.assert_close(l_lean, l_ref, rtol=1e-6, atol=0)
    l_ref.backward()
    l_lean.backward()
    lean_params = dict(lean.named_parameters())
    for name, p in ref.named_parameters():
        g_ref, g_lean = p.grad, lean_params[name].grad
        assert g_lean is not None, name
        # Floor on the norm: key biases have a gradient that is 0 in exact arithmetic (softmax is
        # invariant to a per-row shift), so both sides are ~1e-11 rounding noise there.
        err = (g_lean - g_ref).norm() / g_ref.norm().clamp_min(1e-4)
        assert err <= 1e-5, (name, err.item())


def test_eval_outputs_identical():
    ref, lean = _pair()
    ref.eval(), lean.eval()
    batch = _batch()
    with torch.no_grad():
        a, b = ref(**batch), lean(**batch)
    assert torch.equal(a.logits, b.logits)
    assert torch.equal(a.loss, b.loss)


def test_eval_outputs_identical_eager():
    ref, lean = _pair(attn="eager")
    ref.eval(), lean.eval()
    batch = _batch()
    with torch.no_grad():
        assert torch.equal(ref(**batch).logits, lean(**batch).logits)


def test_output_attentions_falls_back_to_eager():
    ref, lean = _pair(attn="eager")
    ref.eval(), lean.eval()
    batch = _batch()
    a = ref(**batch, output_attentions=True)
    b = lean(**batch, output_attentions=True)
    assert len(b.attentions) == 2
    for x, y in zip(a.attentions, b.attentions):
        torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-6)
    assert lean.config._attn_implementation == "leanact"  # only that call fell back


def test_state_dict_unchanged():
    ref, lean = _pair()
    sd_ref, sd_lean = ref.state_dict(), lean.state_dict()
    assert list(sd_ref) == list(sd_lean)
    for k in sd_ref:
        assert torch.equal(sd_ref[k], sd_lean[k]), k
    # Same Parameter objects as before patching: optimizers built earlier keep working.
    torch.manual_seed(0)
    m = BertForMaskedLM(_config())
    before = {n: p for n, p in m.named_parameters()}
    patch(m)
    assert all(p is before[n] for n, p in m.named_parameters())


def test_unpatch_restores_original_modules():
    torch.manual_seed(0)
    m = BertForMaskedLM(_config())
    mods = dict(m.named_modules())
    patch(m)
    m.eval()  # train/eval flags made while patched carry over
    assert unpatch(m) is m
    assert summary(m) is None
    assert m.config._attn_implementation == "sdpa"
    after = dict(m.named_modules())
    assert list(after) == list(mods)
    assert all(after[k] is mods[k] for k in mods)
    assert not any(x.training for x in m.modules())
    unpatch(m)  # no-op on an unpatched model


@pytest.mark.parametrize("fn", [patch, unpatch])
def test_not_a_module_is_a_type_error(fn):
    with pytest.raises(TypeError, match=rf"leanact.{fn.__name__}\(model\): model must be a torch.nn.Module, got "
                                        "NoneType None; pass the model object itself"):
        fn(None)


def test_unpatch_of_a_submodule_raises_and_changes_nothing():
    torch.manual_seed(0)
    m = BertForMaskedLM(_config())
    patch(m)
    patched = dict(m.named_modules())
    with pytest.raises(ValueError, match="this BertLayer is part of a patched BertForMaskedLM.*call leanact.unpatch "
                                         "on the BertForMaskedLM given to leanact.patch"):
        unpatch(m.bert.encoder.layer[0])
    assert dict(m.named_modules()) == patched and summary(m) is not None
    unpatch(m)
    assert not any(type(x).__module__.startswith("leanact") for x in m.modules())
    assert unpatch(m.bert.encoder.layer[0]) is m.bert.encoder.layer[0]  # nothing patched any more: a no-op


def test_patch_twice_and_no_attention_option():
    torch.manual_seed(0)
    m = BertForMaskedLM(_config())
    patch(m)
    patch(m, attention=False)
    assert m.config._attn_implementation == "sdpa"
    assert summary(m).attention == []
    with pytest.raises(ValueError):
        patch(m, attention="flash")


def test_train_with_dropout_runs_and_masks_padding():
    ref, lean = _pair(dropout=0.1)
    lean.train()
    batch = _batch()
    lean(**batch).loss.backward()
    # Padding mask honoured: changing a padded token does not change the others' logits (eval).
    lean.eval()
    ids2 = batch["input_ids"].clone()
    ids2[2, 5] = (ids2[2, 5] + 1) % 100
    with torch.enable_grad():
        for p in lean.parameters():
            p.requires_grad_(True)
        a = lean(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        b = lean(input_ids=ids2, attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(a[2, :3], b[2, :3])


def test_verbose_prints_table(capsys):
    torch.manual_seed(0)
    patch(BertForMaskedLM(_config()), verbose=True)
    out = capsys.readouterr().out
    assert "leanact.nn.LayerNorm" in out and "attention" in out


def test_unknown_model_gets_generic_replacements():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.SiLU(), torch.nn.Dropout(0.1),
                                torch.nn.LayerNorm(8))
    patch(model)
    assert [type(m) for m in model] == [torch.nn.Linear, PatchedGELU, torch.nn.SiLU, lnn.Dropout, lnn.LayerNorm]
    s = summary(model)
    assert [r[0] for r in s.left] == ["2"] and s.attention == []


def _bert_build(patched, dropout=0.1, h=64, a=4, attn="eager"):
    def build(n):
        torch.manual_seed(0)
        cfg = BertConfig(hidden_size=h, num_hidden_layers=n, num_attention_heads=a, intermediate_size=4 * h,
                         vocab_size=100, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                         attn_implementation=attn)
        m = BertModel(cfg, add_pooling_layer=False).to(torch.bfloat16).train()
        return patch(m) if patched else m
    return build


def test_saved_bytes_per_layer_lower():
    from leanact.memory import measure_layer_cost

    s, b, h = 64, 2, 64
    ids = lambda: (torch.randint(1, 100, (b, s), generator=torch.Generator().manual_seed(0)),)  # noqa: E731
    eager = measure_layer_cost(_bert_build(False), ids, s, b, h)
    lean = measure_layer_cost(_bert_build(True), ids, s, b, h)
    # eager at this geometry: 34 + 5as/h = 34 + 20 = 54 B/sbh; lean: no s x s tensor at all.
    assert eager.per_sbh > 50
    assert lean.per_sbh < 0.5 * eager.per_sbh, (eager.per_sbh, lean.per_sbh)


@pytest.mark.slow
def test_bert_large_geometry_bytes_per_layer():
    """BERT-Large layer (h=1024, a=16), s=512, b=1, bf16, dropout 0.1: HF eager keeps 84 B/sbh,
    the patched model <= 21 (Q, K, V, attention output, LayerNorm outputs, GELU output + bits)."""
    from leanact.memory import measure_layer_cost

    s, b, h = 512, 1, 1024
    ids = lambda: (torch.randint(1, 100, (b, s), generator=torch.Generator().manual_seed(0)),)  # noqa: E731
    eager = measure_layer_cost(_bert_build(False, 0.1, h, 16, "eager"), ids, s, b, h)
    lean = measure_layer_cost(_bert_build(True, 0.1, h, 16, "eager"), ids, s, b, h)
    assert round(eager.per_sbh, 1) == 84.0
    assert lean.per_sbh <= 21.0, lean.by_op
    assert "Softmax" not in lean.by_op and "Bmm" not in lean.by_op


@pytest.mark.parametrize("precision", ["fp32", "autocast"])
def test_fused_sub_layer_ends_are_the_lean_modules_bitwise_with_dropout(precision):
    """With dropout (p = 0.1, train mode) the fused sub-layer ends (dropout + add + LayerNorm as one op)
    give bitwise the loss and gradients of the same patched model running HF's forward over its lean
    dropout and LayerNorm, and leave the random stream where it leaves it; in eval, the unpatched
    model's output."""
    import copy

    import transformers

    import leanact
    from leanact.patching.hf_residual_norm import _LeanHFResidualNorm

    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=100, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    base = transformers.BertForMaskedLM(cfg).train()
    fused = leanact.patch(copy.deepcopy(base))
    unfused = leanact.patch(copy.deepcopy(base))
    ends = [m for m in unfused.modules() if isinstance(m, _LeanHFResidualNorm)]
    assert len(ends) == 4
    for m in ends:  # HF's own forward over the lean children
        m.__dict__["forward"] = lambda *a, m=m: type(m).__mro__[2].forward(m, *a)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    results = []
    for model in (fused, unfused):
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
            loss = model(input_ids=ids, labels=ids).loss
        after = torch.randint(0, 1 << 30, ())
        nodes, todo = set(), [loss.grad_fn]
        while todo:
            n = todo.pop()
            if n is not None and n not in nodes:
                nodes.add(n)
                todo.extend(f for f, _ in n.next_functions)
        fused_nodes = sum(type(n).__name__ == "DropoutAddLayerNormBackward" for n in nodes)
        loss.backward()
        results.append((loss.detach(), after, [p.grad for p in model.parameters()], fused_nodes))
    (l0, a0, g0, n0), (l1, a1, g1, n1) = results
    assert (n0, n1) == (4, 0)  # the fused op ran in each sub-layer end, and only in the fused model
    assert torch.equal(l0, l1) and torch.equal(a0, a1)
    assert all(torch.equal(x, y) for x, y in zip(g0, g1))
    fused.eval(), base.eval()
    with torch.no_grad():
        assert torch.equal(fused(input_ids=ids).logits, base(input_ids=ids).logits)
