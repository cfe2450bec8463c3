"""What a patched layer keeps under ``torch.autocast`` (fp32 weights), to the byte.

Per layer and per sample: (2-layer model − 1-layer model) at batch 2 minus the same at batch 1, so
the batch-independent part (autocast's 16-bit weight copies, seeds) cancels. Under bf16 autocast
the residual stream is fp32: each norm keeps its fp32 output once, and the Linears after it keep
nothing more (their casts are recipes, :mod:`leanact.recompute.casts`); the rest is 16-bit:

* BERT layer: Q, K, V and the attention output (2·4h), one fp32 log-sum-exp per row and head (4a),
  two norms' fp32 outputs and rstd (2·(4h + 4)), the GELU's bf16 output and its branch bits
  (2I + I/8): 16h + 2.125·I + 4a + 8 bytes per token.
* LLaMA layer: the same with q (2h), k, v (2·2·kv·d), the output (2h), the lse (4a), two RMSNorms'
  fp32 outputs and rstd, the SwiGLU's gate and up outputs (2·2I): 4 bytes per h more than with
  bf16 weights (two fp32 residual-stream tensors instead of two bf16 ones).
"""
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import leanact  # noqa: E402
from leanact.memory import SavedTensorMeter  # noqa: E402
from leanact.recompute import counters, reset_counters  # noqa: E402

H, A, KV, I, S = 64, 4, 2, 256, 16  # noqa: E741 (I: the intermediate size, as in the formulas)


def _bert(n):
    cfg = transformers.BertConfig(hidden_size=H, num_hidden_layers=n, num_attention_heads=A, intermediate_size=I,
                                  vocab_size=100, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                                  attn_implementation="sdpa")
    return transformers.BertModel(cfg, add_pooling_layer=False)


def _llama(n):
    cfg = transformers.LlamaConfig(hidden_size=H, num_hidden_layers=n, num_attention_heads=A, num_key_value_heads=KV,
                                   intermediate_size=I, vocab_size=100, use_cache=False, attn_implementation="sdpa")
    return transformers.LlamaModel(cfg)


BUILD = {"bert": _bert, "llama": _llama}


def _kept(family, n, b, precision, lean=True):
    torch.manual_seed(0)
    model = BUILD[family](n).train()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    if lean:
        leanact.patch(model)
    ids = torch.randint(1, 100, (b, S), generator=torch.Generator().manual_seed(0))
    meter = SavedTensorMeter(model)
    with warnings.catch_warnings(), meter, torch.autocast("cpu", dtype=torch.bfloat16,
                                                          enabled=precision == "autocast"):
        warnings.simplefilter("ignore")
        out = model(ids).last_hidden_state
    meter.release()
    del out
    return meter.total_bytes


def per_sample_layer(family, precision, lean=True):
    """Bytes one layer keeps per sample (batch slope of the 2-layer minus 1-layer difference)."""
    layer = {b: _kept(family, 2, b, precision, lean) - _kept(family, 1, b, precision, lean) for b in (1, 2)}
    return layer[2] - layer[1]


def test_bert_layer_under_autocast_to_the_byte():
    expected = S * (16 * H + 2 * I + I // 8 + 4 * A + 8)
    assert per_sample_layer("bert", "autocast") == expected
    # the unpatched layer under the same autocast keeps several times more
    assert per_sample_layer("bert", "autocast", lean=False) > 2.5 * expected


def test_llama_layer_under_autocast_to_the_byte():
    d = H // A
    expected = S * (2 * (4 * H + 4) + 2 * H + 2 * 2 * KV * d + 2 * H + 4 * A + 2 * 2 * I)
    assert per_sample_layer("llama", "autocast") == expected
    # fp32 residual stream: two norm outputs of 4 bytes instead of 2 per h
    assert per_sample_layer("llama", "bf16") == expected - S * 2 * 2 * H


def _grads(model, batch, *, amp_recipes):
    model.zero_grad(set_to_none=True)
    forward = model.forward if amp_recipes else type(model).forward.__get__(model)  # bypass the wrapper
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("ignore")
        loss = forward(**batch).last_hidden_state.float().pow(2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _patched_without_dropout(family):
    """A patched 2-layer model of ``family`` (dropout off) and a batch of token ids."""
    torch.manual_seed(0)
    model = leanact.patch(BUILD[family](2).train())
    if family == "bert":
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    return model, dict(input_ids=torch.randint(1, 100, (2, S), generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_cast_recipes_are_bitwise_the_casts(family):
    """Rebuilding autocast's casts in backward gives the very same gradients as keeping them."""
    model, batch = _patched_without_dropout(family)
    reset_counters()
    loss, grads = _grads(model, batch, amp_recipes=True)
    assert counters().get("recompute:cast", 0) > 0
    loss_ref, ref = _grads(model, batch, amp_recipes=False)
    assert torch.equal(loss, loss_ref)
    assert grads.keys() == ref.keys()
    for n in ref:
        assert torch.equal(grads[n], ref[n]), n


def test_cast_of_modified_source_raises():
    """The norm output is kept (by the norm and, through the recipe, by the Linear's cast): modifying
    it in place before backward raises, as torch does for a tensor kept for backward."""
    norm = leanact.nn.LayerNorm(H)
    lin = torch.nn.Linear(H, H)
    x = torch.randn(2, S, H, requires_grad=True)
    from leanact.recompute import RecipeTransform

    with RecipeTransform(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(x)
        out = lin(y)
    with torch.no_grad():
        y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.float().sum().backward()


def test_no_autocast_no_transform():
    """Without autocast the patched forward is the model's own (no recipe transform entered)."""
    model = leanact.patch(_bert(1).train())
    ids = torch.randint(1, 100, (1, S))
    reset_counters()
    model(ids).last_hidden_state.sum().backward()
    assert counters().get("claimed", 0) == 0
    leanact.unpatch(model)
    assert "forward" not in model.__dict__


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_fused_loss_dtype_follows_autocast(family):
    """autocast runs cross_entropy in fp32: the fused loss of a patched model is fp32 there too
    (BERT's MLM loss reads bf16 logits; LLaMA's loss upcasts them itself)."""
    from _tiny import tiny_batch, tiny_hf

    ref, lean = tiny_hf(family), leanact.patch(tiny_hf(family))
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("ignore")
        a, b = ref(**tiny_batch()).loss, lean(**tiny_batch()).loss
    assert leanact.summary(lean).loss_states[""].fused_calls == 1
    assert a.dtype == b.dtype == torch.float32


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_the_autocast_recipes(how):
    """A deep copy or pickle round trip of a patched model rebuilds autocast's casts as the original does."""
    import copy
    import pickle

    torch.manual_seed(0)
    model = leanact.patch(_llama(1).train())
    twin = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    ids = torch.randint(1, 100, (1, S))
    kept = []
    for m in (model, twin):
        meter = SavedTensorMeter(m)
        reset_counters()
        with meter, torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(ids).last_hidden_state
        out.float().sum().backward()
        kept.append(meter.total_bytes)
        # q, k, v, gate, up: 5 casts rebuilt, not kept; once per source (the two norms' outputs)
        assert counters().get("claimed", 0) == 5 and counters().get("recompute:cast", 0) == 2
    assert kept[0] == kept[1]
    leanact.unpatch(twin)
    assert "forward" not in twin.__dict__


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_ambient_recipes_keep_the_same_with_fewer_python_saves(family, monkeypatch):
    """With Linear layers wrapped (recast_weights), the autocast recipes are active only inside the
    norms and the Linears (leanact.saved.ambient): the same bytes kept and the same gradients as
    with the recipes around the whole forward, while attention, dropout, residual adds... keep
    their tensors without a Python pack/unpack call each."""
    from leanact import saved
    from leanact.patching import weight_recast

    calls = [0]
    pack = saved._pack

    def counting(t):
        calls[0] += 1
        return pack(t)

    monkeypatch.setattr(saved, "_pack", counting)
    model, batch = _patched_without_dropout(family)
    results = {}
    for scoped in (True, False):
        monkeypatch.setattr(weight_recast, "wraps_linears", lambda m, scoped=scoped: scoped)
        calls[0] = 0
        loss, grads = _grads(model, batch, amp_recipes=True)
        results[scoped] = (calls[0], loss, grads, per_sample_layer(family, "autocast"))
    (n_amb, l_amb, g_amb, kept_amb), (n_all, l_all, g_all, kept_all) = results[True], results[False]
    assert torch.equal(l_amb, l_all) and g_amb.keys() == g_all.keys()
    assert all(torch.equal(g_amb[k], g_all[k]) for k in g_amb)
    assert kept_amb == kept_all
    assert n_amb < n_all, (n_amb, n_all)


@pytest.mark.parametrize("strategy", ["offload", "selective:pointwise", "lossy:int8"])
def test_ambient_recipes_under_a_strategy(strategy, monkeypatch):
    """With a strategy's transforms active in the layers, the ambient autocast recipes (inside the
    norms and Linears only) keep what recipes around the whole forward keep, with the same gradients."""
    from leanact import strategies
    from leanact.patching import weight_recast

    results = {}
    for scoped in (True, False):
        monkeypatch.setattr(weight_recast, "wraps_linears", lambda m, scoped=scoped: scoped)
        model, batch = _patched_without_dropout("llama")
        kw = {"offload_threshold": 0} if strategy == "offload" else {}
        strategies.uniform(model, strategy, **kw).apply(model)
        meter = SavedTensorMeter(model)
        with warnings.catch_warnings(), meter, torch.autocast("cpu", dtype=torch.bfloat16):
            warnings.simplefilter("ignore")
            out = model(**batch).last_hidden_state
        meter.release()
        del out
        results[scoped] = (meter.total_bytes, *_grads(model, batch, amp_recipes=True))
    (kept_a, loss_a, grads_a), (kept_w, loss_w, grads_w) = results[True], results[False]
    assert kept_a == kept_w
    assert torch.equal(loss_a, loss_w) and all(torch.equal(grads_a[k], grads_w[k]) for k in grads_w)


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_cast_recipes_off_keeps_autocasts_copies(family):
    """``patch(cast_recipes=False)``: autocast's 16-bit casts of the norms' outputs are kept, as HF
    keeps them (one per consumer: Q, K, V, the MLP's first projections, BERT's head transform), bitwise
    the same loss and gradients; everything else kept is the same."""
    from _tiny import tiny_batch, tiny_hf

    batch = tiny_batch()
    tokens, h = batch["input_ids"].numel(), 32
    kept, results = {}, {}
    for recipes in (True, False):
        m = leanact.patch(tiny_hf(family), cast_recipes=recipes)
        meter = SavedTensorMeter(m, exclude=list(batch.values()))
        with meter, torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(**batch).loss
        loss.backward()
        kept[recipes] = meter.total_bytes
        results[recipes] = (loss.detach(), [p.grad for p in m.parameters() if p.grad is not None])
    # BERT (1 layer): Q, K, V and the intermediate dense cast a norm output, so does the head's transform;
    # LLaMA (1 layer): Q, K, V, gate and up
    casts = 3 + 1 + 1 if family == "bert" else 3 + 2
    assert kept[False] - kept[True] == casts * tokens * h * 2, kept
    assert torch.equal(results[True][0], results[False][0])
    assert all(torch.equal(a, b) for a, b in zip(results[True][1], results[False][1]))
    with pytest.raises(TypeError, match="cast_recipes="):
        leanact.patch(tiny_hf(family), cast_recipes="no")
