"""leanact.patch's fused loss in Hugging Face language-model heads (leanact.patching.hf_head).

Patched vs unpatched models with identical weights: fp32 loss and every parameter gradient within
1e-5 relative (gradients that are zero in exact arithmetic -- key biases -- are compared against
1e-6 of the median gradient norm, as in tests/test_matrix.py); the logits come back None when the
fused loss consumed them (training mode with labels), and unchanged whenever they are asked for
(no labels, eval mode, ``no_grad``, ``generate``, ``keep_logits``, ``fused_loss=False``). What the
loss keeps is asserted to the byte.
"""
from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

import _families as F
import leanact
from leanact.memory import SavedTensorMeter

FAMILIES = ["gpt2", "llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2", "gemma3", "olmo2", "mixtral",
            "qwen2_moe", "bert", "roberta"]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _pair(family, attn="sdpa", **patch_kw):
    try:
        ref = F.build(family, attn)
    except F.Unsupported:
        ref = F.build(family, "eager")
    return ref, leanact.patch(copy.deepcopy(ref), **patch_kw)


def _step(model, batch, **kw):
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kw)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_close(ref_out, ref_g, out, g):
    assert abs(out.loss.item() - ref_out.loss.item()) <= 1e-5 * abs(ref_out.loss.item())
    assert ref_g.keys() == g.keys()
    median = torch.stack([t.norm() for t in ref_g.values()]).median()
    for name, t in ref_g.items():
        if t.norm() < 1e-6 * median:
            assert (g[name] - t).norm() <= 1e-6 * median, name
        else:
            assert ((g[name] - t).norm() / t.norm()).item() <= 1e-5, name


def _moe(family):
    return dict(output_router_logits=True) if family in ("mixtral", "qwen2_moe") else {}


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_loss_matches_unpatched(family):
    ref, lean = _pair(family)
    batch = F.batch(family, "right")
    a, ga = _step(ref, batch, **_moe(family))
    b, gb = _step(lean, batch, **_moe(family))
    _assert_close(a, ga, b, gb)
    assert b.logits is None and "logits" not in b.keys()
    state = leanact.summary(lean).loss_states[""]
    assert state.fused_calls == 1 and state.fallbacks == {}
    if family in ("mixtral", "qwen2_moe"):  # the router's auxiliary loss is still added by the model
        assert b.aux_loss is not None and torch.allclose(b.aux_loss, a.aux_loss)


def test_summary_reports_the_head():
    _, lean = _pair("llama")
    s = leanact.summary(lean)
    assert s.loss == [("", "lm_head (Linear) + cross_entropy",
                       "leanact fused linear + cross-entropy (training with labels; logits None)")]
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(s.table())
    assert "fused linear + cross-entropy" in console.export_text()
    _, off = _pair("llama", fused_loss=False)
    assert leanact.summary(off).loss == [("", "lm_head (Linear) + cross_entropy", "left: fused_loss=False")]


def test_tied_embeddings():
    for family, cfg_kw in (("gpt2", {}), ("llama", dict(tie_word_embeddings=True))):
        make, cls_name, _ = F._configs()[family]
        cfg = F.no_dropout(make())
        for k, v in cfg_kw.items():
            setattr(cfg, k, v)
        torch.manual_seed(0)
        ref = getattr(F.T, cls_name)(cfg).train()
        lean = leanact.patch(copy.deepcopy(ref))
        assert lean.get_output_embeddings().weight is lean.get_input_embeddings().weight
        batch = F.batch(family)
        a, ga = _step(ref, batch)
        b, gb = _step(lean, batch)
        _assert_close(a, ga, b, gb)
        assert b.logits is None and leanact.summary(lean).loss_states[""].fused_calls == 1


def test_logits_when_asked_for():
    ref, lean = _pair("llama")
    batch = F.batch("llama", "left")
    with torch.no_grad():  # evaluation: bit-identical, logits and loss
        a, b = ref(**batch), lean(**batch)
        assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
    with leanact.keep_logits():
        b = lean(**batch)
    a = ref(**batch)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=0)
    lean.eval(), ref.eval()  # eval mode with autograd (as Liger-Kernel: only training fuses)
    b, a = lean(**batch), ref(**batch)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-6)
    lean.train(), ref.train()
    nolabels = {k: v for k, v in batch.items() if k != "labels"}
    torch.testing.assert_close(lean(**nolabels).logits, ref(**nolabels).logits, rtol=1e-5, atol=1e-6)
    _, off = _pair("llama", fused_loss=False)
    assert off(**batch).logits is not None
    assert leanact.summary(lean).loss_states[""].fused_calls == 0


def test_generate_unchanged():
    ref, lean = _pair("llama")
    ref.eval(), lean.eval()
    ids = F.batch("llama")["input_ids"]
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(ref.generate(ids, **kw), lean.generate(ids, **kw))


def test_gradient_accumulation_path_and_shift_labels():
    """Hugging Face's num_items_in_batch (sum / count) and precomputed shift_labels."""
    ref, lean = _pair("llama")
    batch = F.batch("llama")
    labels = batch.pop("labels")
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    shift[0, :4] = -100
    for kw in (dict(labels=labels, num_items_in_batch=torch.tensor(7)), dict(labels=labels, shift_labels=shift),
               dict(labels=labels, shift_labels=shift, num_items_in_batch=3)):
        a, ga = _step(ref, batch, **kw)
        b, gb = _step(lean, batch, **kw)
        _assert_close(a, ga, b, gb)
    assert leanact.summary(lean).loss_states[""].fused_calls == 3


def test_return_dict_false_drops_the_logits():
    ref, lean = _pair("gpt2")
    batch = F.batch("gpt2")
    a = ref(**batch, return_dict=False, use_cache=False)
    b = lean(**batch, return_dict=False, use_cache=False)
    assert len(b) == len(a) - 1 and torch.allclose(b[0], a[0], rtol=1e-5)


def test_unrecognised_use_of_the_logits_materialises_them():
    """A loss that does more than F.cross_entropy on the logits: the logits are materialised, the
    model's own loss comes back exactly, and the summary names the operation."""
    ref, lean = _pair("llama")

    def loss_function(logits, labels, vocab_size, **kw):
        logp = logits.float().log_softmax(-1)[:, :-1]
        return -logp.gather(-1, labels[:, 1:, None]).mean()

    for m in (ref, lean):
        m.loss_function = loss_function
    batch = F.batch("llama")
    a, ga = _step(ref, batch)
    b, gb = _step(lean, batch)
    _assert_close(a, ga, b, gb)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-6)
    st = leanact.summary(lean).loss_states[""]
    assert st.fused_calls == 0 and "log_softmax" in st.fallbacks


def test_copies_keep_and_unpatch_removes_the_fused_loss():
    ref, lean = _pair("llama")
    batch = F.batch("llama")
    a, ga = _step(ref, batch)
    for copied in (copy.deepcopy(lean), pickle.loads(pickle.dumps(lean))):
        b, gb = _step(copied, batch)
        _assert_close(a, ga, b, gb)
        assert b.logits is None and leanact.summary(copied).loss_states[""].fused_calls == 1
        leanact.unpatch(copied)
        assert not copied._forward_hooks and "forward" not in copied.__dict__
        assert copied(**batch).logits is not None
    assert leanact.summary(lean).loss_states[""].fused_calls == 0  # the copies counted their own calls


def test_loss_type_named_where_hugging_face_falls_back(caplog):
    """GPT-2's ``loss_type`` is None: Hugging Face warns and uses ``ForCausalLM`` (a graph break under
    torch.compile). Patching names that loss, the same function; unpatching (copies too) restores None;
    a value set by the user since is theirs and stays; a model with its own ``loss_type`` keeps it."""
    ref, lean = _pair("gpt2")
    assert ref.loss_type is None and lean.loss_type == "ForCausalLM"
    assert lean.loss_function is ref.loss_function
    for copied in (copy.deepcopy(lean), pickle.loads(pickle.dumps(lean))):
        leanact.unpatch(copied)
        assert copied.loss_type is None
    leanact.unpatch(lean)
    assert lean.loss_type is None
    leanact.patch(lean)
    lean.loss_type = "ForMaskedLM"
    leanact.unpatch(lean)
    assert lean.loss_type == "ForMaskedLM"
    llama = leanact.patch(F.build("llama", "sdpa"))
    assert llama.loss_type == "ForCausalLM"
    assert leanact.summary(llama).loss_states[""].loss_type_was is None


def test_autocast_and_bf16_within_2x_unpatched_error():
    """bf16 weights, and fp32 weights under bf16 autocast: loss and gradients against the fp32 truth
    (same weights) within 2x the unpatched model's own error (Gemma 2: logit soft-capping)."""
    for family in ("gemma2", "llama"):
        ref32, _ = _pair(family)
        batch = F.batch(family, "right")
        truth, gt = _step(ref32, batch)
        for case in ("bf16", "autocast"):
            ref = copy.deepcopy(ref32).to(torch.bfloat16) if case == "bf16" else copy.deepcopy(ref32)
            lean = leanact.patch(copy.deepcopy(ref))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"):
                a, ga = _step(ref, batch)
                b, gb = _step(lean, batch)
            assert b.logits is None

            def e(x, t):
                return (x.float() - t).norm().item() / t.norm().item()

            assert e(b.loss, truth.loss) <= 2 * max(e(a.loss, truth.loss), 2**-9), (family, case)
            head = next(n for n, p in ref.named_parameters() if p is ref.get_output_embeddings().weight)
            for name in (head, "model.norm.weight", "model.embed_tokens.weight"):
                if name in gt:
                    assert e(gb[name], gt[name]) <= 2 * max(e(ga[name], gt[name]), 2**-9), (family, case, name)


def test_kept_bytes_to_the_byte():
    """The fused loss computes its gradients in the forward and keeps them until backward scales
    them: dx (the head input's size and dtype) and dW (the weight's), no logits. The meter files
    them as gradients (every step allocates them; unfused, at the backward's start), not as
    activations: the head's activation bytes are 0. Its input is the final norm's output, which
    the lean norm keeps anyway (one storage). The unfused head keeps its fp32 log-softmax instead:
    over V·4 bytes per token."""
    ref, lean = _pair("llama")
    batch = F.batch("llama", "right")
    n_tokens = batch["input_ids"].numel()
    head = lean.get_output_embeddings().weight
    grads_bytes = n_tokens * head.shape[1] * 4 + head.numel() * head.element_size()
    kept = {}
    for name, m in (("fused", lean), ("unfused", leanact.patch(copy.deepcopy(ref), fused_loss=False))):
        meter = SavedTensorMeter(m, exclude=list(batch.values()))
        with meter:
            out = m(**batch)
        meter.attribute(out.loss)
        kept[name] = meter
        out.loss.backward()
    ops = kept["fused"].by_op()
    assert not any("LinearCrossEntropy" in k for k in ops), ops
    grads = [r for r in kept["fused"].records if r.excluded == "gradient"]
    assert sum(r.storage_nbytes for r in grads) == grads_bytes
    # everything else is kept alike: the difference is exactly the unfused head's own records
    head_ops = {k: v for k, v in kept["unfused"].by_op().items() if k not in ops}
    assert sum(head_ops.values()) >= n_tokens * F.V * 4, head_ops
    assert kept["unfused"].total_bytes - kept["fused"].total_bytes == sum(head_ops.values())


@pytest.mark.slow
def test_estimate_sees_the_fused_loss():
    """leanact.estimate (fake tensors) keeps what the real step keeps: the fused loss saves the same
    bytes on fake and real tensors."""
    from leanact.estimate import measure

    _, lean = _pair("llama")
    batch = F.batch("llama")
    est = leanact.estimate(lean, batch, None)
    real = measure(lean, batch, None)
    off = leanact.estimate(leanact.patch(copy.deepcopy(lean), fused_loss=False), batch, None)
    assert est.saved - real.saved == off.saved - measure(leanact.patch(copy.deepcopy(lean), fused_loss=False),
                                                         batch, None).saved
    assert est.saved < off.saved  # (the fused loss keeps gradients, not activations: no logits)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_error_inside_the_head_leaks_nothing(error):
    """The head's window is closed in ``finally``: after an exception (or a KeyboardInterrupt, which
    torch's always-called forward hooks do not see) raised inside the head's forward, no mode is
    left on the stack, the head's forward is its own and the next call fuses the loss again."""
    _, lean = _pair("llama")
    batch = F.batch("llama")
    head = lean.get_output_embeddings()
    modes = len(torch.overrides._get_current_function_mode_stack())

    capture = {}

    original_open = leanact.patching.hf_head._open

    def armed(module, args, kwargs):  # the head's capture enters the window's mode, then raises
        win = original_open(module, args, kwargs)
        capture["win"] = win
        real = win.capture

        def failing(x):
            real(x)  # enters the window's mode, then fails
            raise error("inside the head")
        head.__dict__["forward"] = failing
        win.capture = failing
        return win

    leanact.patching.hf_head._open = armed
    try:
        with pytest.raises(error, match="inside the head"):
            lean(**batch)
    finally:
        leanact.patching.hf_head._open = original_open
    assert capture["win"].entered
    assert len(torch.overrides._get_current_function_mode_stack()) == modes
    assert "forward" not in head.__dict__ and not lean.__dict__[leanact.patching.hf_head.ATTR].windows
    out, _ = _step(lean, batch)
    assert out.logits is None and torch.isfinite(out.loss)
