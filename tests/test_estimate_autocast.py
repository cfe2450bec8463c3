"""leanact.estimate under torch.autocast (fp32 weights, the forward in bf16 / fp16): predicted vs
measured on the CPU (small BERT, LLaMA, GPT-2 geometries, patched and not), the weight copies it
reports (2 bytes per Linear weight element unpatched, none for the Linears ``leanact.patch`` recasts),
detection of an enclosing autocast, and bad arguments."""
import re

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import leanact  # noqa: E402
from leanact.estimate import estimate, estimate_config, measure  # noqa: E402
from test_estimate import _build, _inputs  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("family,patched,amp", [("bert", False, "bf16"), ("llama", True, "bf16"),
                                                ("gpt2", True, "fp16"), ("bert", True, "bf16")])
def test_predicted_vs_measured_under_autocast(family, patched, amp):
    model = _build(family, layers=2, h=64)
    if patched:
        leanact.patch(model)
    x = _inputs(2, 32)
    pred = estimate(model, x, autocast=amp)
    real = measure(model, x, autocast=amp)
    assert pred.autocast == real.autocast == {"bf16": "bfloat16", "fp16": "float16"}[amp]
    for field in ("peak", "activations"):
        p, m = getattr(pred, field), getattr(real, field)
        assert abs(p - m) / m <= 0.05, (field, p, m)
    assert pred.per_layer == real.per_layer and pred.weight_copies == real.weight_copies
    # (outside the layers, an unpatched BERT head's LayerNorm under autocast keeps its mean and rstd
    # in fp32 on real tensors and in bf16 on fake ones: 256 bytes here)
    assert abs(pred.saved - real.saved) / real.saved <= 0.05


def _layer_linear_elements(model, layer, skip=()):
    return sum(m.weight.numel() for n, m in model.get_submodule(layer).named_modules()
               if type(m) is nn.Linear and n.rsplit(".", 1)[-1] not in skip)


@pytest.mark.slow
def test_weight_copies_counted_and_recast_removes_them():
    """Per layer, recast_weights=False keeps exactly 2 bytes per Linear weight element more than the
    default patch, at every batch size; the unpatched estimate reports every Linear's copy. (The
    lean gated MLP's down projection keeps the fp32 weight whatever the option: no copy to remove.)"""
    plain = _build("llama", layers=2, h=64)
    layer = "model.layers.1"
    elements = _layer_linear_elements(plain, layer, skip=("down_proj",))
    est = estimate(plain, _inputs(2, 32), autocast="bf16")
    every = sum(m.weight.numel() for m in plain.modules() if type(m) is nn.Linear)
    assert est.weight_copies == 2 * every
    assert estimate(plain, _inputs(2, 32)).weight_copies == 0  # no autocast, no copies
    for b in (2, 4):
        kept = {}
        for recast in (False, True):
            m = leanact.patch(_build("llama", layers=2, h=64), recast_weights=recast)
            kept[recast] = estimate(m, _inputs(b, 32), autocast="bf16").per_layer[layer]
        assert kept[False] - kept[True] == 2 * elements, (b, kept)


@pytest.mark.slow
def test_detects_an_enclosing_autocast_and_names_bad_values():
    model = leanact.patch(_build("llama", layers=1, h=64))
    x = _inputs(2, 16)
    explicit = estimate(model, x, autocast=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        detected = estimate(model, x)
        off = estimate(model, x, autocast=False)
    assert detected.autocast == "bfloat16" and detected.per_layer == explicit.per_layer
    assert detected.saved == explicit.saved
    assert off.autocast is None and off.per_layer == estimate(model, x).per_layer
    assert estimate(model, x, autocast="float16").autocast == "float16"
    for bad, error in (("fp32", ValueError), (torch.float32, ValueError), ("fp8", ValueError), (16, TypeError)):
        with pytest.raises(error, match=re.escape(f"estimate(autocast={bad!r}): use \"bf16\" or \"fp16\"")):
            estimate(model, x, autocast=bad)
    with pytest.raises(ValueError, match=re.escape("measure(autocast='fp32')")):
        measure(model, x, autocast="fp32")


@pytest.mark.slow
def test_config_estimate_under_autocast_without_real_memory():
    """A config built on fake tensors under bf16 autocast: unpatched, every Linear keeps its copy;
    patched, no layer keeps one (the head's copy can remain: the estimator's tracker reads the
    logits' storage, so the fused loss materialises them through the head's own Linear)."""
    h, kv, ffn, v = 256, 128, 688, 1000
    cfg = transformers.LlamaConfig(hidden_size=h, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=ffn, vocab_size=v, max_position_embeddings=128)
    x = _inputs(2, 64)
    est = {p: estimate_config(cfg, x, model_class=transformers.LlamaForCausalLM, patch=p, autocast="bf16")
           for p in (False, True)}
    layer = 2 * h * h + 2 * kv * h + 3 * ffn * h  # q, o; k, v; gate, up, down
    assert est[False].weight_copies == 2 * (2 * layer + v * h)
    assert est[True].weight_copies in (0, 2 * v * h)
    assert est[True].autocast == "bfloat16"


def test_plan_counts_weight_copies_under_autocast():
    """leanact.plan measures the layers under autocast: with recast_weights=False each layer keeps
    2 bytes per Linear weight element more than with the default patch (down_proj aside: see
    above); without autocast, the same."""
    from leanact import planner as lplan

    x = _inputs(2, 32)
    kept = {}
    for recast in (False, True):
        m = leanact.patch(_build("llama", layers=2, h=64), recast_weights=recast)
        costs = lplan.plan(m, x, "1GiB", time_model="flops", strategies=["lean"], autocast="bf16").costs
        kept[recast] = [layer.by_strategy["lean"].kept for layer in costs.layers]
        with torch.autocast("cpu", dtype=torch.bfloat16):  # detected
            again = lplan.plan(m, x, "1GiB", time_model="flops", strategies=["lean"]).costs
        assert [layer.by_strategy["lean"].kept for layer in again.layers] == kept[recast]
    elements = _layer_linear_elements(_build("llama", layers=2, h=64), "model.layers.0", skip=("down_proj",))
    assert [a - b for a, b in zip(kept[False], kept[True])] == [2 * elements] * 2
    with pytest.raises(ValueError, match=re.escape("plan(autocast='fp32')")):
        lplan.plan(m, x, "1GiB", autocast="fp32")
