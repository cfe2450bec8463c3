"""Recipes instead of cheap producers' outputs: exactness, saved bytes, recompute count, safety.

Equality: LayerNorm, activations, SwiGLU and dropout run torch's own kernels in forward, backward
and rebuild, so outputs and gradients are bitwise equal to the plain torch composition (fp32 and
bf16). RMSNorm's backward evaluates the standard formulas in fp32 while F.rms_norm differentiates
its CPU composite op by op: compared with a tolerance there (outputs still bitwise).
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leanact.memory import SavedTensorMeter, saved_bytes
from leanact.nn.fused import LayerNormLinears, LeanMLP, RecipeDropout, RecipeGELU, RecipeLayerNorm
from leanact.ops.dropout.function import dropout as seeded_dropout
from leanact.ops.dropout.function import dropout_seeded
from leanact.recompute import (RecipeTransform, cached_bytes, counters, live_recipes, producers as P, reset_counters,
                               scope)

B, S, H = 2, 8, 16  # tokens B*S = 16


def nbytes(*shape, dtype=torch.float32):
    n = torch.empty((), dtype=dtype).element_size()
    for d in shape:
        n *= d
    return n


def lin(x, w):
    return F.linear(x, w)


# --- gradcheck (float64) ------------------------------------------------------------------------

def _producers():
    """(name, fn(*inputs) -> tensor, inputs) for each producer, float64."""
    g = torch.Generator().manual_seed(0)

    def t(*shape, away_from_zero=False):
        v = torch.randn(*shape, dtype=torch.float64, generator=g)
        if away_from_zero:
            v = v + 0.2 * v.sign()
        return v.requires_grad_()

    w, b = 1 + 0.3 * t(5), t(5)
    return [
        ("layer_norm", lambda x, w, b: P.layer_norm(x, 5, w, b), (t(3, 5), w, b)),
        ("layer_norm_noaffine", lambda x: P.layer_norm(x, 5), (t(3, 5),)),
        ("rms_norm", lambda x, w: P.rms_norm(x, 5, w, 1e-6), (t(3, 5), w)),
        ("gelu", lambda x: P.gelu(x), (t(3, 5),)),
        ("gelu_tanh", lambda x: P.gelu(x, "tanh"), (t(3, 5),)),
        ("silu", P.silu, (t(3, 5),)),
        ("relu", P.relu, (t(3, 5, away_from_zero=True),)),
        ("swiglu_fused", P.swiglu, (t(3, 10),)),
        ("swiglu_two", P.swiglu, (t(3, 5), t(3, 5))),
        ("dropout", lambda x: P.dropout(x, 0.3, seed=7), (t(3, 5),)),
        ("gelu_dropout", lambda x: P.dropout(P.gelu(x), 0.3, seed=7), (t(3, 5),)),
        ("ln_gelu_dropout", lambda x: P.dropout(P.gelu(P.layer_norm(x, 5)), 0.3, seed=7), (t(3, 5),)),
    ]


@pytest.mark.parametrize("name,fn,inputs", _producers(), ids=[p[0] for p in _producers()])
def test_gradcheck_outside_and_inside_transform(name, fn, inputs):
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fn, inputs)  # an ordinary op outside the transform

    def consumed(*a):  # producer -> Linear, the Linear's copy replaced by the recipe
        with RecipeTransform():
            return lin(fn(*a[:-1]), a[-1])

    reset_counters()
    assert torch.autograd.gradcheck(consumed, (*inputs, w))
    assert (counters().get("claimed", 0) > 0) == (name != "dropout")  # dropout of an input: not kept
    if name in ("layer_norm", "gelu", "swiglu_fused", "ln_gelu_dropout"):
        assert torch.autograd.gradgradcheck(consumed, (*inputs, w))  # rebuilt with history


# --- equality with the plain torch composition --------------------------------------------------

def _grads(module, fn, x, dy_seed=3):
    x = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    torch.manual_seed(11)  # same dropout seeds for both compositions
    out = fn(x)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(dy_seed)
    dys = [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs]
    torch.autograd.backward(outs, dys)
    return [o.detach() for o in outs] + [x.grad] + [p.grad for p in module.parameters()]


def _assert_same(got, ref, exact=True):
    assert len(got) == len(ref)
    for a, r in zip(got, ref):
        if exact:
            assert torch.equal(a, r), (a - r).abs().max()
        else:
            tol = 1e-5 if a.dtype == torch.float32 else 2e-2
            torch.testing.assert_close(a, r, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_norm_linears_equal_torch(dtype, norm):
    torch.manual_seed(0)
    m = LayerNormLinears(H, [H, H, 2 * H], norm=norm, eps=1e-5).to(dtype)
    with torch.no_grad():
        m.norm.weight.normal_(1, 0.3)
        if norm == "layer":
            m.norm.bias.normal_()

    def ref(x):
        if norm == "layer":
            n = F.layer_norm(x, (H,), m.norm.weight, m.norm.bias, 1e-5)
        else:
            n = F.rms_norm(x, (H,), m.norm.weight, 1e-5)
        return tuple(lin(n) for lin in m.linears)

    x = torch.randn(B, S, H).to(dtype)
    reset_counters()
    got = _grads(m, m, x)
    assert counters()[f"recompute:{norm}_norm"] == 1 and counters()["claimed"] == 3
    _assert_same(got, _grads(m, ref, x), exact=norm == "layer")


def _ref_mlp(m: LeanMLP, x, p):
    u = m.fc1(x)
    if m.activation == "swiglu":
        g, up = u.chunk(2, -1)
        a = F.silu(g) * up
    else:
        acts = {"gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"), "silu": F.silu, "relu": F.relu}
        a = acts[m.activation](u)
    return m.fc2(seeded_dropout(a, p, True))  # same generator draws as LeanMLP's seeded dropout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu", "silu", "swiglu"])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_lean_mlp_equal_torch(dtype, act, p):
    torch.manual_seed(0)
    m = LeanMLP(H, 4 * H, act, dropout=p).to(dtype)
    x = torch.randn(B, S, H).to(dtype)
    reset_counters()
    got = _grads(m, m, x)
    c = counters()
    assert c["claimed"] == 1 and c[f"recompute:{'swiglu' if act == 'swiglu' else act}"] == 1
    assert c.get("recompute:dropout", 0) == (1 if p else 0)
    _assert_same(got, _grads(m, lambda x: _ref_mlp(m, x, p), x))


def test_autocast_cpu_equal_torch_and_lean():
    """Under autocast the Linears would save their own bf16 copies of the norm output: LayerNormLinears
    casts through recipe producers (one per Linear, as autocast), so they keep nothing; the MLP's
    activations run in bf16."""
    torch.manual_seed(0)
    m, mlp = LayerNormLinears(H, [H, H, H]), LeanMLP(H, 4 * H, "gelu", dropout=0.1)
    x = torch.randn(B, S, H)

    def ac(fn):
        def run(x):
            with torch.autocast("cpu", torch.bfloat16):
                return fn(x)
        return run

    def ref(x):
        n = F.layer_norm(x, (H,), m.norm.weight, m.norm.bias)
        return tuple(lin(n) for lin in m.linears)

    reset_counters()
    _assert_same(_grads(m, ac(m), x), _grads(m, ac(ref), x))
    _assert_same(_grads(mlp, ac(mlp), x), _grads(mlp, ac(lambda x: _ref_mlp(mlp, x, 0.1)), x))
    c = counters()
    assert c["claimed"] == 4 and c["recompute:layer_norm"] == 1 and c["recompute:cast"] == 3
    xr = x.clone().requires_grad_()
    weight_copies = 3 * nbytes(H, H, dtype=torch.bfloat16)  # autocast's bf16 weight copies, kept by the mms
    assert saved_bytes(lambda: ac(m)(xr), m, exclude=[xr]) == 2 * nbytes(B, S, 1) + weight_copies


def test_dropout_producer_mask_is_keep_mask_like():
    x = torch.randn(4, 64, requires_grad=True)
    seed = torch.tensor(1234)
    torch.testing.assert_close(P.dropout(x, 0.25, seed=seed), dropout_seeded(x, seed, 0.25), rtol=0, atol=0)
    w = torch.randn(64, 64, requires_grad=True)
    for s in (seed, torch.tensor([1234]), 1234):  # user seeds (tensor, 1-element, int) are pinned too
        reset_counters()
        with RecipeTransform():
            lin(P.dropout(P.gelu(x), 0.25, seed=s), w)
        assert counters()["claimed"] == 1


# --- saved bytes --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bytes_ln_qkv(dtype):
    m = LayerNormLinears(H, [H, H, H]).to(dtype)
    x = torch.randn(B, S, H, dtype=dtype, requires_grad=True)
    stats = 2 * nbytes(B, S, 1, dtype=dtype)  # torch's CPU LayerNorm: mean, rstd in x's dtype
    lean = saved_bytes(lambda: m(x), m)

    def plain():
        n = F.layer_norm(x, (H,), m.norm.weight, m.norm.bias)
        return [lin(n) for lin in m.linears]

    plain = saved_bytes(plain, m)
    assert lean == nbytes(B, S, H, dtype=dtype) + stats
    assert plain == lean + nbytes(B, S, H, dtype=dtype)  # + the normalized input
    assert saved_bytes(lambda: m._forward(x), m) == plain  # producers outside a transform: ordinary ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["gelu", "swiglu"])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_saved_bytes_mlp(dtype, act, p):
    ffn = 4 * H
    m = LeanMLP(H, ffn, act, dropout=p).to(dtype)
    x = torch.randn(B, S, H, dtype=dtype, requires_grad=True)
    xb, ub = nbytes(B, S, H, dtype=dtype), nbytes(B, S, m.fc1.out_features, dtype=dtype)
    ab = nbytes(B, S, ffn, dtype=dtype)
    lean = saved_bytes(lambda: m(x), m)
    assert lean == xb + ub + (8 if p else 0)  # fc1 input + fc1 output (+ one seed)

    def plain():
        u = m.fc1(x)
        a = F.gelu(u) if act == "gelu" else F.silu(u.chunk(2, -1)[0]) * u.chunk(2, -1)[1]
        return m.fc2(F.dropout(a, p))

    # torch: + the activation output (SwiGLU: + silu(gate) too); dropout: + mask (x's dtype on
    # the CPU) + dropout output instead of the activation output
    extra = ab * (2 if act == "swiglu" else 1) + (ab if p else 0)
    assert saved_bytes(plain, m) == lean - (8 if p else 0) + extra


def test_saved_bytes_chains_and_policy():
    w1, w2 = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
    x = torch.randn(B, S, H, requires_grad=True)
    xb, ub = nbytes(B, S, H), nbytes(B, S, 4 * H)

    def run(fn):
        with RecipeTransform():
            return fn()

    mods = nn.ModuleList([w1, w2])

    # Linear -> LN -> GELU -> dropout -> dropout -> Linear: the GELU's own copy of its input (the
    # LN output) is a recipe too; all is rebuilt from the LN input (fc1 output), stats, two seeds
    def chain():
        return w2(P.dropout(P.dropout(P.gelu(P.layer_norm(w1(x), 4 * H)), 0.1), 0.2))

    assert saved_bytes(lambda: run(chain), mods) == xb + ub + 2 * nbytes(B, S, 1) + 16
    # dropout of a Linear output (kept by nobody) or of an input (alive, not kept): recipe not used
    reset_counters()
    assert saved_bytes(lambda: run(lambda: w2(P.dropout(w1(x), 0.1))), mods) == xb + ub + 8
    u = torch.randn(B, S, 4 * H, requires_grad=True)
    assert saved_bytes(lambda: run(lambda: w2(P.dropout(u, 0.1))), mods) == ub + 8
    assert counters().get("claimed", 0) == 0
    # meter inside or outside the transform: same count
    for outer_meter in (True, False):
        meter, tr = SavedTensorMeter(mods), RecipeTransform()
        with (meter if outer_meter else tr), (tr if outer_meter else meter):
            out = chain()
        assert meter.total_bytes == xb + ub + 2 * nbytes(B, S, 1) + 16
        del out


def test_scope_hooks_any_module():
    model = nn.Sequential(RecipeLayerNorm(H), nn.Linear(H, 4 * H), RecipeGELU(), RecipeDropout(0.1),
                          nn.Linear(4 * H, H))
    x = torch.randn(B, S, H, requires_grad=True)
    xb, ub = nbytes(B, S, H), nbytes(B, S, 4 * H)
    plain = saved_bytes(lambda: model(x), model)
    with scope(model) as handle:
        lean = saved_bytes(lambda: model(x), model)
        assert handle.transform.claimed == 2
    assert lean == xb + 2 * nbytes(B, S, 1) + ub + 8  # LN input + stats, fc1 output, seed
    assert plain == lean + xb + ub  # + the LN output and the dropout output, kept by the Linears
    assert saved_bytes(lambda: model(x), model) == plain  # hooks removed


# --- recompute once, cache freed, memory really freed -------------------------------------------

@pytest.mark.slow
def test_one_recompute_for_three_consumers_and_cache_freed():
    m = LayerNormLinears(H, [H, H, H])
    x = torch.randn(B, S, H, requires_grad=True)
    seen = []
    reset_counters()
    gc.collect()
    before = live_recipes()  # (other tests' graphs may still be alive)
    with m.recipes:
        y = P.layer_norm(x, H, m.norm.weight, m.norm.bias)
        outs = [lin(y) for lin in m.linears]
    y_ref = weakref.ref(y)
    del y
    gc.collect()
    assert y_ref() is None  # nobody keeps the normalized output: its memory is really freed
    assert live_recipes() == before + 1
    for o in outs:
        o.register_hook(lambda g: seen.append(cached_bytes()))
    sum(o.sum() for o in outs).backward()
    assert counters()["recompute"] == 1 and counters()["claimed"] == 3
    assert max(seen) == nbytes(B, S, H)  # the rebuilt output is cached between the consumers
    assert cached_bytes() == 0
    del outs
    gc.collect()
    assert live_recipes() == before  # nothing survives the step


def test_alive_output_is_served_without_recompute():
    x = torch.randn(B, S, H, requires_grad=True)
    w = torch.randn(H, H, requires_grad=True)
    reset_counters()
    with RecipeTransform():
        y = P.gelu(x)
        out = lin(y, w)
    out.sum().backward()
    assert counters().get("recompute", 0) == 0 and counters()["served_alive"] == 1
    torch.testing.assert_close(w.grad, torch.ones(B * S, H).T @ F.gelu(x.detach()).reshape(-1, H))


def test_retain_graph_second_backward_recomputes():
    m = LeanMLP(H, 4 * H, "gelu", dropout=0.1)
    x = torch.randn(B, S, H, requires_grad=True)
    torch.manual_seed(1)
    out = m(x)
    reset_counters()
    out.sum().backward(retain_graph=True)
    g1 = [p.grad.clone() for p in m.parameters()]
    out.sum().backward()
    assert counters()["recompute:gelu"] == 2 and counters()["recompute:dropout"] == 2
    for p, g in zip(m.parameters(), g1):
        torch.testing.assert_close(p.grad, 2 * g, rtol=0, atol=0)
    assert cached_bytes() == 0


# --- in-place safety ----------------------------------------------------------------------------

def test_inplace_on_recipe_input_raises():
    m = LeanMLP(H, 4 * H, "gelu")
    x = torch.randn(B, S, H, requires_grad=True)
    with m.recipes:
        u = m.fc1(x)
        out = m.fc2(P.gelu(u))
    u.add_(1.0)  # the GELU input, from which the fc2 input is rebuilt
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*leanact recipe for gelu"):
        out.sum().backward()

    h = x * 1.0
    with RecipeTransform():
        out = m.fc1(P.layer_norm(h, H))
    h.mul_(2.0)
    with pytest.raises(RuntimeError, match="leanact recipe for layer_norm"):
        out.sum().backward()


def test_output_modified_before_consumer_is_kept_as_is():
    x = torch.randn(B, S, H, requires_grad=True)
    w = torch.randn(H, H, requires_grad=True)
    reset_counters()
    with RecipeTransform():
        y = P.gelu(x)
        y.mul_(2.0)  # the recipe no longer describes y: the consumer keeps y itself
        out = lin(y, w)
    assert counters().get("claimed", 0) == 0
    out.sum().backward()
    torch.testing.assert_close(x.grad, 2 * torch.ops.aten.gelu_backward(w.sum(0).expand(B, S, H), x.detach()))


# --- torch.compile ------------------------------------------------------------------------------

@pytest.mark.slow
def test_compile_aot_eager_gradients():
    """Inside compiled regions producers register nothing; AOTAutograd decides what is kept (for
    this MLP: the fc1 output and the activation/dropout output, as without recipes). Gradients are
    exact; a transform outside the compiled function sees the compiled graph's saved tensors."""
    torch._dynamo.reset()
    m = LeanMLP(H, 4 * H, "gelu", dropout=0.1)
    x = torch.randn(B, S, H)
    ref = _grads(m, m, x)
    cm = torch.compile(m, backend="aot_eager")
    reset_counters()
    _assert_same(_grads(m, cm, x), ref)
    cf = torch.compile(m._forward, backend="aot_eager")
    with RecipeTransform():
        _assert_same(_grads(m, cf, x), ref)
    assert counters().get("registered", 0) == 0
    torch._dynamo.reset()


def test_no_pin_when_another_transform_may_replace_inputs():
    from leanact.saved import SavedTensorTransform

    class Offload(SavedTensorTransform):  # toy: keeps nothing special, but could have
        def pack(self, t):
            return None

    m = LeanMLP(H, 4 * H, "gelu")
    x = torch.randn(B, S, H, requires_grad=True)
    reset_counters()
    with Offload():
        m(x)
    assert counters().get("claimed", 0) == 0
    with RecipeTransform(), Offload():  # a recipe transform outside all others knows what stays kept
        m(x)
    assert counters()["claimed"] == 1


def test_checkpointed_region_keeps_checkpoint_behaviour():
    from torch.utils.checkpoint import checkpoint

    m = LeanMLP(H, 4 * H, "gelu", dropout=0.1)
    x = torch.randn(B, S, H, requires_grad=True)
    handle = scope(m)
    assert saved_bytes(lambda: checkpoint(m, x, use_reentrant=False), m) == nbytes(B, S, H)  # only the input
    handle.remove()
    torch.manual_seed(0)
    checkpoint(m, x, use_reentrant=False).sum().backward()
    g, x.grad = x.grad, None
    torch.manual_seed(0)
    m(x).sum().backward()
    assert torch.equal(g, x.grad)
