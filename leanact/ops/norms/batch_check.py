"""The norms' from-output rule (:mod:`leanact.ops.norms.verdict`) for many (γ, β) at once: one pass, one sync.

Each norm decides once per optimizer step whether its output determines x̂ (a reduction over γ, β
read on the host). Decided one norm at a time, that is ~20 small launches and a device-to-host
sync per norm: the GPU drains its queue at every norm of the first forward after each step (50
times in a BERT-Large MLM step). :func:`check_many` evaluates the same rule for every norm of the
previous step (whose γ, β an optimizer has just updated in place) in one batch: γ's and β's
concatenated, the per-norm constants (tiny, max, √N, max_ratio, rounded to the compute dtype as
the one-at-a-time rule rounds them) repeated over each norm's channels, the failing channels
counted per norm by a cumulative sum, one ``tolist()``. The verdicts are the one-at-a-time rule's,
element for element. With ``slack=True`` the same sync also returns, per norm, how far every
element of γ and β may move before the rule can fail, and the largest |w|, |β|
(:mod:`leanact.ops.norms.step_bound`: what lets a verdict outlive Adam's steps without a check).
:func:`check_many_later` evaluates the same rule without a sync: the verdicts reach the host when the
device has computed them (a copy into pinned memory and an event), read when needed (:class:`Later`):
what confirms, off the host's critical path, the verdicts that stood on the bound alone.
"""
from __future__ import annotations

import math

import torch

from ..amp import autocast_off

__all__ = ["check_many", "check_many_later", "Later"]


_PROMOTED: dict[tuple[torch.dtype, torch.dtype], torch.dtype] = {}


def _compute_dtype(ref: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    key = (ref, dtype)
    ct = _PROMOTED.get(key)
    if ct is None:
        ct = _PROMOTED[key] = torch.promote_types(torch.promote_types(ref, dtype), torch.float32)
    return ct


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 1 else t.reshape(-1)  # (no_grad: γ, β go into torch.cat as they are)


def check_many(items: list[tuple], slack: bool = False) -> list:
    """For each ``(weight, bias, n, dtype, max_ratio[, offset])`` (weight or bias may be None, not
    both; all on one device), whether every channel satisfies |γ| ≥ tiny, |β| ≤ max_ratio·|γ| and
    |γ|·√n + |β| ≤ max with γ, β finite (tiny, max of ``dtype``; γ = 1 where there is no weight,
    γ = 1 + weight in float32 with ``offset``: Gemma's RMSNorm).

    ``slack=True``: ``(ok, slack, max |weight|, max |bias|)`` per item instead (0.0 for a missing
    tensor): ``slack`` is the largest δ such that changing every element of the weight and the bias
    by at most δ keeps every channel within the rule (0.0 where ok is False; computed in float64,
    on devices without it none: 0.0)."""
    items = [it if len(it) == 6 else (*it, False) for it in items]
    out: list = [None] * len(items)
    groups: dict[torch.dtype, list[int]] = {}
    for i, (w, b, n, dtype, ratio, offset) in enumerate(items):
        if (w if w is not None else b).numel() == 0:
            out[i] = (True, math.inf, 0.0, 0.0) if slack else True  # no channel fails
            continue
        gamma_dtype = torch.float32 if offset else (w if w is not None else b).dtype
        groups.setdefault(_compute_dtype(gamma_dtype, dtype), []).append(i)
    for ct, idx in groups.items():
        with autocast_off(items[idx[0]][0 if items[idx[0]][0] is not None else 1].device.type):
            for i, res in zip(idx, _check_group([items[i] for i in idx], ct, slack)):
                out[i] = res
    return out


def _gamma(w: torch.Tensor | None, offset: bool, count: int, ct: torch.dtype, dev) -> torch.Tensor:
    if w is None:
        return torch.ones(count, dtype=ct, device=dev)
    return _flat(1.0 + w.to(torch.float32)) if offset else _flat(w)  # (leanact.ops.norms.verdict.offset_gamma)


def _check_group(items: list[tuple], ct: torch.dtype, slack: bool = False, later: bool = False):
    ref = next(t for w, b, *_ in items for t in (w, b) if t is not None)
    dev = ref.device
    counts = [(w if w is not None else b).numel() for w, b, *_ in items]
    total = sum(counts)
    with torch.no_grad():
        g = torch.cat([_gamma(w, offset, c, ct, dev)
                       for (w, _, _, _, _, offset), c in zip(items, counts)]).to(ct).abs()
        consts = []
        for w, b, n, dtype, ratio, _ in items:
            fi = torch.finfo(dtype)
            consts.append((fi.tiny, fi.max, math.sqrt(n), ratio))
        reps = torch.tensor(counts, dtype=torch.int64).to(dev)
        tiny, big, root, ratio = torch.tensor(consts, dtype=ct).to(dev).repeat_interleave(
            reps, dim=0, output_size=total).unbind(1)
        ok = torch.isfinite(g) & (g >= tiny)
        bound = g * root
        if any(b is not None for _, b, *_ in items):
            bb = torch.cat([_flat(b) if b is not None else torch.zeros(c, dtype=ct, device=dev)
                            for (_, b, *_), c in zip(items, counts)]).to(ct).abs()
            ok &= torch.isfinite(bb) & (bb <= ratio * g)
            bound = bound + bb
        ok &= bound <= big
        bad = (~ok).to(torch.int64).cumsum(0)
        ends = torch.tensor(counts, dtype=torch.int64).cumsum(0).sub_(1).to(dev)
        if later:  # per item, its failing channels' count (on the device: no sync)
            return torch.diff(bad[ends], prepend=bad.new_zeros(1))
        if slack and dev.type in _FLOAT64_DEVICES:
            extra = _slack_rows(items, counts, g, bb if any(b is not None for _, b, *_ in items) else None,
                                tiny, big, root, ratio, dev)
            rows = torch.cat([bad[ends].to(torch.float64)[None], extra]).tolist()  # the one sync
            at_ends = [int(v) for v in rows[0]]
        else:
            at_ends = bad[ends].tolist()  # the one sync
            rows = None
    before = [0] + at_ends[:-1]
    oks = [e - s == 0 for e, s in zip(at_ends, before)]
    if not slack:
        return oks
    if rows is None:
        return [(ok, 0.0, math.inf, math.inf) for ok in oks]
    return [(ok, max(s, 0.0) if ok else 0.0, wm, bm) for ok, s, wm, bm in zip(oks, *rows[1:])]


#: devices whose float64 arithmetic the slack is computed in (elsewhere: no slack, checked every step)
_FLOAT64_DEVICES = ("cpu", "cuda")


def _slack_rows(items, counts, g, bb, tiny, big, root, ratio, dev) -> torch.Tensor:
    """(3, norms) float64: per norm the min over channels of the largest δ that keeps the rule when
    every element of γ and β moves by δ (|γ| may shrink by δ and |β| grow by δ), max |w|, max |β|."""
    f64 = torch.float64
    total = g.numel()
    seg = torch.repeat_interleave(torch.arange(len(items), device=dev), torch.tensor(counts, device=dev),
                                  output_size=total)
    g64, tiny, big, root, ratio = (t.to(f64) for t in (g, tiny, big, root, ratio))
    b64 = bb.to(f64) if bb is not None else torch.zeros_like(g64)
    s = torch.minimum(g64 - tiny, (big - g64 * root - b64) / (root + 1.0))
    finite_ratio = torch.isfinite(ratio)  # (an infinite max_ratio: no ratio rule, RMSNorm's)
    ratio = torch.where(finite_ratio, ratio, torch.zeros_like(ratio))
    if bb is not None:
        s = torch.where(finite_ratio, torch.minimum(s, (ratio * g64 - b64) / (ratio + 1.0)), s)
    # less the rounding of the rule's own comparisons in the compute dtype (and of γ = 1 + w there)
    s = s - 8.0 * torch.finfo(g.dtype).eps * (g64 * (root + ratio + 1.0) + b64 + 1.0)
    s = torch.where(torch.isfinite(s), s, torch.zeros_like(s))
    raw_w = torch.cat([w.detach().reshape(-1).to(f64).abs() if w is not None else torch.zeros(c, dtype=f64, device=dev)
                       for (w, *_), c in zip(items, counts)])
    out = torch.full((3, len(items)), math.inf, dtype=f64, device=dev)
    out[0].scatter_reduce_(0, seg, s, "amin")
    out[1].fill_(0.0).scatter_reduce_(0, seg, raw_w, "amax")
    out[2].fill_(0.0).scatter_reduce_(0, seg, b64, "amax")
    return out


class Later:
    """Verdicts on their way to the host (:func:`check_many_later`): :meth:`result` waits for the copy
    only (on CUDA an event recorded after it; the device has long computed them when they are read)."""

    __slots__ = ("_counts", "_event", "_order")

    def __init__(self, counts: torch.Tensor, event, order: list[int]):
        self._counts, self._event, self._order = counts, event, order

    def result(self) -> list[bool]:
        """Whether each item passed, in the order given to :func:`check_many_later`."""
        if self._event is not None:
            self._event.synchronize()
        out = [True] * len(self._order)
        for i, bad in zip(self._order, self._counts.tolist()):
            out[i] = bad == 0
        return out


def check_many_later(items: list[tuple]) -> Later:
    """:func:`check_many`'s verdicts (items as there, all on one device) without waiting for them."""
    items = [it if len(it) == 6 else (*it, False) for it in items]
    groups: dict[torch.dtype, list[int]] = {}
    for i, (w, b, n, dtype, ratio, offset) in enumerate(items):
        if (w if w is not None else b).numel():
            gamma_dtype = torch.float32 if offset else (w if w is not None else b).dtype
            groups.setdefault(_compute_dtype(gamma_dtype, dtype), []).append(i)
    if not groups:
        return Later(torch.zeros(0, dtype=torch.int64), None, [])
    order = [i for idx in groups.values() for i in idx]
    ref = next(t for w, b, *_ in items for t in (w, b) if t is not None)
    with autocast_off(ref.device.type):  # (called from a forward, often inside an autocast block)
        counts = torch.cat([_check_group([items[i] for i in idx], ct, later=True) for ct, idx in groups.items()])
    if counts.device.type != "cuda":
        return Later(counts.cpu(), None, order)
    host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
    host.copy_(counts, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(counts.device))
    return Later(host, event, order)
