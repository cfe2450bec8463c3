"""The differential matrix's adversarial-user axis for the norms' cached verdicts: every way torch
offers to change a parameter or an optimizer's state between or inside steps. A patched model and an
unpatched one holding the same weights before each step give the same gradients (fp32, 1e-5
relative), or leanact raises a clear error; never silently other gradients.

The writes that matter break the norms' from-output rule (γ = 0, |β| > 8|γ|): the backward from the
output would then be inexact (NaN for γ = 0), so a verdict that stood on a stale assumption shows."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import leanact
from leanact.ops.norms import batch_check, step_bound, verdict as LN

from _families import batch, build

FAMILIES = ["llama", "bert", "gpt2"]
STEPS = 4


def _norm_params(model) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if "norm" in n.lower() or "ln_" in n.lower()]


def _gamma(model) -> torch.nn.Parameter:
    """The first norm's weight (γ) of the first layer."""
    return next(p for n, p in model.named_parameters() if ("norm" in n.lower() or "ln_" in n.lower()) and p.dim() == 1
                and "bias" not in n)


def _break(p: torch.Tensor, how: str = "no_grad") -> None:
    """γ = 0 on half the channels: the rule fails (torch's own norm backward is still exact)."""
    half = p.shape[0] // 2
    if how == "data":
        p.data[:half] = 0.0  # (skips _version)
    else:
        with torch.no_grad():
            p[:half] = 0.0


def _grads_equal(ref, lean, inputs) -> None:
    l_ref, l_lean = ref(**inputs).loss, lean(**inputs).loss
    l_ref.backward()
    l_lean.backward()
    assert abs(l_ref.item() - l_lean.item()) <= 1e-5 * abs(l_ref.item())
    pairs = [(n, p.grad, q.grad) for (n, p), q in zip(ref.named_parameters(), lean.parameters()) if p.grad is not None]
    # (a floor for gradients that vanish in exact arithmetic, e.g. attention's key bias: rounding noise)
    floor = 1e-6 * torch.stack([g.norm() for _, g, _ in pairs]).norm()
    for name, g, h in pairs:
        assert h is not None and torch.isfinite(h).all(), name
        assert (g - h).norm() <= 1e-5 * g.norm() + floor, name


def _train(family, make_optimizers, event, steps=STEPS, dtype=torch.float32):
    """``steps`` steps of a patched model; before each, an unpatched copy takes its weights and both
    compute gradients on one batch (compared); ``event(step, model, optimizers)`` runs before each step's
    forward (after the previous ``optimizer.step()``). Returns the optimizers."""
    LN.clear_decision_cache()
    lean = build(family).to(dtype)
    ref = copy.deepcopy(lean)
    leanact.patch(lean)
    inputs = batch(family)
    optimizers = make_optimizers(lean)
    for step in range(steps):
        event(step, lean, optimizers)
        with torch.no_grad():
            for p, q in zip(ref.parameters(), lean.parameters()):
                p.copy_(q)
        ref.zero_grad(set_to_none=True)
        _grads_equal(ref, lean, inputs)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return optimizers


def _adamw(model):
    return [torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)]


def _nothing(step, model, optimizers):
    pass


def _exact_or_leanact_error(run):
    """The run gives the unpatched gradients, or raises leanact's error (never other gradients)."""
    try:
        run()
    except RuntimeError as e:
        assert "leanact" in str(e) and ".data" in str(e), e


# -- hooks: anything leanact did not install ends the bound for that step ----------------------------

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("where", ["pre", "post", "global_pre", "global_post"])
@pytest.mark.parametrize("how", ["no_grad", "data"])
def test_a_write_inside_the_optimizers_hooks_is_seen(family, where, how):
    handles = []

    def make(model):
        opts = _adamw(model)
        gamma = _gamma(model)
        state = {"n": 0}

        def hook(opt, args, kwargs):
            state["n"] += 1
            if state["n"] == 3:
                _break(gamma, how)
                if "pre" in where:
                    gamma.grad = None  # (the step then leaves γ = 0 as the hook wrote it)

        register = {"pre": opts[0].register_step_pre_hook, "post": opts[0].register_step_post_hook,
                    "global_pre": register_optimizer_step_pre_hook,
                    "global_post": register_optimizer_step_post_hook}[where]
        handles.append(register(hook))
        return opts

    try:
        _train(family, make, _nothing)  # no error: leanact saw the hook and checked again
    finally:
        for h in handles:
            h.remove()


def test_a_hook_that_spikes_the_learning_rate_ends_the_bound(monkeypatch):
    """A pre-hook raising lr to 10 and a post-hook resetting it: the step moved γ by ~10 while the group
    reads lr 1e-3 after it; the verdict is checked again, not carried by a bound on lr 1e-3. (float64:
    weights moved by ~10 per step make the model so ill-conditioned that fp32 roundings, leanact's and
    torch's, differ by percents, and by how much depends on the CPU's kernels.)"""
    checks = []
    real = LN.check_many
    monkeypatch.setattr(LN, "check_many", lambda items, **kw: checks.append(len(items)) or real(items, **kw))

    def make(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt.register_step_pre_hook(lambda o, a, k: o.param_groups[0].__setitem__("lr", 10.0))
        opt.register_step_post_hook(lambda o, a, k: o.param_groups[0].__setitem__("lr", 1e-3))
        return [opt]

    _train("llama", make, _nothing, dtype=torch.float64)
    assert len(checks) == STEPS - 1  # every step's verdicts checked


def test_a_closure_runs_inside_the_step_and_ends_the_bound():
    model = leanact.nn.LayerNorm(16)
    LN.clear_decision_cache()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 16)
    for step in range(3):
        def closure():
            opt.zero_grad()
            loss = model(x).pow(2).sum()
            loss.backward()
            if step == 1:
                _break(model.weight, "data")
            return loss
        opt.step(closure)
    ref = torch.nn.LayerNorm(16)
    ref.load_state_dict(model.state_dict())
    _close_grads(model, ref, x)


def _close_grads(lean, ref, x):
    lean.zero_grad()
    ref.zero_grad()
    lean(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for p, q in zip(ref.parameters(), lean.parameters()):
        assert torch.isfinite(q.grad).all()
        assert (p.grad - q.grad).norm() <= 1e-5 * p.grad.norm()


# -- writes between steps -------------------------------------------------------------------------

def _at(step_no, action):
    def event(step, model, optimizers):
        if step == step_no:
            action(model, optimizers)
    return event


def _repoint(model, optimizers):
    g = _gamma(model)
    t = g.detach().clone()
    t[: t.shape[0] // 2] = 0.0
    g.data = t


def _vector(model, optimizers):
    params = list(model.parameters())
    vec = torch.nn.utils.parameters_to_vector(params).clone()
    g = _gamma(model)
    start = sum(p.numel() for p in params[: next(i for i, p in enumerate(params) if p is g)])
    vec[start: start + g.numel() // 2] = 0.0
    torch.nn.utils.vector_to_parameters(vec, params)


def _load_model_state(model, optimizers):
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    name = next(n for n, p in model.named_parameters() if p is _gamma(model))
    sd[name][: sd[name].shape[0] // 2] = 0.0
    model.load_state_dict(sd)


def _data_in_place(model, optimizers):
    _break(_gamma(model), "data")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("action", [_repoint, _vector, _load_model_state], ids=["data=", "vector_to_parameters",
                                                                             "load_state_dict"])
def test_a_write_between_steps_is_seen(family, action):
    _train(family, _adamw, _at(2, action))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_data_write_that_skips_the_version_is_confirmed_or_raises(family):
    """``p.data[...] = 0`` after AdamW's steps: invisible to ``_version``; the device check launched at
    the forward's first norm contradicts the verdict that stood, and the backward raises leanact's
    error (torch's norm would be exact, leanact's from-output backward would not); the next call decides
    again and is exact."""
    LN.clear_decision_cache()
    lean = build(family)
    ref = copy.deepcopy(lean)
    leanact.patch(lean)
    inputs = batch(family)
    opt = torch.optim.AdamW(lean.parameters(), lr=1e-3)
    for _ in range(2):
        lean(**inputs).loss.backward()
        opt.step()
        opt.zero_grad()
    _break(_gamma(lean), "data")
    with pytest.raises(RuntimeError, match="leanact.*cannot see"):
        lean(**inputs).loss.backward()
    lean.zero_grad()
    with torch.no_grad():
        for p, q in zip(ref.parameters(), lean.parameters()):
            p.copy_(q)
    _grads_equal(ref, lean, inputs)


def _broken_after_steps():
    """A lean LayerNorm after two AdamW steps (its verdict standing on the bound), γ then zeroed on half
    its channels through ``.data``, and one forward under grad that used the cached verdict."""
    LN.clear_decision_cache()
    m = leanact.nn.LayerNorm(16)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x = torch.randn(4, 16)
    for _ in range(2):
        m(x).sum().backward()
        opt.step()
    _break(m.weight, "data")
    y = m(x)  # (no backward yet: or one that runs compiled, whose Python is not run again)
    assert LN._PENDING
    return m, opt, x, y


@pytest.mark.parametrize("kept", [False, True], ids=["graph dropped", "graph kept"])
def test_a_contradicted_verdict_read_at_the_next_forward_is_still_raised(kept):
    """The next forward's first norm reads the confirmation where no error can be raised, and decides
    again (its own backward is exact, torch's path). The failure is owed: the first forward's backward
    (inexact) raises if it ever runs, and so does the next optimizer step, before applying anything."""
    m, opt, x, y = _broken_after_steps()
    if not kept:
        del y
    second = m(x).sum()
    assert not LN._PENDING and LN._OWED
    if kept:
        with pytest.raises(RuntimeError, match="leanact.*cannot see"):
            (y.sum() + second).backward()
    else:
        second.backward()  # (exact: the fallback)
        with pytest.raises(RuntimeError, match="leanact.*cannot see"):
            opt.step()
    m.zero_grad()
    ref = torch.nn.LayerNorm(16)
    ref.load_state_dict(m.state_dict())
    _close_grads(m, ref, x)
    assert not LN._PENDING and not LN._OWED


def test_an_optimizer_step_after_a_contradicted_verdict_raises():
    """Where the norms' backward did not confirm, the next optimizer step does, before it applies the
    gradients."""
    m, opt, _x, _y = _broken_after_steps()
    before = m.bias.detach().clone()
    with pytest.raises(RuntimeError, match="leanact.*cannot see"):
        opt.step()
    assert torch.equal(m.bias.detach(), before)  # (no step taken)


# -- optimizer state, groups, schedulers, several optimizers --------------------------------------

def test_a_loaded_optimizer_state_is_verified_once_and_then_trusted(monkeypatch):
    """Moments from elsewhere (|m| = 1000·sqrt(v): not what Adam's recursion from zero gives) are
    verified at the next step (one sync), and the bound takes their ratio; reloading the optimizer's
    own state does not make every later step check."""
    LN.clear_decision_cache()
    m = leanact.nn.LayerNorm(16)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x = torch.randn(4, 16)
    checks = []
    real = LN.check_many
    monkeypatch.setattr(LN, "check_many", lambda items, **kw: checks.append(len(items)) or real(items, **kw))
    for _ in range(2):
        m(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    sd = copy.deepcopy(opt.state_dict())
    for st in sd["state"].values():
        st["exp_avg_sq"].fill_(1e-10)
        st["exp_avg"].fill_(1e-2)  # |m|/sqrt(v) = 1000
    opt.load_state_dict(sd)
    m(x).pow(2).sum().backward()
    opt.step()
    assert step_bound._MOMENTS[opt][0] >= 1000.0 * 0.999
    opt.load_state_dict(opt.state_dict())  # its own state, reloaded
    n = len(checks)
    for _ in range(10):
        m(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    assert len(checks) - n <= 2, checks  # (not one check a step)
    ref = torch.nn.LayerNorm(16)
    ref.load_state_dict(m.state_dict())
    _close_grads(m, ref, x)


def test_a_moment_edited_in_place_is_verified():
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.Adam([p], lr=1e-3)
    step_bound.track(p, 1.0)
    for _ in range(2):
        p.grad = torch.ones(4)
        opt.step()
    with torch.no_grad():
        opt.state[p]["exp_avg"].mul_(1e6)
    p.grad = torch.ones(4)
    opt.step()
    assert step_bound._MOMENTS[opt][0] > 1e4


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_schedulers_edited_groups_and_two_optimizers(family):
    def make(model):
        norms = {id(p) for p in _norm_params(model)}
        rest = [p for p in model.parameters() if id(p) not in norms]
        adam = torch.optim.AdamW(rest, lr=1e-3)
        weights = [p for p in _norm_params(model) if p.dim() == 1 and p is not _gamma(model)]
        sgd = torch.optim.SGD([_gamma(model)], lr=50.0)  # a large SGD step can cross the rule
        other = torch.optim.Adam(weights, lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(other, lambda s: [1.0, 300.0, 1.0, 1.0][min(s, 3)])
        return [adam, sgd, other, _Scheduled(sched)]

    def edit(step, model, optimizers):
        if step == 2:
            optimizers[2].param_groups[0]["lr"] = 5.0  # hand-edited
    _train(family, make, edit)


class _Scheduled:
    """A scheduler stepped like an optimizer in :func:`_train`'s loop."""

    def __init__(self, sched):
        self.sched = sched

    def step(self):
        self.sched.step()

    def zero_grad(self, set_to_none=True):
        pass


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_grad_scaler_skipped_steps(family):
    """A GradScaler that skips a step (an inf gradient after the comparison), then a write between
    steps: the verdicts follow."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    scaler.scale(torch.ones(()))  # (the loss is not scaled: unscaling divides by 16, which Adam ignores)

    class Scaled:
        calls = 0

        def __init__(self, opt):
            self.opt = opt

        def step(self):
            Scaled.calls += 1
            if Scaled.calls == 2:
                next(p for g in self.opt.param_groups for p in g["params"] if p.grad is not None).grad.fill_(math.inf)
            scaler.step(self.opt)
            scaler.update()

        def zero_grad(self, set_to_none=True):
            self.opt.zero_grad(set_to_none=set_to_none)

    _train(family, lambda model: [Scaled(torch.optim.AdamW(model.parameters(), lr=1e-3))],
           _at(3, _load_model_state), steps=5)
    assert scaler.get_scale() < 2.0**4  # (the step was skipped)


def test_unwatched_steps_check_and_watched_steps_do_not(monkeypatch):
    """The host-side cost: with no foreign hook, AdamW's steps take no batched check (the verdicts
    stand and a deferred device check confirms them); with one, every step checks."""
    checks, later = [], []
    real, real_later = LN.check_many, LN.check_many_later
    monkeypatch.setattr(LN, "check_many", lambda items, **kw: checks.append(len(items)) or real(items, **kw))
    monkeypatch.setattr(LN, "check_many_later", lambda items: later.append(len(items)) or real_later(items))
    LN.clear_decision_cache()
    norms = torch.nn.ModuleList([leanact.nn.LayerNorm(16), leanact.nn.RMSNorm(16)])
    opt = torch.optim.AdamW(norms.parameters(), lr=1e-5)
    x = torch.randn(4, 16)
    for _ in range(5):
        sum(m(x).sum() for m in norms).backward()
        opt.step()
    assert checks == [2] and later == [2, 2, 2, 2]  # (one deferred check a forward from the second on)
    handle = opt.register_step_post_hook(lambda *a: None)
    try:
        for _ in range(3):
            sum(m(x).sum() for m in norms).backward()
            opt.step()
    finally:
        handle.remove()
    assert checks == [2, 2, 2]  # (the first forward after the hook came still stood: the step before was watched)
    assert batch_check.check_many_later([(torch.zeros(3), None, 3, torch.float32, 8.0)]).result() == [False]


def test_the_step_bound_can_be_turned_off(monkeypatch):
    checks = []
    real = LN.check_many
    monkeypatch.setattr(LN, "check_many", lambda items, **kw: checks.append(len(items)) or real(items, **kw))
    LN.clear_decision_cache()
    m = leanact.nn.LayerNorm(16)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
    x = torch.randn(4, 16)
    LN.use_step_bound(False)
    try:
        for _ in range(4):
            m(x).sum().backward()
            opt.step()
    finally:
        LN.use_step_bound(True)
    assert checks == [1, 1, 1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_the_deferred_check_agrees_with_the_synchronous_one(device):
    gen = torch.Generator().manual_seed(0)
    items = []
    for n in (8, 1024):
        w = (torch.rand(n, generator=gen) + 0.2).to(device)
        b = torch.randn(n, generator=gen).to(device)
        items += [(w, b, n, torch.float32, 8.0, False), (w * 0, None, n, torch.bfloat16, 8.0, False),
                  (w, b * 100, n, torch.float16, 8.0, False), (w - 1.0, None, n, torch.float32, math.inf, True),
                  (None, b, n, torch.float32, 8.0, False)]
    want = batch_check.check_many(items)
    assert batch_check.check_many_later(items).result() == want
    assert True in want and False in want


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_a_data_write_with_no_step_between_forwards_raises(frozen):
    """The cached verdict between two forwards with no optimizer step (gradient accumulation, frozen
    γ of a LoRA model): a ``.data`` write is confirmed against at the next backward, which raises."""
    LN.clear_decision_cache()
    m = leanact.nn.LayerNorm(16)
    m.weight.requires_grad_(not frozen)
    m.bias.requires_grad_(not frozen)
    x = torch.randn(4, 16, requires_grad=True)
    for _ in range(2):
        m(x).pow(2).sum().backward()
    _break(m.weight, "data")
    with pytest.raises(RuntimeError, match="leanact.*cannot see"):
        m(x).pow(2).sum().backward()
    x.grad = None
    m(x).pow(2).sum().backward()  # decided again: the fallback, exact
    ref = torch.nn.LayerNorm(16)
    ref.load_state_dict(m.state_dict())
    x2 = x.detach().clone().requires_grad_(True)
    ref(x2).pow(2).sum().backward()
    assert torch.allclose(x.grad, x2.grad, rtol=1e-5, atol=1e-6)


def test_one_deferred_check_per_forward_none_in_a_recompute(monkeypatch):
    """Gradient accumulation: one deferred check per forward; the forwards that checkpointing re-runs
    inside the backward launch none (they read what the forward's check confirmed)."""
    later = []
    real_later = LN.check_many_later
    monkeypatch.setattr(LN, "check_many_later", lambda items: later.append(len(items)) or real_later(items))
    LN.clear_decision_cache()
    norms = torch.nn.ModuleList([leanact.nn.LayerNorm(16) for _ in range(3)])
    x = torch.randn(4, 16, requires_grad=True)

    def run(h):
        for m in norms:
            h = m(h)
        return h

    run(x).sum().backward()  # (decided: read now)
    for _ in range(3):
        torch.utils.checkpoint.checkpoint(run, x, use_reentrant=False).sum().backward()
    assert later == [3, 3, 3]


@pytest.mark.parametrize("how", ["no_grad", "data"])
def test_a_step_replaced_on_the_instance(how):
    """A wrapper set as ``optimizer.step`` (as accelerate's with a GradScaler) that writes after the
    update: outside leanact's hooks, so seen as a write between steps (or raised by the confirmation)."""
    def make(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        original, gamma, calls = opt.step, _gamma(model), []

        def step(*args, **kwargs):
            out = original(*args, **kwargs)
            calls.append(1)
            if len(calls) == 2:
                _break(gamma, how)
            return out

        opt.step = step
        return [opt]

    if how == "no_grad":
        _train("llama", make, _nothing)
    else:
        _exact_or_leanact_error(lambda: _train("llama", make, _nothing))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_checks_run_inside_autocast_with_mixed_dtypes(dtype):
    """Norms of bf16 and fp32 γ in one batch, decided and confirmed inside a CPU autocast block (fp16's
    rejects a bf16 tensor in its casts)."""
    LN.clear_decision_cache()
    norms = torch.nn.ModuleList([leanact.nn.LayerNorm(16), leanact.nn.LayerNorm(16).to(torch.bfloat16)])
    opt = torch.optim.AdamW(norms.parameters(), lr=1e-3)
    x = torch.randn(4, 16)
    for _ in range(4):
        with torch.autocast("cpu", dtype=dtype):
            loss = norms[0](x).float().sum() + norms[1](x.to(torch.bfloat16)).float().sum()
        loss.backward()
        opt.step()
    assert all(LN._DECISIONS[m.weight][1] for m in norms)


@pytest.mark.parametrize("later", [False, True])
def test_the_batched_checks_ignore_an_enclosing_autocast(later):
    """The batch gathers every cached norm (other models' too): γ, β of several dtypes, concatenated
    inside the caller's autocast block, whose casts reject some (fp16's takes no bf16 next to float64)."""
    w1, b1 = torch.ones(16), torch.zeros(16)
    w2, b2 = torch.ones(16, dtype=torch.float64), torch.zeros(16, dtype=torch.bfloat16)
    items = [(w1, b1, 16, torch.float32, 8.0), (w2, b2, 16, torch.bfloat16, 8.0),
             (w2 * 0, None, 16, torch.float32, 8.0)]
    with torch.autocast("cpu", dtype=torch.float16):
        got = batch_check.check_many_later(items).result() if later else batch_check.check_many(items)
    assert got == [True, True, False]
