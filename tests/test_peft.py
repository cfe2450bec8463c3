"""PEFT LoRA: patching before or after ``get_peft_model`` keeps the same bytes; LoRA gradients exact."""
import copy

import pytest
import torch

import leanact
from _tiny import tiny_batch, tiny_hf
from leanact.memory import SavedTensorMeter

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

FAMILIES = ("llama", "bert")


def _lora(model, dropout=0.1):
    torch.manual_seed(3)  # init_lora_weights=False: random B, so that A's gradient is not zero
    cfg = peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=dropout, init_lora_weights=False)
    return peft.get_peft_model(model, cfg)


def _kept(model, batch):
    with SavedTensorMeter(model) as meter:
        model(**batch)
    return meter


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_before_or_after_get_peft_model_keeps_the_same_bytes(family):
    batch = tiny_batch()
    plain = _lora(tiny_hf(family))
    before = _lora(leanact.patch(tiny_hf(family)))
    after = leanact.patch(_lora(tiny_hf(family)))
    meters = [_kept(m, batch) for m in (plain, before, after)]
    k_plain, k_before, k_after = (m.total_bytes for m in meters)
    assert k_before == k_after < k_plain
    assert torch._C._len_torch_function_stack() == 0  # (the dropout scope left under the fused loss's window)
    if family == "llama":  # the MLP itself keeps only g and u (fp32, I = 64), its LoRA layers their own
        from leanact.patching.peft_lora import _LoRASwiGLU

        b, s = batch["input_ids"].shape
        for model, meter in zip((before, after), meters[1:]):
            mlp = model.base_model.model.model.layers[0].mlp
            assert isinstance(mlp, _LoRASwiGLU)
            assert meter.by_module()["base_model.model.model.layers.0.mlp"] == 2 * b * s * 64 * 4
    s = leanact.summary(after)
    assert not [row for row in s.left if row[1].endswith("MLP")], s.left  # the SwiGLU MLP seen through LoRA
    lora_dropouts = [r for r in s.replaced if ".lora_dropout." in r[0]]
    assert lora_dropouts and all(r[2] == "leanact.nn.Dropout" for r in lora_dropouts)
    # patch before: PEFT's dropouts, created afterwards, keep a seed through the functional-dropout mode;
    # all but q, k, v's, whose input (the frozen embeddings' normalised output) needs no grad
    assert leanact.summary(before.get_base_model()).functional_dropout.lean_calls == len(lora_dropouts) - 3


@pytest.mark.parametrize("family", FAMILIES)
def test_frozen_base_norms_and_gelus_keep_what_they_keep_without_peft(family):
    batch = tiny_batch()
    lean = _kept(leanact.patch(tiny_hf(family)), batch).by_module()
    with_lora = _kept(leanact.patch(_lora(tiny_hf(family))), batch).by_module()
    compared = 0
    for name, kept in lean.items():  # (norms before the first LoRA layer see no grad: they keep nothing)
        if ("norm" in name.lower() or name.endswith("act_fn")) and f"base_model.model.{name}" in with_lora:
            assert with_lora[f"base_model.model.{name}"] == kept, name
            compared += 1
    assert compared >= 2
    b, s, h = batch["input_ids"].shape + (32,)
    # (BERT: the sub-layer end, dropout + add + LayerNorm as one op, keeps what its LayerNorm kept)
    norm = "bert.encoder.layer.0.output" if family == "bert" else "model.norm"
    row_stat = 4 * b * s  # one fp32 statistic per row
    assert lean[norm] == 4 * b * s * h + row_stat  # output + statistic, not the input


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_gradients_match_unpatched(family, when):
    batch = tiny_batch()
    ref = _lora(tiny_hf(family), dropout=0.0)
    lean = _lora(leanact.patch(tiny_hf(family)), 0.0) if when == "before" else leanact.patch(
        _lora(tiny_hf(family), 0.0))
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), lean.state_dict().values()))
    grads = []
    for m in (ref, lean):
        m(**batch).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and all("lora_" in n for n in grads[0])
    for n, g in grads[0].items():
        assert (grads[1][n] - g).norm() <= 1e-5 * g.norm(), n


@pytest.mark.parametrize("family", FAMILIES)
def test_merge_save_and_unpatch_unchanged(family, tmp_path):
    batch = tiny_batch(padded=False)
    ref = _lora(tiny_hf(family))
    lean = leanact.patch(copy.deepcopy(ref))
    ref.save_pretrained(tmp_path / "ref")
    lean.save_pretrained(tmp_path / "lean")
    from safetensors.torch import load_file

    a, b = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("ref", "lean"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ref_merged, lean_merged = ref.merge_and_unload().eval(), lean.merge_and_unload().eval()
    assert ref_merged.state_dict().keys() == lean_merged.state_dict().keys()
    assert all(torch.equal(x, y) for x, y in zip(ref_merged.state_dict().values(), lean_merged.state_dict().values()))
    with torch.no_grad():
        assert torch.equal(ref_merged(**batch).logits, lean_merged(**batch).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_unpatch_after_peft_keeps_the_adapters(family):
    """Patch, get_peft_model, unpatch: the LoRA layers PEFT put into lean modules stay in the originals."""
    batch = tiny_batch(padded=False)
    ref = _lora(tiny_hf(family)).eval()
    base = leanact.patch(tiny_hf(family))
    model = _lora(base).eval()
    leanact.unpatch(base)
    assert sum(peft.tuners.lora.LoraLayer in type(m).__mro__ for m in model.modules()) == sum(
        peft.tuners.lora.LoraLayer in type(m).__mro__ for m in ref.modules())
    with torch.no_grad():
        assert torch.equal(ref(**batch).logits, model(**batch).logits)


def _fp32_adapters(model, dropout=0.0):
    """PEFT's default on a bf16 model: fp32 adapters (autocast_adapter_dtype=True), random B."""
    torch.manual_seed(3)
    cfg = peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=dropout, init_lora_weights=False)
    return peft.get_peft_model(model.to(torch.bfloat16), cfg)


def _upcasts_off(monkeypatch):
    from leanact.patching import peft_lora

    monkeypatch.setattr(peft_lora, "install_upcasts", lambda model: 0)


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "bf16-autocast"])
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_adapters_keep_the_16bit_input_not_a_copy(family, when, autocast, monkeypatch):
    """fp32 adapters on a bf16 model: PEFT casts each LoRA projection's input to fp32 and lora_A keeps
    that copy; patched, lora_A casts it itself and keeps the bf16 input (the norm's output, kept anyway),
    with the same loss and gradients, bit for bit, as the patched model without it; under autocast too
    (autocast's linear then reads the bf16 input: casting it to fp32 and back changes no bit). A deep
    copy of the patched model behaves the same."""
    batch = tiny_batch()

    def build():
        if when == "after":
            return leanact.patch(_fp32_adapters(tiny_hf(family)))
        return _fp32_adapters(leanact.patch(tiny_hf(family)))

    lean = build()
    layer = next(m for m in lean.modules() if peft_lora_layer(m))
    assert layer.lora_A["default"].weight.dtype == torch.float32
    def step(model):
        model.zero_grad(set_to_none=True)
        with SavedTensorMeter(model) as meter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, meter.total_bytes

    results = [step(lean)]
    twin = step(copy.deepcopy(lean))
    assert torch.equal(twin[0], results[0][0]) and all(torch.equal(twin[1][n], results[0][1][n]) for n in twin[1])
    with monkeypatch.context() as mp:  # (through the first forward: patched before PEFT, it installs them)
        _upcasts_off(mp)
        results.append(step(build()))
    (loss, grads, kept), (loss0, grads0, kept0) = results
    assert layer.cast_input_dtype_enabled is False  # (patched before PEFT: set by the first training forward)
    assert torch.equal(loss, loss0) and all(torch.equal(grads[n], grads0[n]) for n in grads0)
    b, s = batch["input_ids"].shape
    if autocast:  # autocast's linear on the bf16 input itself (PEFT: on a bf16 copy of the fp32 cast)
        assert kept <= kept0
    else:  # q, k, v: PEFT keeps three fp32 copies of their 32-wide input; lora_A at most the bf16 input once
        assert kept <= kept0 - 3 * b * s * 32 * 4 + b * s * 32 * 2, (kept, kept0)


def peft_lora_layer(m):
    from leanact.patching.peft_lora import is_lora_layer

    return is_lora_layer(m)


def test_fp32_adapters_with_dropout_or_unpatched_stay_peft():
    lean = leanact.patch(_fp32_adapters(tiny_hf("llama"), dropout=0.1))
    assert all(getattr(m, "cast_input_dtype_enabled", True) for m in lean.modules())  # dropout on the fp32 copy: PEFT's
    lean = leanact.patch(_fp32_adapters(tiny_hf("llama")))
    assert not all(getattr(m, "cast_input_dtype_enabled", True) for m in lean.modules())
    leanact.unpatch(lean)
    assert all(getattr(m, "cast_input_dtype_enabled", True) for m in lean.modules())
    assert all(type(m.lora_A["default"]) is torch.nn.Linear for m in lean.modules() if peft_lora_layer(m))
