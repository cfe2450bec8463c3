"""The patched attention follows the semantics of the implementation the model had before patching.

Regressions: the causal triangle in every fallback to the model's eager function (no-grad eval,
``generate``, ``output_attentions=True``, reentrant checkpointing), fully masked query rows under
left padding on eager models (uniform rows, and the gradients eager gives them), autocast with
``backward`` inside and outside the block. fp32 tiny Llama/GPT-2/BERT, CPU, dropout 0.
"""
import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from leanact.patching import patch  # noqa: E402
from leanact.ops.attention.masked_rows import EagerMaskedRows  # noqa: E402

import test_patch_families as fam  # noqa: E402
import test_patch_llama as llama  # noqa: E402
from test_patch_families import _assert_grads_close  # noqa: E402


def _build(family, attn):
    return llama._build(family, attn) if family in llama.FAMILIES else fam._build(family, attn)


def _pair(family, attn):
    ref = _build(family, attn)
    return ref, patch(copy.deepcopy(ref))


def _left_padded(vocab=100):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, vocab, (3, 10), generator=g)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[0, :4] = 0
    mask[1, :9] = 0  # one real token
    return dict(input_ids=ids, attention_mask=mask, labels=ids)  # pads not ignored: their rows matter


def _unpadded(vocab=100):
    """No padding: transformers' mask function returns None and leaves the triangle to is_causal."""
    ids = torch.randint(3, vocab, (2, 11), generator=torch.Generator().manual_seed(6))
    return dict(input_ids=ids, labels=ids)


def _step(model, batch, **kw):
    model.zero_grad(set_to_none=True)
    loss = model(**batch, **kw).loss
    loss.backward()
    return loss.detach()


# ---- the eager rows of fully masked queries: a custom Function, float64 gradcheck ----------------
def _eager_reference(q, k, v, dead, scale):
    """The eager composition: additive dtype-min mask on the dead rows, softmax, @ v."""
    g = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * scale
    s = s + torch.zeros((), dtype=q.dtype).masked_fill(dead.unsqueeze(-1), torch.finfo(q.dtype).min)
    return (torch.softmax(s, -1) @ v) * dead.unsqueeze(-1)


@pytest.mark.parametrize("groups", [1, 2])
def test_eager_masked_rows_gradcheck(groups):
    gen = torch.Generator().manual_seed(groups)
    q = torch.randn(2, 4, 5, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(2, 4 // groups, 6, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(2, 4 // groups, 6, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    dead = torch.zeros(2, 1, 5, dtype=torch.bool)
    dead[0, 0, :2] = dead[1, 0, 4] = True
    fn = lambda q, k, v: EagerMaskedRows.apply(q, k, v, dead, 0.7)  # noqa: E731
    # The forward depends on v only (the dtype-min mask absorbs the scores): gradcheck sees v's
    # gradient; q's and k's are eager's softmax derivative at the uniform point, checked below.
    assert torch.autograd.gradcheck(lambda v: fn(q.detach(), k.detach(), v), (v,))
    ref = _eager_reference(q, k, v, dead, 0.7)
    go = torch.randn(ref.shape, dtype=torch.float64, generator=gen)
    out = fn(q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        assert a.abs().max() > 0  # eager does give q and k a gradient on those rows


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_dead_rows_grads_op(softcap):
    """The compiled backward's custom op: ``opcheck``-clean, the eager formula where a row is dead and
    exact zeros where none is (what it skips)."""
    from leanact.ops.attention import masked_rows as M

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 5, 3, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(2, 2, 6, 3, dtype=torch.float64, generator=gen) for _ in "kv")
    dout = torch.randn(2, 4, 5, 3, dtype=torch.float64, generator=gen)
    dead = torch.zeros(2, 1, 5, dtype=torch.bool)
    args = (q, k, v, dead, dout, 0.7, softcap)
    assert all(t.eq(0).all() for t in M._dead_rows_grads_op(*args))
    dead[0, 0, :2] = True
    got, want = M._dead_rows_grads_op(*args), M.dead_rows_grads(*args)
    for a, b in zip(got, want):
        assert a.is_contiguous() and torch.equal(a, b)
    assert got[0].abs().max() > 0
    torch.library.opcheck(M._dead_rows_grads_op, args)


# ---- whole models --------------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_no_grad_eval_and_generate_keep_the_causal_mask(family, attn):
    ref, lean = _pair(family, attn)
    ref.eval(), lean.eval()
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, lean(ids).logits)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ref.generate(ids[:1, :3], **kw), lean.generate(ids[:1, :3], **kw))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_output_attentions_training(family, attn):
    ref, lean = _pair(family, attn)
    batch = fam._batch(family) if family == "bert" else _unpadded()
    out_ref = ref(**batch, output_attentions=True)
    out_lean = lean(**batch, output_attentions=True)
    torch.testing.assert_close(out_lean.loss, out_ref.loss, rtol=1e-6, atol=0)
    if attn == "eager":
        for a, b in zip(out_lean.attentions, out_ref.attentions, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    else:  # transformers' SDPA function returns no probabilities; neither does the patched model
        assert all(a is None for a in out_ref.attentions or ()) and all(a is None for a in out_lean.attentions or ())
    out_ref.loss.backward(), out_lean.loss.backward()
    _assert_grads_close(ref, lean)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_left_padding_matches_the_original_implementation(family, attn):
    ref, lean = _pair(family, attn)
    batch = _left_padded()
    torch.testing.assert_close(_step(lean, batch), _step(ref, batch), rtol=1e-6, atol=0)
    _assert_grads_close(ref, lean)


def test_fully_masked_rows_are_read_back_once_per_forward(monkeypatch):
    """Every layer gets the same mask object: its fully masked rows are found (a host sync) once per
    forward, not once per layer; results as the original eager implementation's."""
    from torch.utils.weak import WeakIdKeyDictionary

    import leanact.patching.attention_hf as A

    looked_up, read = [], []

    class Counting(WeakIdKeyDictionary):
        def __setitem__(self, key, value):  # a miss: the rows were read back
            read.append(key)
            super().__setitem__(key, value)

    masked_rows = A._masked_rows_as_eager
    monkeypatch.setattr(A, "_DEAD_ROWS", Counting())
    monkeypatch.setattr(A, "_masked_rows_as_eager", lambda *a, **k: looked_up.append(1) or masked_rows(*a, **k))
    ref, lean = _pair("llama", "eager")
    batch = _left_padded()
    torch.testing.assert_close(_step(lean, batch), _step(ref, batch), rtol=1e-6, atol=0)
    assert len(looked_up) == lean.config.num_hidden_layers > 1 and len(read) == 1
    _assert_grads_close(ref, lean)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_reentrant_checkpointing(attn):
    ref, lean = _pair("llama", attn)
    for m in (ref, lean):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        m.train()
    batch = _unpadded()
    torch.testing.assert_close(_step(lean, batch), _step(ref, batch), rtol=1e-6, atol=0)
    _assert_grads_close(ref, lean)


def _rel(a, b, floor):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(floor)).item()


@pytest.mark.parametrize("inside", [True, False], ids=["backward-inside", "backward-outside"])
@pytest.mark.parametrize("family", ["bert", "llama", "gpt2"])
def test_autocast_bf16_no_worse_than_unpatched(family, inside):
    """fp32 weights + bf16 autocast: errors vs the fp32 model at most 2x the unpatched model's
    (floored at one bf16 ulp, 2^-8, relative)."""
    ref, lean = _pair(family, "sdpa")
    fp32 = copy.deepcopy(ref)
    batch = fam._batch(family) if family == "bert" else llama._batch()
    l32 = _step(fp32, batch)
    losses = {}
    for name, m in (("ref", ref), ("lean", lean)):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(**batch).loss
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        losses[name] = loss.item()
    ulp = 2.0 ** -8
    assert abs(losses["lean"] - l32.item()) <= 2 * max(abs(losses["ref"] - l32.item()), ulp * abs(l32.item()))
    g32 = dict(fp32.named_parameters())
    median = torch.stack([p.grad.norm() for p in g32.values()]).median()
    lean_params = dict(lean.named_parameters())
    for name, p in ref.named_parameters():
        truth = g32[name].grad
        e_ref = _rel(p.grad, truth, 1e-3 * median)
        e_lean = _rel(lean_params[name].grad, truth, 1e-3 * median)
        assert math.isfinite(e_lean) and e_lean <= 2 * max(e_ref, ulp), (name, e_ref, e_lean)
