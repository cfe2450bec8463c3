"""Differential matrix: every family leanact claims, patched vs unpatched with identical weights.

Axes: original attention (eager, sdpa) x padding (none, right, left, one real token) x mode (train
with grad, eval with grad, no_grad, output_attentions, reentrant and non-reentrant checkpointing)
x precision (fp32, bf16 weights, fp32 + bf16 autocast with backward inside / outside the block) x
copy (none, deepcopy, pickle round trip). The full product is ~14k cases per family; each family
gets CASES cases chosen greedily so that every value of every axis appears at least once with the
family and the pairs vary (deterministic).

Rules (README "Exactness"):
* fp32: loss within 1e-5 relative, every gradient within 1e-5 relative (norm-wise; gradients that
  are zero in exact arithmetic compared against 1e-6 of the model's median gradient norm);
* bf16 weights and autocast: the patched model's error against an fp32 reference is at most twice
  the unpatched model's own error: the error of all gradients together (norm-wise, floored at one
  bf16 ulp, 2^-8) and of the loss (floored at 4 ulps: a scalar's rounding noise); each parameter's
  gradient at most 4x (one random rounding against another is too noisy for 2x per tensor, and
  the ratio would depend on the CPU's kernels); scalar parameters (gates) together, as one tensor: a
  scalar's gradient is one reduction whose relative rounding error is unbounded where its terms cancel;
* no_grad: outputs bit-identical (the patch runs the original kernels).
"""
from __future__ import annotations

import copy
import pickle
import random
import warnings

import pytest
import torch

import _families as F

import leanact  # noqa: E402

ATTN = ("eager", "sdpa")
PADDING = ("none", "right", "left", "one")
MODES = ("train", "eval", "no_grad", "output_attentions", "ckpt_reentrant", "ckpt")
PRECISION = ("fp32", "bf16", "autocast_inside", "autocast_outside")
COPIES = ("none", "deepcopy", "pickle")
AXES = (ATTN, PADDING, MODES, PRECISION, COPIES)
CASES = 8
ULP = 2.0 ** -8


def _cases(family: str, n: int = CASES):
    """n cases covering every axis value: each axis takes its least used value, ties broken by a
    per-family deterministic RNG."""
    rng = random.Random(family)
    counts = [dict.fromkeys(axis, 0) for axis in AXES]
    out = []
    for _ in range(n):
        case = []
        for axis, c in zip(AXES, counts):
            low = min(c.values())
            v = rng.choice([x for x in axis if c[x] == low])
            c[v] += 1
            case.append(v)
        out.append(tuple(case))
    return out


# Known gaps: cases that fail the rules today (strict: a fix turns them into failures to remove).
_KNOWN: dict[str, str] = {}


def _param(f, c):
    case_id = f"{f}-{'-'.join(c)}"
    marks = [pytest.mark.xfail(reason=_KNOWN[case_id], strict=True)] if case_id in _KNOWN else []
    return pytest.param(f, *c, id=case_id, marks=marks)


PARAMS = [_param(f, c) for f in F.FAMILIES for c in _cases(f)]


def test_every_axis_value_with_every_family():
    for f in F.FAMILIES:
        cases = _cases(f)
        for i, axis in enumerate(AXES):
            assert {c[i] for c in cases} == set(axis), (f, axis)


def _main_output(out, fused_loss=False) -> torch.Tensor | None:
    """The model's main output; None for a patched language model whose fused loss consumed the logits."""
    for k in ("logits", "logits_per_image", "last_hidden_state"):
        if getattr(out, k, None) is not None:
            return getattr(out, k)
    if fused_loss and "logits" in type(out).__dataclass_fields__ and out.loss is not None:
        return None
    raise AssertionError(f"no main output in {type(out).__name__}")


def _run(model, batch, mode, precision):
    """(loss, main output, {name: grad}) of one step of ``model`` in ``mode`` / ``precision``."""
    model.zero_grad(set_to_none=True)
    model.train(mode != "eval" and mode != "no_grad")
    kw = {"output_attentions": True} if mode == "output_attentions" else {}
    ac = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision.startswith("autocast"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode == "no_grad":
            with torch.no_grad(), ac:
                out = model(**batch)
            return out.loss, _main_output(out), {}, out
        with ac:
            out = model(**batch, **kw)
            if precision == "autocast_inside":
                out.loss.backward()
        if precision != "autocast_inside":
            out.loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    main = _main_output(out, fused_loss=bool(getattr(leanact.summary(model), "loss_states", None)))
    return out.loss.detach().float(), None if main is None else main.detach(), grads, out


def _attentions(out) -> list:
    """Which attention probabilities came back (the shapes: None where a layer returned none)."""
    found = []
    for key in ("attentions", "encoder_attentions", "decoder_attentions", "cross_attentions",
                "text_model_output", "vision_model_output"):
        v = getattr(out, key, None)
        if key.endswith("_output") and v is not None:
            found += _attentions(v)
        elif v is not None:
            found.append((key, [None if a is None else tuple(a.shape) for a in v]))
    return found


def _rel(a, b, floor):
    return ((a - b).norm() / b.norm().clamp_min(floor)).item()


def _copy(model, how):
    if how == "deepcopy":
        return copy.deepcopy(model)
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    return model


@pytest.mark.slow
@pytest.mark.parametrize("family, attn, padding, mode, precision, copies", PARAMS)
def test_patched_matches_unpatched(family, attn, padding, mode, precision, copies):
    try:
        ref = F.build(family, attn)
    except F.Unsupported:
        attn = "sdpa" if attn == "eager" else "eager"  # eager-only / sdpa-less family: the other one
        ref = F.build(family, attn)
    if F.kind(family) == "image":
        padding = "none"  # images have no padding
    batch = F.batch(family, padding)
    if precision == "bf16":
        ref = ref.to(torch.bfloat16)
    lean = _copy(leanact.patch(copy.deepcopy(ref)), copies)
    assert leanact.summary(lean) is not None
    if mode.startswith("ckpt"):  # after copying: HF's reentrant set-up adds a hook that cannot be pickled
        if not ref.supports_gradient_checkpointing:
            pytest.skip(f"{type(ref).__name__} does not support gradient checkpointing")
        for m in (ref, lean):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "ckpt_reentrant"})
    dtype_batch = F.float_inputs(batch, torch.bfloat16) if precision == "bf16" else batch

    l_ref, o_ref, g_ref, ref_out = _run(ref, dtype_batch, mode, precision)
    l_lean, o_lean, g_lean, lean_out = _run(lean, dtype_batch, mode, precision)
    if mode == "no_grad":
        assert torch.equal(o_lean, o_ref), (o_lean - o_ref).abs().max()
        assert torch.equal(l_lean, l_ref)
        return
    if mode == "output_attentions":
        assert _attentions(lean_out) == _attentions(ref_out)
    assert g_ref.keys() == g_lean.keys()
    median = torch.stack([g.norm() for g in g_ref.values()]).median()
    if precision == "fp32":
        assert abs(l_lean - l_ref) <= 1e-5 * abs(l_ref), (l_ref, l_lean)
        for name, g in g_ref.items():
            if g.norm() < 1e-6 * median:  # zero in exact arithmetic: rounding noise on both sides
                assert (g_lean[name] - g).norm() <= 1e-6 * median, name
            else:
                assert _rel(g_lean[name], g, 0) <= 1e-5, (name, _rel(g_lean[name], g, 0))
        return
    truth = copy.deepcopy(ref).float()  # the same weights (bf16-representable for "bf16"), fp32 arithmetic
    l32, _, g32, _ = _run(truth, batch, mode, "fp32")
    assert abs(l_lean - l32) <= 2 * max(abs(l_ref - l32), 4 * ULP * abs(l32)), (l32, l_ref, l_lean)
    names = list(g32)
    flat = lambda g: torch.cat([g[n].flatten() for n in names])  # noqa: E731
    e_ref, e_lean = _rel(flat(g_ref), flat(g32), 0), _rel(flat(g_lean), flat(g32), 0)
    assert e_lean <= 2 * max(e_ref, ULP), ("all gradients", e_ref, e_lean)
    # Per parameter, 4x: a wrong term in one gradient shows; the ratio of two rounding noises does not.
    # Gradients below one ulp of the median gradient norm (zero in exact arithmetic: key biases) are
    # measured against that floor, in which unit up to 1 is noise.
    # Scalar parameters (gates: Mllama's, Gemma 3n's) are taken together: each one's gradient is a single
    # reduction over a whole activation, whose relative rounding error grows without bound where its terms
    # cancel, so the ratio of two roundings of one scalar is noise.
    median = torch.stack([g.norm() for g in g32.values()]).median()
    scalars = [n for n, g in g32.items() if g.numel() == 1]
    groups = [([n], g32[n]) for n in g32 if n not in scalars]
    if scalars:
        groups.append((scalars, torch.cat([g32[n].flatten() for n in scalars])))
    for group, g in groups:
        pick = lambda grads: torch.cat([grads[n].flatten() for n in group]).view_as(g) if len(group) > 1 \
            else grads[group[0]]  # noqa: E731
        e_ref, e_lean = _rel(pick(g_ref), g, ULP * median), _rel(pick(g_lean), g, ULP * median)
        assert e_lean <= 4 * max(e_ref, ULP if g.norm() >= ULP * median else 1.0), (group, e_ref, e_lean)


@pytest.mark.slow
@pytest.mark.parametrize("family", F.FAMILIES)
def test_summary_is_truthful(family, monkeypatch):
    """Every attention row that says "leanact" ran leanact's core in a training step; every row
    that says "left" did not."""
    from leanact.patching import attention_hf, hf_alibi

    try:
        model = leanact.patch(F.build(family, "sdpa"))
    except F.Unsupported:
        model = leanact.patch(F.build(family, "eager"))
    seen, last = set(), []
    state_of, core = attention_hf.module_state, attention_hf._lean_attention

    def spy_state(module):
        last[:] = [state_of(module)]
        return last[0]

    def spy_core(*args, **kwargs):
        seen.add(id(last[0]))
        return core(*args, **kwargs)

    def spy_alibi_core(*args, **kwargs):  # Bloom / Falcon: one state per model, on the modules
        seen.add("alibi")
        return alibi_core(*args, **kwargs)

    alibi_core = hf_alibi._lean_attention
    monkeypatch.setattr(attention_hf, "module_state", spy_state)
    monkeypatch.setattr(attention_hf, "_lean_attention", spy_core)
    monkeypatch.setattr(hf_alibi, "_lean_attention", spy_alibi_core)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(**F.batch(family, "right")).loss.backward()
    s = leanact.summary(model)
    rows = [(path, after) for path, _, after in s.attention if path in s.attention_states]
    assert rows, s.attention
    for path, after in rows:
        state = s.attention_states[path]
        ran = ("alibi" if isinstance(state, hf_alibi.AlibiState) else id(state)) in seen
        assert ran == after.startswith("leanact"), (path, after, ran)
