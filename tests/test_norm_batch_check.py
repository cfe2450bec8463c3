"""The norms' from-output decision for many norms at once (leanact.ops.norms.batch_check): the same
verdicts as the one-at-a-time rule, and after an optimizer step one batch for every norm of the
model instead of one reduction and one sync per norm."""
import math

import pytest
import torch

import leanact.nn as lnn
from leanact.ops.norms import batch_check, verdict as LN


def _cases():
    """(weight, bias, n, dtype, max_ratio): passing and failing for each clause of the rule."""
    g = torch.Generator().manual_seed(0)
    w = torch.rand(16, generator=g) + 0.5
    b = torch.randn(16, generator=g) * 0.1
    tiny16 = torch.finfo(torch.float16).tiny
    cases = [
        (w, b, 16, torch.float32, 8.0), (w, None, 16, torch.float32, 8.0), (None, b, 16, torch.float32, 8.0),
        (w.clone().index_fill_(0, torch.tensor([3]), 0.0), b, 16, torch.float32, 8.0),  # γ = 0
        (w.clone().index_fill_(0, torch.tensor([5]), 1e-40), None, 16, torch.float32, math.inf),  # subnormal γ
        (w, b.clone().index_fill_(0, torch.tensor([2]), 9.0), 16, torch.float32, 8.0),  # |β| > 8|γ|
        (w, b.clone().index_fill_(0, torch.tensor([2]), 9.0), 16, torch.float32, 20.0),  # allowed by the ratio
        (w.clone().index_fill_(0, torch.tensor([1]), math.nan), b, 16, torch.float32, 8.0),
        (w, b.clone().index_fill_(0, torch.tensor([1]), math.inf), 16, torch.float32, 8.0),
        (w * 60000, None, 16, torch.float16, math.inf),  # |γ|·√n overflows fp16's max
        (w * 60000, None, 1, torch.float16, math.inf),  # n = 1: it does not
        (torch.full((16,), tiny16 / 2), None, 16, torch.float16, math.inf),  # below fp16's tiny
        (torch.full((16,), tiny16), None, 16, torch.float16, math.inf),  # exactly tiny
        (w.to(torch.bfloat16), b.to(torch.bfloat16), 16, torch.bfloat16, 8.0),
        (w.to(torch.bfloat16), None, 16, torch.float32, math.inf),  # bf16 γ, fp32 input
        (w.double(), b.double(), 16, torch.float64, 8.0),
        (torch.full((16,), 1e-300, dtype=torch.float64), None, 16, torch.float64, math.inf),
        (torch.empty(0), None, 0, torch.float32, 8.0),
    ]
    return cases


def _offset_cases():
    """Gemma's γ = 1 + w (fp32), w of any dtype: passing, γ = 0 (w = -1), γ subnormal, NaN, overflow."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, generator=g) * 0.3
    return [
        (w, None, 16, torch.float32, math.inf, True), (w.to(torch.bfloat16), None, 16, torch.bfloat16, math.inf, True),
        (w.clone().index_fill_(0, torch.tensor([4]), -1.0), None, 16, torch.float32, math.inf, True),  # γ = 0
        (w.clone().index_fill_(0, torch.tensor([4]), -1.0 + 2.0**-24), None, 16, torch.float32, math.inf, True),
        (w.clone().index_fill_(0, torch.tensor([6]), math.nan), None, 16, torch.float32, math.inf, True),
        (w * 40000, None, 16, torch.float16, math.inf, True),  # |1 + w|·√n above fp16's max
        (w.double(), None, 16, torch.float64, math.inf, True),
        (w.clone().index_fill_(0, torch.tensor([0]), -1.0), None, 16, torch.float32, math.inf, False),  # γ = w
    ]


def test_the_same_verdicts_as_one_at_a_time():
    cases = _cases() + _offset_cases()
    one = [LN._check(*c) if (c[0] if c[0] is not None else c[1]).numel() else True for c in cases]
    assert one[-len(_offset_cases()):] == [True, True, False, True, False, False, True, True]
    assert batch_check.check_many(cases) == one
    assert True in one and False in one  # both kinds are exercised
    for i in range(len(cases)):  # and alone, and in every position
        assert batch_check.check_many(cases[i:] + cases[:i]) == one[i:] + one[:i]


def _model():
    return torch.nn.Sequential(lnn.LayerNorm(16), torch.nn.Linear(16, 16), lnn.RMSNorm(16), torch.nn.Linear(16, 16),
                               lnn.LayerNorm(16, bias=False), lnn.LayerNorm(16))


def test_one_batch_per_optimizer_step(monkeypatch):
    """Step 1 decides norm by norm; after each optimizer step the first norm decides again for all
    four at once, and the others find their decision cached; a γ set to zero by the optimizer step
    moves its norm to the fallback (keeps the input) from that step on."""
    LN.clear_decision_cache()
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(4, 16, requires_grad=True)
    batches, singles = [], []
    check_many, check = batch_check.check_many, LN._check
    monkeypatch.setattr(LN, "check_many", lambda items, **kw: batches.append(len(items)) or check_many(items, **kw))
    monkeypatch.setattr(LN, "_check", lambda *a: singles.append(1) or check(*a))

    def step():
        model(x).sum().backward()
        opt.step()

    step()
    assert (batches, len(singles)) == ([], 4)
    step()
    step()
    assert (batches, len(singles)) == ([4, 4], 4)

    with torch.no_grad():  # what an optimizer step could do: this norm's γ becomes 0
        model[2].weight[3] = 0.0
    LN._STEPS[0] += 1  # (as the step post-hook counts)
    y = model[2](torch.randn(4, 16, requires_grad=True))
    assert batches[-1] == 4 and LN._DECISIONS[model[2].weight][1] is False
    assert y.grad_fn.from_output is False  # the fallback: it keeps the input, not y


def test_no_batch_under_a_dispatch_mode(monkeypatch):
    """Under fake tensors (leanact.estimate) or any dispatch mode the values cannot be read back in
    one batch: the norm decides alone, as before."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    LN.clear_decision_cache()
    model = _model()
    x = torch.randn(4, 16, requires_grad=True)
    model(x)
    _stepped(model)
    monkeypatch.setattr(LN, "check_many", lambda items, **kw: pytest.fail("batched under a dispatch mode"))
    with Passthrough():
        model(x)
    batches = []
    monkeypatch.setattr(LN, "check_many",
                        lambda items, **kw: batches.append(len(items)) or batch_check.check_many(items, **kw))
    _stepped(model)
    model(x)
    assert batches == [4]  # without the mode: batched


def _stepped(*models):
    """The models' parameters stepped by an optimizer (lr 0: values unchanged)."""
    torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.0).step()


def test_dead_norms_are_skipped():
    """Norms freed since their decision drop out of the batch (γ, β are held weakly)."""
    LN.clear_decision_cache()
    keep, gone = _model(), _model()
    x = torch.randn(4, 16, requires_grad=True)
    keep(x)
    gone(x)
    del gone
    _stepped(keep)
    keep(x)
    assert len(LN._DECISIONS) == 4 and all(v[0][2] == LN._STEPS[0] for v in LN._DECISIONS.values())


def test_only_parameters_an_optimizer_steps_are_batched(monkeypatch):
    """A norm whose γ is not a parameter the optimizer updated in place (e.g. FSDP's unsharded copy,
    written just before its layer runs) may hold last step's values when the batch runs: it decides
    alone when it runs."""
    LN.clear_decision_cache()
    stepped, copies = _model(), _model()
    x = torch.randn(4, 16, requires_grad=True)
    stepped(x)
    copies(x)
    batches = []
    check_many = batch_check.check_many
    monkeypatch.setattr(LN, "check_many", lambda items, **kw: batches.append(items) or check_many(items, **kw))
    _stepped(stepped)
    stepped(x)
    assert [len(b) for b in batches] == [4]
    assert not any(t is p for items in batches for it in items for t in it[:2] for p in copies.parameters())
    copies(x)  # decided one by one
    assert [len(b) for b in batches] == [4]


def test_norms_whose_storage_was_freed_are_skipped():
    """FSDP frees an unsharded γ's storage after the forward and keeps its shape: such a norm is
    left out of the batch (reading it would read freed memory) and decides alone when it runs."""
    LN.clear_decision_cache()
    a, b = _model(), _model()
    x = torch.randn(4, 16, requires_grad=True)
    a(x)
    b(x)
    _stepped(a, b)
    freed = b[0].weight
    freed.untyped_storage().resize_(0)
    assert not LN._intact(freed) and LN._intact(a[0].weight)
    a(x)  # batch of the other 7 cached norms
    assert LN._DECISIONS[freed][0][2] == LN._STEPS[0] - 1  # not refreshed
    assert all(v[0][2] == LN._STEPS[0] for k, v in LN._DECISIONS.items() if k is not freed)


def test_frozen_norms_are_decided_once(monkeypatch):
    """γ, β that do not require grad (PEFT / LoRA fine-tuning) change only by a write that moves
    their _version: decided once, then cached across optimizer steps."""
    LN.clear_decision_cache()
    model = _model().requires_grad_(False)
    x = torch.randn(4, 16, requires_grad=True)
    singles = []
    check = LN._check
    monkeypatch.setattr(LN, "_check", lambda *a: singles.append(1) or check(*a))
    for _ in range(3):
        model(x).sum().backward()
        LN._STEPS[0] += 1  # optimizer steps of the trained (other) parameters
    assert len(singles) == 4
    with torch.no_grad():
        model[0].weight.mul_(2.0)
    model(x)
    assert len(singles) == 5
