"""leanact.estimate.depth: a deep model's step from the line through two shallow estimates (1 and 2
layers; 3 and 4 with offload), and
plan(maximize=...) searching with it and confirming with the whole model."""
import sys

import pytest
import torch
import transformers

import leanact
from leanact.estimate import depth as depth_mod
from leanact.estimate.depth import alike_layers, depths_for, scaled, shallow
from leanact.estimate.maximize import maximize, step_estimate

maximize_mod = sys.modules["leanact.estimate.maximize"]  # (leanact.estimate is also a function)


def _llama(layers=6, hidden=64, **kw):
    cfg = transformers.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=2 * hidden, vocab_size=128,
                                   max_position_embeddings=1 << 20, **kw)
    with torch.device("meta"):
        return leanact.patch(transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)).train()


def _ids(s=64):
    ids = torch.zeros(1, s, dtype=torch.long)
    return dict(input_ids=ids, labels=ids)


def test_alike_layers():
    model = _llama()
    assert alike_layers(model) is model.model.layers
    assert alike_layers(_llama(layers=5)) is None  # too few to gain anything
    g = transformers.Gemma2Config(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=128, vocab_size=128, head_dim=16)
    assert alike_layers(transformers.Gemma2ForCausalLM(g)) is None  # sliding and global layers alternate
    q = transformers.Qwen2Config(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=128, vocab_size=128, use_sliding_window=True, max_window_layers=3)
    assert alike_layers(transformers.Qwen2ForCausalLM(q)) is None  # windows from layer 3 on
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=6, n_head=4, vocab_size=128,
                                                                bos_token_id=0, eos_token_id=0))
    bert = transformers.BertForMaskedLM(transformers.BertConfig(hidden_size=64, num_hidden_layers=6,
                                                                num_attention_heads=4, intermediate_size=128,
                                                                vocab_size=128))
    assert alike_layers(leanact.patch(gpt2)) is gpt2.transformer.h
    assert alike_layers(leanact.patch(bert)) is bert.bert.encoder.layer
    frozen = _llama()
    frozen.model.layers[5].mlp.up_proj.weight.requires_grad_(False)
    assert alike_layers(frozen) is None


@pytest.mark.parametrize("stop", [RuntimeError, KeyboardInterrupt])
def test_shallow_restores_the_layers(stop):
    model = _llama()
    layers = list(model.model.layers)
    with pytest.raises(stop):
        with shallow(model.model.layers, 2):
            assert list(model.model.layers) == layers[:2]
            raise stop()
    assert list(model.model.layers) == layers
    with pytest.raises(ValueError, match="between 1 and the 6 layers"):
        with shallow(model.model.layers, 7):
            pass


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["lean", "full", "full+tiled_mlp", "offload+recompute+tiled_mlp"])
def test_the_line_is_the_whole_model_where_activations_set_the_peak(strategy):
    """Byte for byte: peak and host memory of the 6-layer step from its shallow ones."""
    model = _llama()
    layers = alike_layers(model)
    for n in (65536,):  # (offload moves tensors of 1 MiB and more)
        line = scaled(lambda: step_estimate(model, _ids(), strategy, "seq", n, device="cuda"), layers,
                      depths_for(strategy))
        whole = step_estimate(model, _ids(), strategy, "seq", n, device="cuda")
        assert (line.peak, line.host) == (whole.peak, whole.host), n
        assert (whole.host > 0) == strategy.startswith("offload")


def _exact(model, strategy, n, limit, multiple=128):
    """The whole model's step fits at ``n`` and not at the next size: ``n`` is the answer."""
    at, after = (step_estimate(model, _ids(), strategy, "seq", k, device="cuda").peak for k in (n, n + multiple))
    return at <= limit < after


@pytest.mark.slow
def test_maximize_with_the_line_is_exact_with_one_whole_model_estimate(monkeypatch):
    """The answer and every candidate's reach are the whole model's (checked on either side), with one
    whole-model estimate (the line was right, to the byte, at its answer) and the estimate returned
    the whole model's."""
    model = _llama(hidden=256)  # (offload moves tensors of 1 MiB and more: from 2,048 tokens on)
    depths = []
    real = step_estimate

    def counted(m, *a, **k):
        depths.append(len(m.model.layers))
        return real(m, *a, **k)

    monkeypatch.setattr(maximize_mod, "step_estimate", counted)
    found = maximize(model, _ids(), 160 << 20, "seq", strategies=["lean", "offload+recompute+tiled_mlp"],
                     device="cuda")
    monkeypatch.undo()
    assert found.strategy == "offload+recompute+tiled_mlp" and found.confirmed == (found.strategy,)
    assert depths.count(6) == 1 and depths[-1] == 6 and set(depths[:-1]) == {1, 2, 3, 4}
    assert found.value > found.by_strategy["lean"] > 0 and found.host > 0
    for strategy, n in found.by_strategy.items():
        assert _exact(model, strategy, n, found.limit), strategy
    assert found.estimate == step_estimate(model, _ids(), found.strategy, "seq", found.value, device="cuda")
    assert len(model.model.layers) == 6


@pytest.mark.slow
def test_a_wrong_line_costs_time_not_the_answer(monkeypatch):
    """When the line is off (here: forced 30% low), the whole-model search still gives the exact answer."""
    model = _llama()
    real = depth_mod.scaled

    def low(estimate_at, layers, depths):
        got = real(estimate_at, layers, depths)
        return depth_mod.Scaled(int(got.peak * 0.7), got.host)

    monkeypatch.setattr(maximize_mod, "scaled", low)
    found = maximize(model, _ids(), 96 << 20, "seq", strategies=["lean"], device="cuda")
    monkeypatch.undo()
    assert found.value > 0 and _exact(model, "lean", found.value, found.limit)
