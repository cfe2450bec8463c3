"""The norms' verdict: whether a norm's output determines x̂, decided from γ and β and cached.

The from-output backward of LayerNorm and RMSNorm (:mod:`.layer_norm`, :mod:`.rms_norm`,
:mod:`.dropout_add_norm`) rebuilds x̂ = (y − β)/γ from the output y it keeps: what is kept for
backward is y and rstd only where this module says y determines x̂ accurately enough.

When is x̂ = (y − β)/γ exact enough? y is rounded to its dtype (unit roundoff u), with absolute
error ≤ u·(|y| + tiny) (tiny = smallest normal, the subnormal spacing), so x̂ recovered from y
is off by ≤ u·(|x̂| + |β/γ| + tiny/|γ|). The |x̂| term is the rounding y carries anyway; the
others are amplification. The op recovers x̂ from y only if every channel satisfies

    |γ| ≥ tiny                      (y not subnormal, (y − β)/γ finite; tiny/|γ| ≤ 1),
    |β| ≤ max_ratio·|γ|             (at most max_ratio extra units of y's rounding),
    |γ|·sqrt(N) + |β| ≤ max         (y cannot overflow: |x̂| ≤ sqrt(N)),

and γ, β are finite; otherwise it falls back to torch's own layer_norm (keeps the input, mean and
rstd). ``max_ratio`` defaults to 8: the recovered x̂ is then within u·(|x̂| + 9) of the exact one,
i.e. the worst channel loses about 3 bits of y's precision. Note the rule is per tensor: one bad
channel moves the whole tensor to the fallback.

The decision reads γ and β on the host (one tiny reduction and one sync) and is cached per weight
tensor, keyed on (data_ptr, _version) of γ and β and on the number of optimizer steps taken so far
(a global ``torch.optim`` step post-hook counts every ``Optimizer.step()``, fused or not: a fused
AdamW updates parameters without bumping ``_version``), so it runs once per optimizer step; the
first norm to run after a step decides again, at once, for every norm of the previous step whose γ
and β are parameters an optimizer updated in place (:mod:`.batch_check`: one sync per step, not one
per norm; norms on copies refreshed just before they run, as FSDP's, decide alone). Under
Adam / AdamW a passing verdict stands without that check while the steps since it cannot have
moved γ, β out of the rule (:mod:`.step_bound`: no sync on most steps; only steps leanact watched
end to end count, every other write ends the bound; :func:`use_step_bound` turns it off).
Frozen γ and β (``requires_grad=False``: PEFT / LoRA) are decided once, while their storage and
``_version`` stay the same. A cached verdict trusts that nothing it cannot see (a write through
``.data``, a kernel that skips ``_version``) changed γ, β: so every forward that uses one launches,
at its first norm and without a sync, the same batched check of every cached passing verdict
(:func:`_arm`), and the norms' backward reads it when the device has long computed it
(:func:`confirm_verdicts`; where the backward ran compiled, the next optimizer step's pre-hook): a
contradicted verdict raises an error naming leanact before any inexact gradient is returned (or
applied), and the norm decides again at its next call (or call :func:`clear_decision_cache` after
such writes). Callers can skip the check with ``from_output=True/False``. Under ``torch.func``
transforms the op is torch's own layer_norm, and the check, when called there, reads the values of the
wrapped γ, β (functorch wrappers have no storage), uncached. Under torch.compile the decision is
taken when the graph is traced (the eager check on γ, β then: no graph break) and is a constant of
the graph; every run of a graph that recovers x̂ from y checks on the device, without a sync, that
γ, β still pass the rule, and stops with an error naming leanact if they do not
(``torch._assert_async``).
"""
from __future__ import annotations

import contextlib
import math
import os
import weakref

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.weak import WeakIdKeyDictionary

from .. import fake_rules
from ..transforms import is_wrapped, unwrap
from . import step_bound
from .batch_check import check_many, check_many_later

__all__ = ["from_output_ok", "clear_decision_cache", "confirm_verdicts", "use_step_bound", "offset_gamma",
           "DEFAULT_MAX_RATIO"]

DEFAULT_MAX_RATIO = 8.0

#: ref (γ, else β) -> [key, ok, args, stand]: the cached decision, what deciding it again needs, and
#: for a passing verdict of the batched check its :class:`~leanact.ops.norms.step_bound.Stand` (None
#: otherwise): while the optimizer steps since stay within its slack, it stands unchecked
_DECISIONS: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: id(ref) -> (weak reference to ref, its _DECISIONS entry): the per-call lookup by id (a
#: WeakIdKeyDictionary lookup builds a weak reference each time, per norm call)
_BY_ID: dict[int, tuple] = {}
_STEPS = [0]  # optimizer steps taken in this process (any torch.optim.Optimizer, fused or not)
#: whether a passing verdict may stand on Adam's step bound (:func:`use_step_bound`)
_BOUND = [os.environ.get("LEANACT_NORM_BOUND", "1") != "0"]


def use_step_bound(enabled: bool) -> None:
    """Let passing verdicts stand on Adam/AdamW's step bound between checks (the default; confirmed by a
    deferred device check), or check every norm at every optimizer step (one sync a step). The
    environment variable ``LEANACT_NORM_BOUND=0`` sets False at import."""
    _BOUND[0] = bool(enabled)


#: id -> weak reference of the parameters of every optimizer that has stepped (their values are
#: current right after a step); by id, not a dictionary of weak keys: looked up per norm and step
_OPTIMIZED: dict[int, weakref.ref] = {}
_OPTIMIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> parameters it had


def _count_step(optimizer, args, kwargs) -> None:
    _STEPS[0] += 1
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if _OPTIMIZERS.get(optimizer) != len(params):  # new, or a param group added since
        _OPTIMIZERS[optimizer] = len(params)
        for p in params:
            if _optimized(p):
                continue
            key = id(p)
            _OPTIMIZED[key] = weakref.ref(p, lambda _r, key=key: _OPTIMIZED.pop(key, None)
                                          if _OPTIMIZED.get(key) is _r else None)


def _optimized(t: torch.Tensor) -> bool:
    r = _OPTIMIZED.get(id(t))
    return r is not None and r() is t


# Every torch.optim.Optimizer's step() runs the global post-hooks, fused kernels included: the
# cached decisions are keyed on this count, so a step that skips _version still invalidates them.
register_optimizer_step_post_hook(step_bound.own_hook(_count_step))


def clear_decision_cache() -> None:
    """Forget cached from-output decisions (needed only after writes outside an optimizer step that
    skip ``_version``, e.g. ``p.data.copy_(...)``)."""
    _DECISIONS.clear()
    _BY_ID.clear()
    _PENDING.clear()
    _OWED.clear()
    _GENERATION[0] += 1


def _remember(ref: torch.Tensor, entry: list) -> None:
    """Cache ``entry`` as ``ref``'s decision (in :data:`_DECISIONS` and its by-id mirror)."""
    _GENERATION[0] += 1
    _DECISIONS[ref] = entry
    key = id(ref)
    _BY_ID[key] = (weakref.ref(ref, lambda r, key=key: _BY_ID.pop(key, None) if _BY_ID.get(key, (None,))[0] is r
                               else None), entry)


def _cached(ref: torch.Tensor) -> list | None:
    """``ref``'s cached decision entry, or None."""
    hit = _BY_ID.get(id(ref))
    return hit[1] if hit is not None and hit[0]() is ref else None


def offset_gamma(w: torch.Tensor) -> torch.Tensor:
    """γ = 1 + w in float32 (Gemma's RMSNorm: :func:`from_output_ok` with ``offset=True``)."""
    return 1.0 + w.to(torch.float32)


def _check(weight, bias, n: int, dtype: torch.dtype, max_ratio: float, offset: bool = False) -> bool:
    return bool(_rule_holds(weight, bias, n, dtype, max_ratio, offset))


def _rule_holds(weight, bias, n: int, dtype: torch.dtype, max_ratio: float, offset: bool = False) -> torch.Tensor:
    """The rule of the module doc for every channel, as a 0-d bool tensor on γ's device (no sync)."""
    if offset:
        weight = offset_gamma(weight.detach())
    fi = torch.finfo(dtype)
    ref = weight if weight is not None else bias
    ct = torch.promote_types(torch.promote_types(ref.dtype, dtype), torch.float32)
    with torch.no_grad():
        g = (weight.detach().to(ct).abs().reshape(-1) if weight is not None
             else torch.ones_like(bias, dtype=ct).reshape(-1))
        ok = torch.isfinite(g) & (g >= fi.tiny)
        bound = g * math.sqrt(n)
        if bias is not None:
            b = bias.detach().to(ct).abs().reshape(-1)
            ok &= torch.isfinite(b) & (b <= max_ratio * g)
            bound = bound + b
        ok &= bound <= fi.max
        return ok.all()


def _check_unwrapped(weight, bias, n: int, dtype: torch.dtype, max_ratio: float, offset: bool = False) -> bool:
    """:func:`_check` on the values under functorch wrappers. Under ``vmap`` these carry batch
    dimensions (anywhere) that γ and β need not share: then the rule is applied to the extremes,
    min|γ| against max|β| (a sufficient condition for every channel of every batch entry)."""
    w = None if weight is None else unwrap(weight)
    b = None if bias is None else unwrap(bias)
    if offset:
        w, weight = offset_gamma(w), offset_gamma(weight)
    if all(u is None or u.shape == t.shape for u, t in ((w, weight), (b, bias))):
        return _check(w, b, n, dtype, max_ratio)
    ref = w if w is not None else b
    ct = torch.promote_types(torch.promote_types(ref.dtype, dtype), torch.float32)
    fi = torch.finfo(dtype)
    with torch.no_grad():
        g = w.detach().to(ct).abs() if w is not None else torch.ones(1, dtype=ct)
        bb = b.detach().to(ct).abs() if b is not None else torch.zeros(1, dtype=ct)
        if not (torch.isfinite(g).all() and torch.isfinite(bb).all()):
            return False
        g_min, g_max, b_max = g.min().item(), g.max().item(), bb.max().item()
    return g_min >= fi.tiny and b_max <= max_ratio * g_min and g_max * math.sqrt(n) + b_max <= fi.max


def _identity(t: torch.Tensor):
    """(data_ptr, _version) of a tensor with storage; None for wrappers without one."""
    try:
        return t.data_ptr(), t._version
    except RuntimeError:  # e.g. "Cannot access data pointer of Tensor that doesn't have storage"
        return None


def from_output_ok(weight, bias, n: int, dtype: torch.dtype, max_ratio: float = DEFAULT_MAX_RATIO,
                   offset: bool = False) -> bool:
    """True when x̂ can be recovered from a ``dtype`` output y = γ·x̂ + β accurately (see module doc).

    ``n`` is the number of normalized elements per row. ``offset``: γ = 1 + ``weight`` in float32
    (Gemma's RMSNorm; no bias). Cached per weight on (data_ptr, _version) and the optimizer step
    count; functorch-wrapped γ, β (``torch.func``) are checked by value (under ``vmap``: every batch
    entry must pass), uncached. Under torch.compile: decided when traced, asserted on the device at
    every run (module doc).
    """
    if _FAKE_RUN[0] is not None and any(t is not None and is_fake(t) for t in (weight, bias)):
        return _fake_decision(_FAKE_RUN[0].real_of, weight, bias, n, dtype, max_ratio, offset)
    if torch.compiler.is_compiling():
        if not _decided_while_tracing(weight, bias, n, dtype, max_ratio, offset):
            return False
        _assert_still_holds(weight, bias, n, dtype, max_ratio, offset)
        return True
    return _from_output_ok_on_host(weight, bias, n, dtype, max_ratio, offset)  # eager: no compiler.disable wrapper


# -- on fake tensors (leanact.estimate) ----------------------------------------------------------

_FAKE_RUN: list = [None]  # the leanact.ops.fake_rules.FakeRun while the estimate's rules are in force


def _fake_decision(real_of: dict, weight, bias, n: int, dtype: torch.dtype, max_ratio: float, offset: bool) -> bool:
    """The decision for fake γ, β, whose values a fake tensor does not have: the real weights' when
    the estimate knows them, else True (a model built from a config, or meta weights: the default
    initialisation γ = 1, β = 0)."""
    real = [None if t is None else real_of.get(id(t)) for t in (weight, bias)]
    if any(t is not None and (r is None or r.device.type == "meta") for t, r in zip((weight, bias), real)):
        return True
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        return from_output_ok(real[0], real[1], n, dtype, max_ratio, offset)


@contextlib.contextmanager
def _fake_rule(run):
    saved = _FAKE_RUN[0]
    _FAKE_RUN[0] = run
    try:
        yield
    finally:
        _FAKE_RUN[0] = saved


fake_rules.register("norm verdicts", rule=_fake_rule)


def _from_output_ok_on_host(weight, bias, n: int, dtype: torch.dtype, max_ratio: float, offset: bool = False) -> bool:
    if weight is None and bias is None:
        return True
    # (explicit tests, no generators: this runs per norm call, on the host's critical path)
    if (weight is not None and is_wrapped(weight)) or (bias is not None and is_wrapped(bias)):
        with torch._C._DisableFuncTorch():
            return _check_unwrapped(weight, bias, n, dtype, max_ratio, offset)
    ref = weight if weight is not None else bias
    w_id = None if weight is None else _identity(weight)
    b_id = None if bias is None else _identity(bias)
    if (weight is not None and w_id is None) or (bias is not None and b_id is None):
        return _check(weight, bias, n, dtype, max_ratio, offset)  # no storage identity to cache on
    key = (w_id, b_id, _step_of(weight, bias), n, dtype, max_ratio, offset)
    hit = _cached(ref)
    if hit is None or hit[0] != key:
        if hit is not None and hit[0][2] not in (_STEPS[0], _FROZEN) and _refresh_stale(ref.device):
            hit = _cached(ref)  # every norm of the last step decided again, in one pass
        if hit is None or hit[0] != key:
            ok = _check(weight, bias, n, dtype, max_ratio, offset)
            hit = [key, ok, _args(weight, bias, n, dtype, max_ratio, offset), None, _EPOCH[0]]  # (no slack: alone)
            _remember(ref, hit)
            return ok  # (read now: nothing to confirm)
    if hit[1] and _graph_task_id() == -1:  # a passing verdict read earlier, used by a forward (not a recompute)
        if not _PENDING or hit[4] == _EPOCH[0]:  # none in flight, or this norm already ran under it: a new forward
            _arm()
        hit[4] = _EPOCH[0]
    return hit[1]


#: the step part of the key of a norm whose γ and β do not require grad (a PEFT / LoRA model's): no
#: optimizer steps them, so the decision holds across steps while their storage and _version do
_FROZEN = -1


def _step_of(weight, bias) -> int:
    if (weight is not None and weight.requires_grad) or (bias is not None and bias.requires_grad):
        return _STEPS[0]
    return _FROZEN


def _args(weight, bias, n, dtype, max_ratio, offset) -> tuple:
    """What a later step needs to decide again for the same norm (γ, β held weakly)."""
    return (None if weight is None else weakref.ref(weight), None if bias is None else weakref.ref(bias), n, dtype,
            max_ratio, offset)


def _intact(t: torch.Tensor) -> bool:
    """Whether a cached norm's γ or β holds its current values now, before its norm runs: a plain
    parameter of an optimizer that has stepped (updated in place), whose storage still holds it.
    Not so for copies refreshed just before their layer runs, e.g. FSDP's unsharded parameters (the
    optimizer steps the shards; after the forward FSDP may free the storage and keep the shape):
    such norms decide alone when they run, as before."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or not _optimized(t) or is_wrapped(t) or not t.numel():
        return False
    if _identity(t) is None:
        return False
    return t.untyped_storage().nbytes() >= step_bound.storage_bytes(t)


def _refresh_stale(device: torch.device) -> bool:
    """Decide again for every cached norm on ``device`` whose decision predates this optimizer step:
    a passing verdict whose γ, β only Adam/AdamW steps moved, by less than its slack, stands
    (:class:`leanact.ops.norms.step_bound.Stand`: no device work, no sync); the others are decided in one
    batch (:func:`leanact.ops.norms.batch_check.check_many`: one sync), which also gives their slack. False
    (nothing done) where that cannot help: no such norm, or a dispatch mode (fake tensors) active."""
    if _get_current_dispatch_mode() is not None:
        return False
    step = _STEPS[0]
    _settle(raising=False)  # (verdicts of a forward whose backward never ran: no gradient was inexact)
    refs, items, stood = [], [], False
    for ref, entry in list(_DECISIONS.items()):
        key = entry[0]
        if key[2] == step or key[2] == _FROZEN:
            continue
        stand = entry[3]
        if stand is not None and _BOUND[0] and stand.holds():  # (any device: the verdict needs no check now)
            wr, br = entry[2][:2]
            w, b = (None if r is None else r() for r in (wr, br))
            entry[0] = (None if w is None else _identity(w), None if b is None else _identity(b), step, *key[3:])
            stood = True  # (confirmed with the forward's others: _arm)
            continue
        wr, br, n, dtype, max_ratio, offset = entry[2]
        w, b = (None if r is None else r() for r in (wr, br))
        if (wr is not None and w is None) or (br is not None and b is None) or ref.device != device:
            continue
        if is_fake(ref) or not all(t is None or _intact(t) for t in (w, b)):
            continue
        refs.append(ref)
        items.append((w, b, n, dtype, max_ratio, offset))
    if not items:
        return stood
    for ref, (w, b, n, dtype, max_ratio, offset), (ok, slack, w_max, b_max) in zip(
            refs, items, check_many(items, slack=True)):
        stand = None
        if ok and slack > 0.0:
            stand = step_bound.Stand(slack, [(t, m) for t, m in ((w, w_max), (b, b_max)) if t is not None])
        _remember(ref, [_key_of(w, b, n, dtype, max_ratio, offset), ok, _args(w, b, n, dtype, max_ratio, offset),
                        stand, 0])
    return True


_STALE = -2  # the step part of the key of a verdict its confirmation contradicted

#: [(epoch, [(ref weakly, entry)], Later)]: the passing verdicts in the cache when a forward first used
#: one, with the deferred check that confirms them (:func:`_arm`)
_PENDING: list = []
_GENERATION = [0]  # advanced when a cached decision is added, replaced or contradicted
_EPOCH = [1]  # advanced at each _arm; a cache entry's [4] is the epoch in which its norm last ran
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)  # -1: not inside a backward


def _arm() -> None:
    """At the first norm of a forward that uses a cached passing verdict: launch, without a sync, the
    check of every cached passing verdict whose γ, β are readable now (per device, one batch:
    :func:`leanact.ops.norms.batch_check.check_many_later`); the norms' backward reads it
    (:func:`confirm_verdicts`). A cached verdict trusts that nothing changed γ, β unseen since it was
    read; this confirms it for every forward, at the cost of one batch of small launches."""
    _settle(raising=False)
    _EPOCH[0] += 1
    if _get_current_dispatch_mode() is not None:
        return
    by_device: dict = {}
    for ref_wr, entry, (wr, br, *rest), sizes in _armable():
        w, b = (None if r is None else r() for r in (wr, br))
        if (wr is not None and w is None) or (br is not None and b is None):
            continue
        # (storage still holding the values: not an FSDP copy freed after its layer ran)
        if all(t is None or t.untyped_storage().nbytes() >= n for t, n in zip((w, b), sizes)):
            by_device.setdefault(w.device if w is not None else b.device, []).append((ref_wr, entry, (w, b, *rest)))
    for triples in by_device.values():
        _PENDING.append((_EPOCH[0], [(r, e) for r, e, _ in triples], check_many_later([it for *_, it in triples])))


_ARMABLE: list = [-1, []]  # [_GENERATION when built, [(ref weakly, entry, args, storage bytes of γ, β)]]


def _armable() -> list:
    """The cached passing verdicts whose γ, β are plain tensors with storage (no fake tensor, functorch
    wrapper or tensor subclass), rebuilt only when a decision changed."""
    if _ARMABLE[0] != _GENERATION[0]:
        out = []
        for ref, entry in list(_DECISIONS.items()):
            if not entry[1] or is_fake(ref):
                continue
            wr, br = entry[2][:2]
            w, b = (None if r is None else r() for r in (wr, br))
            if all(t is not None and _plain(t) for t in (w, b) if t is not None) and (w is not None or b is not None):
                out.append((weakref.ref(ref), entry, entry[2], tuple(0 if t is None else step_bound.storage_bytes(t)
                                                                    for t in (w, b))))
        _ARMABLE[:] = [_GENERATION[0], out]
    return _ARMABLE[1]


def _plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and not is_wrapped(t) and _identity(t) is not None


def confirm_verdicts() -> None:
    """Called by every from-output backward: the cached verdicts this forward used are confirmed by the
    check :func:`_arm` launched at its first norm, read now (the device has long computed it: no
    wait). A write that skips ``_version`` (``p.data.mul_(0)``, a kernel of one's own), which neither
    the cache nor Adam's bound can see, and that moved γ, β out of the rule would make this backward
    inexact: the norm decides again at its next call, and this raises."""
    if torch.compiler.is_compiling():
        return
    if (_PENDING or _OWED) and _get_current_dispatch_mode() is None:
        _settle(raising=True)  # (not while a compiler traces the backward: see _confirm_before_step)


def _confirm_before_step(optimizer, args, kwargs) -> None:
    """The same confirmation before an optimizer applies gradients: where the norms' backward ran
    compiled (its Python is not run again), an inexact step raises here before it is taken."""
    confirm_verdicts()


register_optimizer_step_pre_hook(step_bound.own_hook(_confirm_before_step))


#: normalized sizes of norms whose contradicted verdict a forward used, read where no error could be
#: raised (the next forward's first norm): owed to the next backward or optimizer step, which raise
#: (that forward's graph, if it is ever differentiated, holds the inexact path)
_OWED: list = []


def _settle(raising: bool) -> None:
    failed = _OWED
    while _PENDING:
        epoch, pairs, later = _PENDING.pop()
        for (ref, entry), ok in zip(pairs, later.result()):
            if ok:
                continue
            r = ref()
            used = entry[4] == epoch and r is not None and _cached(r) is entry and entry[1]
            entry[0], entry[1], entry[3] = (None, None, _STALE, *entry[0][3:]), False, None  # decided again
            _GENERATION[0] += 1
            if used:
                failed.append(entry[2][2])
    if failed and raising:
        failed = failed[:]
        _OWED.clear()
        raise RuntimeError(
            f"leanact: the γ/β of {len(failed)} norm(s) (normalized sizes {sorted(set(failed))}) changed "
            "in a way leanact cannot see (a write through `.data`, or by a kernel that skips `_version`) and "
            "left the range where the backward from the norm's output is exact, so this backward would give "
            "inexact gradients. Write parameters under `torch.no_grad()` without `.data` (leanact sees those "
            "writes), or call `leanact.ops.norms.clear_decision_cache()` after such writes; these norms "
            "decide again at their next call.")


def _key_of(w, b, n, dtype, max_ratio, offset) -> tuple:
    return (None if w is None else _identity(w), None if b is None else _identity(b), _step_of(w, b), n, dtype,
            max_ratio, offset)


# reads values on the host: outside any compiled graph (the graph break names from_output_ok)
# -- while torch.compile traces ------------------------------------------------------------------
# The decision is taken when the graph is traced, on the values γ and β have then (the cached eager
# check: no graph break), and is a constant of the graph. Every run of the graph then checks on the
# device, without a sync, that γ and β still pass: a graph that recovers x̂ from y never runs on γ, β
# that fail the rule (torch._assert_async: on the CPU a RuntimeError with the message below; on CUDA
# a device-side assertion, which stops the process).

_decided_while_tracing = torch._dynamo.assume_constant_result(_from_output_ok_on_host)

_FAILED_WHILE_COMPILED = ("leanact: a compiled norm recovers its input from its output, decided when the graph was "
                          "traced, and its weight (gamma, beta) no longer allows it (zero, tiny or large entries). "
                          "Fix: set from_output=False on that norm (or leanact.unpatch the model) and compile again")


def _assert_still_holds(weight, bias, n: int, dtype: torch.dtype, max_ratio: float, offset: bool) -> None:
    if weight is None and bias is None:
        return
    torch._assert_async(_rule_holds(weight, bias, n, dtype, max_ratio, offset), _FAILED_WHILE_COMPILED)
