"""BERT-style losses (``nn.CrossEntropyLoss()`` built in forward) fused while compiling
(leanact.patching.hf_head_loss_form).

The class's forward is read; only the exact form is taken outside the forward (anything else keeps
the model's own loss, exact and unfused). The compiled call with positional labels and with
``return_dict=False`` gives eager's loss and output structure.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import transformers as T
from torch import nn
from torch.nn import CrossEntropyLoss

import _families as F
import leanact
from leanact.patching.hf_head_loss_form import loss_form

pytestmark = pytest.mark.timeout(300)


class _Out(dict):
    pass


class Exact:
    def forward(self, input_ids, labels=None):
        scores = self.head(input_ids)
        loss = None
        if labels is not None:
            f = CrossEntropyLoss()
            loss = f(scores.view(-1, self.config.vocab_size), labels.view(-1))
        return _Out(loss=loss, logits=scores)


class Moved:
    def forward(self, input_ids, labels=None):
        scores = self.head(input_ids)
        loss = None
        if labels is not None:
            labels = labels.to(scores.device)
            f = nn.CrossEntropyLoss()
            loss = f(scores.view(-1, self.config.vocab_size), labels.view(-1))
        return _Out(loss=loss, logits=scores)


class Smoothed:
    def forward(self, input_ids, labels=None):
        scores = self.head(input_ids)
        loss = None
        if labels is not None:
            f = CrossEntropyLoss(label_smoothing=0.1)
            loss = f(scores.view(-1, self.config.vocab_size), labels.view(-1))
        return _Out(loss=loss, logits=scores)


class LabelsElsewhere:
    def forward(self, input_ids, labels=None):
        scores = self.head(input_ids) + (labels is None)
        loss = None
        if labels is not None:
            f = CrossEntropyLoss()
            loss = f(scores.view(-1, self.config.vocab_size), labels.view(-1))
        return _Out(loss=loss, logits=scores)


class Scaled:
    def forward(self, input_ids, labels=None):
        scores = self.head(input_ids)
        loss = None
        if labels is not None:
            f = CrossEntropyLoss()
            loss = f(scores.view(-1, self.config.vocab_size), labels.view(-1))
        return _Out(loss=loss * 2 if loss is not None else None, logits=scores)


class LogitsReassigned:
    def forward(self, input_ids, labels=None):
        scores = self.head(input_ids)
        loss = None
        if labels is not None:
            f = CrossEntropyLoss()
            loss = f(scores.view(-1, self.config.vocab_size), labels.view(-1))
        scores = scores.float()
        return _Out(loss=loss, logits=scores)


class OtherLoss:
    def forward(self, input_ids, labels=None):
        scores = self.head(input_ids)
        loss = None
        if labels is not None:
            f = nn.MSELoss()
            loss = f(scores.view(-1, self.config.vocab_size), labels.view(-1))
        return _Out(loss=loss, logits=scores)


def test_form_read_from_the_source():
    assert loss_form(Exact) == "as_is" and loss_form(Moved) == "moved"
    for cls in (Smoothed, LabelsElsewhere, Scaled, LogitsReassigned, OtherLoss):
        assert loss_form(cls) is None, cls.__name__
    assert loss_form(T.BertForMaskedLM) == "as_is" and loss_form(T.RobertaForMaskedLM) == "moved"
    assert loss_form(T.AlbertForMaskedLM) == "as_is" and loss_form(T.XLMRobertaForMaskedLM) == "moved"
    for cls in (T.LlamaForCausalLM, T.GPT2LMHeadModel, T.BertForPreTraining, T.DebertaV2ForMaskedLM,
                T.DistilBertForMaskedLM):
        assert loss_form(cls) is None, cls.__name__


def _position(cls) -> int:
    import inspect
    return list(inspect.signature(cls.forward).parameters).index("labels") - 1


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "roberta", "albert"])
def test_compiled_positional_labels_and_tuples(family):
    """Labels passed by position, ``return_dict`` True and False: the compiled call's loss and output
    fields are eager's (logits dropped where the loss was fused, in both)."""
    torch._dynamo.reset()
    lean = leanact.patch(F.build(family, "sdpa"))
    batch = F.batch(family, "right")
    labels = batch.pop("labels")
    i = _position(type(lean))
    args = [None] * (i + 1)
    args[0], args[1], args[i] = batch["input_ids"], batch["attention_mask"], labels
    compiled = torch.compile(lean, backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for return_dict in (True, False):
            want = lean(*args, return_dict=return_dict)
            got = compiled(*args, return_dict=return_dict)
            if return_dict:
                assert want.logits is None and got.logits is None and list(got.keys()) == list(want.keys())
                want, got = want.loss, got.loss
            else:
                assert isinstance(got, tuple) and len(got) == len(want)
                want, got = want[0], got[0]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


@pytest.mark.slow
def test_a_forward_changed_since_patching_keeps_its_own_loss():
    """The form holds for the forward that was read: a class ``forward`` replaced after patching, or a
    forward set on the instance before patching (either may do anything with ``labels``), keeps the
    model's own loss under compile: here twice the cross-entropy, as eager gives it."""
    base = type(F.build("bert", "sdpa"))

    def doubled(self, *args, **kwargs):
        out = base.forward(self, *args, **kwargs)
        if out.loss is not None:
            out["loss"] = out.loss * 2
            object.__setattr__(out, "loss", out["loss"])
        return out

    batch = F.batch("bert", "right")
    for where in ("class", "instance"):
        torch._dynamo.reset()
        model = F.build("bert", "sdpa")
        if where == "class":
            model.__class__ = type("BertLater", (base,), {})
            lean = leanact.patch(model)
            type(lean).forward = doubled
        else:
            model.forward = doubled.__get__(model)
            lean = leanact.patch(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = lean(**batch).loss
            got = torch.compile(lean, backend="aot_eager")(**batch).loss
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        plain = F.build("bert", "sdpa")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert abs(want / plain(**batch).loss - 2) < 1e-5, where
