"""Comparing two computations of one elementwise formula that may differ before their last rounding.

Two implementations of ``act(g)`` whose float32 values are at most ``d`` apart (say, two ``erff``
builds, each within 2 ulp of erf) give the same 16-bit value unless a rounding boundary of the
16-bit grid lies between the two float32 values. Two checks follow from that alone:

- :func:`within`: every element within ``bound`` (the float32 distance carried through the
  formula) plus one ulp of the storage dtype at the larger of the two;
- :func:`rare_flips`: where ``d`` is a small part of the 16-bit spacing (``d / ulp <= limit``),
  the boundaries fall between the two values on about ``d / ulp`` of such elements, so the
  elements that differ there are at most the sum of ``d / ulp`` (the expected count when ``d`` is
  reached everywhere, and it is a worst case) plus three of its standard deviations. A kernel that
  rounds in another order (once where torch rounds twice) flips a fixed fraction of these elements
  whatever ``d``, far over that; a legitimate difference (another ``erff``) flips a tiny part.

Where ``d / ulp`` is large (GELU's ``1 + erf(x / sqrt 2)`` for x < -2 cancels, and an ulp of erf
there moves the result by many 16-bit ulps) only :func:`within` applies: no bitwise fraction there
follows from the math (it depends on how often the two ``erff`` builds disagree).
"""
import torch

#: Significand bits (with the implicit one) of each float dtype.
MANT = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}


def ulp(x: torch.Tensor, dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at |x| (float64; the subnormal spacing below the normal range)."""
    fi = torch.finfo(dtype)
    _, e = torch.frexp(x.double().abs().clamp_min(fi.tiny).nan_to_num(0.0, fi.max, fi.max))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), (e - MANT[dtype]).double())


def _same(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (x == ref) | (x.isnan() & ref.isnan())


def within(x: torch.Tensor, ref: torch.Tensor, bound) -> bool:
    """|x - ref| <= bound + one ulp at the larger of the two, elementwise (NaN where ref is NaN; inf equal)."""
    u = torch.maximum(ulp(x, x.dtype), ulp(ref, ref.dtype))
    return bool((_same(x, ref) | ((x.double() - ref.double()).abs() <= bound + u)).all())


def rare_flips(x: torch.Tensor, ref: torch.Tensor, apart, at: torch.Tensor | None = None, limit: float = 0.125):
    """``(differing, allowed)`` over the elements where the two float32 values before the rounding that
    can differ are at most ``apart`` apart with ``apart <= limit * ulp``: ``allowed`` is the sum of
    ``apart / ulp`` there plus three standard deviations (see the module doc). The ulp is ``at``'s
    (that rounding's result on the reference side; default ``ref``): for ``h = round(round(act(g)) * u)``
    it is ``round(act(g))``: the product of two 16-bit values is exact in float32, so h can differ
    only where ``round(act(g))`` does."""
    at = ref if at is None else at
    ratio = torch.as_tensor(apart, dtype=torch.float64) / ulp(at, at.dtype)
    fine = ratio <= limit
    differing = int((fine & ~_same(x, ref)).sum())
    expected = ratio[fine].sum().item()
    return differing, expected + 3 * expected ** 0.5
