"""The largest batch or sequence whose whole training step fits a memory budget.

:func:`largest_fitting` searches an integer ``n`` for the largest ``cost(n) <= budget``, ``cost``
being non-decreasing (the predicted peak of a step: parameters, gradients, optimizer state,
activations and temporaries). Each call of ``cost`` is one fake-tensor estimate (seconds), so the
search uses the shape of the cost: a step's bytes are a polynomial of degree ≤ 2 in the sequence
length (attention scores are s²; everything else linear) and of degree 1 in the batch. It fits
that polynomial to three sizes, solves it for the budget, and then checks the answer and its
successor with two more estimates, stepping or bisecting (never trusting the fit) until
``cost(n) <= budget < cost(n + 1)``. Typically 5 estimates.
"""
from __future__ import annotations

import math
from typing import Callable

__all__ = ["largest_fitting"]


def _solve(points: list[tuple[int, int]], budget: int) -> float | None:
    """The root of the quadratic through three ``(n, cost)`` points at ``budget`` (the larger
    root), or of the line through the last two; None if the cost does not grow."""
    (x0, y0), (x1, y1), (x2, y2) = points[-3:]
    d0, d1 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
    a = (d1 - d0) / (x2 - x0)
    b = d1 - a * (x1 + x2)
    c = y2 - a * x2 * x2 - b * x2 - budget
    if abs(a) * x2 * x2 < 1e-9 * max(abs(y2), 1):  # linear
        return None if b <= 0 else -c / b
    disc = b * b - 4 * a * c
    if disc < 0:
        return None if d1 <= 0 else x2 + (budget - y2) / d1
    return (-b + math.sqrt(disc)) / (2 * a) if a > 0 else (-b - math.sqrt(disc)) / (2 * a)


def largest_fitting(cost: Callable[[int], int], budget: int, *, probes: tuple[int, int, int] = (1, 2, 4),
                    multiple: int = 1, limit: int | None = None) -> tuple[int, dict[int, int]]:
    """The largest ``n`` (a multiple of ``multiple``, ≤ ``limit`` if given) with ``cost(n) <= budget``,
    and every ``cost`` computed ({n: bytes}); 0 if even the smallest multiple does not fit.
    ``cost`` must not decrease with ``n``; ``probes`` (in units of ``multiple``) are where the
    polynomial is fitted."""
    if multiple < 1 or any(p < 1 for p in probes) or sorted(set(probes)) != list(probes):
        raise ValueError("largest_fitting: multiple >= 1 and three increasing probes >= 1 needed")
    top = None if limit is None else limit // multiple  # in units of `multiple`
    seen: dict[int, int] = {}

    def at(k: int) -> int:
        if k not in seen:
            seen[k] = cost(k * multiple)
        return seen[k]

    def result(k: int) -> tuple[int, dict[int, int]]:
        return k * multiple, {k_ * multiple: v for k_, v in sorted(seen.items())}

    if top is not None and top < 1:
        return result(0)
    if at(1) > budget:
        return result(0)
    probes = tuple(p for p in probes if top is None or p <= top)
    for p in probes:
        if at(p) > budget:
            break
    good = max(k for k, v in seen.items() if v <= budget)
    bad = min((k for k, v in seen.items() if v > budget), default=None)
    if bad is None and len(seen) >= 3:
        guess = _solve(sorted(seen.items()), budget)
        k = good if guess is None else max(good, int(guess))
        k = k if top is None else min(k, top)
        if k > good:  # check the guess and its successor
            if at(k) <= budget:
                good = k
                if top is None or k + 1 <= top:
                    if at(k + 1) > budget:
                        bad = k + 1
            else:
                bad = k
    while bad is None:  # the fit undershot (or no fit): double until something does not fit
        if top is not None and good >= top:
            return result(top)
        k = 2 * good if top is None else min(2 * good, top)
        if at(k) <= budget:
            good = k
        else:
            bad = k
    while bad - good > 1:  # bisect the bracket (interpolated, then halved if that does not shrink it)
        lo_c, hi_c = seen[good], seen[bad]
        k = good + int((budget - lo_c) / max(hi_c - lo_c, 1) * (bad - good))
        k = min(max(k, good + 1), bad - 1)
        if at(k) <= budget:
            good = k
        else:
            bad = k
        if bad - good > 1 and k not in (good + 1, bad - 1):
            mid = (good + bad) // 2
            if at(mid) <= budget:
                good = mid
            else:
                bad = mid
    return result(good)
