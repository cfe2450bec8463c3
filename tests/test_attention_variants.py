"""Attention variants through the lean core: logit softcap (Gemma 2), attention sinks (GPT-OSS).

Gradcheck in float64, fp32/bf16 within the worst-case rounding bound of the float64 truth (the plain
composition held to the same bound), bytes kept to the byte (nothing of size s²), and the Hugging
Face models that use them: patched vs unpatched gradients, the summary, no fallback.
"""
import copy
import math
import warnings

import pytest
import torch
from torch import nn

from _tol import within_rounding_bound
from leanact.memory import SavedTensorMeter
from leanact.ops.attention import attention
from leanact.ops.random import keep_mask_like
from test_attention import SEED, _one_thread, grads, make_mask, make_qkv  # noqa: F401 (autouse fixture)

VARIANTS = {"softcap": (2.0, False), "sinks": (None, True), "both": (1.5, True)}


def reference(q, k, v, mask=None, p=0.0, causal=False, softcap=None, sinks=None):
    """The plain composition in q's dtype: c·tanh(s/c), mask, [s, sink] softmax without the sink column,
    dropout (leanact's mask for the seed), @ v."""
    b, h, s_q, d = q.shape
    g = h // k.size(1)
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask
    if causal:
        s = s.masked_fill(torch.ones(s_q, k.size(2), dtype=torch.bool).triu(1), -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype).view(1, h, 1, 1).expand(b, h, s_q, 1)], -1)
    a = torch.softmax(s, -1)
    if sinks is not None:
        a = a[..., :-1]
    if p > 0:
        a = a * keep_mask_like(SEED, a.shape, p) / (1 - p)
    return a @ v


def _sinks(h, dtype, gen):
    return nn.Parameter(torch.randn(h, generator=gen, dtype=torch.float64).to(dtype))


GC_CASES = [  # (mask kind, causal, G, p)
    (None, False, 1, 0.0),
    ("pad", False, 2, 0.2),
    ("full", False, 1, 0.0),
    (None, True, 2, 0.25),
    ("float", False, 1, 0.0),
]


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", GC_CASES, ids=str)
def test_gradcheck_float64(variant, case):
    softcap, with_sinks = VARIANTS[variant]
    kind, causal, g, p = case
    gen = torch.Generator().manual_seed(2)
    b, h, s_q, s_k, d = 2, 2 * g, 7, 7 if causal else 6, 4
    _, q, k, v = make_qkv(b, h, s_q, d, torch.float64, hkv=h // g, s_k=s_k, generator=gen)
    mask = make_mask(kind, b, h, s_q, s_k, generator=gen)
    inputs = [q, k, v]
    sinks = _sinks(h, torch.float64, gen) if with_sinks else None
    if sinks is not None:
        inputs.append(sinks)
    if kind == "float":
        mask.requires_grad_()

    def fn(q, k, v, *rest):
        return attention(q, k, v, mask, p, causal, block_size=3, seed=SEED, enable_gqa=g > 1, softcap=softcap,
                         sinks=rest[0] if with_sinks else None)

    assert torch.autograd.gradcheck(fn, tuple(inputs))
    if kind == "float":  # the additive mask gets its gradient too
        assert torch.autograd.gradcheck(lambda m: attention(q, k, v, m, p, causal, block_size=3, seed=SEED,
                                                            softcap=softcap, sinks=sinks), (mask,))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.15])
@pytest.mark.parametrize("kind", ["pad", "causal"])
@pytest.mark.parametrize("mode", ["recompute", "tempo"])
def test_matches_plain_composition(variant, dtype, p, kind, mode):
    """Output and gradients (q, k, v, sinks) within n·u·max|truth| of the float64 truth, n = d + 2 s_k + 4
    (as tests/test_attention.py, plus the tanh and the sink term); the plain composition held to the same bound."""
    softcap, with_sinks = VARIANTS[variant]
    gen = torch.Generator().manual_seed(7)
    b, h, s, d = 2, 3, 70, 64
    _, q, k, v = make_qkv(b, h, s, d, dtype, generator=gen)
    sinks = _sinks(h, dtype, gen) if with_sinks else None
    mask, causal = make_mask(kind, b, h, s, s, generator=gen), kind == "causal"
    leaves = (q, k, v) + ((sinks,) if with_sinks else ())
    ref = reference(q, k, v, mask, p, causal, softcap, sinks)
    wide = [t.double() for t in (q, k, v)] + [sinks.double() if with_sinks else None]
    truth = reference(*wide[:3], mask, p, causal, softcap, wide[3])
    n = d + 2 * s + 4
    expected = (truth, *grads(truth, leaves))
    for x, t in zip((ref, *grads(ref, leaves)), expected):
        assert within_rounding_bound(x, t, dtype, n)[0]
    out = attention(q, k, v, mask, p, causal, mode=mode, block_size=32, seed=SEED, softcap=softcap, sinks=sinks)
    assert out.shape == (b, h, s, d) and out.dtype == dtype
    for i, (x, t) in enumerate(zip((out, *grads(out, leaves)), expected)):
        ok, err, bound = within_rounding_bound(x, t, dtype, n)
        assert ok, (i, err, bound)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bytes_exact_and_linear_in_s(variant, dtype):
    """q, k, v, the fp32 lse and the seed (the sinks are a parameter): nothing of size s²."""
    softcap, with_sinks = VARIANTS[variant]

    def kept(s, p=0.1, mask=None):
        _, q, k, v = make_qkv(2, 4, s, 16, dtype, hkv=2)
        sinks = _sinks(4, dtype, torch.Generator().manual_seed(0)) if with_sinks else None
        with SavedTensorMeter() as meter:
            attention(q, k, v, mask, p, mask is None, block_size=16, enable_gqa=True, softcap=softcap, sinks=sinks)
        return meter.total_bytes, q.element_size()

    got, es = kept(64)
    assert got == (2 * 4 * 64 * 16 + 2 * 2 * 2 * 64 * 16) * es + 2 * 4 * 64 * 4 + 8
    assert kept(128)[0] - 8 == 2 * (got - 8)
    mask = make_mask("pad", 2, 4, 64, 64)
    assert kept(64, 0.0, mask)[0] == got - 8 + mask.numel()  # no dropout: no seed; the caller's mask


def test_errors():
    _, q, k, v = make_qkv(1, 2, 4, 4)
    with pytest.raises(ValueError, match="softcap must be a positive number"):
        attention(q, k, v, softcap=0.0)
    with pytest.raises(ValueError, match=r"sinks must be a floating-point tensor of shape \(2,\)"):
        attention(q, k, v, sinks=torch.zeros(3))


def test_fully_masked_rows_with_sinks_give_zero():
    _, q, k, v = make_qkv(1, 2, 4, 4, torch.float64)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    mask[..., 1, :] = False
    sinks = _sinks(2, torch.float64, torch.Generator().manual_seed(0))
    out = attention(q, k, v, mask, sinks=sinks)
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    torch.testing.assert_close(out, reference(q, k, v, mask, sinks=sinks), rtol=1e-12, atol=1e-12)


# ---- Hugging Face models ----------------------------------------------------------------------
transformers = pytest.importorskip("transformers")


def _gpt_oss():
    if not hasattr(transformers, "GptOssForCausalLM"):
        pytest.skip(f"no GPT-OSS in transformers {transformers.__version__}")
    cfg = transformers.GptOssConfig(vocab_size=96, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                                    num_experts_per_tok=2, max_position_embeddings=64, sliding_window=4)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_()  # non-trivial sinks
    return model.train()


def _gemma2():
    cfg = transformers.Gemma2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    max_position_embeddings=64, sliding_window=4, attn_logit_softcapping=2.0)
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(cfg).train()


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
@pytest.mark.parametrize("padding", ["none", "left"])
def test_hf_models_run_the_core_and_match(family, padding):
    """Softcap (Gemma 2, small cap so that it bends the scores), sinks (GPT-OSS) and both models' sliding
    windows through the core: no fallback, loss and gradients as the unpatched (eager) model's in fp32,
    fewer bytes kept."""
    import leanact
    from leanact.patching import attention_hf

    ref = _gemma2() if family == "gemma2" else _gpt_oss()
    lean = leanact.patch(copy.deepcopy(ref))
    ((_, was, now),) = leanact.summary(lean).attention
    assert now.startswith("leanact (recompute") and "sliding windows" in now
    assert ("logit softcap" if family == "gemma2" else "attention sinks") in now
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padding == "left":
        mask[1, :5] = 0
    batch = dict(input_ids=ids, attention_mask=mask, labels=ids)
    calls = []
    core = attention_hf._lean_attention
    kept = []
    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as mp:
        warnings.simplefilter("ignore")
        mp.setattr(attention_hf, "_lean_attention", lambda *a, **kw: calls.append(kw) or core(*a, **kw))
        for m in (ref, lean):
            with SavedTensorMeter(m) as meter:
                loss = m(**batch).loss
            loss.backward()
            kept.append(meter.total_bytes)
    assert len(calls) == 2 and not leanact.summary(lean).attention_fallbacks()
    assert kept[1] < kept[0]
    torch.testing.assert_close(lean(**batch).loss, ref(**batch).loss, rtol=1e-5, atol=0)
    g_ref = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    g_lean = {n: p.grad for n, p in lean.named_parameters() if p.grad is not None}
    assert g_ref.keys() == g_lean.keys()
    for n, g in g_ref.items():
        assert (g_lean[n] - g).norm() <= 1e-5 * g.norm() + 1e-9, n
