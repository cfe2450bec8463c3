"""The largest batch or sequence whose whole training step fits a memory budget.

:func:`largest_fitting` searches an integer ``n`` for the largest ``cost(n) <= budget``, ``cost``
being non-decreasing (the predicted peak of a step: parameters, gradients, optimizer state,
activations and temporaries). Each call of ``cost`` is one fake-tensor estimate (seconds), so the
search uses the shape of the cost: a step's bytes are a polynomial of degree ≤ 2 in the sequence
length (attention scores are s²; everything else linear) and of degree 1 in the batch. Above
every size seen it solves the quadratic through three of them (spread out: allocator rounding
makes small steps) for the budget and checks the answer and its successor; inside a bracket it
interpolates and halves in turn. Nothing is trusted from the fit: the result always satisfies
``cost(n) <= budget < cost(n + 1)``. Typically 5 to 8 estimates.
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

    while bad is None:  # above everything seen: the polynomial through the last three points, else doubling
        if top is not None and good >= top:
            return result(top)
        pts = sorted(seen.items())
        pts = [pts[0], pts[len(pts) // 2], pts[-1]]  # spread out: allocator rounding makes steps
        guess = _solve(pts, budget) if len({n for n, _ in pts}) == 3 else None
        fitted = guess is not None and int(guess) > good
        k = int(guess) if fitted else 2 * good
        probe(k if top is None else min(k, top), successor=fitted)
    turn = 0
    while bad - good > 1:  # inside the bracket: interpolation and halving in turn (at most 2·log2 steps)
        lo_c, hi_c = seen[good], seen[bad]
        k = good + int((budget - lo_c) / max(hi_c - lo_c, 1) * (bad - good))
        k = min(max(k, good + 1), bad - 1) if turn % 2 == 0 else (good + bad) // 2
        probe(k, successor=turn % 2 == 0)
        turn += 1
    return result(good)
