"""Solve the few-bit derivative tables shipped in ``leanact/ops/lossy/fewbit_tables.py``.

    python scripts/fewbit_tables.py            # rewrite leanact/ops/lossy/fewbit_tables.py
    python scripts/fewbit_tables.py --check    # solve again and compare with the shipped tables

Problem (few-bit backward, Novikov et al. 2023, our own solver): approximate the derivative f' of
an activation (GELU erf form, GELU tanh form, SiLU) by a function q(x) taking 2**b values
("levels") that minimises the weighted L2 error  E = integral (f'(x) - q(x))**2 w(x) dx.
q is constant on intervals of x; the intervals are what the b-bit index stored in forward
selects. The optimality conditions (Lloyd-Max, quantising the random variable f'(X), X ~ w):

* each level is the w-weighted mean of f' over its region (the union of the x intervals mapped
  to it);
* each x is mapped to the level nearest to f'(x): the borders are the points where f' equals the
  mean of two neighbouring levels.

f' of these activations is not monotonic (GELU' has a minimum at x = -sqrt 2 and a maximum
above 1 at x = +sqrt 2; SiLU' likewise), so a level set {f' = t} has up to three points and one
level's region can be several intervals. The solver iterates the two conditions: thresholds
(midpoints of sorted levels) -> all roots of f' = threshold on the three monotone pieces of f'
-> intervals, each labelled with the level nearest to f' inside it -> levels = weighted means
(composite Gauss-Legendre quadrature in float64) -> ... until the levels move by < 1e-15.
Initial levels: weighted quantiles of f'(X). The result is a fixed point of both conditions
(a local optimum of E; tests/test_fewbit.py checks the conditions independently).

Weight ``normal``: w = N(0, sigma**2) density (default, sigma = 1: pre-activations of trained
Transformers are roughly standardised); ``uniform``: constant on [-R, R] (the paper's
unweighted fit on a finite range).
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sys

import torch

FUNCTIONS = ("gelu", "gelu_tanh", "silu")
BITS = (1, 2, 3, 4)
_D = torch.float64
_K1, _A = math.sqrt(2.0 / math.pi), 0.044715
_SPAN = 50.0  # f' is 0 / 1 to float64 precision beyond |x| = 50 (for the end pieces)


def derivative(name: str, x: torch.Tensor) -> torch.Tensor:
    """f'(x) in float64."""
    if name == "gelu":
        return 0.5 * torch.special.erfc(-x / math.sqrt(2.0)) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    if name == "gelu_tanh":
        t = torch.tanh(_K1 * (x + _A * x**3))
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _K1 * (1 + 3 * _A * x * x)
    if name == "silu":
        s = torch.sigmoid(x)
        return s * (1 + x * (1 - s))
    raise ValueError(f"unknown function {name!r}; expected one of {FUNCTIONS}")


def _extremum(name: str, lo: float, hi: float, sign: float) -> float:
    """argmin of sign*f' on [lo, hi] (f' unimodal there): golden-section search."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    for _ in range(200):
        c, d = b - g * (b - a), a + g * (b - a)
        fc, fd = (sign * derivative(name, torch.tensor([c, d], dtype=_D))).tolist()
        if fc < fd:
            b = d
        else:
            a = c
    return 0.5 * (a + b)


def monotone_pieces(name: str) -> list[tuple[float, float]]:
    """[(-SPAN, x_min), (x_min, x_max), (x_max, SPAN)]: f' is monotone on each piece."""
    x_min = _extremum(name, -6.0, 0.0, 1.0)
    x_max = _extremum(name, 0.0, 6.0, -1.0)
    return [(-_SPAN, x_min), (x_min, x_max), (x_max, _SPAN)]


def _roots(name: str, pieces, t: torch.Tensor) -> torch.Tensor:
    """All x with f'(x) = t (t: thresholds), by bisection on each monotone piece, sorted."""
    out = []
    for lo, hi in pieces:
        f_lo, f_hi = derivative(name, torch.tensor([lo, hi], dtype=_D)).tolist()
        inside = (t > min(f_lo, f_hi)) & (t < max(f_lo, f_hi))
        tt = t[inside]
        if tt.numel() == 0:
            continue
        a, b = torch.full_like(tt, lo), torch.full_like(tt, hi)
        up = f_hi > f_lo
        for _ in range(64):
            m = 0.5 * (a + b)
            below = (derivative(name, m) < tt) if up else (derivative(name, m) > tt)
            a, b = torch.where(below, m, a), torch.where(below, b, m)
        out.append(0.5 * (a + b))
    return torch.sort(torch.cat(out)).values if out else torch.empty(0, dtype=_D)


def _gauss_legendre(n: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes and weights on [-1, 1] (Golub-Welsch)."""
    k = torch.arange(1, n, dtype=_D)
    beta = k / torch.sqrt(4 * k * k - 1)
    evals, evecs = torch.linalg.eigh(torch.diag(beta, 1) + torch.diag(beta, -1))
    return evals, 2 * evecs[0] ** 2


_NODES, _WEIGHTS = _gauss_legendre()


class Weight:
    """Input distribution: ``normal`` (sigma) or ``uniform`` on [-radius, radius]."""

    def __init__(self, kind: str = "normal", sigma: float = 1.0, radius: float = 6.0):
        if kind not in ("normal", "uniform"):
            raise ValueError(f"weight must be 'normal' or 'uniform', got {kind!r}")
        self.kind, self.sigma, self.radius = kind, sigma, radius
        self.support = (-12.0 * sigma, 12.0 * sigma) if kind == "normal" else (-radius, radius)

    def density(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "normal":
            return torch.exp(-0.5 * (x / self.sigma) ** 2) / (self.sigma * math.sqrt(2 * math.pi))
        return torch.full_like(x, 1.0 / (2 * self.radius))

    def key(self) -> str:
        return f"normal({self.sigma:g})" if self.kind == "normal" else f"uniform({self.radius:g})"


def integrals(name: str, w: Weight, edges: torch.Tensor, levels: torch.Tensor | None = None, pieces: int = 96):
    """Per interval [edges[i], edges[i+1]] (clipped to the weight's support): (int w, int f' w,
    int (f' - levels[i])**2 w) by composite Gauss-Legendre quadrature (``pieces`` equal pieces of
    20 nodes per interval: pieces <= 0.25 sigma, exact to float64 rounding for these integrands)."""
    lo, hi = edges[:-1].clamp(*w.support), edges[1:].clamp(*w.support)
    span = (hi - lo).clamp_min(0)
    frac = torch.arange(pieces, dtype=_D) / pieces
    half = (span / (2 * pieces)).view(-1, 1, 1)
    centers = (lo.unsqueeze(1) + span.unsqueeze(1) * frac).unsqueeze(2) + half
    x = centers + half * _NODES
    wt = half * _WEIGHTS * w.density(x)
    fp = derivative(name, x)
    sq = (wt * (fp - levels.view(-1, 1, 1)) ** 2).sum((1, 2)) if levels is not None else torch.zeros_like(lo)
    return torch.stack([wt.sum((1, 2)), (wt * fp).sum((1, 2)), sq])


def _labels(name: str, borders: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Level index of each interval: the level nearest to f' at a point inside it."""
    edges = torch.cat([borders[:1] - 1.0, borders, borders[-1:] + 1.0]) if borders.numel() else torch.zeros(2, dtype=_D)
    mids = 0.5 * (edges[:-1] + edges[1:])
    return (derivative(name, mids).unsqueeze(1) - levels).abs().argmin(dim=1)


def _initial_levels(name: str, w: Weight, k: int) -> torch.Tensor:
    x = torch.linspace(*w.support, 400001, dtype=_D)
    fp, p = derivative(name, x), w.density(x)
    order = torch.argsort(fp)
    cdf = torch.cumsum(p[order], 0)
    cdf /= cdf[-1].clone()
    q = (torch.arange(k, dtype=_D) + 0.5) / k
    return fp[order][torch.searchsorted(cdf, q).clamp(max=x.numel() - 1)]


def solve(name: str, bits: int, weight: Weight | None = None, tol: float = 1e-15, max_iter: int = 20000,
          start=None) -> dict:
    """Lloyd-Max fixed point for ``f'`` with ``2**bits`` levels (module doc). Returns a dict with
    ``borders`` (sorted x), ``labels`` (level index of each of the len(borders)+1 intervals),
    ``levels`` (sorted), ``error`` (weighted L2 error, squared) and ``iterations``. ``start``:
    initial levels (default: weighted quantiles of f'); from a solved table's levels the iteration
    stops at once if they are its fixed point."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add synchronisation
    try:
        return _solve(name, bits, weight or Weight(), tol, max_iter, start)
    finally:
        torch.set_num_threads(threads)


def _solve(name: str, bits: int, w: Weight, tol: float, max_iter: int, start=None) -> dict:
    pieces = monotone_pieces(name)
    if start is None:
        levels = _initial_levels(name, w, 2**bits)
    else:
        levels = torch.sort(torch.as_tensor(start, dtype=_D)).values
        if levels.numel() != 2**bits:
            raise ValueError(f"start must hold 2**bits = {2**bits} levels, got {levels.numel()}")
    for it in range(1, max_iter + 1):
        borders = _roots(name, pieces, 0.5 * (levels[1:] + levels[:-1]))
        labels = _labels(name, borders, levels)
        edges = torch.cat([torch.tensor([-math.inf], dtype=_D), borders, torch.tensor([math.inf], dtype=_D)])
        mass, moment, _ = integrals(name, w, edges)
        num = torch.zeros_like(levels).index_add_(0, labels, moment)
        den = torch.zeros_like(levels).index_add_(0, labels, mass)
        new = torch.where(den > 0, num / den.clamp_min(1e-300), levels)
        new, _ = torch.sort(new)
        delta = (new - levels).abs().max().item()
        levels = new
        if delta < tol:
            break
    borders = _roots(name, pieces, 0.5 * (levels[1:] + levels[:-1]))
    labels = _labels(name, borders, levels)
    edges = torch.cat([torch.tensor([-math.inf], dtype=_D), borders, torch.tensor([math.inf], dtype=_D)])
    err = integrals(name, w, edges, levels[labels])[2].sum().item()
    return dict(borders=borders.tolist(), labels=labels.tolist(), levels=levels.tolist(), error=err,
                iterations=it, weight=w.key())


def solve_all(weight: Weight | None = None) -> dict:
    return {(name, bits): solve(name, bits, weight) for name in FUNCTIONS for bits in BITS}


def render(tables: dict) -> str:
    lines = [
        '"""Few-bit derivative tables, generated by ``python scripts/fewbit_tables.py`` (do not edit).',
        "",
        "TABLES[(function, bits)]: ``borders`` (sorted x), ``labels`` (level index of each of the",
        "len(borders) + 1 intervals), ``levels`` (2**bits derivative values, sorted), ``error`` (weighted",
        "squared L2 error of the piecewise-constant derivative), ``weight`` (input distribution).",
        '"""',
        "",
        "TABLES = {",
    ]
    for (name, bits), t in tables.items():
        lines.append(f"    ({name!r}, {bits}): dict(")
        for key in ("borders", "labels", "levels"):
            lines.append(f"        {key}=({', '.join(repr(v) for v in t[key])},),")
        lines.append(f"        error={t['error']!r}, weight={t['weight']!r},")
        lines.append("    ),")
    lines.append("}")
    return "\n".join(lines) + "\n"


def compare(shipped: dict, solved: dict, tol: float = 1e-12) -> list[str]:
    """Differences between two sets of tables (empty list: equal to ``tol``)."""
    problems = []
    for key, t in solved.items():
        s = shipped.get(key)
        if s is None:
            problems.append(f"{key}: missing from the shipped tables")
            continue
        if list(s["labels"]) != list(t["labels"]) or len(s["borders"]) != len(t["borders"]):
            problems.append(f"{key}: interval structure differs")
            continue
        for field in ("borders", "levels"):
            d = max((abs(a - b) for a, b in zip(s[field], t[field])), default=0.0)
            if d > tol:
                problems.append(f"{key}: {field} differ by {d:.3g}")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the shipped tables, write nothing")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parents[1] / "leanact" / "ops" / "lossy"
                                         / "fewbit_tables.py"))
    args = ap.parse_args(argv)
    tables = solve_all()
    for (name, bits), t in tables.items():
        print(f"{name:10s} b={bits}: {len(t['borders']):2d} borders, error {t['error']:.3e}, "
              f"{t['iterations']} iterations")
    if args.check:
        from leanact.ops.lossy.fewbit_tables import TABLES

        problems = compare(TABLES, tables)
        print("\n".join(problems) or "shipped tables reproduced")
        return 1 if problems else 0
    pathlib.Path(args.out).write_text(render(tables))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
