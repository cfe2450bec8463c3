"""leanact.strategies: every strategy gives the plain model's loss and gradients (fp32, tiny HF
BERT / GPT-2 / LLaMA, with and without leanact.patch), replays dropout masks, keeps the bytes it
claims, and applies / removes cleanly."""
import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import leanact  # noqa: E402
from leanact import strategies as S  # noqa: E402
from leanact.memory import SavedTensorMeter  # noqa: E402

from test_patch_families import _assert_grads_close, _batch  # noqa: E402
from test_patch_families import _build as _build_family  # noqa: E402
from test_patch_llama import _batch as _llama_batch  # noqa: E402
from test_patch_llama import _build as _build_llama  # noqa: E402

ALL = [s for s in S.STRATEGIES if s not in S.LOSSY]  # exact ones (lossy: tests/test_plan_lossy.py)


def _model(family, patched, dropout=0.0):
    m = _build_llama("llama") if family == "llama" else _build_family(family, dropout=dropout)
    return (leanact.patch(m) if patched else m).train()


def _data(family):
    return _llama_batch() if family == "llama" else _batch(family)


def _step(m, batch, seed=5):
    torch.manual_seed(seed)
    loss = m(**batch).loss
    loss.backward()
    return loss


def _layer_records(meter, name):
    return [r for r in meter.counted() if r.module == name or r.module.startswith(name + ".")]


# ---- layers ---------------------------------------------------------------------------------------

def test_find_layers_hf_and_custom():
    assert [n for n, _ in S.find_layers(_model("bert", False))] == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    assert [n for n, _ in S.find_layers(_model("gpt2", False))] == ["transformer.h.0", "transformer.h.1"]
    assert [n for n, _ in S.find_layers(_model("llama", False))] == ["model.layers.0", "model.layers.1"]
    stack = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 4), nn.Linear(4, 4)]))
    assert [type(m) for _, m in S.find_layers(stack)] == [nn.Linear] * 3
    with pytest.raises(ValueError, match="no repeated layers found in Sequential"):
        S.find_layers(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))


def test_unknown_strategy_and_bad_plan():
    m = _model("bert", False)
    with pytest.raises(ValueError, match="unknown strategy 'recompute'"):
        S.uniform(m, "recompute")
    with pytest.raises(ValueError, match="one strategy per layer"):
        S.Plan(["bert.encoder.layer.0"], ["full", "lean"])
    with pytest.raises(ValueError, match="does not have"):
        S.Plan(["bert.encoder.layer.7"], ["full"]).apply(m)


# ---- exact gradients ------------------------------------------------------------------------------

_slow = pytest.mark.slow


@pytest.mark.parametrize("family,patched", [("bert", False), ("bert", True), ("llama", True),
                                            pytest.param("gpt2", True, marks=_slow),
                                            pytest.param("gpt2", False, marks=_slow),
                                            pytest.param("llama", False, marks=_slow)])
def test_every_strategy_gives_the_plain_gradients(family, patched):
    """fp32, dropout 0: loss and every parameter gradient of each strategy equal the model's own
    (same model, no strategy) to 1e-6 relative."""
    ref = _model(family, patched)
    batch = _data(family)
    l_ref = _step(ref, batch)
    for name in ALL:
        m = copy.deepcopy(ref)
        m.zero_grad(set_to_none=True)
        plan = S.uniform(m, name, offload_threshold=1024)
        plan.apply(m)
        loss = _step(m, batch)
        torch.testing.assert_close(loss, l_ref, rtol=1e-6, atol=0, msg=name)
        _assert_grads_close(ref, m, tol=1e-6)


def test_recomputed_layers_get_no_kv_cache():
    """An unpatched causal LM with its default use_cache=True hands its DynamicCache to every layer
    (``past_key_values=`` before transformers 5.24, ``cache=`` from 5.24 on). A recomputed layer gets
    none, whatever the argument's name: the replay would append K and V a second time (attention
    over twice the keys: SAC saw another op sequence, full recompute a shape mismatch)."""
    from leanact.strategies.cache import strip_caches

    cache = transformers.DynamicCache()
    args, kwargs, changed = strip_caches((1, cache), {"cache": cache, "kv": cache, "use_cache": True, "x": 2})
    assert changed and args == (1, None) and kwargs == {"cache": None, "kv": None, "use_cache": False, "x": 2}
    assert strip_caches((1,), {"cache": {"mine": 1}}) == ((1,), {"cache": {"mine": 1}}, False)  # not an HF cache

    ref = _model("llama", False)
    assert ref.config.use_cache
    batch = _data("llama")
    l_ref = _step(ref, batch)
    for name in ["full", "selective:attention"]:
        m = copy.deepcopy(ref)
        m.zero_grad(set_to_none=True)
        S.uniform(m, name).apply(m)
        loss = _step(m, batch)
        torch.testing.assert_close(loss, l_ref, rtol=1e-6, atol=0, msg=name)
        _assert_grads_close(ref, m, tol=1e-6)


@pytest.mark.parametrize("patched", [pytest.param(False, marks=_slow), True])
def test_recompute_replays_dropout_masks(patched):
    """Dropout 0.1 (attention and hidden): each recompute strategy gives the loss and gradients of
    the same model without strategy, same seed (checkpoint restores the RNG state)."""
    ref = _model("bert", patched, dropout=0.1)
    batch = _data("bert")
    l_ref = _step(ref, batch)
    l_other = _step(copy.deepcopy(ref), batch, seed=6)
    assert abs(l_other.item() - l_ref.item()) > 1e-4  # the masks matter for this loss
    for name in ["full", "selective:attention", "selective:pointwise", "selective:norms", "offload+recompute"]:
        m = copy.deepcopy(ref)
        m.zero_grad(set_to_none=True)
        S.uniform(m, name, offload_threshold=1024).apply(m)
        torch.testing.assert_close(_step(m, batch), l_ref, rtol=1e-6, atol=0, msg=name)
        _assert_grads_close(ref, m, tol=1e-6)


# ---- bytes kept -----------------------------------------------------------------------------------

def _inputs_of_layers(m, batch):
    """Storage keys of the tensor arguments each layer receives."""
    seen = {}
    hooks = []
    for name, layer in S.find_layers(m):
        def pre(mod, args, kwargs, name=name):
            ts = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            seen[name] = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in ts}
        hooks.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
    return seen, hooks


@pytest.mark.parametrize("patched", [False, True])
def test_full_keeps_exactly_the_layer_inputs(patched):
    m = _model("bert", patched)
    S.uniform(m, "full").apply(m)
    batch = _data("bert")
    seen, hooks = _inputs_of_layers(m, batch)
    meter = SavedTensorMeter(m)
    with meter:
        out = m(**batch)
    for h in hooks:
        h.remove()
    for name, _ in S.find_layers(m):
        recs = [r for r in meter.records if r.module == name and r.excluded is None]
        assert {r.storage_key for r in recs} == set(seen[name]), name  # hidden states (+ mask), nothing else
        inner = [r for r in meter.records if r.module.startswith(name + ".")]
        assert inner == []
    out.loss.backward()


def test_selective_keeps_the_cached_op_outputs():
    """A block x → fc1 → GELU → fc2: selective:pointwise keeps x, fc1's and fc2's outputs (addmm);
    selective:attention keeps the GELU output too; lean keeps x, fc1's output (GELU input) and the
    GELU output (fc2's input)."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x)))

    model = nn.Sequential(nn.Linear(16, 16), nn.ModuleList([Block(), Block()]))

    def run(name):
        m = copy.deepcopy(model)
        S.Plan(["1.0"], [name]).apply(m)
        x = torch.randn(8, 16, requires_grad=True)
        meter = SavedTensorMeter(m)
        with meter:
            y = m[1][0](x)
        y.sum().backward()
        return sum(r.counted_bytes for r in _layer_records(meter, "1.0"))

    f4 = 4  # fp32
    assert run("lean") == f4 * (8 * 16 + 8 * 64 + 8 * 64)
    assert run("selective:pointwise") == f4 * (8 * 16 + 8 * 64 + 8 * 16)
    assert run("selective:attention") == f4 * (8 * 16 + 8 * 64 + 8 * 64 + 8 * 16)
    assert run("full") == f4 * 8 * 16


def test_selective_keeps_less_than_eager_bert():
    """Unpatched BERT (sdpa): selective:pointwise keeps less than the plain layers, full least."""
    kept = {}
    for name in ["lean", "selective:pointwise", "full"]:
        m = _model("bert", False)
        S.uniform(m, name).apply(m)
        meter = SavedTensorMeter(m)
        with meter:
            out = m(**_data("bert"))
        kept[name] = sum(r.counted_bytes for r in _layer_records(meter, "bert.encoder.layer.0"))
        out.loss.backward()
    assert kept["full"] < kept["selective:pointwise"] < kept["lean"], kept


# ---- apply / remove -------------------------------------------------------------------------------

def test_apply_remove_round_trip():
    m = _model("bert", True)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    m.eval()
    batch = _data("bert")
    with torch.no_grad():
        ref = m(**batch).logits
    plan = S.Plan(["bert.encoder.layer.0", "bert.encoder.layer.1"], ["full", "selective:pointwise"])
    plan.apply(m)
    plan.apply(m)  # idempotent: replaces, never wraps twice
    layer = m.bert.encoder.layer[0]
    assert layer.forward.original.__func__ is type(layer).forward
    assert S.applied_plan(m) == plan
    assert list(m.state_dict()) == list(sd) and all(torch.equal(m.state_dict()[k], v) for k, v in sd.items())
    with torch.no_grad():
        assert torch.equal(m(**batch).logits, ref)
    S.remove(m)
    assert "forward" not in layer.__dict__ and S.applied_plan(m) is None
    with torch.no_grad():
        assert torch.equal(m(**batch).logits, ref)
    S.remove(m)  # removing twice is a no-op


def test_plan_then_patch_composes():
    """Patching a model that has a plan (and unpatching) keeps the plan working and exact."""
    ref = _model("gpt2", True)
    batch = _data("gpt2")
    l_ref = _step(ref, batch)
    m = _model("gpt2", False)
    S.uniform(m, "full").apply(m)
    leanact.patch(m)
    torch.testing.assert_close(_step(m, batch), l_ref, rtol=1e-6, atol=0)
    _assert_grads_close(ref, m, tol=1e-6)
    leanact.unpatch(m)
    assert S.applied_plan(m) is not None


def test_explain_without_costs_lists_strategies():
    from rich.console import Console

    m = _model("bert", False)
    plan = S.uniform(m, "offload")
    assert plan.choices == ["offload", "lean"]  # the last layer is never offloaded
    console = Console(record=True, width=200)
    console.print(plan.explain())
    text = console.export_text()
    assert "bert.encoder.layer.0" in text and "offload" in text


def test_every_strategy_with_recipe_modules():
    """Layers built from leanact.nn.fused (RecipeTransform scopes inside): exact under every strategy."""
    from test_offload import MLPBlock, _grads, _stack, _x

    ref = _stack(cls=MLPBlock)
    x = _x()
    out_ref, g_ref = _grads(ref, x)
    for name in ALL:
        m = copy.deepcopy(ref)
        S.uniform(m, name, offload_threshold=1024).apply(m)
        out, g = _grads(m, x)
        assert torch.equal(out, out_ref), name
        for a, b in zip(g, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
