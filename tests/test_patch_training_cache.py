"""A patched model builds no KV cache in training calls (GPT-2 and Llama default to use_cache=True)."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import leanact  # noqa: E402

import _families as F  # noqa: E402
from test_patch_families import _assert_grads_close  # noqa: E402


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_no_cache_in_training_same_gradients(family):
    ref = F.build(family)
    assert ref.config.use_cache
    lean = leanact.patch(copy.deepcopy(ref))
    batch = F.batch(family, "right")
    out_ref, out_lean = ref(**batch), lean(**batch)
    assert out_ref.past_key_values is not None and out_lean.past_key_values is None
    out_ref.loss.backward(), out_lean.loss.backward()
    _assert_grads_close(ref, lean)
    assert any("use_cache=False" in n for n in leanact.summary(lean).notes)


def test_eval_generate_and_explicit_requests_keep_the_cache():
    lean = leanact.patch(F.build("gpt2"))
    batch = F.batch("gpt2")
    assert lean(**batch, use_cache=True).past_key_values is not None  # asked for: kept
    lean.eval()
    assert lean(**batch).past_key_values is not None
    with torch.no_grad():
        lean.train()
        assert lean(**batch).past_key_values is not None  # no autograd: untouched


def test_unpatch_and_copies():
    lean = leanact.patch(F.build("gpt2"))
    twin = copy.deepcopy(lean)
    assert twin(**F.batch("gpt2")).past_key_values is None
    leanact.unpatch(twin)
    assert twin(**F.batch("gpt2")).past_key_values is not None
    assert not twin._forward_pre_hooks
    leanact.unpatch(lean)
    assert lean(**F.batch("gpt2")).past_key_values is not None
