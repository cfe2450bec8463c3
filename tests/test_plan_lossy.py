"""Lossy strategies in plans: opt-in only (allow_lossy), and they reach budgets exact plans cannot."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import leanact  # noqa: E402
import leanact.planner as lplan  # noqa: E402
from leanact import strategies as S  # noqa: E402
from leanact.memory import SavedTensorMeter  # noqa: E402

from test_patch_families import _batch  # noqa: E402
from test_patch_families import _build as _build_family  # noqa: E402


def _kept(m, batch):
    meter = SavedTensorMeter(m)
    with meter:
        out = m(**batch)
    out.loss.backward()
    return meter.total_bytes


def test_lossy_strategies_are_listed_and_opt_in():
    assert S.LOSSY == {"lossy:fp8", "lossy:int8"} and S.LOSSY <= set(S.STRATEGIES)
    m = leanact.patch(_build_family("bert")).train()
    with pytest.raises(ValueError, match="allow_lossy=True"):
        lplan.plan(m, _batch("bert"), "1GiB", strategies=["lean", "lossy:fp8"], time_model="flops")


def test_uniform_fp8_keeps_less_and_changes_gradients_slightly():
    torch.manual_seed(0)
    m = leanact.patch(_build_family("bert")).train()
    batch = _batch("bert")
    lean_bytes = _kept(m, batch)
    g_exact = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    S.uniform(m, "lossy:fp8").apply(m)
    fp8_bytes = _kept(m, batch)
    S.remove(m)
    assert fp8_bytes < lean_bytes  # (tiny model: storages under 4096 elements stay as they are)
    diffs = [((p.grad - g_exact[n]).norm() / g_exact[n].norm()).item()
             for n, p in m.named_parameters()
             if n in g_exact and g_exact[n].norm() > 1e-6]  # (key bias: 0 in exact math)
    assert max(diffs) > 0  # lossy: gradients change ...
    assert max(diffs) < 0.1  # ... but only by fp8 rounding of the kept activations


def _bert(hidden=128, seq=64):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, intermediate_size=4 * hidden,
                     vocab_size=200, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = torch.randint(0, 200, (2, seq))
    return leanact.patch(BertForMaskedLM(cfg)).train(), dict(input_ids=ids, labels=ids)


def test_allow_lossy_trades_recompute_for_fp8_storage():
    """At the all-fp8 plan's predicted peak exact plans must recompute; with allow_lossy the
    planner stores in fp8 instead (no recompute time), and the budget is met when measured."""
    from leanact.planner.dp import predict

    m, batch = _bert()
    exact = ["lean", "selective:attention", "selective:pointwise", "selective:norms", "full"]
    costs = lplan.plan(m, batch, "1GiB", strategies=exact + ["lossy:fp8"], allow_lossy=True,
                       time_model="flops").costs
    budget = predict(costs, ["lossy:fp8", "lossy:fp8"])[0]
    exact_plan = lplan.plan(m, batch, budget, costs=costs)  # allow_lossy off: never a lossy choice
    assert not set(exact_plan.choices) & S.LOSSY
    assert predict(costs, exact_plan.choices)[1] > 0  # it must recompute something
    p = lplan.plan(m, batch, budget, allow_lossy=True, costs=costs)
    assert any(c in S.LOSSY for c in p.choices)
    assert predict(costs, p.choices)[1] < predict(costs, exact_plan.choices)[1]
    p.apply(m)
    try:
        assert _kept(m, batch) <= budget
    finally:
        S.remove(m)
