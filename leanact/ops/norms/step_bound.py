"""How far optimizer steps can move a norm's γ and β: what lets a from-output verdict outlive a
step without a check (no device-to-host sync).

The norms decide once per optimizer step whether their output determines x̂
(:mod:`leanact.ops.norms.verdict`): one batched check and one sync per step
(:mod:`leanact.ops.norms.batch_check`). The sync makes the host wait for the GPU to finish the previous
step before it enqueues the next forward: in a host-bound step, time lost (docs/benchmarks.md,
"Measurements behind the library's constants"). For ``torch.optim.Adam`` and ``AdamW`` the check
can be skipped for many steps, exactly:

* **Adam's step is bounded whatever the gradients.** With m, v started at zero (as torch starts
  them), ``|m_t| ≤ A·sqrt(v_t)`` element-wise for every t, with ``A = 1/sqrt(1−β2)``, whatever β1 is
  at each step (up to ``2β2/(1+β2)``, 0.9995 for β2 = 0.999: a schedule such as OneCycleLR's, which
  cycles β1, included): by Cauchy–Schwarz on the recursions m ← β1·m + (1−β1)·g, v ← β2·v + (1−β2)·g²,
  ``a_{t+1}² ≤ (β1²/β2)·a_t² + (1−β1)²/(1−β2)``, and A² is above that whenever ``a_t ≤ A`` (a larger
  β2 seen earlier keeps its larger A: the largest of the group's history is used). So the update
  ``lr·(m/bc1)/(sqrt(v/bc2) + eps)`` is at most ``lr·A·F`` with ``F = sup_t sqrt(1−β2^t)/(1−β1^t)``
  for this step's betas (``A·F`` ≈ 31.6 for the default betas; a fixed β1 = 0.9 would give 7.3, but
  β1 may change between steps), whatever the gradients, their scale, clipping, ``amsgrad`` (a larger
  denominator) or ``maximize``. Weight decay coupled to the gradient (Adam) is inside that bound;
  decoupled (AdamW) adds ``lr·wd·|θ|``. The parameter's own rounding adds ``eps(dtype)·|θ|``.
* **A verdict has a slack.** The batched check also returns, per norm, the largest change δ of
  every element of γ and β that cannot break the rule (``|γ| ≥ tiny``, ``|β| ≤ r·|γ|``,
  ``|γ|·sqrt(N) + |β| ≤ max``) and the largest ``|γ|``, ``|β|``.

A per-parameter accumulator (:class:`Drift`) adds each Adam/AdamW step's bound (a global step
post-hook; the learning rate and betas read from the parameter's group at that step). A passing
verdict then stands while the drift since its check is at most half its slack (the other half
covers the rule's own rounding in the compute dtype) and the parameter was written by nothing else:
its ``_version`` and ``data_ptr`` are the ones the last step left, and were the check's when that
step began (a step pre-hook). The rule: a step counts only where leanact watched it end to end, i.e.
nothing but the optimizer's own update ran between leanact's global pre- and post-hook: any step hook
leanact did not install (the optimizer's or global: it may write parameters, moments or the learning
rate) or a closure ends the bound for that step. So does any
other optimizer (SGD's step has no such bound), a learning rate or betas held as CUDA tensors,
``eps = 0``, β1 above ``2β2/(1+β2)`` or a write outside a step: the next step checks again.
The moments' invariant ``|m| ≤ A·sqrt(v)`` holds for a state leanact saw the optimizer produce
from zero; a state it did not see (loaded by ``load_state_dict``, edited in place, or stepped while
the parameter was not tracked: its tensors' identity and ``_version`` differ from what the last
watched step left) is verified once, at the next step (the largest ``|m|/sqrt(v)`` of the group,
one sync), and the bound then uses that ratio as A where it is larger: the induction above holds
from any state with a finite ratio. Writes no ``_version`` records (through ``.data``, by a kernel of
one's own) are what this module cannot see: :func:`leanact.ops.norms.verdict.confirm_verdicts` confirms
every cached verdict a forward used with a deferred check, so such a write raises there instead of
giving an inexact gradient.
"""
from __future__ import annotations

import math
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["Drift", "Stand", "track", "step_bound", "ratio_bound", "storage_bytes"]


class Drift:
    """What optimizer steps may have done to one parameter since it was tracked: ``total`` (the sum
    of the steps' bounds on any element's change), ``epoch`` (advanced where no bound holds: a
    verdict of an earlier epoch no longer stands), ``version`` (the ``_version`` the last step, or
    the check, left), ``mbound`` (a bound on max |θ| now), ``eps`` (the dtype's unit of rounding)."""

    __slots__ = ("total", "epoch", "version", "ptr", "mbound", "eps")

    def __init__(self, p: torch.Tensor):
        self.total, self.epoch, self.version, self.ptr = 0.0, 0, p._version, p.data_ptr()
        self.mbound = math.inf
        self.eps = torch.finfo(p.dtype).eps if p.is_floating_point() else math.inf


_DRIFT: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> Drift
_GENERATION = [0]  # advanced when a parameter is first tracked (the per-optimizer lists are rebuilt)
_BY_OPTIMIZER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> (key, [(group, pairs)])


def track(p: torch.Tensor, max_abs: float) -> tuple[float, int]:
    """Start or refresh ``p``'s drift at a check that read its values now (max |p| = ``max_abs``);
    returns the baseline ``(total, epoch)`` a verdict of that check compares with (:class:`Stand`)."""
    d = _DRIFT.get(p)
    if d is None:
        d = _DRIFT[p] = Drift(p)
        _GENERATION[0] += 1
    elif d.version != p._version or d.ptr != p.data_ptr():  # written or re-pointed since last seen
        d.epoch += 1
    d.version, d.ptr, d.mbound = p._version, p.data_ptr(), max_abs
    return d.total, d.epoch


def storage_bytes(t: torch.Tensor) -> int:
    """The bytes of storage ``t``'s elements reach (offset and strides included)."""
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return (t.storage_offset() + span) * t.element_size()


class Stand:
    """A passing verdict's standing (checked per step at the first norm, on the host's critical path:
    attribute reads only, no dictionary of weak keys): the tensors it read, weakly, each with its
    :class:`Drift`, the drift's baseline at the check, and the storage bytes its values need."""

    __slots__ = ("half_slack", "parts")

    def __init__(self, slack: float, tensors: list[tuple[torch.Tensor, float]]):
        self.half_slack = 0.5 * slack
        parts = []
        for t, max_abs in tensors:
            total, epoch = track(t, max_abs)
            parts.append((weakref.ref(t), _DRIFT[t], total, epoch, storage_bytes(t)))
        self.parts = tuple(parts)

    def holds(self) -> bool:
        """Whether the verdict still stands: every tensor within half the slack of its values at the
        check (only bounded optimizer steps since, no other write: its ``_version`` is the one the last
        step left, its epoch the check's) and its storage still holding them."""
        half = self.half_slack
        for ref, d, total, epoch, nbytes in self.parts:
            t = ref()
            if (t is None or d.epoch != epoch or d.version != t._version or d.total - total > half
                    or d.ptr != t.data_ptr() or t.untyped_storage().nbytes() < nbytes):
                return False
        return True


_BIAS_FACTORS: dict[tuple[float, float], float] = {}


def moment_bound(beta2: float) -> float | None:
    """``A = 1/sqrt(1−β2)``: ``|m| ≤ A·sqrt(v)`` for any β1 schedule (module doc); None outside (0, 1)."""
    return 1.0 / math.sqrt(1.0 - beta2) if 0.0 < beta2 < 1.0 else None


def ratio_bound(beta1: float, beta2: float, moment: float | None = None) -> float | None:
    """``A·F`` (module doc): the largest ``|m̂|/sqrt(v̂)`` a step with these betas can produce, ``A``
    the largest :func:`moment_bound` of the group's history (default: this β2's), or None where no
    finite bound is derived (β1 above ``2β2/(1+β2)``, betas outside [0, 1))."""
    a = moment_bound(beta2)
    if a is None or not 0.0 <= beta1 <= min(0.9999, 2.0 * beta2 / (1.0 + beta2)):
        return None
    key = (beta1, beta2)
    f = _BIAS_FACTORS.get(key)
    if f is None:
        # F: the bias corrections' ratio; past a few hundred thousand steps β1^t is 0 in float64 and
        # the ratio tends to 1
        f, p1, p2 = 1.0, 1.0, 1.0
        for _ in range(400_000):
            p1 *= beta1
            p2 *= beta2
            f = max(f, math.sqrt(1.0 - p2) / (1.0 - p1))
            if p1 < 1e-300:
                break
        _BIAS_FACTORS[key] = f
    return max(a, moment or 0.0) * f * 1.001  # (and the update's own rounding in float32, far below 0.1%)


#: optimizer -> {group index: the largest moment_bound its steps have had}
_MOMENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _scalar(v) -> float | None:
    """A hyperparameter as a float without a device sync (None for one held on an accelerator)."""
    if isinstance(v, torch.Tensor):
        return float(v) if v.device.type == "cpu" and v.numel() == 1 else None
    return float(v)


def _hyper(group: dict) -> tuple[float, float, float, float, float] | None:
    """(lr, eps, weight decay, β1, β2) of an Adam group as floats, or None (missing, or on a device)."""
    try:
        values = (_scalar(group["lr"]), _scalar(group["eps"]), _scalar(group["weight_decay"]),
                  *(_scalar(b) for b in group["betas"]))
    except (KeyError, TypeError, ValueError):
        return None
    return None if len(values) != 5 or None in values else values  # type: ignore[return-value]


def step_bound(optimizer, group: dict, moment: float | None = None) -> tuple[float, float] | None:
    """``(c, k)``: one step of ``optimizer`` on ``group`` changes each element of a parameter by at
    most ``c + k·|θ|`` (module doc; ``moment``: the largest :func:`moment_bound` of the group's
    history); None where no bound is known."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return None
    hyper = _hyper(group)
    if hyper is None:
        return None
    lr, eps, wd, b1, b2 = hyper
    if not (lr >= 0.0 and eps > 0.0 and wd >= 0.0):
        return None
    ab = ratio_bound(b1, b2, moment)
    if ab is None or not math.isfinite(lr * ab):
        return None
    decoupled = type(optimizer) is torch.optim.AdamW or bool(group.get("decoupled_weight_decay", False))
    return lr * ab, (lr * wd if decoupled else 0.0)


def _moments(optimizer) -> dict[int, float] | None:
    """Record this step's β2 for every group of an Adam/AdamW ``optimizer`` (every step, tracked or
    not: the history a later bound needs) and return the groups' largest moment bounds."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return None
    seen = _MOMENTS.get(optimizer)
    if seen is None:
        seen = _MOMENTS[optimizer] = {}
    for i, g in enumerate(optimizer.param_groups):
        hyper = _hyper(g)
        a = None if hyper is None else moment_bound(hyper[4])
        seen[i] = max(seen.get(i, 0.0), a if a is not None else math.inf)
    return seen


def _tracked(optimizer) -> list[tuple[dict, list[tuple[torch.Tensor, Drift]]]]:
    """(group, [(parameter, drift)]) for the tracked parameters of ``optimizer``, cached until a
    parameter is tracked anew or the groups change (the group dicts themselves: ``load_state_dict``
    replaces them)."""
    groups = optimizer.param_groups
    key = (_GENERATION[0], tuple(map(id, groups)), sum(len(g["params"]) for g in groups))
    hit = _BY_OPTIMIZER.get(optimizer)
    if hit is not None and hit[0] == key:
        return hit[1]
    out = []
    for g in groups:
        pairs = [(p, d) for p in g["params"] if (d := _DRIFT.get(p)) is not None]
        if pairs:
            out.append((g, pairs))
    _BY_OPTIMIZER[optimizer] = (key, out)
    return out


#: the global optimizer step hooks of leanact's own (:func:`own_hook`): any other step hook, global
#: or the optimizer's, may write parameters, moments or hyper-parameters inside the step
_OWN_HOOKS: set = set()


def own_hook(hook):
    """Register ``hook`` as a global step hook of leanact's (it writes nothing the bound depends on)."""
    _OWN_HOOKS.add(hook)
    return hook


def _watched(optimizer, args, kwargs) -> bool:
    """Whether this step runs nothing but the optimizer's own update between leanact's pre- and
    post-hook: no step hook but leanact's (global or the optimizer's), no closure (user code run
    inside the step). (A ``step`` replaced on the instance, as accelerate's with a GradScaler, runs its
    code outside that window: what it writes is seen as any write between steps.)"""
    from torch.optim import optimizer as _opt

    pre = getattr(optimizer, "_optimizer_step_pre_hooks", None)
    post = getattr(optimizer, "_optimizer_step_post_hooks", None)
    if pre is None or post is None or pre or post:
        return False
    if kwargs.get("closure") is not None or any(a is not None for a in args[1:]):
        return False
    return all(h in _OWN_HOOKS for hooks in (getattr(_opt, "_global_optimizer_pre_hooks", None),
                                             getattr(_opt, "_global_optimizer_post_hooks", None))
               for h in (hooks.values() if hooks is not None else (None,)))


#: optimizer -> {parameter id: the identity and _version of its Adam state as the last watched step
#: left it}: a state replaced (``load_state_dict``) or edited in place since is verified before the
#: bound trusts it again
_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


def _state_signature(optimizer, pairs) -> tuple:
    out = []
    for p, _d in pairs:
        st = optimizer.state.get(p)
        if not st:
            out.append(None)
            continue
        out.append(tuple((id(t), t._version, t.data_ptr()) if isinstance(t, torch.Tensor) else None
                         for t in (st.get(k) for k in _MOMENT_KEYS)))
    return tuple(out)


def _verify_moments(optimizer, groups) -> dict[int, float]:
    """The largest ``|m|/sqrt(v)`` of each group's tracked Adam states as they are now (one sync for
    all): the invariant the bound's induction starts from (module doc), for a state leanact did not
    see its optimizer produce. inf where it fails (``v = 0`` under ``m ≠ 0``, non-finite values)."""
    maxima, index = [], []
    with torch.no_grad():
        for i, (g, pairs) in enumerate(groups):
            for p, _d in pairs:
                st = optimizer.state.get(p) or {}
                m, v = st.get("exp_avg"), st.get("exp_avg_sq")
                if not (isinstance(m, torch.Tensor) and isinstance(v, torch.Tensor)):
                    continue
                # (float32, on every device: its rounding, a few units in 2^-24, is inside ratio_bound's 0.1%)
                m32, v32 = m.detach().float().abs(), v.detach().float()
                ratio = torch.where(m32 == 0, torch.zeros_like(m32), m32 / v32.sqrt())
                maxima.append(torch.nan_to_num(ratio, nan=math.inf).amax())
                index.append(i)
    out: dict[int, float] = {}
    by_device: dict = {}
    for i, a in zip(index, maxima):
        by_device.setdefault(a.device, []).append((i, a))
    for pairs in by_device.values():  # (one sync per device)
        for (i, _a), v in zip(pairs, torch.stack([a for _, a in pairs]).tolist()):
            out[i] = max(out.get(i, 0.0), v)
    return out


def _end(pairs) -> None:
    for _p, d in pairs:
        d.epoch += 1


def _before_step(optimizer, args, kwargs) -> None:
    if not _DRIFT:
        return
    groups = _tracked(optimizer)
    if not groups:
        return
    watched = _watched(optimizer, args, kwargs)
    adam = type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
    states = _STATES.get(optimizer)
    verified = None
    for i, (g, pairs) in enumerate(groups):
        if not watched:
            _end(pairs)
            continue
        for p, d in pairs:
            if p._version != d.version or p.data_ptr() != d.ptr:  # written or re-pointed since: not a bounded change
                d.epoch += 1
        if adam and (states is None or states.get(id(g)) != _state_signature(optimizer, pairs)):
            if verified is None:  # a state this process did not see the optimizer produce: verified once
                verified = _verify_moments(optimizer, groups)
            index = next((j for j, h in enumerate(optimizer.param_groups) if h is g), None)
            if index is not None:
                _MOMENTS.setdefault(optimizer, {})[index] = verified.get(i, 0.0)  # (0: no state yet)
    _WATCHED[optimizer] = watched


#: optimizer -> whether its step in progress is watched end to end (:func:`_watched`, at its pre-hook)
_WATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _after_step(optimizer, args, kwargs) -> None:
    moments = _moments(optimizer)
    if not _DRIFT:
        return
    groups = _tracked(optimizer)
    if not groups:
        return
    watched = _WATCHED.pop(optimizer, False) and _watched(optimizer, args, kwargs)
    index = {id(g): i for i, g in enumerate(optimizer.param_groups)} if moments else {}
    signatures = {}
    for g, pairs in groups:
        bound = None
        if watched:
            bound = step_bound(optimizer, g, moments.get(index.get(id(g)), math.inf) if moments else None)
        for p, d in pairs:
            if bound is None:
                d.epoch += 1
            else:
                c, k = bound
                delta = c + (k + d.eps) * d.mbound
                d.total += delta
                d.mbound += delta
            d.version, d.ptr = p._version, p.data_ptr()
        if watched and moments:
            signatures[id(g)] = _state_signature(optimizer, pairs)
    _STATES[optimizer] = signatures  # (after a step not watched: none, the next step verifies)


own_hook(_before_step)
own_hook(_after_step)
register_optimizer_step_pre_hook(_before_step)
register_optimizer_step_post_hook(_after_step)
