"""The largest batch or sequence whose whole training step fits a memory budget.

:func:`largest_fitting` searches an integer ``n`` for the largest ``cost(n) <= budget``, ``cost``
being non-decreasing (the predicted peak of a step: parameters, gradients, optimizer state,
activations and temporaries). Each call of ``cost`` is one fake-tensor estimate (seconds), so the
search uses the shape of the cost: a step's bytes are a polynomial of degree ≤ 2 in the sequence
length (attention scores are s²; everything else linear) and of degree 1 in the batch (``degree``).
Above every size seen it solves the polynomial through the largest size seen and sizes about half
and a quarter of it (spread out: allocator rounding makes small steps, and at small sizes the
peak may be another moment of the step, e.g. the optimizer's, so the cost is flat there) for
the budget, and checks the answer -- and its successor when the fit came from sizes close to it;
inside a bracket it interpolates and halves in turn. Nothing is trusted from the fit: the result
always satisfies ``cost(n) <= budget < cost(n + 1)``. Typically 5 to 7 estimates.
"""
from __future__ import annotations

import math
from typing import Callable

__all__ = ["largest_fitting"]


def _spread(seen: dict[int, int], count: int) -> list[tuple[int, int]]:
    """Up to ``count`` seen points, increasing: the largest, then each the largest at most half the
    previous one (else the next smaller one)."""
    pts = sorted(seen.items())
    chosen = [pts.pop()]
    while pts and len(chosen) < count:
        half = [p for p in pts if p[0] <= chosen[-1][0] / 2]
        chosen.append(half[-1] if half else pts[-1])
        pts = pts[:pts.index(chosen[-1])]
    return chosen[::-1]


def _solve(points: list[tuple[int, int]], budget: int) -> float | None:
    """Where the polynomial through the ``(n, cost)`` points (two: a line; three: a quadratic)
    reaches ``budget`` (the larger root); None if the cost does not grow."""
    if len(points) == 2:
        (x1, y1), (x2, y2) = points
        d1 = (y2 - y1) / (x2 - x1)
        return None if d1 <= 0 else x2 + (budget - y2) / d1
    (x0, y0), (x1, y1), (x2, y2) = points
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
                    multiple: int = 1, limit: int | None = None, degree: int = 2) -> tuple[int, dict[int, int]]:
    """The largest ``n`` (a multiple of ``multiple``, ≤ ``limit`` if given) with ``cost(n) <= budget``,
    and every ``cost`` computed ({n: bytes}); 0 if even the smallest multiple does not fit.
    ``cost`` must not decrease with ``n``; ``probes`` (in units of ``multiple``) are where the
    polynomial of ``degree`` (1 or 2: the cost's growth at large ``n``) is fitted first."""
    if multiple < 1 or any(p < 1 for p in probes) or sorted(set(probes)) != list(probes):
        raise ValueError("largest_fitting: multiple >= 1 and three increasing probes >= 1 needed")
    if degree not in (1, 2):
        raise ValueError(f"largest_fitting: degree must be 1 (linear growth) or 2 (quadratic), got {degree!r}")
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

    def probe(k: int, successor: bool = True) -> None:  # evaluate k; if it fits, maybe k + 1 (the likely answer)
        nonlocal good, bad
        if at(k) > budget:
            bad = k
            return
        good = k
        if successor and (top is None or k + 1 <= top) and (bad is None or k + 1 < bad):
            if at(k + 1) > budget:
                bad = k + 1
            else:
                good = k + 1

    while bad is None:  # above everything seen: the polynomial through spread-out points, else doubling
        if top is not None and good >= top:
            return result(top)
        pts = _spread(seen, degree + 1)
        guess = _solve(pts, budget) if len(pts) == degree + 1 else None
        if guess is None:
            k, near = 2 * good, False
        else:  # the fit's answer; its successor too when the fit came from sizes close to it
            k = max(int(guess), good + 1)
            near = k <= 2 * good
        probe(k if top is None else min(k, top), successor=near)
    turn = 0
    while bad - good > 1:  # inside the bracket: interpolation and halving in turn (at most 2·log2 steps)
        lo_c, hi_c = seen[good], seen[bad]
        k = good + int((budget - lo_c) / max(hi_c - lo_c, 1) * (bad - good))
        k = min(max(k, good + 1), bad - 1) if turn % 2 == 0 else (good + bad) // 2
        probe(k, successor=turn % 2 == 0)
        turn += 1
    return result(good)
