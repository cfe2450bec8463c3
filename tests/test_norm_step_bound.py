"""Verdicts that outlive Adam's steps (leanact.ops.norms.step_bound): the step bound holds whatever the
gradients, the slack keeps the rule, and a verdict stands only while both say so; anything else
(another optimizer, a write outside a step) is checked as before."""
from __future__ import annotations

import math

import pytest
import torch

import leanact
from leanact.ops.norms import batch_check, step_bound, verdict as LN


def _gradients(kind: str, steps: int, gen: torch.Generator) -> list[torch.Tensor]:
    if kind == "growing":  # Cauchy–Schwarz's equality case: |m|/sqrt(v) tends to the bound (after
        # enough steps that the bias corrections are ~1)
        return ([torch.full((4,), 1e-3, dtype=torch.float64)] * 3000
                + [torch.full((4,), 1e-3 * (0.999 / 0.9) ** i, dtype=torch.float64) for i in range(steps)])
    if kind == "spikes":
        return [torch.randn(4, generator=gen, dtype=torch.float64) * (1e6 if i % 17 == 0 else 1e-6)
                for i in range(steps)]
    if kind == "heavy":
        return [torch.randn(4, generator=gen, dtype=torch.float64) ** 5 for i in range(steps)]
    return [torch.full((4,), (-1.0) ** i * (i % 5), dtype=torch.float64) for i in range(steps)]  # alternating


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["growing", "spikes", "heavy", "alternating"])
@pytest.mark.parametrize("opt_kind,kwargs", [
    ("Adam", {}), ("AdamW", {"weight_decay": 0.1}), ("Adam", {"weight_decay": 0.5}),
    ("Adam", {"amsgrad": True, "maximize": True}), ("AdamW", {"betas": (0.5, 0.9), "eps": 1e-12}),
    ("AdamW", {"foreach": True}), ("Adam", {"fused": True})])
def test_one_step_moves_no_element_further_than_its_bound(kind, opt_kind, kwargs):
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, generator=gen, dtype=torch.float64))
    opt = getattr(torch.optim, opt_kind)([p], lr=0.01, **kwargs)
    ratio = 0.0
    for g in _gradients(kind, 300, gen):
        before = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        c, k = step_bound.step_bound(opt, opt.param_groups[0])
        moved = (p.detach() - before).abs().max().item()
        assert moved <= c + k * before.abs().max().item() + 4 * 2**-52 * before.abs().max().item(), (moved, c, k)
        if not kwargs.get("weight_decay"):
            ratio = max(ratio, moved / c)
    if kind == "growing" and not kwargs:
        # the fixed-β1 worst case (Cauchy–Schwarz's equality) is nearly reached: a·F for β1 = 0.9, where
        # a² = (1−β1)²/((1−β2)(1−β1²/β2)); the bound allows any β1 schedule, so it is above that
        fixed = 0.1 / math.sqrt(0.001 * (1 - 0.81 / 0.999))
        assert ratio * c / 0.01 > 0.9 * fixed


def test_a_beta1_schedule_stays_within_the_bound():
    """β1 changed between steps (OneCycleLR cycles it): after steps at β1 = 0 and a spike, a step at
    β1 = 0.9 moves θ ~4x further than the fixed-β1 bound of 0.9 allows, and within the bound used."""
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = torch.optim.Adam([p], lr=0.01, betas=(0.0, 0.999))
    for i in range(3001):
        p.grad = torch.full((1,), 1e3 if i == 3000 else 1e-3, dtype=torch.float64)
        opt.step()
    opt.param_groups[0]["betas"] = (0.9, 0.999)
    before = p.detach().clone()
    p.grad = torch.zeros(1, dtype=torch.float64)
    opt.step()
    moved = (p.detach() - before).abs().item()
    fixed = 0.01 * 0.1 / math.sqrt(0.001 * (1 - 0.81 / 0.999))  # a·F for β1 = 0.9 held fixed
    assert moved > 3 * fixed
    assert moved <= step_bound.step_bound(opt, opt.param_groups[0])[0]


def test_no_bound_where_none_is_derived():
    p = torch.nn.Parameter(torch.zeros(2))
    assert step_bound.ratio_bound(0.9, 0.999) == pytest.approx(31.65, abs=0.02)
    assert step_bound.ratio_bound(0.9, 0.999, moment=100.0) == pytest.approx(100.1, abs=0.02)
    assert step_bound.ratio_bound(0.9995, 0.99) is None  # β1 above 2β2/(1+β2)
    assert step_bound.step_bound(torch.optim.SGD([p], lr=0.1), torch.optim.SGD([p], lr=0.1).param_groups[0]) is None
    adam = torch.optim.Adam([p], lr=0.1, eps=0.0)
    assert step_bound.step_bound(adam, adam.param_groups[0]) is None  # 0/0 possible
    adam = torch.optim.Adam([p], lr=torch.tensor(0.1))
    assert step_bound.step_bound(adam, adam.param_groups[0]) == pytest.approx((0.1 * 31.65, 0.0), abs=2e-3)


def test_the_slack_keeps_the_rule_and_is_the_rules_distance():
    gen = torch.Generator().manual_seed(1)
    items = []
    for n in (8, 64):
        w = torch.rand(n, generator=gen) + 0.2
        b = torch.randn(n, generator=gen)
        items += [(w, b, n, torch.bfloat16, 8.0, False), (w, None, n, torch.float32, 8.0, False),
                  (None, b.clamp(-2, 2), n, torch.float16, 8.0, False), (w - 1.0, None, n, torch.float32, 8.0, True),
                  (w, None, n, torch.bfloat16, math.inf, False)]  # (RMSNorm's: no ratio rule)
    out = batch_check.check_many(items, slack=True)
    assert [o[0] for o in out] == batch_check.check_many(items)
    for (w, b, n, dtype, ratio, offset), (ok, slack, w_max, b_max) in zip(items, out):
        assert ok and slack > 0
        assert w_max == (0.0 if w is None else w.abs().max().item())
        assert b_max == (0.0 if b is None else b.abs().max().item())
        # every element moved by the slack in the worst direction: |γ| down, |β| up; the rule holds
        w2 = None if w is None else w - torch.sign(w + (1.0 if offset else 0.0)) * slack
        b2 = None if b is None else b + torch.sign(b) * slack
        assert LN._check(w2, b2, n, dtype, ratio, offset)
    # one channel, γ = 1, β = 0.5: the ratio's distance (8·1 − 0.5)/9
    (ok, slack, *_), = batch_check.check_many([(torch.ones(1), torch.tensor([0.5]), 4, torch.float32, 8.0)],
                                              slack=True)
    assert 7.5 / 9 - 2e-5 <= slack < 7.5 / 9  # (less a guard of 8 float32 units for the rule's own rounding)
    assert batch_check.check_many([(torch.zeros(3), None, 3, torch.float32, 8.0)], slack=True)[0][:2] == (False, 0.0)


def _norms():
    torch.manual_seed(0)
    return torch.nn.ModuleList([leanact.nn.LayerNorm(16), leanact.nn.LayerNorm(16), leanact.nn.RMSNorm(16)])


def _setup(monkeypatch, optimizer, **kwargs):
    """Fresh norms, their optimizer, an input, and the list of the batched checks' sizes."""
    LN.clear_decision_cache()
    norms = _norms()
    batches = []
    check_many = batch_check.check_many
    monkeypatch.setattr(LN, "check_many", lambda items, **kw: batches.append(len(items)) or check_many(items, **kw))
    return norms, optimizer(norms.parameters(), **kwargs), torch.randn(4, 16, requires_grad=True), batches


def _decide(norms, x):
    for m in norms:
        m(x)


def _truth(m) -> bool:
    return LN._check(m.weight, getattr(m, "bias", None), 16, torch.float32,
                     getattr(m, "max_ratio", LN.DEFAULT_MAX_RATIO))


@pytest.mark.slow
def test_verdicts_stand_under_adam_until_its_steps_could_break_the_rule(monkeypatch):
    """γ pushed down and β up by Adam (lr 0.002, 0.002 a step: β > 8γ after ~444 steps): the cached
    verdicts are the rule's at every step, with fewer checks than steps; the verdict flips at the step
    the rule does."""
    norms, opt, x, batches = _setup(monkeypatch, torch.optim.Adam, lr=0.002)
    flipped = None
    for step in range(520):
        _decide(norms, x)
        verdicts = [LN._DECISIONS[m.weight][1] for m in norms]
        assert verdicts == [_truth(m) for m in norms], step
        if flipped is None and not verdicts[0]:
            flipped = step
        for m in norms:
            m.weight.grad = torch.ones_like(m.weight)
            if getattr(m, "bias", None) is not None:
                m.bias.grad = -torch.ones_like(m.bias)
        opt.step()
    assert flipped is not None and 440 <= flipped <= 450
    # checks grow more frequent as the slack shrinks near the rule's edge, and none after the flip
    # (a failing verdict is checked every step: it may pass again)
    assert len(batches) < 0.6 * 520, len(batches)


def test_a_usual_fine_tuning_run_checks_once(monkeypatch):
    """γ = 1, β = 0 at lr 2e-5 (Adam moves each element by at most ~6.3e-4 a step, whatever β1 does):
    the verdicts of the first batched check stand for hundreds of steps."""
    norms, opt, x, batches = _setup(monkeypatch, torch.optim.AdamW, lr=2e-5, weight_decay=0.01)
    for step in range(200):
        _decide(norms, x)
        assert all(LN._DECISIONS[m.weight][1] for m in norms)
        sum(m(x).pow(2).sum() for m in norms).backward()
        opt.step()
        opt.zero_grad()
    assert batches == [3]


@pytest.mark.parametrize("when", ["after the step", "before the step"])
def test_a_write_outside_the_optimizer_is_checked(monkeypatch, when):
    norms, opt, x, _batches = _setup(monkeypatch, torch.optim.AdamW, lr=1e-4)
    for _ in range(3):
        _decide(norms, x)
        sum(m(x).sum() for m in norms).backward()
        if when == "before the step" and _ == 2:
            with torch.no_grad():
                norms[1].bias[3] = 100.0  # |β| > 8|γ|: the rule fails
        opt.step()
        opt.zero_grad()
    if when == "after the step":
        with torch.no_grad():
            norms[1].bias[3] = 100.0
    _decide(norms, x)
    assert [LN._DECISIONS[m.weight][1] for m in norms] == [True, False, True]
    assert not getattr(norms[1](x).grad_fn, "from_output", False)  # the fallback keeps the input


def test_other_optimizers_check_every_step(monkeypatch):
    norms, opt, x, batches = _setup(monkeypatch, torch.optim.SGD, lr=1e-4, momentum=0.9)
    for _ in range(4):
        _decide(norms, x)
        sum(m(x).sum() for m in norms).backward()
        opt.step()
    assert batches == [3, 3, 3]


def test_the_step_bound_accumulates_per_parameter():
    p = torch.nn.Parameter(torch.ones(3))
    c, k = 0.01 * step_bound.ratio_bound(0.9, 0.999), 0.01 * 0.1  # (β2 as before: the same moment bound)
    one_step = c + (k + 2**-23) * 1.0
    stands = [step_bound.Stand(s, [(p, 1.0)]) for s in (2 * one_step * 1.0001, 2 * c, math.inf)]
    opt = torch.optim.AdamW([p], lr=0.01, weight_decay=0.1)
    p.grad = torch.ones(3)
    opt.step()
    assert step_bound.step_bound(opt, opt.param_groups[0]) == pytest.approx((c, k))
    assert step_bound._DRIFT[p].total - stands[0].parts[0][2] == pytest.approx(one_step)
    assert [s.holds() for s in stands] == [True, False, True]
    with torch.no_grad():
        p.add_(0.0)  # a write: _version moves
    assert not stands[2].holds()


def test_a_slack_serves_only_the_rule_it_was_computed_for(monkeypatch):
    """The same γ used with another dtype (fp16's max, not fp32's) decides again, alone, and the
    slack of the fp32 rule is dropped: it never lets an fp16 verdict stand."""
    norms, opt, x, _batches = _setup(monkeypatch, torch.optim.AdamW, lr=1e-4)
    for _ in range(2):
        _decide(norms, x)
        opt.step()
    ln = norms[0]
    assert LN._DECISIONS[ln.weight][3] is not None  # a Stand
    assert LN.from_output_ok(ln.weight, ln.bias, 16, torch.float16)
    assert LN._DECISIONS[ln.weight][3] is None


def test_a_write_seen_by_one_check_ends_every_older_verdict_on_that_tensor():
    """A β shared by two norms, written outside a step: the check that sees the write first (one
    norm's) does not let the other norm's older verdict stand on the new values."""
    p = torch.nn.Parameter(torch.ones(3))
    older = step_bound.Stand(1.0, [(p, 1.0)])
    with torch.no_grad():
        p.mul_(100.0)
    newer = step_bound.Stand(1.0, [(p, 100.0)])  # (a check of the other norm reads the new values)
    assert newer.holds() and not older.holds()


def test_a_larger_beta2_seen_earlier_keeps_its_bound():
    """|m| ≤ A·sqrt(v) with A from the largest β2 the group stepped with: after β2 0.9999 → 0.99 the
    drift per step still uses A = 100, not 10."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([p], lr=0.01, betas=(0.9, 0.9999))
    step_bound.track(p, 1.0)  # (tracked from the start: its state is the one leanact saw produced)
    p.grad = torch.ones(2)
    opt.step()  # (the group's history: β2 = 0.9999)
    base = step_bound.track(p, 1.0)[0]
    opt.param_groups[0]["betas"] = (0.9, 0.99)
    opt.step()
    f = step_bound.ratio_bound(0.9, 0.99) / (10.0 * 1.001)  # F of this step's betas
    assert step_bound._DRIFT[p].total - base == pytest.approx(0.01 * 100.0 * f * 1.001 + 2**-23 * 1.0, rel=1e-6)
