"""Bloom's and Falcon's attention (ALiBi / rotary, outside AttentionInterface) through leanact's core:
patched vs unpatched losses and gradients, memory kept, fallbacks (leanact.patching.hf_alibi)."""
import contextlib
import copy
import warnings

import pytest
import torch

import leanact
from leanact.memory import SavedTensorMeter
from leanact.ops.attention import attention, compose
from leanact.patching import hf_alibi

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

S, B, V = 24, 2, 100  # s = 24 appears in no weight's shape: an (s, s) record would be a score-sized tensor


def _falcon(alibi, **kw):
    return transformers.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=V,
                                     alibi=alibi, **kw)


CASES = {
    "bloom": (transformers.BloomForCausalLM,
              lambda: transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=V), "eager"),
    "falcon-alibi-eager": (transformers.FalconForCausalLM, lambda: _falcon(True), "eager"),
    "falcon-alibi-sdpa": (transformers.FalconForCausalLM, lambda: _falcon(True), "sdpa"),
    "falcon-rotary-eager": (transformers.FalconForCausalLM, lambda: _falcon(False), "eager"),
    "falcon-rotary-sdpa": (transformers.FalconForCausalLM, lambda: _falcon(False), "sdpa"),
    "falcon-new-arch": (transformers.FalconForCausalLM,
                        lambda: _falcon(True, new_decoder_architecture=True, num_kv_heads=2), "sdpa"),
    "falcon-multi-query": (transformers.FalconForCausalLM, lambda: _falcon(False, multi_query=True), "eager"),
}


def _model(case, dtype=torch.float32, dropout=0.0):
    cls, cfg, impl = CASES[case]
    cfg = cfg()
    cfg.attention_dropout = dropout
    cfg.hidden_dropout = 0.0
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls._from_config(cfg, attn_implementation=impl, dtype=dtype)


def _reference(case):
    """The kernel the unpatched model's gradients are taken with. Falcon's new decoder architecture under
    SDPA with left padding: torch's CPU flash kernel's backward differs from its math kernel (autograd of
    the composition) by O(1) in the layers' gradients, even in float64; leanact agrees with the latter."""
    if case == "falcon-new-arch":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def _batch(pad="both"):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    if pad == "both":
        mask[0, :5] = 0  # left padding: query rows 0-4 of sequence 0 see no key
    if pad:
        mask[1, -3:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _step(model, ids, mask, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _patched(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return leanact.patch(copy.deepcopy(model))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def test_core_takes_is_causal_with_a_per_key_bias():
    """attention(..., attn_mask=(b, H, 1, s) bias, is_causal=True): the triangle on top of the bias,
    gradients (the bias's too) as the float64 composition's."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 8, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(3))
    bias = torch.randn(2, 4, 1, 9, dtype=torch.float64, generator=g)
    bias[0, :, :, :3] = -torch.inf  # padded keys: rows 0-2 of sequence 0 see none (output 0)
    bias.requires_grad_()
    do = torch.randn(2, 4, 9, 8, dtype=torch.float64, generator=g)
    outs = []
    for fn in (lambda: attention(q, k, v, bias, is_causal=True, block_size=4), lambda: compose(q, k, v, bias, True)):
        out = fn()
        out = torch.nan_to_num(out)  # (the composition gives NaN on rows with no key)
        grads = torch.autograd.grad(out, (q, k, v, bias), do)
        outs.append((out, [torch.nan_to_num(x) for x in grads]))
    (o1, g1), (o2, g2) = outs
    torch.testing.assert_close(o1, o2, rtol=1e-12, atol=1e-12)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("train", [True, False])
def test_fp32_loss_and_gradients_as_hf(case, train):
    model = _model(case).train(train)
    lean = _patched(model)
    assert "attention" not in leanact.summary(lean).left_in_layers()
    assert any(type(m).__name__.startswith("Lean") and "Attention" in type(m).__name__ for m in lean.modules())
    batch = _batch()
    with _reference(case):
        l0, g0 = _step(model, *batch)
    l1, g1 = _step(lean, *batch)
    assert abs(l0.item() - l1.item()) <= 1e-5 * abs(l0.item())
    for n in g0:
        assert _rel(g1[n], g0[n]) <= 1e-5, n
    assert not leanact.summary(lean).attention_fallbacks()


@pytest.mark.parametrize("case", ["bloom", "falcon-alibi-eager", "falcon-rotary-eager"])
def test_fully_masked_rows_as_hf_eager(case):
    """Left padding: HF's additive mask of dtype-min values makes those rows the uniform average of the
    values (gradients included); the padded rows' outputs enter this loss (a random projection of
    the last hidden states)."""
    model = _model(case).train()
    lean = _patched(model)
    ids, mask, _ = _batch()
    r = torch.randn(B, S, 32, generator=torch.Generator().manual_seed(2))
    outs = []
    for m in (model, lean):
        m.zero_grad()
        h = m.transformer(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        (h * r).sum().backward()
        outs.append((h.detach(), [p.grad.clone() for p in m.parameters()]))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(outs[1][1], outs[0][1]):
        assert _rel(a, b) <= 1e-5


@pytest.mark.parametrize("case", ["bloom", "falcon-alibi-sdpa", "falcon-rotary-sdpa", "falcon-new-arch"])
def test_bf16_within_twice_hf_error_vs_float64(case):
    """bf16: HF rounds scores / probabilities to bf16, leanact's core keeps them in fp32; both are
    compared with the float64 model on the same (bf16-rounded) weights. Right padding only: with rows
    that see no key Bloom's float64 model gives NaN (its softmax in fp32 turns float64's min into -inf)."""
    ref = _model(case, dtype=torch.bfloat16).train()
    truth = copy.deepcopy(ref).double()
    lean = _patched(ref)
    batch = _batch(pad="right")
    with _reference(case):
        (lt, gt), (l0, g0) = _step(truth, *batch), _step(ref, *batch)
    l1, g1 = _step(lean, *batch)
    floor = torch.finfo(torch.bfloat16).eps * abs(lt.item())
    assert abs(l1.item() - lt.item()) <= 2 * abs(l0.item() - lt.item()) + floor
    e0 = sum(_rel(g0[n], gt[n]) for n in gt)
    e1 = sum(_rel(g1[n], gt[n]) for n in gt)
    assert e1 <= 2 * e0


@pytest.mark.parametrize("case", ["bloom", "falcon-alibi-eager", "falcon-rotary-sdpa"])
def test_no_grad_inference_is_hf_bitwise(case):
    model = _model(case).eval()
    lean = _patched(model)
    ids, mask, _ = _batch()
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask).logits
        b = lean(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(a, b)


def _kept(model, dropout_seed=0):
    ids, mask, labels = _batch()
    torch.manual_seed(dropout_seed)
    with SavedTensorMeter(model) as meter:
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    return meter, loss


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_memory_without_score_sized_tensors(case, dropout):
    """Nothing of size s x s is kept by the patched model (HF keeps scores or probabilities per layer)."""
    model = _model(case, dropout=dropout).train()
    lean = _patched(model)
    before, _ = _kept(model)
    after, loss = _kept(lean)
    square = lambda m: [r for r in m.counted() if list(r.shape).count(S) >= 2]  # noqa: E731
    assert square(before) or "rotary-sdpa" in case or "new-arch" in case  # (SDPA fused kernels keep none)
    assert not square(after), [(r.module, r.shape) for r in square(after)]
    assert after.total_bytes < before.total_bytes
    _, again = _kept(lean)
    assert torch.equal(loss, again)  # the dropout seed comes from torch's generator: same seed, same loss


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_bloom_kept_bytes_per_layer(dropout):
    """A patched Bloom layer's attention keeps the fused QKV output (q, k, v are views of it), the
    fp32 log-sum-exp per row, its fp32 ALiBi + padding bias (b, H, 1, s), with dropout an 8-byte
    seed, and the bool mask of rows that see no key (b, 1, s): one for all layers (found once per
    forward), counted in the first layer's."""
    h, heads = 32, 4
    after, _ = _kept(_patched(_model("bloom", dropout=dropout).train()))
    expect = B * S * 3 * h * 4 + 2 * B * heads * S * 4 + (8 if dropout else 0)
    assert after.by_module()["transformer.h.0.self_attention"] == expect + B * S
    assert after.by_module()["transformer.h.1.self_attention"] == expect


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("pad", [None, "right"])
def test_estimate_equals_a_measured_step(case, pad):
    """leanact.estimate of a patched Bloom / Falcon on fake tensors (the ALiBi mask has no values: it is
    taken as Hugging Face builds it from the 2-D mask): kept bytes equal a measured step's, without and
    with right padding; the peak within 1%."""
    from leanact.estimate import estimate, measure

    ids, mask, labels = _batch(pad)
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    lean = _patched(_model(case).train())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        predicted, real = estimate(lean, batch), measure(lean, batch)
    assert predicted.saved == real.saved
    assert abs(predicted.peak - real.peak) <= 0.01 * real.peak


def test_a_fake_mask_is_taken_as_causal_only_inside_an_estimate():
    """Outside leanact.estimate's trace (another fake-tensor trace, which may be run for real later) a
    fake mask is not assumed to be causal: HF's forward; inside, it is (memory only)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):  # (as leanact.estimate's)
        mask = torch.zeros(1, 1, 4, 4)
        hf_alibi._CHECKED[0] = None
        assert hf_alibi._key_bias(mask) is None
        with hf_alibi._estimating(None):
            assert hf_alibi._key_bias(mask)[0] is True
    hf_alibi._CHECKED[0] = None


def test_summary_and_unpatch():
    model = _model("bloom")
    lean = _patched(model)
    s = leanact.summary(lean)
    assert s.attention == [("", "eager", "leanact (recompute, ALiBi; Hugging Face's attention code around "
                                         "leanact's core)")]
    assert "attention" not in s.left_in_layers()
    leanact.unpatch(lean)
    assert [type(m) for m in lean.modules()] == [type(m) for m in model.modules()]


def test_cache_and_attention_weights_run_hf():
    model = _model("falcon-alibi-eager").eval()
    lean = _patched(model)
    ids, mask, _ = _batch()
    out = lean(input_ids=ids, attention_mask=mask, use_cache=True)  # eval with grad: HF's forward with a cache
    ref = model(input_ids=ids, attention_mask=mask, use_cache=True)
    torch.testing.assert_close(out.logits, ref.logits)  # (leanact's LayerNorm/GELU: within rounding)
    assert leanact.summary(lean).attention_fallbacks() == {"": {"cache"}}
    att = lean(input_ids=ids, attention_mask=mask, use_cache=False, output_attentions=True).attentions
    assert att is not None and att[0].shape == (B, 4, S, S)


def test_custom_mask_runs_hf_and_is_recorded():
    model = _model("falcon-rotary-eager").train()
    lean = _patched(model)
    ids, _, labels = _batch(pad=False)
    mask = torch.ones(B, 1, S, S, dtype=torch.bool).tril()
    mask[:, :, :, 3] = False  # key 3 hidden from every row, as padding would: still causal + padding
    mask[:, :, 10, 2] = False  # one more hole: not causal + padding
    add = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    (l0, _), (l1, _) = _step(model, ids, add, labels), _step(lean, ids, add, labels)
    assert torch.equal(l0, l1)
    assert leanact.summary(lean).attention_fallbacks() == {"": {"attention mask other than causal + padding"}}


def test_unknown_forward_is_left(monkeypatch):
    monkeypatch.setitem(hf_alibi._KNOWN, "BloomAttention", set())
    lean = _patched(_model("bloom"))
    s = leanact.summary(lean)
    assert s.attention[0][2] == "left: the model does not use AttentionInterface"
    assert any(cls == "BloomAttention" and "not the one leanact's rewrite reproduces" in why for _, cls, why in s.left)
    assert "attention" in s.left_in_layers()


def test_fully_masked_rows_read_back_once_per_forward(monkeypatch):
    """Every layer gets the same per-key bias: its rows without an allowed key are found (a host
    sync) once per forward, not once per layer."""
    from torch.utils.weak import WeakIdKeyDictionary

    import leanact.patching.hf_alibi as A

    read = []

    class Counting(WeakIdKeyDictionary):
        def __setitem__(self, key, value):  # a miss: the rows were read back
            read.append(key)
            super().__setitem__(key, value)

    monkeypatch.setattr(A, "_DEAD_ROWS", Counting())
    model = _model("bloom").train()
    lean = _patched(model)
    assert model.config.n_layer > 1
    l0, g0 = _step(model, *_batch())
    l1, g1 = _step(lean, *_batch())
    assert len(read) == 1
    assert abs(l0.item() - l1.item()) <= 1e-5 * abs(l0.item())
