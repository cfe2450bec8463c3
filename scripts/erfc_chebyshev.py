"""Coefficients of the erfc series in leanact/ops/triton/gelu32_kernels.py (``_exp_g``).

For a >= 0, t = 2/(2+a), w = 2t - 1: erfc(a) = t exp(-a^2) exp(G(w)) with G smooth on [-1, 1].
Prints the Chebyshev coefficients c_0 .. c_30 of G (interpolation at 64 Chebyshev nodes, 40
digits; the terms after c_30 are below 1e-18). The float32 kernels use c_0 .. c_13 (the terms
after them sum to 1.4e-9). Run: python scripts/erfc_chebyshev.py
"""
import mpmath as mp


def g(w):
    t = (w + 1) / 2
    if t == 0:
        return -mp.log(2 * mp.sqrt(mp.pi))
    z = 2 * (1 - t) / t
    return mp.log(mp.erfc(z) / t) + z * z


def coefficients(n: int = 64, keep: int = 31):
    with mp.workdps(40):
        nodes = [mp.cos(mp.pi * (k + mp.mpf(1) / 2) / n) for k in range(n)]
        vals = [g(w) for w in nodes]
        c = [2 * sum(vals[k] * mp.cos(mp.pi * j * (k + mp.mpf(1) / 2) / n) for k in range(n)) / n for j in range(n)]
        c[0] /= 2
        return [float(v) for v in c[:keep]]


if __name__ == "__main__":
    for j, c in enumerate(coefficients()):
        print(j, repr(c))
