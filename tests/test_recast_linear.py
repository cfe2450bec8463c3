"""A Linear under autocast as one Function (leanact.ops.recast_linear): the path a patched Linear takes
when nothing observes saves.

* The op: float64 gradcheck and gradgradcheck; under CPU autocast (bf16, fp16) outputs and
  gradients bitwise ``nn.Linear``'s (and GPT-2's ``Conv1D``'s: the transposed weight), for 2-D /
  3-D inputs, with and without bias, frozen weights and inputs without grad; what it keeps,
  counted by the meter: the input's cast only where the weight needs a gradient, the fp32 input
  instead where a share is given, never a weight copy. CUDA (cuBLAS) likewise, where present.
* The patched path: bitwise the hooked path (a meter active) on whole models; what autograd keeps
  there, counted on the graph itself (no hooks: a hook would change the path), exactly the
  meter's count; Q, K and V of one norm output share one cast, rebuilt once per backward
  (retain_graph included) and dropped after the last; in-place ops on the output; an in-place
  change of the weight or of the norm output before backward raises; float64 and integer inputs,
  which autocast does not cast, raise as unpatched.
"""
import copy

import pytest
import torch
from torch import nn

import leanact
from leanact.memory import SavedTensorMeter
from leanact.ops.recast_linear import RecastLinear, recast_linear
from leanact.recompute import counters, reset_counters

LOW = [torch.bfloat16, torch.float16]


class _Share:
    """A stand-in for leanact.recompute.casts.SharedCast: the cast, counted."""

    def __init__(self, dtype):
        self.dtype, self.takes = dtype, 0

    def take(self, x):
        self.takes += 1
        return x.to(self.dtype)


def _graph_saved_bytes(root: torch.Tensor, exclude=()) -> int:
    """Bytes of the tensors autograd keeps for ``root``'s backward, read off the graph (no
    saved-tensor hooks): every node's saved tensors, storages counted once, parameters and the
    storages of ``exclude`` (the model's buffers, as the meter) left out."""
    # id -> node, each node held: a node's Python object may be freed with its last reference (torch
    # 2.11 does) and its id reused by another node's, which would then pass for seen
    seen_nodes, storages = {}, {}
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    stack = [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen_nodes:
            continue
        seen_nodes[id(node)] = node
        kept = []
        if hasattr(node, "saved_tensors") and isinstance(node, torch.autograd.function.BackwardCFunction):
            kept = [t for t in node.saved_tensors if t is not None]
        for name in dir(node):
            if name.startswith("_saved_"):
                v = getattr(node, name)
                if isinstance(v, torch.Tensor):
                    kept.append(v)
        for t in kept:
            if isinstance(t, nn.Parameter):
                continue
            s = t.untyped_storage()
            if s.data_ptr() not in skip:
                storages[s.data_ptr()] = s.nbytes()
        stack.extend(n for n, _ in node.next_functions)
    return sum(storages.values())


def test_gradcheck_float64():
    """The Function's math (dX = dY W, dW = dYᵀ X, db = Σ dY; transposed: the (in, out) weight's) in
    float64, with and without a share."""
    torch.manual_seed(0)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    wt = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)  # (in, out): GPT-2's Conv1D
    for share in (None, _Share(torch.float64)):
        for weight, transposed in ((w, False), (wt, True)):
            def fn(x, w, b):
                return RecastLinear.apply(x, w, b, torch.float64, share, transposed)

            assert torch.autograd.gradcheck(fn, (x, weight, b))
            assert torch.autograd.gradgradcheck(fn, (x, weight, b))
            assert torch.autograd.gradcheck(lambda x, w: RecastLinear.apply(x, w, None, torch.float64, share,
                                                                            transposed), (x, weight))
    x3 = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: recast_linear(x, w, b, torch.float64), (x3, w, b))
    assert torch.autograd.gradcheck(lambda x, w, b: recast_linear(x, w, b, torch.float64, transposed=True), (x3, wt, b))


def _op_vs_linear(device, dtype, shape, bias, needs, shared, kind="linear"):
    """Output and gradients bitwise ``nn.Linear``'s (or GPT-2's ``Conv1D``'s) under autocast; kept
    (meter): the input's cast where the weight needs a gradient (with a share: the fp32 input
    instead), no weight copy."""
    torch.manual_seed(0)
    if kind == "linear":
        lin = nn.Linear(16, 24, bias=bias).to(device)
    else:
        from transformers.pytorch_utils import Conv1D

        lin = Conv1D(24, 16).to(device)
        nn.init.normal_(lin.bias)
    lin.weight.requires_grad_(needs != "frozen_weight")
    x = torch.randn(shape, device=device)
    dy = torch.randn(*shape[:-1], 24, device=device).to(dtype)
    share = _Share(dtype) if shared else None
    outs, kept = [], []
    lean = lambda xi: recast_linear(xi, lin.weight, lin.bias, dtype, share, kind == "conv1d")  # noqa: E731
    for fn in (lambda xi: lin(xi), lean):
        xi = x.clone().requires_grad_(needs != "input_no_grad")
        meter = SavedTensorMeter([])
        with meter, torch.autocast(device, dtype=dtype):
            y = fn(xi)
        kept.append(meter.total_bytes)
        wanted = [t for t in (xi, lin.weight, lin.bias) if t is not None and t.requires_grad]
        outs.append([y, *torch.autograd.grad(y, wanted, dy)])
    for a, b in zip(*outs):
        assert a.dtype == b.dtype and torch.equal(a, b)
    needs_x = needs != "frozen_weight"
    assert kept[0] == (x.numel() * 2 if needs_x else 0) + (24 * 16 * 2 if needs != "input_no_grad" else 0)
    assert kept[1] == ((x.numel() * (4 if shared else 2)) if needs_x else 0)
    if shared:
        assert share.takes == (1 if needs_x else 0)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("shape", [(6, 16), (2, 5, 16)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("needs", ["all", "frozen_weight", "input_no_grad"])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_op_bitwise_autocast_linear_and_keeps(dtype, shape, bias, needs, shared, kind):
    if kind == "conv1d" and not bias:
        pytest.skip("transformers' Conv1D always has a bias")
    _op_vs_linear("cpu", dtype, shape, bias, needs, shared, kind)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("shape", [(6, 16), (2, 5, 16), (4, 128, 16)])
@pytest.mark.parametrize("needs", ["all", "frozen_weight"])
def test_op_bitwise_autocast_linear_and_keeps_cuda(dtype, shape, needs):
    """On CUDA (cuBLAS): the same matmul calls as autocast's Linear, bitwise."""
    for bias, kind in ((True, "linear"), (False, "linear"), (True, "conv1d")):
        for shared in (False, True):
            _op_vs_linear("cuda", dtype, shape, bias, needs, shared, kind)


def test_output_in_place_and_weight_modified_raises():
    """The op's output is no view of the Function's (in-place ops on it work, as on F.linear's); an
    in-place change of the weight before backward raises torch's error."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(2, 3, 8)
    grads = []
    for fn in (lambda xi: lin(xi), lambda xi: recast_linear(xi, lin.weight, lin.bias, torch.bfloat16)):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(xi)
            y.mul_(2)
        y.float().sum().backward()
        grads.append((y, xi.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = recast_linear(x.clone().requires_grad_(), lin.weight, lin.bias, torch.bfloat16)
    with torch.no_grad():
        lin.weight.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.float().sum().backward()


def _base_model(family="bert", layers=2):
    """A tiny base model (no head: every saved tensor is in the loss's graph), dropout off."""
    from transformers import BertConfig, BertModel, GPT2Config, GPT2Model, LlamaConfig, LlamaModel

    torch.manual_seed(0)
    if family == "bert":
        cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                         intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return BertModel(cfg, add_pooling_layer=False).train()
    if family == "llama":
        cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2)
        return LlamaModel(cfg).train()
    cfg = GPT2Config(vocab_size=100, n_embd=32, n_layer=layers, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0)
    return GPT2Model(cfg).train()


def _bert(layers=2):
    return _base_model("bert", layers)


def _step(model, ids, observed, retain=False):
    """(loss, grads, bytes kept: the meter's, or the graph's own count) of one autocast step."""
    device = ids.device.type
    meter = SavedTensorMeter(model) if observed else None
    with meter if meter is not None else torch.enable_grad(), torch.autocast(device, dtype=torch.bfloat16):
        loss = model(ids).last_hidden_state.float().pow(2).mean()
    kept = meter.total_bytes if observed else _graph_saved_bytes(loss, exclude=list(model.buffers()))
    loss.backward(retain_graph=retain)
    if retain:
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, kept


def _quiet_and_hooked(device, family="bert"):
    """A patched model's autocast step with nothing observing saves (the Function path) and with a
    meter (hooks on the saved tensors): (loss, grads, bytes kept, counters) of each."""
    base = _base_model(family).to(device)
    ids = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    runs = {}
    for observed in (False, True):
        m = leanact.patch(copy.deepcopy(base))
        reset_counters()
        runs[observed] = (*_step(m, ids, observed), dict(counters()))
    (l0, g0, k0, c0), (l1, g1, k1, c1) = runs[False], runs[True]
    assert torch.equal(l0, l1) and g0.keys() == g1.keys()
    for n in g0:
        if device == "cpu":
            assert torch.equal(g0[n], g1[n]), n
        else:  # SDPA's CUDA backward may accumulate in another order run to run: a few bf16 roundings
            torch.testing.assert_close(g0[n], g1[n], rtol=0, atol=4 * 2**-8 * g1[n].abs().max().item(), msg=n)
    assert k0 == k1 > 0
    assert c0.get("claimed") == c1.get("claimed") and c0.get("recompute:cast") == c1.get("recompute:cast")
    return c0


def test_patched_quiet_path_is_the_hooked_path():
    """The same loss and gradients bitwise, the same bytes kept; per layer Q, K, V read the previous
    norm's output and the FFN's first Linear the attention's: 4 claims, 2 sources, each cast rebuilt
    once per backward."""
    c = _quiet_and_hooked("cpu")
    assert c.get("claimed") == 8 and c.get("recompute:cast") == 4


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_patched_quiet_path_is_the_hooked_path_families(family):
    """As for BERT: LLaMA (q, k, v, gate, up after the two RMSNorms; the fused SwiGLU down projection),
    GPT-2 (Conv1D after ln_1 and ln_2, which flattens its input first): the same gradients bitwise, the
    same bytes, the same claims and rebuilds (GPT-2: 2 sources per layer, each cast rebuilt once)."""
    c = _quiet_and_hooked("cpu", family)
    assert c.get("claimed", 0) > 0
    if family == "gpt2":
        assert c.get("claimed") == c.get("recompute:cast") == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.cuda
def test_patched_quiet_path_is_the_hooked_path_cuda():
    """As on the CPU, with leanact's CUDA kernels (norms in fp32 under CUDA autocast)."""
    c = _quiet_and_hooked("cuda")
    assert c.get("claimed", 0) > 0 and c.get("recompute:cast", 0) > 0


def test_shared_cast_retain_graph_and_release(monkeypatch):
    """Two backwards over one graph (retain_graph): the shared cast is rebuilt once per backward and
    dropped after its last reader each time; the gradients are twice one backward's."""
    from leanact.recompute import recipes

    base = _bert(1)
    ids = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    once = _step(leanact.patch(copy.deepcopy(base)), ids, observed=False)
    shares = []
    real = recipes.cast_share
    monkeypatch.setattr(recipes, "cast_share", lambda *a: shares.append(real(*a)) or shares[-1])
    reset_counters()
    twice = _step(leanact.patch(copy.deepcopy(base)), ids, observed=False, retain=True)
    assert counters().get("recompute:cast") == 2 * 2  # 2 sources, 2 backwards
    live = [s for s in shares if s is not None]
    assert len(live) == 4 and len({id(s) for s in live}) == 2  # Q, K, V share one; the FFN's its own
    assert all(s._cast is None for s in live)
    for n in once[1]:
        assert torch.equal(twice[1][n], 2 * once[1][n]), n


def test_modified_norm_output_raises():
    """The Linear keeps the norm's output itself where it shares its cast: modifying that output in
    place before backward raises, as torch does for any tensor kept for backward."""
    model = leanact.patch(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)))
    kept = {}
    model[0].register_forward_hook(lambda m, inp, out: kept.setdefault("norm", out))
    x = torch.randn(2, 5, 16, requires_grad=True)
    reset_counters()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert counters().get("claimed") == 1 and kept["norm"].dtype == torch.float32
    with torch.no_grad():
        kept["norm"].mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.float().sum().backward()


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_inputs_autocast_does_not_cast_raise_as_unpatched(dtype):
    """Autocast leaves float64 and integer inputs alone, so a Linear of them raises under autocast;
    the patched Linear must not cast them itself and run: it raises the same error."""
    errors = []
    for patched in (False, True):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 4))
        if patched:
            leanact.patch(m)
        x = torch.ones(2, 4, dtype=dtype)
        with pytest.raises(RuntimeError) as info, torch.autocast("cpu", dtype=torch.bfloat16):
            m(x.requires_grad_() if dtype.is_floating_point else x)
        errors.append(str(info.value))
    assert errors[0] == errors[1]
