"""The largest batch or sequence whose whole training step fits a memory budget.

:func:`largest_fitting` searches an integer ``n`` for the largest ``cost(n) <= budget``, ``cost``
being non-decreasing (the predicted peak of a step: parameters, gradients, optimizer state,
activations and temporaries). Each call of ``cost`` is one fake-tensor estimate (a second or more),
so the search uses the shape of the cost: a step's bytes are a polynomial of degree ≤ 2 in the
sequence length (attention scores are s²; everything else linear) and of degree 1 in the batch
(``degree``). At small sizes another moment of the step (the optimizer's) sets the peak and the
cost is flat; points on that floor (:func:`_growing`) are left out of every fit. Above every size
seen the search solves the polynomial through the largest size seen and sizes about half and a
quarter of it for the budget (eight times further while the cost has not grown yet) and checks
the answer -- and its successor when the fit came from sizes close to it; inside a bracket it
takes the secant through the two sizes evaluated last, and halves the bracket after two fits that
did not. Nothing is trusted from the fit: the result always satisfies
``cost(n) <= budget < cost(n + 1)``. Typically 5 to 7 estimates; 2 when given a ``start`` that is
the answer.
"""
from __future__ import annotations

import math
from typing import Callable

__all__ = ["largest_fitting"]


def _growing(seen: dict[int, int]) -> dict[int, int]:
    """The seen points off the cost's floor: at small sizes another moment of the step (the
    optimizer's) sets the peak and the cost is flat, which a fit must not see. Two points at least
    a factor 2 apart whose costs differ by at most 1/1024 are both on the floor."""
    ks = sorted(seen)
    flat = {k for k in ks for j in ks if j <= k / 2 and seen[k] - seen[j] <= seen[j] / 1024}
    flat |= {j for j in ks for k in ks if j <= k / 2 and seen[k] - seen[j] <= seen[j] / 1024}
    return {k: v for k, v in seen.items() if k not in flat}  # (in the order evaluated)


def _spread(seen: dict[int, int], count: int) -> list[tuple[int, int]]:
    """Up to ``count`` seen points, increasing: the largest, then each the largest at most half the
    previous one (else the next smaller one)."""
    pts = sorted(seen.items())
    if not pts:
        return []
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
                    multiple: int = 1, limit: int | None = None, degree: int = 2,
                    start: int | None = None, known: dict[int, int] | None = None) -> tuple[int, dict[int, int]]:
    """The largest ``n`` (a multiple of ``multiple``, ≤ ``limit`` if given) with ``cost(n) <= budget``,
    and every ``cost`` computed ({n: bytes}); 0 if even the smallest multiple does not fit.
    ``cost`` must not decrease with ``n``; ``probes`` (in units of ``multiple``) are where the
    polynomial of ``degree`` (1 or 2: the cost's growth at large ``n``) is fitted first.
    ``start``: a likely answer (e.g. from a cheaper model of the cost), evaluated first: if it fits
    and the next multiple does not, it is the answer (two calls); else the search goes on from what
    they showed (a start where the cost grows makes the first fit good). ``known``: costs already
    computed ({n: bytes}, ``n`` multiples of ``multiple``), used instead of calling ``cost`` again."""
    if multiple < 1 or any(p < 1 for p in probes) or sorted(set(probes)) != list(probes):
        raise ValueError("largest_fitting: multiple >= 1 and three increasing probes >= 1 needed")
    if degree not in (1, 2):
        raise ValueError(f"largest_fitting: degree must be 1 (linear growth) or 2 (quadratic), got {degree!r}")
    if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < 0
                              or start % multiple):
        raise ValueError(f"largest_fitting: start must be a multiple of {multiple} >= 0, got {start!r}")
    top = None if limit is None else limit // multiple  # in units of `multiple`
    seen: dict[int, int] = {}
    known = dict(known or {})

    def at(k: int) -> int:
        if k not in seen:
            seen[k] = known[k * multiple] if k * multiple in known else cost(k * multiple)
        return seen[k]

    def result(k: int) -> tuple[int, dict[int, int]]:
        return k * multiple, {k_ * multiple: v for k_, v in sorted(seen.items())}

    if top is not None and top < 1:
        return result(0)
    first = 1 if not start else start // multiple if top is None else min(start // multiple, top)
    if first > 1:  # the likely answer, then its neighbour on the side it points to
        if at(first) <= budget:
            if (top is not None and first >= top) or at(first + 1) > budget:
                return result(first)
        elif at(first - 1) <= budget:
            return result(first - 1)
        else:  # both over: where the line through them meets the budget, before the smallest size
            guess = _solve(_latest(seen), budget)
            if guess is not None and 1 < int(guess) < first - 1:
                at(int(guess))
    if not any(v <= budget for v in seen.values()) and at(1) > budget:
        return result(0)
    if len(seen) == 1:
        for p in (p for p in probes if top is None or p <= top):
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

    while bad is None:  # above everything seen: the polynomial through spread-out points
        if top is not None and good >= top:
            return result(top)
        pts = _spread(_growing(seen) or {good: seen[good]}, degree + 1)
        guess = _solve(pts, budget) if len(pts) >= 2 else None
        if guess is None:  # the cost has not grown yet: eight times further
            k, near = 8 * good, False
        else:  # the fit's answer; its successor too when the fit came from sizes close to it
            k = max(int(guess), good + 1)
            near = k <= 2 * good
        probe(k if top is None else min(k, top), successor=near)
    misses = 0
    while bad - good > 1:  # inside the bracket: the secant through the last two points, else halving
        width = bad - good
        pts = _latest(_growing(seen))
        guess = _solve(pts, budget) if misses < 2 and len(pts) >= 2 else None
        k = (good + bad) // 2 if guess is None else min(max(int(guess), good + 1), bad - 1)
        probe(k, successor=guess is not None)
        misses = 0 if guess is None or bad - good <= width // 2 else misses + 1  # two fits that did not halve it: halve
    return result(good)


def _latest(seen: dict[int, int]) -> list[tuple[int, int]]:
    """The two points evaluated last (the secant's), increasing."""
    return sorted(list(seen.items())[-2:])

