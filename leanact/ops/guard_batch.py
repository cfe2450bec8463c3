"""The norms' from-output rule (``leanact.ops.layer_norm``) for many (γ, β) at once: one pass, one sync.

Each norm decides once per optimizer step whether its output determines x̂ (a reduction over γ, β
read on the host). Decided one norm at a time, that is ~20 small launches and a device-to-host
sync per norm: the GPU drains its queue at every norm of the first forward after each step (50
times in a BERT-Large MLM step). :func:`check_many` evaluates the same rule for every norm of the
previous step (whose γ, β an optimizer has just updated in place) in one batch: γ's and β's
concatenated, the per-norm constants (tiny, max, √N, max_ratio, rounded to the compute dtype as
the one-at-a-time rule rounds them) repeated over each norm's channels, the failing channels
counted per norm by a cumulative sum, one ``tolist()``. The verdicts are the one-at-a-time rule's,
element for element.
"""
from __future__ import annotations

import math

import torch

__all__ = ["check_many"]


_PROMOTED: dict[tuple[torch.dtype, torch.dtype], torch.dtype] = {}


def _compute_dtype(ref: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    key = (ref, dtype)
    ct = _PROMOTED.get(key)
    if ct is None:
        ct = _PROMOTED[key] = torch.promote_types(torch.promote_types(ref, dtype), torch.float32)
    return ct


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 1 else t.reshape(-1)  # (no_grad: γ, β go into torch.cat as they are)


def check_many(items: list[tuple]) -> list[bool]:
    """For each ``(weight, bias, n, dtype, max_ratio[, offset])`` (weight or bias may be None, not
    both; all on one device), whether every channel satisfies |γ| ≥ tiny, |β| ≤ max_ratio·|γ| and
    |γ|·√n + |β| ≤ max with γ, β finite (tiny, max of ``dtype``; γ = 1 where there is no weight,
    γ = 1 + weight in float32 with ``offset``: Gemma's RMSNorm)."""
    items = [it if len(it) == 6 else (*it, False) for it in items]
    out: list[bool | None] = [None] * len(items)
    groups: dict[torch.dtype, list[int]] = {}
    for i, (w, b, n, dtype, ratio, offset) in enumerate(items):
        if (w if w is not None else b).numel() == 0:
            out[i] = True  # no channel fails
            continue
        gamma_dtype = torch.float32 if offset else (w if w is not None else b).dtype
        groups.setdefault(_compute_dtype(gamma_dtype, dtype), []).append(i)
    for ct, idx in groups.items():
        for i, ok in zip(idx, _check_group([items[i] for i in idx], ct)):
            out[i] = ok
    return out  # type: ignore[return-value]


def _gamma(w: torch.Tensor | None, offset: bool, count: int, ct: torch.dtype, dev) -> torch.Tensor:
    if w is None:
        return torch.ones(count, dtype=ct, device=dev)
    return _flat(1.0 + w.to(torch.float32)) if offset else _flat(w)  # (leanact.ops.layer_norm.offset_gamma)


def _check_group(items: list[tuple], ct: torch.dtype) -> list[bool]:
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
        at_ends = bad[ends].tolist()  # the one sync
    before = [0] + at_ends[:-1]
    return [e - s == 0 for e, s in zip(at_ends, before)]
