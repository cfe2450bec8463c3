"""Differential matrix, packed sequences: patched vs unpatched with identical weights.

A packed batch is what ``DataCollatorWithFlattening`` and padding-free packing produce: several
sequences concatenated in one row, ``position_ids`` restarting at 0, no ``attention_mask``
(optionally the collator's flash-attention kwargs ``cu_seq_lens_q/k``, ``max_length_q/k``).
transformers' mask builder separates the sequences only when the call has no KV cache; a model
called in training with its default ``use_cache=True`` attends across the restarts. The patched
model must do whatever the unpatched one does, in every mode: training (where leanact drops the
unused training cache elsewhere), eval with grad, ``no_grad``, and an explicit ``use_cache=False``
(the sequences separated on both sides). fp32 rules as in :mod:`test_matrix`.
"""
from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch

import _families as F

import leanact  # noqa: E402

LENGTHS = ((6, 4), (3, 7))  # two packed sequences in each of two rows (F.S = 10 tokens)
MODES = ("train", "eval", "no_grad", "train_no_cache", "train_flash_kwargs")


def _packed_families():
    out = []
    for f in F.FAMILIES:
        if F.kind(f) != "clm":
            continue
        try:
            model = F.build(f, "sdpa")
        except F.Unsupported:
            model = F.build(f, "eager")
        if "position_ids" in inspect.signature(type(model).forward).parameters:
            out.append(f)
    return out


FAMILIES = _packed_families()


def packed_batch(seed: int = 1) -> dict:
    """Two rows of two packed sequences: ids, restarting position_ids, labels with each sequence's
    first token ignored (as the collator does), and the collator's flash kwargs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, F.V, (len(LENGTHS), F.S), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in LENGTHS])
    labels = ids.clone()
    labels[pos == 0] = -100
    lens = [n for row in LENGTHS for n in row]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    flash = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens))
    return dict(input_ids=ids, position_ids=pos, labels=labels), flash


def _run(model, mode):
    batch, flash = packed_batch()
    kw = {"use_cache": False} if mode == "train_no_cache" else flash if mode == "train_flash_kwargs" else {}
    model.zero_grad(set_to_none=True)
    model.train(mode != "eval")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode == "no_grad":
            with torch.no_grad():
                out = model(**batch, **kw)
            return out.loss, out.logits, {}
        out = model(**batch, **kw)
        out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), None, grads


def test_the_families_that_take_position_ids_are_covered():
    assert {"llama", "gpt2", "mistral", "qwen3", "gemma2", "mixtral"} <= set(FAMILIES), FAMILIES


def test_the_modes_differ_where_transformers_separates_sequences():
    """The batch is packed in the sense transformers detects: one call separates, another does not
    (otherwise this file would compare nothing but plain causal attention)."""
    ref = F.build("llama", "sdpa")
    with torch.no_grad():
        batch, _ = packed_batch()
        joined = ref(**batch).loss
        apart = ref(**batch, use_cache=False).loss
    assert abs(joined - apart) > 1e-4 * abs(joined)


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_patched_matches_unpatched(family, mode, attn):
    try:
        ref = F.build(family, attn)
    except F.Unsupported:
        pytest.skip(f"{family} has no {attn} attention")
    lean = leanact.patch(copy.deepcopy(ref))
    l_ref, o_ref, g_ref = _run(ref, mode)
    l_lean, o_lean, g_lean = _run(lean, mode)
    if mode == "no_grad":
        assert torch.equal(o_lean, o_ref) and torch.equal(l_lean, l_ref)
        return
    assert abs(l_lean - l_ref) <= 1e-5 * abs(l_ref), (l_ref, l_lean)
    assert g_ref.keys() == g_lean.keys()
    median = torch.stack([g.norm() for g in g_ref.values()]).median()
    truth = None
    for name, g in g_ref.items():
        if (g_lean[name] - g).norm() <= 1e-5 * max(g.norm(), median * 1e-1):
            continue
        # A gradient that is a cancelling sum (a router bias under softmax: its entries sum to 0) is
        # small against the terms that rounding acts on: judged against float64 instead, the patched
        # model's error at most 4x the unpatched model's own.
        if truth is None:
            truth = _run(copy.deepcopy(ref).double(), mode)[2]
        e_ref, e_lean = (g - truth[name]).norm(), (g_lean[name] - truth[name]).norm()
        assert e_lean <= 4 * e_ref, (name, e_ref.item(), e_lean.item())
