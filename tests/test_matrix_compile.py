"""Differential matrix, whole-model ``torch.compile``: a compiled patched model against the eager
patched model with the same weights.

* runs (``torch.compile(leanact.patch(model))`` used to recurse without end through the instance
  forward wrappers), in training, with padding, twice (the second call reuses the compiled graphs);
* gives the eager patched model's loss and gradients (fp32 rules of :mod:`test_matrix`;
  the eager patched model is itself checked against the unpatched one there);
* keeps what the eager patched model keeps, under inductor (what ``torch.compile`` uses by
  default), fused head included: every kept floating-point tensor larger than one value per token,
  bytes for bytes, but RoPE's cos and sin, which inductor recomputes. BERT's loss (``nn.CrossEntropyLoss()``
  built in its forward, which Dynamo rewrites into a direct call, without ``__torch_function__``) is
  taken outside its forward while compiling (:mod:`leanact.patching.hf_head_loss_form`), and fused.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import _families as F
from _tol import assert_grads_close, unit_roundoff

import leanact  # noqa: E402
from leanact.memory.meter import SavedTensorMeter  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NUMERICS = ("llama", "gpt2", "bert", "qwen3", "gemma2", "phi3", "mixtral", "t5")
MEMORY = ("llama", "gpt2", "bert")


def _build(family):
    try:
        return F.build(family, "sdpa")
    except F.Unsupported:
        return F.build(family, "eager")


def _step(fn, model, batch):
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = fn(**batch).loss
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", NUMERICS + ("gpt2-own-break",))
def test_compiled_patched_matches_eager_patched(family):
    """``gpt2-own-break``: GPT-2 with ``loss_type`` None again after patching, so that Hugging Face's
    loss-type warning is a graph break of the model's own around the head: the forward wrapper then
    runs eagerly, and the eager head's window is inside the compiled frames."""
    torch._dynamo.reset()
    own_break = family == "gpt2-own-break"
    family = "gpt2" if own_break else family
    lean = leanact.patch(_build(family))
    if own_break:
        lean.loss_type = None
    batch = F.batch(family, "right")
    l_eager, g_eager = _step(lean, lean, batch)
    compiled = torch.compile(lean, backend="aot_eager")
    for _ in range(2):
        l_comp, g_comp = _step(compiled, lean, batch)
        assert abs(l_comp - l_eager) <= 1e-5 * abs(l_eager), (l_eager, l_comp)
        assert_grads_close(g_eager, g_comp)


def _kept(fn, model, batch, tokens):
    """Bytes of the kept floating-point tensors larger than one value per token (per-token statistics
    and the integer labels may be kept in another dtype or layout by the compiled graph)."""
    meter = SavedTensorMeter(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with meter:
            out = fn(**batch)
    total = sum(r.counted_bytes for r in meter.counted()
                if r.dtype.is_floating_point and torch.Size(r.shape).numel() > tokens)
    del out
    meter.release()
    return total


@pytest.mark.parametrize("family", MEMORY)
def test_compiled_patched_keeps_what_eager_keeps(family):
    torch._dynamo.reset()
    model = _build(family)
    lean = leanact.patch(model)
    batch = F.batch(family, "right")
    tokens = batch["input_ids"].numel()
    eager = _kept(lean, lean, batch, tokens)
    compiled = _kept(torch.compile(lean, fullgraph=True), lean, batch, tokens)
    # inductor recomputes RoPE's cos and sin (cheap functions of the positions) instead of keeping them
    rope = getattr(lean.model, "rotary_emb", None) if hasattr(lean, "model") else None
    tables = 0 if rope is None else 2 * batch["input_ids"].shape[1] * lean.config.head_dim * 4
    # BERT's head transform (dense, GELU, LayerNorm, then the fused loss, whose gradient is computed in
    # the forward): inductor keeps one of its two element-wise outputs and recomputes the other
    head = tokens * lean.config.hidden_size * 4 if family == "bert" else 0
    assert eager - tables - head <= compiled <= eager, (eager, compiled)


@pytest.mark.parametrize("family", MEMORY)
def test_compiled_under_autocast_keeps_no_weight_copy(family):
    """Under bf16 autocast, inductor (``fullgraph=True``): no 16-bit copy of a weight is kept (each Linear
    is the custom op ``leanact::recast_linear``, which casts the fp32 weight again in backward; traced,
    the partitioner keeps every cast), GELU's output is kept once (its backward the custom op
    ``leanact::gelu_backward``), and the rest is within what eager keeps plus the 16-bit casts of the
    fp32 norm outputs that feed Linears (two per layer and the head's), which eager recasts from the
    kept outputs (docs/patching.md, "Still different while compiling"). Loss and gradients as eager's,
    within bf16's rounding."""
    torch._dynamo.reset()
    lean = leanact.patch(_build(family))
    batch = F.batch(family, "right")
    tokens = batch["input_ids"].numel()

    def kept(fn):
        meter = SavedTensorMeter(lean)
        with warnings.catch_warnings(), meter, torch.autocast("cpu", dtype=torch.bfloat16):
            warnings.simplefilter("ignore")
            out = fn(**batch)
        records = meter.counted()
        total, copies = sum(r.counted_bytes for r in records), sum(r.counted_bytes for r in records if r.weight_copy)
        del out
        meter.release()
        return total, copies

    compiled = torch.compile(lean, fullgraph=True)
    (eager, eager_copies), (comp, comp_copies) = kept(lean), kept(compiled)
    casts = (2 * lean.config.num_hidden_layers + 1) * tokens * lean.config.hidden_size * 2
    assert eager_copies == comp_copies == 0 and comp <= eager + casts, (eager, comp, casts)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        l_eager, g_eager = _step(lean, lean, batch)
        l_comp, g_comp = _step(compiled, lean, batch)
    # the compiled graph rounds to bf16 at other places than eager (its fused kernels keep fp32 between
    # ops): each such rounding is at most one unit roundoff u; a few per layer on these two layers: 8u
    rel = 8 * unit_roundoff(torch.bfloat16)
    assert abs(l_comp - l_eager) <= rel * abs(l_eager), (l_eager, l_comp)
    median = torch.stack([g.norm() for g in g_eager.values()]).median()
    for name, g in g_eager.items():  # (a key projection's bias: zero in exact arithmetic, noise in bf16)
        assert (g_comp[name] - g).norm() <= rel * max(g.norm(), median), name


#: (family, padding): Gemma 2 (eager attention, softcap) with left padding, whose first rows have no key;
#: GPT-2 (``leanact.patch`` names the loss Hugging Face falls back to, whose warning is the unpatched
#: model's graph break);
#: GPT-OSS (its experts as a custom op; Mixtral's are the other kind)
FULLGRAPH = ([(f, p) for f in ("llama", "qwen3", "mixtral", "bert") for p in ("none", "right")]
             + [("gemma2", "left"), ("gpt2", "right"), ("gpt_oss", "right")])


@pytest.mark.parametrize("family,padding", FULLGRAPH)
def test_fullgraph_training_and_eval(family, padding):
    """``torch.compile(leanact.patch(model), fullgraph=True)`` traces the training call with labels (the
    norms' decision taken when traced, the fused head as the custom op: logits None as eager's are;
    fully masked rows as eager attention gives them, flagged on the device) and the eval call, and gives
    the eager patched model's loss, gradients and logits."""
    torch._dynamo.reset()
    lean = leanact.patch(_build(family))
    batch = F.batch(family, padding)
    compiled = torch.compile(lean, backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager_out, comp_out = lean(**batch), compiled(**batch)
    assert eager_out.logits is None and comp_out.logits is None
    l_eager, g_eager = _step(lean, lean, batch)
    l_comp, g_comp = _step(compiled, lean, batch)
    assert abs(l_comp - l_eager) <= 1e-5 * abs(l_eager), (l_eager, l_comp)
    for name, g in g_eager.items():
        assert (g_comp[name] - g).norm() <= 1e-5 * g.norm() + 1e-7, name
    lean.eval()
    try:
        with torch.no_grad():
            want = lean(**batch).logits
            got = torch.compile(lean, backend="aot_eager", fullgraph=True)(**batch).logits
    finally:
        lean.train()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
