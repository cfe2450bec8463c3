"""Autocast's 16-bit weight copies replaced by a recast from the fp32 parameter.

* The op (:func:`leanact.ops.weight_recast.linear`): outputs and gradients bit-identical to
  ``F.linear`` under autocast (CPU, and CUDA when present; bf16 and fp16); float64 gradcheck and
  gradgradcheck with autocast off; it keeps exactly the 2-byte copy of the weight fewer; frozen
  weights get no gradient; an in-place change of the weight between forward and backward raises.
* ``leanact.patch`` (``recast_weights``, on by default): a BERT, a LLaMA and a GPT-2 (Conv1D)
  model under autocast keep exactly 2 bytes per wrapped weight element fewer at batch 1 and 2
  (batch-independent), with bit-identical losses and gradients; off, unpatch, copies, checkpointing
  and torch.compile (fallback) behave.
"""
import contextlib
import copy
import gc
import pickle
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leanact.memory import SavedTensorMeter
from leanact.ops.weight_recast import linear

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
LOW = [torch.bfloat16, torch.float16]


def _run(fn, x, w, b, dtype, device):
    x = x.detach().requires_grad_(True)
    meter = SavedTensorMeter([])
    with meter, torch.autocast(device, dtype=dtype):
        y = fn(x, w, b)
    g = torch.linspace(-1, 1, y.numel(), device=device).reshape(y.shape)
    wanted = [t for t in (x, w, b) if t is not None and t.requires_grad]
    grads = torch.autograd.grad(y, wanted, g.to(y.dtype))
    return y, grads, meter.total_bytes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("shape", [(5, 16), (2, 3, 16)])
@pytest.mark.parametrize("bias", [True, False])
def test_op_bit_identical_to_autocast_and_keeps_no_copy(device, dtype, shape, bias):
    torch.manual_seed(0)
    x = torch.randn(*shape, device=device)
    w = nn.Parameter(torch.randn(8, 16, device=device))
    b = nn.Parameter(torch.randn(8, device=device)) if bias else None
    y0, g0, kept0 = _run(F.linear, x, w, b, dtype, device)
    y1, g1, kept1 = _run(linear, x, w, b, dtype, device)
    assert y1.dtype == y0.dtype == dtype and torch.equal(y0, y1)
    assert all(torch.equal(a, c) and a.dtype == c.dtype for a, c in zip(g0, g1))
    n = x.numel() // 16
    assert kept0 == n * 16 * 2 + 8 * 16 * 2  # x's cast + the weight's cast
    assert kept1 == n * 16 * 2  # x's cast only


def test_op_frozen_weight_keeps_nothing_and_gets_no_grad():
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    w = torch.randn(8, 16)  # requires_grad=False (LoRA's frozen base)
    y0, (gx0,), kept0 = _run(F.linear, x, w, None, torch.bfloat16, "cpu")
    y1, (gx1,), kept1 = _run(linear, x, w, None, torch.bfloat16, "cpu")
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
    assert kept0 == 8 * 16 * 2 and kept1 == 0  # the frozen weight's cast (for dX) is all there was
    assert w.grad is None


def test_op_gradcheck_float64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True)

    def f(x, w, b):
        return linear(x, w, b, dtype=torch.float64)  # the recast path (a copy, kept as a recipe)

    assert torch.autograd.gradcheck(f, (x, w, b))
    assert torch.autograd.gradgradcheck(f, (x, w, b))


def test_op_recast_keeps_nothing_in_float64():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = nn.Parameter(torch.randn(5, 4, dtype=torch.float64))
    meter = SavedTensorMeter([])
    with meter:
        y = linear(x, w, None, dtype=torch.float64)
    assert meter.total_bytes == 3 * 4 * 8  # x only; the weight's copy is a recipe
    y.sum().backward()
    assert torch.equal(w.grad, x.detach().sum(0).expand(5, 4))


def test_op_weight_modified_in_place_raises():
    x = torch.randn(4, 16, requires_grad=True)
    w = nn.Parameter(torch.randn(8, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear(x, w)
    with torch.no_grad():
        w.add_(1.0)  # e.g. an optimizer step between forward and backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_op_outside_autocast_is_f_linear():
    x, w = torch.randn(3, 4, requires_grad=True), nn.Parameter(torch.randn(5, 4))
    assert torch.equal(linear(x, w), F.linear(x, w))


# -- patched models -------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
import leanact  # noqa: E402


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=16, vocab_size=50,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg).train()


def _model(family):
    if family == "gpt2":
        return _gpt2()
    from _tiny import tiny_hf

    return tiny_hf(family)


def _batch(b):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 50, (b, 8), generator=g)
    return dict(input_ids=ids, labels=ids)


def _wrapped_weight_elements(model):
    """Weight elements whose autocast copy the recast removes: every Linear / Conv1D but the fused
    LM head and the gated MLPs' down projections (leanact's gated_down keeps their fp32 weight either way)."""
    heads = {id(m.get_output_embeddings()) for m in model.modules() if hasattr(m, "get_output_embeddings")}
    n = 0
    for name, m in model.named_modules():
        if ((type(m) is nn.Linear or type(m).__name__ == "Conv1D") and id(m) not in heads
                and not name.endswith("mlp.down_proj")):
            n += m.weight.numel()
    return n


def _step(model, batch, dtype=torch.bfloat16):
    meter = SavedTensorMeter(model, exclude=list(batch.values()))
    with meter, torch.autocast("cpu", dtype=dtype):
        out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return meter, out.loss.detach(), grads


@pytest.mark.parametrize("family", ["bert", "llama", "gpt2"])
@pytest.mark.parametrize("dtype", LOW)
def test_patched_model_keeps_exactly_two_bytes_per_weight_fewer(family, dtype):
    base = _model(family)
    elements = _wrapped_weight_elements(base)
    assert elements > 0
    for b in (1, 2):  # the difference does not depend on the batch
        kept, result = {}, {}
        for recast in (False, True):
            m = leanact.patch(copy.deepcopy(base), recast_weights=recast)
            meter, loss, grads = _step(m, _batch(b), dtype)
            kept[recast], result[recast] = meter.total_bytes, (loss, grads)
        assert kept[False] - kept[True] == 2 * elements, (b, kept)
        assert torch.equal(result[False][0], result[True][0])
        assert result[False][1].keys() == result[True][1].keys()
        for n, g in result[False][1].items():
            assert torch.equal(g, result[True][1][n]), n


def test_frozen_weights_lora_like():
    """Frozen base weights (LoRA): no weight gradient, and their copies (kept for dX) are gone too."""
    base = _model("llama")
    for p in base.parameters():
        p.requires_grad_(False)
    base.model.embed_tokens.weight.requires_grad_(True)  # something upstream trains
    elements = _wrapped_weight_elements(base)
    kept = {}
    for recast in (False, True):
        m = leanact.patch(copy.deepcopy(base), recast_weights=recast)
        meter, loss, grads = _step(m, _batch(2))
        kept[recast] = meter.total_bytes
        assert list(grads) == ["model.embed_tokens.weight"]
    assert kept[False] - kept[True] == 2 * elements


def test_on_by_default_off_unpatch_and_summary():
    m = leanact.patch(_model("bert"))
    wrapped = [x for x in m.modules() if "forward" in x.__dict__ and type(x) is nn.Linear]
    assert len(wrapped) == 7
    assert any("recast_weights" in n for n in leanact.summary(m).notes)
    leanact.unpatch(m)
    assert not any("forward" in x.__dict__ for x in m.modules())
    m = leanact.patch(_model("bert"), recast_weights=False)
    assert not any("forward" in x.__dict__ for x in m.modules() if type(x) is nn.Linear)
    with pytest.raises(TypeError, match="recast_weights"):
        leanact.patch(m, recast_weights="yes")
    assert leanact.summary(m) is None  # a bad option leaves the model unpatched


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_recasting(how):
    m = leanact.patch(_model("llama"))
    c = copy.deepcopy(m) if how == "deepcopy" else pickle.loads(pickle.dumps(m))
    meter, _, _ = _step(c, _batch(1))
    ref, _, _ = _step(leanact.patch(_model("llama"), recast_weights=False), _batch(1))
    assert ref.total_bytes - meter.total_bytes == 2 * _wrapped_weight_elements(c)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_region_falls_back_and_matches(reentrant):
    """Inside torch.utils.checkpoint the Linear runs as autocast does (non-reentrant: someone else's
    saved-tensor hooks) or, in the reentrant recompute (grad on, no hooks), as leanact's Function:
    gradients equal the unpatched ones bitwise either way."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    lean = leanact.patch(copy.deepcopy(net))
    x = torch.randn(4, 16, requires_grad=True)
    res = []
    for m in (net, lean):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.utils.checkpoint.checkpoint(m, x, use_reentrant=reentrant)
        y.float().sum().backward()
        res.append([p.grad.clone() for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*res))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_matches_unpatched(backend):
    """Compiled, each Linear is the custom op ``leanact::recast_linear`` (saved-tensor hooks are not
    traced), the first one's input without gradient: the same outputs and gradients as the unpatched
    model's, bitwise."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    lean = leanact.patch(copy.deepcopy(net))
    x = torch.randn(4, 16)
    res = []
    for m, run in ((net, net), (lean, torch.compile(lean, backend=backend))):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = run(x)
        y.float().sum().backward()
        res.append((y.detach(), [p.grad.clone() for p in m.parameters()]))
    assert torch.equal(res[0][0], res[1][0])
    assert all(torch.equal(a, b) for a, b in zip(res[0][1], res[1][1]))


# -- the meter ------------------------------------------------------------------------------------

@pytest.mark.parametrize("frozen", [False, True])
def test_meter_reports_weight_copies_apart(frozen):
    """Unpatched under autocast: the meter names each weight copy and sums them apart; patched:
    none. The rest (activations) is the same in both."""
    base = _model("bert")
    if frozen:
        for n, p in base.named_parameters():
            p.requires_grad_("embeddings" in n)
    elements = _wrapped_weight_elements(base)
    hf, _, _ = _step(copy.deepcopy(base), _batch(2))
    off, _, _ = _step(leanact.patch(copy.deepcopy(base), recast_weights=False), _batch(2))
    on, _, _ = _step(leanact.patch(copy.deepcopy(base)), _batch(2))
    head = base.get_output_embeddings().weight.numel()
    assert hf.weight_copy_bytes == 2 * (elements + head)  # HF's head keeps its copy too
    assert off.weight_copy_bytes == 2 * elements  # leanact's fused head keeps the parameter
    assert on.weight_copy_bytes == 0
    assert off.activation_bytes == on.activation_bytes == on.total_bytes
    names = {r.weight_copy for r in off.records if r.weight_copy is not None}
    assert "bert.encoder.layer.0.attention.self.query.weight" in names
    tab = off.table()
    assert "(copy of bert.encoder.layer.0.attention.self.query.weight)" in str(tab.columns[1]._cells)
    assert f"{off.weight_copy_bytes:,}" == tab.columns[4]._cells[-1]


def test_meter_no_weight_copies_without_autocast():
    m = _model("llama")
    meter = SavedTensorMeter(m)
    with meter:
        m(**_batch(1)).loss.backward()
    assert meter.weight_copy_bytes == 0 and meter.activation_bytes == meter.total_bytes > 0


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_layer_cost_under_autocast(family):
    """measure_layer_cost (2 layers - 1 layer) under bf16 autocast: with recast_weights=False one
    layer keeps exactly 2 bytes per Linear weight element more (down_proj aside: see
    _wrapped_weight_elements), all of it reported as weight copies."""
    import transformers

    from leanact.memory import measure_layer_cost

    def build(n, recast):
        torch.manual_seed(0)
        if family == "bert":
            cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=n, num_attention_heads=2,
                                          intermediate_size=64, vocab_size=50, hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0)
            model = transformers.BertModel(cfg, add_pooling_layer=False)
        else:
            cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=n, num_attention_heads=2,
                                           num_key_value_heads=1, intermediate_size=64, vocab_size=50)
            model = transformers.LlamaModel(cfg)
        return leanact.patch(model.train(), recast_weights=recast)

    ids = torch.randint(3, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    cost = {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for recast in (False, True):
            cost[recast] = measure_layer_cost(lambda n: build(n, recast), lambda: (ids,), 8, 2, 32)
    layer = build(1, True)
    elements = _wrapped_weight_elements(layer)
    assert cost[False].bytes - cost[True].bytes == 2 * elements
    assert cost[False].weight_copies == 2 * elements and cost[True].weight_copies == 0


def test_computed_weight_is_left_to_autocast():
    """A weight that is not a parameter (computed in forward; swapped in by ``functional_call``) is
    recast only from a Parameter: recasting a computed fp32 tensor would keep it alive, more than its
    copy, so the Linear runs autocast's own path."""
    torch.manual_seed(0)
    base = nn.Parameter(torch.randn(8, 16))
    net = nn.Sequential(nn.Linear(16, 8))
    lean = leanact.patch(copy.deepcopy(net))
    x = torch.randn(4, 16, requires_grad=True)
    kept = []
    for m in (net, lean):
        meter = SavedTensorMeter(m)
        with meter, torch.autocast("cpu", dtype=torch.bfloat16):
            torch.func.functional_call(m, {"0.weight": 2 * base}, (x,))
        meter.release()
        kept.append(meter.total_bytes)
    assert kept[0] == kept[1] == 4 * 16 * 2 + 8 * 16 * 2  # x's cast and the weight's cast


def test_composes_with_recipes():
    """leanact.nn.LeanMLP (a RecipeTransform scope: fc2's input is a recipe) under autocast, patched:
    the weight copies go, the recipe stays, outputs and gradients bit-identical, dropout included."""
    from leanact import nn as lnn

    torch.manual_seed(0)
    base = nn.Sequential(lnn.LeanMLP(32, 64, "gelu", dropout=0.1)).train()
    lean = leanact.patch(copy.deepcopy(base))
    x = torch.randn(2, 8, 32)
    res = []
    for m in (base, lean):
        meter = SavedTensorMeter(m, exclude=[x])
        torch.manual_seed(1)
        with meter, torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x.requires_grad_(True))
        y.float().pow(2).sum().backward()
        res.append((y.detach(), x.grad.clone(), [p.grad.clone() for p in m.parameters()], meter.total_bytes))
        x.grad = None
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])
    assert all(torch.equal(a, b) for a, b in zip(res[0][2], res[1][2]))
    assert res[0][3] - res[1][3] == 2 * (64 * 32 + 32 * 64)


def test_gated_mlp_stays_lean_with_recast_projections():
    """The recast wraps the gate/up projections' forward; the lean gated MLP still runs (keeps g and
    u only: nothing saved by SiLU or the product), as without autocast."""
    m = leanact.patch(_model("llama"))
    batch = _batch(2)
    meter = SavedTensorMeter(m, exclude=list(batch.values()))
    with meter, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m(**batch).loss
    meter.attribute(loss)
    ops = {r.op for r in meter.records if r.module.endswith("mlp") or ".mlp." in r.module}
    assert "GatedDownFunction" in ops and not {"Silu", "Mul"} & ops, ops


@pytest.mark.parametrize("shape", [(6, 16), (2, 5, 16)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("frozen", [False, True])
def test_patched_linear_is_bitwise_autocast_linear(shape, bias, x_dtype, frozen):
    """A patched Linear under autocast: the output and every gradient bitwise those of ``nn.Linear``
    under autocast; it keeps the fp32 weight (no copy), and the input's cast only where the weight's
    gradient needs it (as autograd's addmm)."""
    from leanact.memory import SavedTensorMeter
    torch.manual_seed(0)
    ref = nn.Linear(16, 24, bias=bias)
    lean = leanact.patch(nn.Sequential(copy.deepcopy(ref)))[0]
    for m in (ref, lean):
        m.weight.requires_grad_(not frozen)
    x = torch.randn(shape).to(x_dtype).requires_grad_()
    dy = torch.randn(*shape[:-1], 24).to(torch.bfloat16)
    outs, kept = [], []
    for m in (ref, lean):
        xi = x.detach().clone().requires_grad_()
        meter = SavedTensorMeter(m)
        with meter, torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(xi)
        kept.append(meter.total_bytes)
        y.backward(dy)
        outs.append([y, xi.grad] + [p.grad for p in m.parameters() if p.requires_grad])
    for a, b in zip(*outs):
        assert a.dtype == b.dtype and torch.equal(a, b)
    cast = x.numel() * 2  # the input's bf16 cast (or the bf16 input itself)
    assert kept[0] == (0 if frozen else cast) + 24 * 16 * 2  # + autocast's weight copy
    assert kept[1] == (0 if frozen else cast)  # the fp32 weight is a parameter: not counted


def test_patched_linear_double_backward():
    """Gradients of gradients through the patched Linear: first order bitwise nn.Linear's under
    autocast; second order within bf16 rounding of it (its backward's matmuls are differentiated in
    another order: a few roundings of 2^-8 each, relative to the largest value)."""
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    lean = leanact.patch(nn.Sequential(copy.deepcopy(ref)))[0]
    x = torch.randn(3, 8)
    grads = []
    for m in (ref, lean):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(xi)
        (gx,) = torch.autograd.grad(y.float().pow(2).sum(), xi, create_graph=True)
        gx.float().pow(2).sum().backward()
        grads.append((gx, xi.grad, m.weight.grad, m.bias.grad))
    assert torch.equal(grads[0][0], grads[1][0])
    for a, b in zip(grads[0][1:], grads[1][1:]):
        torch.testing.assert_close(a, b, rtol=0, atol=4 * 2**-8 * b.abs().max().item())


class _Casts(torch.utils._python_dispatch.TorchDispatchMode):
    """Weak references to every fp32 -> 16-bit ``_to_copy`` of a tensor that needs grad (autocast's casts
    of weights and inputs)."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func.overloadpacket is torch.ops.aten._to_copy and args[0].dtype == torch.float32 and out.dtype in LOW
                and args[0].requires_grad):  # (casts in the graph: not GELU's tables, built once)
            self.refs.append((weakref.ref(out), isinstance(args[0], nn.Parameter)))
        return out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "llama", "gpt2"])
def test_no_cast_kept_by_the_hook_free_path(family, monkeypatch):
    """A plain patched step (nothing observing saves: no meter, no strategy) runs the patched Linears
    (and GPT-2's Conv1D) as one Function each (leanact.ops.recast_linear). After the forward the same fp32 ->
    16-bit casts are alive as with the hooks pushed around each Linear (a meter active: the path the
    byte counts above measure): no weight's, none of a norm's output (BERT, GPT-2: none at all; LLaMA's
    attention keeps its q, k casts), and the loss and gradients are bitwise those of that path."""
    import leanact.patching.weight_recast as patch_recast

    calls = []
    real = patch_recast.recast_linear
    monkeypatch.setattr(patch_recast, "recast_linear", lambda *a: calls.append(1) or real(*a))
    base = _model(family)
    batch = _batch(2)
    results, kept, hooked = [], [], []
    for observed in (False, True):
        calls.clear()
        m = leanact.patch(copy.deepcopy(base))
        meter = SavedTensorMeter(m) if observed else contextlib.nullcontext()
        casts = _Casts()
        with meter, casts, torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(**batch).loss
        gc.collect()
        assert casts.refs
        kept.append(sorted((tuple(r().shape), param) for r, param in casts.refs if r() is not None))
        hooked.append(len(calls))
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    assert kept[0] == kept[1] and not any(param for _, param in kept[0]), kept
    assert hooked[0] > 0 and hooked[1] == 0
    if family in ("bert", "gpt2"):  # (GPT-2: its Conv1D's cast of a reshape of ln_1's / ln_2's output too)
        assert kept[0] == []
    (l0, g0), (l1, g1) = results
    assert torch.equal(l0, l1) and g0.keys() == g1.keys()
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n
    unpatched = copy.deepcopy(base)
    casts = _Casts()
    with casts, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = unpatched(**batch).loss
    gc.collect()
    assert any(param for r, param in casts.refs if r() is not None)  # (the test sees HF keep its weight casts)
