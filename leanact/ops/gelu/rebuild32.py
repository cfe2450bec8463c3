"""float32 storage: the forward in float64; backward from a table guess and one float64 step.

An initial guess for ``x`` from a table (a key computed from ``y`` picks one of 2**17 cells;
linear interpolation in the cell; error ~1e-7), then one float64 step of third order
(``f'(x0 + q) = f' + q f'' + q**2 h``, ``q = (y - f)/f'``, ``h`` from the table), so one float64
``erfc`` and ``exp`` (tanh: one ``exp``) per element.
"""
from __future__ import annotations

import math

import torch

from .buffers import _unpack_into, _Workspace
from .minimum import _A, _APPROXIMATE, _CONSTS, _K1, _LN_INV_SQRT_2PI, _SQRT1_2, _THRESHOLDS, _below
from .rebuild64 import _derivs
from .tables import _ACCESSORS, register

# float32 storage: initial guess for x from (y, bit) by a table, then one step in float64.
# The key is a float32 computed from y whose exponent and top _KEY_BITS mantissa bits pick the
# cell (x is interpolated linearly in the key within it). With D = y - c32, c32 the largest
# float32 below y* (D is exact next to the minimum, Sterbenz):
#   right branch: key = (D - 2**-52) 2**-77 (the offset, a quarter of an ulp of the smallest
#     positive D, only makes D = 0 negative): the cells resolve the square-root branch point; keys
#     in [2**-104, 2**-72), clamped above (y > 32, where x = y);
#   left branch: key = -y / (right key before the clamp) = |y| 2**77 / D: resolves both ends
#     (y -> y*, and the tail y -> 0-, float32 subnormals included); keys in [2**-70, 2**102).
# Both are positive exactly for the elements that have a derivative (y > y*; on the left branch
# also y < 0), and the two ranges do not overlap, so one table indexed by the key's exponent and
# top mantissa bits serves both branches.
_KEY_BITS = 9
_KEY_SHIFT = 23 - _KEY_BITS
_NCELL = 1 << (8 + _KEY_BITS)
_KEY_SCALE = 2.0 ** -77
_KEY_TINY = 2.0 ** -52  # normal: a subnormal operand in every element would be slow
_KEY_RIGHT = (-104, -72)
_KEY_LEFT = (-70, 102)
_KEY_RIGHT_MAX = float(torch.nextafter(torch.tensor(2.0 ** _KEY_RIGHT[1]), torch.tensor(0.0)))


def _f_f64(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """GELU in float64 without cancellation (for the table builder)."""
    if approximate == "none":
        return x * 0.5 * torch.special.erfc(x * -_SQRT1_2)
    return x * torch.sigmoid(x * _K1 * (1.0 + _A * x * x))  # relative accuracy down to x = -24


def _solve_f64(t: torch.Tensor, right: torch.Tensor, approximate: str) -> torch.Tensor:
    """x on the branch with GELU(x) = t, by bisection in float64 (for the table builder)."""
    xs = _CONSTS[approximate].xs
    lo = torch.where(right, torch.full_like(t, xs), torch.full_like(t, -40.0))
    hi = torch.where(right, torch.full_like(t, 40.0), torch.full_like(t, xs))
    for _ in range(52):  # 40 * 2**-52: 1e-14, relative to |x - x*| >= 7e-5 still 1e-10
        mid = 0.5 * (lo + hi)
        fm = _f_f64(mid, approximate)
        up = torch.where(right, fm < t, fm > t)  # the solution lies right of mid
        lo, hi = torch.where(up, mid, lo), torch.where(up, hi, mid)
    return 0.5 * (lo + hi)


_GUESS_CPU: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def _cell_points(approximate: str, key_bits: int, nodes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(key, x, ok)``, each ``(len(nodes), 2**(8 + key_bits))``: in every cell of the key's
    exponent and top ``key_bits`` mantissa bits, the keys at the fractions ``nodes`` of the cell,
    the x (float64) on the branch the key belongs to whose GELU makes that key, and whether an
    element with a derivative can reach the cell there (elsewhere x = 1: finite, harmless)."""
    c = _CONSTS[approximate]
    c32 = _below(c.ys)
    dc = (c.ys - c32) + c.ys_lo  # y* - c32, in (0, ulp)
    cell = torch.arange(1 << (8 + key_bits), dtype=torch.float64)
    e = torch.div(cell, 1 << key_bits, rounding_mode="floor") - 127
    m = cell.remainder(1 << key_bits)
    in_r = (e >= _KEY_RIGHT[0]) & (e < _KEY_RIGHT[1])
    in_l = (e >= _KEY_LEFT[0]) & (e < _KEY_LEFT[1])
    t = torch.tensor(nodes, dtype=torch.float64)[:, None]
    key = torch.pow(2.0, e) * (1 + (m + t) / (1 << key_bits))  # (nodes, cells)
    # right: D = y - c32 = key / scale; left: u = |y| / D = key * scale, D = |c32| / (1 + u)
    u = key * _KEY_SCALE
    d = torch.where(in_r, key / _KEY_SCALE, -c32 / (1 + u))
    y = torch.where(in_l & (u < 1), -(u * -c32) / (1 + u), c32 + d)  # the tail: relative accuracy
    ok = (in_r | in_l) & (d > dc)
    x = torch.ones_like(y)
    x[ok] = _solve_f64(y[ok], in_r.expand_as(y)[ok], approximate)
    return key, x, ok


def _guess_tables(approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ab, h)`` on the CPU: per cell, x ~ a + b key (a, b float32 packed in an int64: linear
    interpolation in the cell), and h = (f''' - f''**2/f')/2 at the cell's centre
    (float64), the second-order coefficient of the float64 step."""
    if approximate in _GUESS_CPU:
        return _GUESS_CPU[approximate]
    nodes = ((1 - math.sqrt(0.5)) / 2, (1 + math.sqrt(0.5)) / 2, 0.5)  # Chebyshev nodes, centre
    key, x, _ = _cell_points(approximate, _KEY_BITS, nodes)
    xs = x.unbind()
    b = (xs[1] - xs[0]) / (key[1] - key[0])
    a = xs[0] - b * key[0]
    ab = torch.stack([a, b], 1).to(torch.float32).contiguous().view(torch.int64).view(-1)
    xc = xs[2]
    _, f1, f2, f3 = _derivs(xc, torch.zeros_like(xc), approximate, False, True)
    h = 0.5 * (f3 - f2 * f2 / f1)
    _GUESS_CPU[approximate] = (ab, h)
    return ab, h


def _build_ab32(dtype, approximate, device):
    return _guess_tables(approximate)[0].to(device)


def _build_h32(dtype, approximate, device):
    return _guess_tables(approximate)[1].to(device)


register("ab32", _build_ab32, ("float32",))
register("h32", _build_h32, ("float32",))
_C32 = {mode: _below(_CONSTS[mode].ys) for mode in _APPROXIMATE}  # the largest float32 below y*


# -- float32 storage: forward in float64, backward from a table guess and one float64 step -----

def _forward32(xf, yf, right, approximate, slices):
    thr = _THRESHOLDS[torch.float32][approximate][0]
    ws = _Workspace(slices[0][1] - slices[0][0], xf.device, {"x": torch.float64, "z": torch.float64})
    for a, b in slices:
        w = ws.cut(b - a)
        x, z = w.x, w.z
        x.copy_(xf[a:b])
        if approximate == "none":  # (erfc(-x/sqrt 2) * 0.5) * x, as _forward_w, rounded once
            torch.mul(x, -_SQRT1_2, out=z).erfc_().mul_(0.5)
        else:  # sigmoid(K1 x (1 + A x^2)) * x, as _tanh_v
            torch.mul(x, x, out=z).mul_(_A).add_(1.0).mul_(x).mul_(_K1).sigmoid_()
        yf[a:b].copy_(z.mul_(x))
        if right is not None:
            torch.gt(xf[a:b], thr, out=right[a:b])


_WS32 = {"rf": torch.float32, "kr": torch.float32, "key": torch.float32, "m": torch.float32,
         "cc": torch.int64, "h": torch.float64, "x": torch.float64, "z": torch.float64,
         "w": torch.float64, "p": torch.float64, "r": torch.float64}


def _guess32(y, rb, dy, w, ab, h, c32):
    """Stage 1 (float32): the key, the keep mask times dy (``w.m``), the cell's interpolated x
    (float32, widened into ``w.x``) and its second-order coefficient (``w.h``)."""
    rf, kr, key, m = w.rf, w.kr, w.key, w.m
    rf.copy_(rb)
    torch.sub(y, c32, out=kr).sub_(_KEY_TINY).mul_(_KEY_SCALE)  # right key
    torch.div(y, kr, out=key).neg_()  # left key (finite for every finite y)
    kr.clamp_(max=_KEY_RIGHT_MAX)
    torch.lerp(key, kr, rf, out=key)  # exact selection (weight 0 or 1, both finite)
    # keep: key > 0 (y above the minimum; on the left branch also y < 0), so m = dy or 0 (the
    # smallest such key is 2**-103.7: the product saturates to 1); nan stays nan (y = nan, +-inf)
    torch.mul(key, 2.0 ** 127, out=m).clamp_(0.0, 1.0).mul_(dy)
    idx = torch.bitwise_right_shift(key.view(torch.int32), _KEY_SHIFT, out=kr.view(torch.int32))
    idx.bitwise_and_(_NCELL - 1)  # the cell: exponent and top mantissa bits (sign dropped)
    torch.index_select(ab, 0, idx, out=w.cc)
    torch.index_select(h, 0, idx, out=w.h)
    coef = w.cc.view(torch.float32).view(-1, 2)
    w.x.copy_(torch.addcmul(coef[:, 0], key, coef[:, 1], out=rf))


def _step32_erf(y, w, out, k):
    """Stage 2 (float64), erf form: with q = (y - f)/f' at x0 (x ~ x0 + q),
    f'(x) = f' + q f'' + q**2 h + O(q**3); ``out = f'(x) * m``, rounded once."""
    x, z, wb, p, r = w.x, w.z, w.w, w.p, w.r
    torch.mul(x, -_SQRT1_2, out=z).erfc_()  # E = 2 Phi
    torch.addcmul(k[0], x, x, value=-0.5, out=wb)  # ln phi
    torch.exp(wb, out=p)  # phi
    r.copy_(y)
    r.addcmul_(x, z, value=-0.5)  # y - f
    x.mul_(p)  # x phi
    z.add_(x, alpha=2.0)  # 2 f' = E + 2 x phi
    r.div_(z)  # q / 2
    wb.add_(1.0 - _LN_INV_SQRT_2PI)  # 1 - x^2/2
    p.mul_(wb)  # f''/2 = phi (1 - x^2/2)
    p.addcmul_(r, w.h)  # f''/2 + (q/2) h
    z.addcmul_(r, p, value=8.0)  # 2 (f' + q f'' + q^2 h)
    wb.copy_(w.m)
    z.mul_(wb).mul_(0.5)
    out.copy_(z)


def _step32_tanh(y, w, out, k):
    """Stage 2 (float64), tanh form (s = sigmoid(v), v = K1 (x + A x^3), p = s (1 - s)):
    f' = s + p x v', f'' = p (v' (4 + (1 - 2s) x v') - 2 K1)."""
    x, z, wb, s, r = w.x, w.z, w.w, w.p, w.r
    torch.mul(x, x, out=wb)  # x^2
    torch.add(k[0], wb, alpha=-_K1 * _A, out=z).mul_(x).exp_()  # e = exp(-v)
    torch.add(z, 1.0, out=s).reciprocal_()  # s
    z.mul_(s)  # 1 - s = e s
    r.copy_(y)
    r.addcmul_(x, s, value=-1.0)  # y - f
    torch.add(k[1], wb, alpha=3.0 * _A * _K1, out=wb)  # v'
    x.mul_(wb)  # x v'
    pp = torch.mul(s, z, out=w.pp)  # p
    z.sub_(s)  # 1 - 2s
    s.addcmul_(pp, x)  # f'
    z.mul_(x).add_(4.0).mul_(wb).sub_(2.0 * _K1).mul_(pp)  # f''
    r.div_(s)  # q
    z.addcmul_(r, w.h)  # f'' + q h
    s.addcmul_(r, z)  # f' + q f'' + q^2 h
    wb.copy_(w.m)
    out.copy_(s.mul_(wb))


def _backward32(yf, bits, gf, of, approximate, slices):
    dev = str(yf.device)
    ab = _ACCESSORS["ab32", "float32", approximate](dev)
    h = _ACCESSORS["h32", "float32", approximate](dev)
    spread = _ACCESSORS["spread", "uint8", "none"](dev)
    c32 = _C32[approximate]
    spec = dict(_WS32, pp=torch.float64) if approximate == "tanh" else _WS32
    ws = _Workspace(slices[0][1] - slices[0][0], yf.device, spec)
    k = torch.tensor([_LN_INV_SQRT_2PI if approximate == "none" else -_K1, _K1], dtype=torch.float64,
                     device=yf.device).unbind()  # 0-dim constants for the fused ops
    step = _step32_erf if approximate == "none" else _step32_tanh
    for a, b in slices:
        w = ws.cut(b - a)
        rb = _unpack_into(bits[a // 8:(b + 7) // 8], spread, w)[: b - a]
        _guess32(yf[a:b], rb, gf[a:b], w, ab, h, c32)
        step(yf[a:b], w, of[a:b], k)
