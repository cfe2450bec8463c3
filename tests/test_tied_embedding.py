"""The tied embedding (leanact.ops.embedding): a head's dW handed to the embedding's node, the tied
weight's gradient made once. Exact (float64 gradcheck; fp32/bf16 bit for bit against torch's
embedding under the same head), less memory at the end of the backward, and sound against what a
user can do that leanact does not see: partial backwards, retained graphs, a backward that raises,
double backward, hooks, casts, several embeddings and heads."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leanact.memory.peak import NewStoragePeak
from leanact.ops.cross_entropy import linear_cross_entropy
from leanact.ops.embedding import TiedEmbeddingFunction, hand_off, handed_off, tied_embedding

V, H = 64, 8


class _Head(torch.autograd.Function):
    """A minimal head, ``sum(g ⊙ h Wᵀ)``, that hands its dW off like leanact's heads."""

    @staticmethod
    def forward(ctx, h, w):
        ctx.save_for_backward(h, w)
        return h @ w.t()

    @staticmethod
    def backward(ctx, g):
        h, w = ctx.saved_tensors
        dh = g @ w if ctx.needs_input_grad[0] else None
        dw = g.t() @ h if ctx.needs_input_grad[1] else None
        return dh, hand_off(ctx, 1, dw)


def _case(dtype=torch.float32, n=40, pad=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g).to(dtype).requires_grad_()
    ids = torch.randint(0, V, (2, n), generator=g)
    ids[0, :5] = 7  # repeated tokens
    ids[1, :4] = pad % V if pad is not None else 1
    mix = (torch.randn(H, H, generator=g) / 3).to(dtype)
    tgt = torch.randint(0, V, (2 * n,), generator=g)
    return w, ids, mix, tgt


def _loss(w, ids, mix, tgt, lean, pad=3, head="fused"):
    x = tied_embedding(ids, w, pad) if lean else F.embedding(ids, w, pad)
    h = torch.tanh(x @ mix).reshape(-1, H)
    if head == "fused":
        return linear_cross_entropy(h, w, tgt)
    return (_Head.apply(h, w) * 0.01).square().sum()


@pytest.mark.parametrize("head", ["fused", "minimal"])
def test_gradcheck_float64(head):
    w, ids, mix, tgt = _case(torch.float64, n=6)
    mix = mix.requires_grad_()
    before = handed_off()
    # (no padding_idx: its row's gradient is zeroed by definition, which finite differences do not see)
    assert torch.autograd.gradcheck(lambda w, mix: _loss(w, ids, mix, tgt, True, pad=None, head=head), (w, mix))
    assert handed_off() > before  # (the analytical gradient went through the hand-off)


def test_gradcheck_float64_alone():
    w, ids, _, _ = _case(torch.float64, n=6)
    assert torch.autograd.gradcheck(lambda w: tied_embedding(ids, w).sin().sum(), (w,))
    assert torch.autograd.gradgradcheck(lambda w: tied_embedding(ids, w).sin().sum(), (w,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pad", [3, None, -2])
@pytest.mark.parametrize("head", ["fused", "minimal"])
def test_bitwise_as_torch_embedding(dtype, pad, head):
    """The same sums in the same order: W's gradient is torch's bit for bit (the head's dW, then the
    token rows summed per token by torch's kernel, added once)."""
    w, ids, mix, tgt = _case(dtype, pad=pad)
    grads = []
    for lean in (False, True):
        w.grad = None
        before = handed_off()
        _loss(w, ids, mix, tgt, lean, pad=pad, head=head).backward()
        assert handed_off() - before == int(lean)
        grads.append(w.grad)
    assert torch.equal(grads[0], grads[1])
    if pad is not None:  # padding rows get nothing from the embedding
        x = torch.zeros_like(w)
        x[pad % V] = 1
        w.grad = None
        (_Head.apply(torch.zeros(1, H, dtype=dtype), w).sum() + (tied_embedding(ids, w, pad) * x[ids]).sum()).backward()
        assert torch.equal(w.grad[pad % V], torch.zeros(H, dtype=dtype))


def test_without_a_head_it_is_torchs():
    w, ids, _, _ = _case()
    out = tied_embedding(ids, w, 3)
    torch.testing.assert_close(out, F.embedding(ids, w, 3), rtol=0, atol=0)
    (g1,) = torch.autograd.grad((out.sin()).sum(), w)
    (g2,) = torch.autograd.grad(F.embedding(ids, w, 3).sin().sum(), w)
    assert torch.equal(g1, g2)


def _reference(w, ids, mix, tgt, head="minimal", **kw):
    w2 = w.detach().clone().requires_grad_()
    _loss(w2, ids, mix, tgt, False, head=head).backward()
    return w2.grad


def test_partial_backwards():
    """autograd.grad for W only, for the hidden states only, backward(inputs=...)."""
    w, ids, mix, tgt = _case()
    ref = _reference(w, ids, mix, tgt)
    (gw,) = torch.autograd.grad(_loss(w, ids, mix, tgt, True, head="minimal"), w)
    assert torch.equal(gw, ref)
    mix = mix.clone().requires_grad_()
    before = handed_off()
    (gm,) = torch.autograd.grad(_loss(w, ids, mix, tgt, True, head="minimal"), mix)  # W's gradient not asked
    assert handed_off() == before
    mix2 = mix.detach().clone().requires_grad_()
    (gm2,) = torch.autograd.grad(_loss(w, ids, mix2, tgt, False, head="minimal"), mix2)
    assert torch.equal(gm, gm2)
    w.grad = None
    _loss(w, ids, mix, tgt, True, head="minimal").backward(inputs=[w])
    assert torch.equal(w.grad, ref)


def test_gradient_of_the_lookup_only():
    """autograd.grad of the lookup's output (captured where it enters the embedding's node, which does
    not run): W's gradient is not asked, nothing is lost, the captured gradient is torch's."""
    w, ids, mix, tgt = _case()
    grads = []
    for lean in (False, True):
        x = tied_embedding(ids, w, 3) if lean else F.embedding(ids, w, 3)
        loss = (_Head.apply(torch.tanh(x @ mix).reshape(-1, H), w) * 0.01).square().sum()
        grads.append(torch.autograd.grad(loss, x)[0])
        w.grad = None
        loss2 = (_Head.apply(torch.tanh(x @ mix).reshape(-1, H), w) * 0.01).square().sum()
        loss2.backward()  # (a later backward of the same lookup: W's whole gradient)
        grads.append(w.grad)
    assert torch.equal(grads[0], grads[2]) and torch.equal(grads[1], grads[3])


def test_embedding_that_runs_before_the_head_keeps_its_own():
    """The head's graph made before the lookup (the engine runs the embedding's node first): the head
    sees the node has run in this backward and returns its dW."""
    w, ids, mix, tgt = _case()
    h = torch.randn(5, H)
    w.grad = None
    before = handed_off()
    (_Head.apply(h, w).square().sum() + tied_embedding(ids, w, 3).sin().sum()).backward()
    w2 = w.detach().clone().requires_grad_()
    (_Head.apply(h, w2).square().sum() + F.embedding(ids, w2, 3).sin().sum()).backward()
    assert handed_off() == before
    assert torch.equal(w.grad, w2.grad)


def test_detached_hidden_states():
    w, ids, mix, tgt = _case()
    x = tied_embedding(ids, w, 3)
    before = handed_off()
    w.grad = None
    (_Head.apply((x @ mix).detach().reshape(-1, H), w).square().sum()).backward()
    assert handed_off() == before  # (the embedding's node is not in this backward)
    w2 = w.detach().clone().requires_grad_()
    (_Head.apply((F.embedding(ids, w2, 3) @ mix).detach().reshape(-1, H), w2).square().sum()).backward()
    assert torch.equal(w.grad, w2.grad)


def test_retained_graph_twice_and_a_backward_that_raises():
    w, ids, mix, tgt = _case()
    ref = _reference(w, ids, mix, tgt)
    x = tied_embedding(ids, w, 3)
    x.retain_grad()
    fail = [True]

    def hook(g):
        if fail[0]:
            raise RuntimeError("boom")
        return g

    h = torch.tanh(x @ mix)
    h.register_hook(hook)  # between the head (which hands dW off) and the embedding
    loss = (_Head.apply(h.reshape(-1, H), w) * 0.01).square().sum()
    w.grad = None
    with pytest.raises(RuntimeError, match="boom"):
        loss.backward(retain_graph=True)
    assert w.grad is None
    fail[0] = False
    loss.backward(retain_graph=True)  # what the raising backward handed off is not taken
    assert torch.equal(w.grad, ref)
    loss.backward()
    torch.testing.assert_close(w.grad, 2 * ref, rtol=1e-6, atol=0)


def test_double_backward_hands_nothing_off():
    w, ids, mix, tgt = _case(torch.float64, n=6)
    before = handed_off()
    loss = _loss(w, ids, mix, tgt, True, head="fused")  # (its backward under create_graph: the unfused one)
    (gw,) = torch.autograd.grad(loss, w, create_graph=True)
    assert handed_off() == before
    w2 = w.detach().clone().requires_grad_()
    ref = _loss(w2, ids, mix, tgt, False, head="fused")
    (gw2,) = torch.autograd.grad(ref, w2, create_graph=True)
    torch.testing.assert_close(gw, gw2)


def test_hooks_on_the_weight_see_the_whole_gradient():
    w, ids, mix, tgt = _case()
    ref = _reference(w, ids, mix, tgt)
    seen = {}
    w.register_hook(lambda g: seen.__setitem__("hook", g.clone()))
    w.register_post_accumulate_grad_hook(lambda p: seen.__setitem__("post", p.grad.clone()))
    w.grad = None
    _loss(w, ids, mix, tgt, True, head="minimal").backward()
    assert torch.equal(seen["hook"], ref) and torch.equal(seen["post"], ref)


def test_a_head_reading_a_cast_keeps_its_own():
    """The head reads W.to(bf16): its W edge is the cast's node, not the embedding's, and nothing is
    handed off."""
    w, ids, mix, tgt = _case()
    before = handed_off()
    h = torch.tanh(tied_embedding(ids, w, 3) @ mix).reshape(-1, H)
    (_Head.apply(h.bfloat16(), w.bfloat16()).float().square().sum()).backward()
    assert handed_off() == before


def test_two_lookups_and_two_heads():
    w, ids, mix, tgt = _case()

    def loss(lean):
        emb = tied_embedding if lean else (lambda i, w, p: F.embedding(i, w, p))
        a = torch.tanh(emb(ids, w, 3) @ mix).reshape(-1, H)
        b = torch.tanh(emb(ids.flip(1), w, 3) @ mix).reshape(-1, H)
        return (_Head.apply(a + b, w) * 0.01).square().sum() + linear_cross_entropy(a * b, w, tgt)

    w2 = w.detach().clone().requires_grad_()
    loss(False).backward()
    ref, w.grad = w.grad, None
    before = handed_off()
    loss(True).backward()
    assert handed_off() - before == 2
    # (the four terms are added in another order: fp32 reassociation, a few ulps of the largest term)
    torch.testing.assert_close(w.grad, ref, rtol=0, atol=8 * torch.finfo(torch.float32).eps * ref.abs().max().item())
    del w2


def test_autocast_cpu():
    w, ids, mix, tgt = _case()
    grads = []
    for lean in (False, True):
        w.grad = None
        before = handed_off()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _loss(w, ids, mix, tgt, lean).backward()
        assert handed_off() - before == int(lean)
        grads.append(w.grad)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peak_of_the_backward(dtype):
    """Under a tracker autograd adds the two dense gradients out of place: torch's embedding peaks at
    three V×H tensors at the end of the backward, the hand-off at one (plus token-sized tensors)."""
    v, n, h = 8192, 4, 64
    g = torch.Generator().manual_seed(0)
    w = torch.randn(v, h, generator=g).to(dtype).requires_grad_()
    ids = torch.randint(0, v, (n,), generator=g)
    vh = v * h * w.element_size()
    peaks = []
    for lean in (False, True):
        w.grad = None
        x = tied_embedding(ids, w, None) if lean else F.embedding(ids, w)
        loss = _Head.apply(torch.tanh(x), w).float().square().sum()
        with NewStoragePeak() as p:
            loss.backward()
        peaks.append(p.peak)
    assert peaks[0] >= 3 * vh
    # (the logits' gradients, dh, the token rows and ids: n-sized, here 1/16 of W's size each at most)
    assert vh <= peaks[1] <= vh + 4 * n * v * 4, peaks
    assert peaks[0] - peaks[1] >= 2 * vh - 4 * n * v * 4, peaks


def test_the_function_keeps_only_the_ids():
    from leanact.memory import SavedTensorMeter

    w, ids, _, _ = _case()
    with SavedTensorMeter() as m:
        out = TiedEmbeddingFunction.apply(w, ids, None)
    assert m.total_bytes == ids.numel() * ids.element_size()
    del out


def test_estimate_predicts_the_hand_off():
    """leanact.estimate traces the hand-off as it runs (fake tensors: every token taken as distinct, the
    most rows the embedding's part can have): predicted and measured peaks agree within those rows."""
    transformers = pytest.importorskip("transformers")
    import leanact
    from leanact.estimate import estimate, measure

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=4000, tie_word_embeddings=True,
                                   attn_implementation="sdpa")
    model = leanact.patch(transformers.LlamaForCausalLM(cfg))
    ids = torch.randint(0, 50, (2, 32), generator=torch.Generator().manual_seed(0))  # (repeated tokens)
    x = dict(input_ids=ids, labels=ids)
    before = handed_off()
    pred = estimate(model, x)
    assert handed_off() - before == 1
    real = measure(model, x)
    assert handed_off() - before >= 2
    assert 0 <= pred.peak - real.peak <= (ids.numel() + 1) * 64 * 4 + 4096, (pred.peak, real.peak)



@pytest.mark.parametrize("family", ["gpt2", "gemma", "opt", "falcon", "whisper", "paligemma"])
def test_tied_families_of_the_matrix_hand_off(family):
    """These tied families' training calls hand the head's gradient to the embedding, so the
    differential matrix (tests/test_matrix.py: checkpointing reentrant or not, autocast, eval, no_grad,
    copies; tests/test_matrix_compile.py) checks the hand-off against the unpatched models."""
    pytest.importorskip("transformers")
    import _families

    import leanact

    model = leanact.patch(_families.build(family))
    model.train()
    before = handed_off()
    model(**_families.batch(family)).loss.backward()
    assert handed_off() - before == 1
