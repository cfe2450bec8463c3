"""Adversarial uses of leanact.patch's fused LM head (leanact.patching.hf_head): losses that edit the
logits in place, auxiliary losses from the logits, and higher-order autograd through the head.

Patched vs unpatched models with the same weights, compared as tests/test_patch_head.py does (fp32
loss and every gradient within 1e-5 relative). An in-place edit of the logits or of anything derived
from them (a view, an upcast, a slice) makes the placeholders real tensors and the model's own code
runs unfused: loss, gradients and returned logits are the unpatched model's. Out-of-place edits and
auxiliary losses keep the loss fused. Double backward: the patched head's create_graph gradients have
the right values, and differentiating them raises leanact's error naming the ways out, which are
exact to second order; the op itself differentiates twice exactly without ``grad_in_forward``.
"""
from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.nn.functional as Fn

import _families as F
import leanact
from leanact.functional import linear_cross_entropy
from leanact.ops.norms import verdict as LN
from test_patch_head import _assert_close, _pair, _quiet, _step  # noqa: F401 (autouse fixture)

T = 0.3  # a temperature
NEVER = 3  # ids below this are never targets (_families draws tokens in [3, V)): masking them keeps the loss finite


def _iadd(z):
    z += torch.linspace(-1, 1, z.shape[-1])


def _setitem(z):
    z[..., :NEVER] = float("-inf")


def _out(z):
    with torch.no_grad():  # (out= does not take tensors requiring grad otherwise)
        torch.mul(z, 1.7, out=z)


def _data(z):
    z.data = z.data * 1.7


#: in-place edits of the (upcast) logits (what they return is not used)
IN_PLACE = {
    "div_": lambda z: z.div_(T),
    "mul_": lambda z: z.mul_(1.7),
    "add_": lambda z: z.add_(torch.linspace(-1, 1, z.shape[-1])),
    "iadd": _iadd,
    "clamp_": lambda z: z.clamp_(-0.05, 0.05),
    "setitem": _setitem,
    "masked_fill_": lambda z: z.masked_fill_(torch.arange(z.shape[-1]) < NEVER, float("-inf")),
    "index_put_ on a view": lambda z: z.view(-1, z.shape[-1]).index_put_(
        (torch.arange(4), torch.tensor([0, 1, 2, 0])), torch.tensor(float("-inf"))),
    "fill_ on a narrow view": lambda z: z.narrow(-1, 0, NEVER).fill_(float("-inf")),
    "copy_ from a scaled copy": lambda z: z.copy_(z * 0.5),
    "out= under no_grad": _out,
    "data setter": _data,
    "relu inplace=True": lambda z: Fn.relu(z, inplace=True),
}

#: out-of-place edits the fused loss stands for (a new tensor each)
OUT_OF_PLACE = {
    "divide": lambda z: z / T,
    "scale": lambda z: 2.0 * z,
    "softcap": lambda z: torch.tanh(z / 5.0) * 5.0,
}


def _causal_loss(edit, in_place=True, view_first=True, aux=None):
    """A user's ``model.loss_function``: HF's shift of the labels, the upcast logits edited by ``edit``
    (in place, or returning a new tensor). With ``view_first`` their flat view is taken before an
    in-place edit, which must reach it as it reaches a torch view; else after (HF's order)."""
    def loss_function(logits, labels, vocab_size, **kw):
        z = logits.float()
        flat = z.view(-1, vocab_size) if view_first else None
        new = edit(z)
        if not in_place:
            flat = new.view(-1, vocab_size)
        elif flat is None:
            flat = z.view(-1, vocab_size)
        labels = Fn.pad(labels, (0, 1), value=-100)[..., 1:]
        loss = Fn.cross_entropy(flat, labels.reshape(-1))
        return loss if aux is None else loss + aux(logits)
    return loss_function


def _plain(z):
    """No edit: HF's own loss."""


def _custom(family, loss_function):
    ref, lean = _pair(family)
    for m in (ref, lean):
        m.loss_function = loss_function
    return ref, lean


def _compare(ref, lean, batch):
    a, ga = _step(ref, batch)
    b, gb = _step(lean, batch)
    _assert_close(a, ga, b, gb)
    return a, b, leanact.summary(lean).loss_states[""]


def _assert_unfused(a, b, state):
    """The model's own code ran: the logits come back, the unpatched model's, edits included."""
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-6)
    assert state.fused_calls == 0 and state.fallbacks, state


@pytest.mark.parametrize("family,edit", [("llama", e) for e in IN_PLACE] + [
    ("gpt2", e) for e in ("div_", "setitem", "index_put_ on a view", "copy_ from a scaled copy", "data setter",
                          "relu inplace=True")])
def test_in_place_edit_reaches_the_loss(family, edit):
    """Every form on Llama, with the flat view taken before the edit; some on GPT-2, the view after it."""
    ref, lean = _custom(family, _causal_loss(IN_PLACE[edit], view_first=family == "llama"))
    _assert_unfused(*_compare(ref, lean, F.batch(family, "right")))


def test_edit_of_the_head_output_itself_and_a_slice():
    """The logits edited before any upcast (fp32: ``.float()`` is the tensor itself), and a slice of
    them edited after their flat view was taken."""
    def edit_logits(logits, labels, vocab_size, **kw):
        logits.div_(T)
        return _causal_loss(_plain)(logits, labels, vocab_size)

    def edit_slice(logits, labels, vocab_size, **kw):
        flat = logits.view(-1, vocab_size)
        logits[:, :-1].mul_(0.5)
        return Fn.cross_entropy(flat, Fn.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1))

    for fn in (edit_logits, edit_slice):
        _assert_unfused(*_compare(*_custom("llama", fn), F.batch("llama")))


@pytest.mark.parametrize("edit", ["div_", "setitem", "masked_fill_"])
def test_bert_hook_edits_the_prediction_scores_in_place(edit):
    """BERT's masked LM calls CrossEntropyLoss itself: the edit comes from a forward hook on the
    prediction head around the output embedding."""
    ref, lean = _pair("bert")
    for m in (ref, lean):
        m.cls.register_forward_hook(lambda mod, args, out: (IN_PLACE[edit](out), None)[1])
    _assert_unfused(*_compare(ref, lean, F.batch("bert")))


def test_bf16_autocast_upcast_is_a_copy():
    """Under bf16 autocast ``.float()`` copies: an in-place edit of the copy leaves the returned bf16
    logits alone, as in the model with the same patch but its loss unfused (bitwise: same operations)."""
    _, lean = _custom("llama", _causal_loss(IN_PLACE["div_"]))
    ref = leanact.patch(F.build("llama"), fused_loss=False)
    ref.loss_function = lean.loss_function
    batch = F.batch("llama")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, ga = _step(ref, batch)
        b, gb = _step(lean, batch)
    assert b.logits.dtype == torch.bfloat16 and torch.equal(b.logits, a.logits) and torch.equal(b.loss, a.loss)
    assert ga.keys() == gb.keys() and all(torch.equal(gb[k], g) for k, g in ga.items())


@pytest.mark.parametrize("edit", list(OUT_OF_PLACE))
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_out_of_place_edits_stay_fused(family, edit):
    ref, lean = _custom(family, _causal_loss(OUT_OF_PLACE[edit], in_place=False))
    _, b, state = _compare(ref, lean, F.batch(family, "right"))
    assert b.logits is None and state.fused_calls == 1 and state.fallbacks == {}


def test_bert_hook_out_of_place_stays_fused():
    ref, lean = _pair("bert")
    for m in (ref, lean):
        m.cls.register_forward_hook(lambda mod, args, out: out / T)
    _, b, state = _compare(ref, lean, F.batch("bert"))
    assert b.logits is None and state.fused_calls == 1 and state.fallbacks == {}


def _z_loss(logits):
    return 1e-2 * logits.float().logsumexp(-1).pow(2).mean()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_auxiliary_losses_from_the_logits(family):
    """A z-loss after the cross-entropy, one before it, and one from a slice of the logits: exact;
    the first two read the logits without changing them, so the cross-entropy stays fused."""
    def before(logits, labels, vocab_size, **kw):
        aux = _z_loss(logits)
        return _causal_loss(_plain)(logits, labels, vocab_size) + aux

    def from_slice(logits, labels, vocab_size, **kw):
        return _causal_loss(_plain)(logits, labels, vocab_size) + _z_loss(logits[:, :-1])

    for fn, fused in ((_causal_loss(_plain, aux=_z_loss), 1), (before, 1), (from_slice, None)):
        *_, state = _compare(*_custom(family, fn), F.batch(family, "right"))
        assert fused is None or state.fused_calls == fused, state


def test_a_placeholder_held_elsewhere_raises_clearly():
    """A placeholder that cannot be turned into the real logits (here: a weak reference holds it) makes
    the in-place edit raise leanact's error naming the ways out, never a fused loss of unedited logits."""
    held = []

    def loss_function(logits, labels, vocab_size, **kw):
        held.append(weakref.ref(logits))
        return _causal_loss(IN_PLACE["div_"])(logits, labels, vocab_size)

    ref, lean = _custom("llama", loss_function)
    with pytest.raises(RuntimeError, match=r"leanact(.|\n)*fused_loss=False(.|\n)*keep_logits"):
        lean(**F.batch("llama"))
    for m in (ref, lean):  # nothing left over: the next call is exact
        m.loss_function = _causal_loss(IN_PLACE["div_"])
    _assert_unfused(*_compare(ref, lean, F.batch("llama")))


# ---- higher-order autograd --------------------------------------------------------------------

def _untied(family, **patch_kw):
    """``_pair`` with the head's weight its own: GPT-2 and BERT tie it to the input embeddings, whose
    gradient runs through every layer, where differentiating it again meets leanact's other ops
    (they raise leanact's own error: tests/test_adversarial_autograd.py)."""
    make, cls_name, _ = F._configs()[family]
    cfg = F.no_dropout(make())
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    ref = getattr(F.T, cls_name)(cfg).train()
    return ref, leanact.patch(copy.deepcopy(ref), **patch_kw)


def _first_order(model, batch, family):
    """Loss and create_graph gradients of the head's weight and (causal LMs) its input, the final
    hidden states: the terms of a gradient penalty."""
    model.zero_grad(set_to_none=True)
    out = model(**batch, output_hidden_states=True)
    w = model.get_output_embeddings().weight
    wrt = [w] if family == "bert" else [w, out.hidden_states[-1]]
    return out.loss, w, torch.autograd.grad(out.loss, wrt, create_graph=True)


def _second_order(model, batch, family):
    """Gradients of loss + gradient penalty over every parameter, and a head-only Hessian-vector product."""
    loss, w, grads = _first_order(model, batch, family)
    penalty = sum(g.pow(2).sum() for g in grads)
    params = [p for p in model.parameters() if p.requires_grad]
    total = torch.autograd.grad(loss + 0.1 * penalty, params, allow_unused=True, retain_graph=True)
    v = torch.linspace(-1, 1, w.numel()).reshape(w.shape)
    (hvp,) = torch.autograd.grad((grads[0] * v).sum(), w)
    return [t for t in total if t is not None] + [hvp]


def _assert_all_close(got, want):
    """Each within 1e-5 relative, or 1e-5 of the median norm where the exact value is ~0 (key biases)."""
    assert len(got) == len(want)
    median = torch.stack([r.norm() for r in want]).median()
    for g, r in zip(got, want):
        assert (g - r).norm() <= 1e-5 * max(r.norm(), median)


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_double_backward_through_the_fused_head_raises_clearly(family):
    """The first-order create_graph gradients are right; a gradient penalty or a Hessian-vector
    product built on them raises leanact's error (before: a silently constant penalty, a generic error)."""
    ref, lean = _untied(family)
    batch = F.batch(family, "right")
    _, _, want = _first_order(ref, batch, family)
    _, w, got = _first_order(lean, batch, family)
    _assert_all_close([g.detach() for g in got], [g.detach() for g in want])
    assert all(g.requires_grad for g in got)
    match = r"leanact(.|\n)*fused_loss=False(.|\n)*keep_logits(.|\n)*unpatch"
    with pytest.raises(RuntimeError, match=match):
        torch.autograd.grad(sum(g.pow(2).sum() for g in got), [p for p in lean.parameters()], allow_unused=True)
    _, w, got = _first_order(lean, batch, family)
    with pytest.raises(RuntimeError, match=match):
        torch.autograd.grad((got[0] * torch.ones_like(w)).sum(), w)


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_the_ways_out_are_exact_to_second_order(family):
    """``keep_logits()`` and ``fused_loss=False``: gradient penalty and HVP as the unpatched model's."""
    ref, lean = _untied(family)
    batch = F.batch(family, "right")
    want = _second_order(ref, batch, family)
    with leanact.keep_logits():
        _assert_all_close(_second_order(lean, batch, family), want)
    _, off = _untied(family, fused_loss=False)
    _assert_all_close(_second_order(off, batch, family), want)


def _op_data(n=6, h=2, v=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    w = (0.5 * torch.randn(v, h, generator=g, dtype=torch.float64)).requires_grad_()
    b = (0.5 * torch.randn(v, generator=g, dtype=torch.float64)).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    y[1::4] = -100
    return x, w, b, y


@pytest.mark.parametrize("kw", [
    dict(label_smoothing=0.2, softcap=2.0, scale=0.7),
    dict(reduction="none"),
], ids=["mean-smooth-softcap-scale", "none"])
def test_op_differentiates_twice_without_grad_in_forward(kw):
    """float64 gradgradcheck: the create_graph backward is the unfused computation's, with its graph."""
    x, w, b, y = _op_data()

    def fn(x, w, b):
        return linear_cross_entropy(x, w, y, b, **kw, chunk_tokens=4, tile_elements=8)

    assert torch.autograd.gradgradcheck(fn, (x, w, b), fast_mode=True)


def test_op_with_grad_in_forward_raises_on_double_backward():
    """grad_in_forward keeps no inputs for a second differentiation: the create_graph gradients have
    the usual values and differentiating them raises leanact's error, even though the loss's incoming
    gradient (ones) does not require grad (torch's once_differentiable returns constants then)."""
    x, w, b, y = _op_data()
    want = torch.autograd.grad(linear_cross_entropy(x, w, y, b), (x, w, b))
    got = torch.autograd.grad(linear_cross_entropy(x, w, y, b, grad_in_forward=True), (x, w, b), create_graph=True)
    for g, r in zip(got, want):
        torch.testing.assert_close(g.detach(), r, rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match=r"leanact(.|\n)*grad_in_forward=False"):
        torch.autograd.grad(sum(g.pow(2).sum() for g in got), (x, w, b))


def test_a_penalty_on_a_lean_op_raises_under_grad_with_inputs():
    """leanact's other ops (``once_differentiable``, leanact/ops/backward.py): the raising node lies on
    the paths to the op's inputs, so ``torch.autograd.grad(loss + penalty, params)`` raises as a plain
    ``backward()`` does (a node fed only the detached results is skipped there: the penalty's terms
    silently dropped out)."""
    LN.clear_decision_cache()
    m = leanact.nn.RMSNorm(8)
    loss = m(torch.randn(3, 8, requires_grad=True)).pow(2).sum()
    (gw,) = torch.autograd.grad(loss, m.weight, create_graph=True)
    with pytest.raises(RuntimeError, match="leanact's .*has no double backward"):
        torch.autograd.grad(loss + gw.pow(2).sum(), m.weight)
