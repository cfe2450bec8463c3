"""leanact.plan: the DP (against brute force on synthetic costs), budgets met by the measured
kept bytes of planned models, the infeasible-budget error, unequal layers, explain()."""
import copy
import gc
import itertools
import re

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import leanact  # noqa: E402
import leanact.planner as lplan  # noqa: E402
from leanact import strategies as S  # noqa: E402
from leanact.memory import SavedTensorMeter  # noqa: E402
from leanact.planner import InfeasibleBudget, parse_budget  # noqa: E402
from leanact.planner.costs import LayerCosts, ModelCosts, StrategyCost  # noqa: E402
from leanact.planner.dp import _unit, min_peak, predict, solve  # noqa: E402

from test_patch_families import _batch  # noqa: E402
from test_patch_families import _build as _build_family  # noqa: E402


# ---- budgets ----------------------------------------------------------------------------------------

def test_parse_budget():
    assert parse_budget("10GiB") == 10 << 30
    assert parse_budget("512 MiB") == 512 << 20
    assert parse_budget("1.5GB") == 1_500_000_000
    assert parse_budget(4096) == 4096
    assert parse_budget("2e3") == 2000
    with pytest.raises(ValueError, match="cannot read budget '10 parsecs'"):
        parse_budget("10 parsecs")
    with pytest.raises(ValueError, match="positive"):
        parse_budget(0)


@pytest.mark.parametrize("bad, error, message", [
    (float("inf"), ValueError, "not a finite number"), (float("nan"), ValueError, "not a finite number"),
    ("1e400", ValueError, "more than"), ("1.2.3", ValueError, "cannot read budget '1.2.3'"),
    ("inf", ValueError, "cannot read budget 'inf'"), ("0.5", ValueError, "less than one byte"),
    (0.5, ValueError, "less than one byte"), ("1.5", ValueError, "not a whole number"),
    (1.5, ValueError, "not a whole number"), (-1, ValueError, "less than one byte"),
    (True, TypeError, "budget must be"), (None, TypeError, "budget must be")])
def test_parse_budget_is_strict(bad, error, message):
    with pytest.raises(error, match=re.escape(message)) as info:
        parse_budget(bad)
    assert "budget" in str(info.value) and "GiB" in str(info.value) and "\n" not in str(info.value)


def test_leanact_plan_is_the_planner_function():
    assert leanact.plan is lplan.plan and leanact.InfeasibleBudget is lplan.InfeasibleBudget


# ---- the DP on synthetic costs ------------------------------------------------------------------------

STRATS = ["lean", "selective:pointwise", "full"]


def _synthetic(sizes, outside=1000):
    """Layers of hidden size h: lean keeps 10h, pointwise 6h (costs 0.1h s), full keeps the
    input h (costs 0.3h s); lean and full keep the input, lean keeps its output."""
    layers = []
    for i, h in enumerate(sizes):
        by = {"lean": StrategyCost(10 * h, 0, 1.0 * h, True, True),
              "selective:pointwise": StrategyCost(6 * h, 0, 1.1 * h, True, False),
              "full": StrategyCost(h, 0, 1.3 * h, True, False)}
        for c in by.values():
            c.extra_time = c.time - by["lean"].time
        layers.append(LayerCosts(f"l{i}", h, h, by))
    return ModelCosts(layers, outside, "cpu")


def _brute(costs, budget):
    best = None
    for choice in itertools.product(STRATS, repeat=len(costs.layers)):
        peak, extra, _ = predict(costs, list(choice))
        if peak <= budget and (best is None or extra < best[0] - 1e-12):
            best = (extra, list(choice))
    return best


@pytest.mark.parametrize("sizes", [[1000, 1000, 1000, 1000], [3000, 500, 2000, 1000, 100]])
def test_dp_matches_brute_force(sizes):
    costs = _synthetic(sizes)
    allowed = [STRATS] * len(sizes)
    u = _unit(costs, allowed)
    lo = predict(costs, ["full"] * len(sizes))[0]
    hi = predict(costs, ["lean"] * len(sizes))[0]
    for frac in [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0]:
        budget = int(lo + frac * (hi - lo)) + (len(sizes) + 2) * u
        sol = solve(costs, allowed, budget)
        assert sol is not None and sol.peak <= budget
        exact = _brute(costs, budget)
        loose = _brute(costs, budget - (len(sizes) + 2) * u)  # the DP rounds bytes up to units of u
        assert exact[0] - 1e-9 <= sol.extra_time <= loose[0] + 1e-9, (frac, sol, exact, loose)


def test_min_peak_is_tight():
    costs = _synthetic([3000, 500, 2000])
    allowed = [STRATS] * 3
    smallest, choices = min_peak(costs, allowed)
    assert choices == ["full"] * 3
    assert solve(costs, allowed, smallest) is not None
    assert solve(costs, allowed, smallest - _unit(costs, allowed)) is None
    assert smallest >= predict(costs, choices)[0]


def test_shared_boundary_counted_once():
    """lean keeps its output and the next lean layer keeps its input: one storage."""
    costs = _synthetic([1000, 1000])
    peak, _, kept = predict(costs, ["lean", "lean"])
    assert kept == [10_000, 9_000]
    _, _, kept = predict(costs, ["full", "lean"])  # full does not keep its output
    assert kept == [1000, 10_000]


# ---- planning real models -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bert_costs():
    m = leanact.patch(_build_family("bert")).train()
    p = lplan.plan(m, _batch("bert"), "1GiB", time_model="flops")
    return p.costs


def _measured(m, batch):
    meter = SavedTensorMeter(m)
    with meter:
        out = m(**batch)
    split = S.split_kept(meter)
    out.loss.backward()
    return split.device


def test_planned_bert_meets_several_budgets(bert_costs):
    m = leanact.patch(_build_family("bert")).train()
    batch = _batch("bert")
    lean = _measured(m, batch)
    smallest = min_peak(bert_costs, [list(bert_costs.layers[0].by_strategy)] * 2)[0]
    seen = set()
    for budget in [smallest, (smallest + lean) // 2, lean, 2 * lean]:
        p = lplan.plan(m, batch, budget, costs=bert_costs)
        peak = predict(bert_costs, p.choices)[0]
        assert peak <= budget
        p.apply(m)
        kept = _measured(m, batch)
        assert kept <= peak <= budget, (budget, p.choices, kept, peak)
        seen.add(tuple(p.choices))
        S.remove(m)
    assert ("lean", "lean") in seen and len(seen) >= 2  # generous budgets keep the model as it is


def test_infeasible_budget_names_the_smallest(bert_costs):
    m = leanact.patch(_build_family("bert")).train()
    batch = _batch("bert")
    with pytest.raises(InfeasibleBudget) as info:
        lplan.plan(m, batch, 1000, costs=bert_costs)
    msg = str(info.value)
    smallest = info.value.smallest
    assert "smallest feasible budget is" in msg and f"{smallest:,} bytes" in msg
    assert re.search(r"within 1000 B \(1,000 bytes\)", msg)
    p = lplan.plan(m, batch, smallest, costs=bert_costs)  # exactly the smallest works
    assert predict(bert_costs, p.choices)[0] <= smallest
    with pytest.raises(InfeasibleBudget):
        lplan.plan(m, batch, smallest - 4096, costs=bert_costs)


def test_explain_table(bert_costs):
    from rich.console import Console

    m = leanact.patch(_build_family("bert")).train()
    u = _unit(bert_costs, [list(bert_costs.layers[0].by_strategy)] * 2)
    p = lplan.plan(m, _batch("bert"), predict(bert_costs, ["full", "lean"])[0] + 4 * u, costs=bert_costs)
    console = Console(record=True, width=200)
    console.print(p.explain())
    text = console.export_text()
    for word in ["bert.encoder.layer.0", "bert.encoder.layer.1", "budget", "outside the layers", "extra"]:
        assert word in text, word
    assert any(s in text for s in ["full", "selective"])


class FFN(nn.Module):
    def __init__(self, h, f):
        super().__init__()
        self.fc1, self.act, self.fc2, self.ln = nn.Linear(h, f), nn.GELU(), nn.Linear(f, h), nn.LayerNorm(h)

    def forward(self, x):
        return self.ln(x + self.fc2(self.act(self.fc1(x))))


class Unequal(nn.Module):
    def __init__(self, h=32, ffns=(32, 512, 64, 256)):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(FFN(h, f) for f in ffns)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


def test_plan_unequal_layers():
    m = Unequal()
    x = torch.randn(8, 32, 32)
    p = lplan.plan(m, (x,), "1GiB", time_model="flops")
    kept = [layer.by_strategy["lean"].kept for layer in p.costs.layers]
    assert kept[1] > kept[3] > kept[2] > kept[0]  # measured per layer, not one for all
    assert p.choices == ["lean"] * 4
    # a budget that forces recompute: the wide layers go first
    full = predict(p.costs, ["lean", "full", "lean", "full"])[0] + 6 * _unit(p.costs, [["lean", "full"]] * 4)
    q = lplan.plan(m, (x,), full, costs=p.costs)
    assert q.choices[1] != "lean" and q.choices[0] == "lean", q.choices
    ref = copy.deepcopy(m)
    ref(x.requires_grad_(False)).backward()
    q.apply(m)
    meter = SavedTensorMeter(m)
    with meter:
        loss = m(x)
    assert meter.total_bytes <= full
    loss.backward()
    for a, b in zip(ref.parameters(), m.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_offload_is_planned_only_where_asked_and_never_last():
    m = Unequal()
    x = torch.randn(8, 32, 32)
    p = lplan.plan(m, (x,), "1GiB", time_model="flops")
    assert not any("offload" in s for s in p.costs.layers[0].by_strategy)  # CPU default: no offload
    q = lplan.plan(m, (x,), "1GiB", time_model="flops", strategies=["lean", "offload", "full"], offload_threshold=0)
    smallest = min_peak(q.costs, [["lean", "offload", "full"]] * 3 + [["lean", "full"]])[0]
    r = lplan.plan(m, (x,), smallest, costs=q.costs, strategies=["lean", "offload", "full"])
    assert r.choices[-1] != "offload"
    assert any(s == "offload" for s in r.choices), r.choices  # keeps 0 device bytes above the threshold
    assert "offloaded" in _text(r.explain()) and "offloaded" not in _text(p.explain())


def _text(renderable) -> str:
    from rich.console import Console

    console = Console(record=True, width=80)
    console.print(renderable)
    return console.export_text()


# ---- causal LMs with their default config, graphs freed, an applied plan kept, bad arguments -------------

def _causal_lm(family):
    T = transformers
    torch.manual_seed(0)
    if family == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=32,
                                              bos_token_id=1, eos_token_id=2)).train()
    cfg, cls = {"llama": (T.LlamaConfig, T.LlamaForCausalLM), "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM)}[family]
    return cls(cfg(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                   intermediate_size=64, vocab_size=100, max_position_embeddings=32)).train()


def _lm_batch():
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    return dict(input_ids=ids, labels=ids)


@pytest.mark.slow
@pytest.mark.parametrize("family, patched", [("gpt2", True), ("llama", False), ("llama", True), ("qwen2", True)])
def test_plan_causal_lm_with_default_config(family, patched):
    """Default configs have use_cache=True: the planner measures without the KV cache (re-running a
    layer on captured arguments used to append to it: a second backward through a freed graph,
    or silently wrong costs), and leaves the config as it was."""
    m = _causal_lm(family)
    if patched:
        leanact.patch(m)
    assert m.config.use_cache
    batch = _lm_batch()
    p = lplan.plan(m, batch, "1GiB", reps=1)
    assert p.choices == ["lean", "lean"] and m.config.use_cache
    flops = lplan.plan(m, batch, "1GiB", time_model="flops").costs
    off = lplan.plan(m, dict(batch, use_cache=False), "1GiB", time_model="flops").costs
    assert flops == off and m.config.use_cache


def _live_tensors():
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


@pytest.mark.slow
def test_plan_frees_what_it_measured():
    """plan() measures forwards without a backward: it releases their graphs (every call used to
    keep one alive), so repeated calls leave no tensor behind."""
    m = leanact.patch(_build_family("bert")).train()
    batch = _batch("bert")
    lplan.plan(m, batch, "1GiB", time_model="flops")  # lazily built caches exist from here on
    before = _live_tensors()
    for _ in range(3):
        lplan.plan(m, batch, "1GiB", time_model="flops")
    assert _live_tensors() <= before


def test_plan_keeps_an_applied_plan():
    m = Unequal()
    x = torch.randn(8, 32, 32)
    applied = S.Plan(["blocks.1", "blocks.3"], ["full", "full"]).apply(m)
    wrapped = m.blocks[1].forward
    p = lplan.plan(m, (x,), "1GiB", time_model="flops")
    assert S.applied_plan(m) == S.Plan(["blocks.1", "blocks.3"], ["full", "full"]) and applied is m
    assert type(m.blocks[1].forward) is type(wrapped) and "forward" not in m.blocks[0].__dict__
    assert p.costs.layers[1].by_strategy["lean"].kept > p.costs.layers[1].by_strategy["full"].kept  # measured bare
    p.apply(m)
    assert S.applied_plan(m) is p


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(reps=0), ValueError, "plan(reps=0): reps must be an integer >= 1"),
    (dict(reps=2.5), TypeError, "plan(reps=2.5)"),
    (dict(layers=["no.such"]), ValueError, "Unequal has no submodule 'no.such'"),
    (dict(layers="blocks.0"), TypeError, "plan(layers='blocks.0'): give a non-empty list"),
    (dict(layers=[]), TypeError, "plan(layers=[])"),
    (dict(layers=["blocks.0", "blocks.0"]), ValueError, "names a layer twice"),
    (dict(time_model="wall"), ValueError, "plan(time_model='wall')"),
    (dict(offload_threshold=-1), ValueError, "offload_threshold"),
    (dict(strategies=["lean", "fastest"]), ValueError, "unknown strategies ['fastest']"),
    (dict(budget="inf"), ValueError, "cannot read budget 'inf'"),
    (dict(model=None), TypeError, "plan(model=...) must be a torch.nn.Module, got NoneType"),
])
def test_plan_bad_arguments_raise_before_any_work(kwargs, error, message, monkeypatch):
    def no_work(*a, **k):
        raise AssertionError("measured before checking the arguments")

    monkeypatch.setattr(lplan, "measure_costs", no_work)
    args = dict(model=Unequal(), sample_inputs=(torch.randn(2, 4, 32),), budget="1GiB") | kwargs
    with pytest.raises(error, match=re.escape(message)) as info:
        lplan.plan(args.pop("model"), args.pop("sample_inputs"), args.pop("budget"), **args)
    assert "\n" not in str(info.value)
