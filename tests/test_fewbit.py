"""Few-bit backward (leanact.ops.lossy.fewbit): tables optimal and reproducible, packing exact, gradient
equal to the table's piecewise-constant derivative.

gradcheck does not apply (the gradient is deliberately approximate); the reference instead is
the analytic piecewise function evaluated in float64 from the float64 borders.
"""
import importlib.util
import math
import pathlib

import mpmath as mp
import pytest
import torch
import torch.nn.functional as F

from leanact.memory import saved_bytes
from leanact.ops.lossy.fewbit import FUNCTIONS, fewbit_activation, fewbit_derivative, fewbit_packed_nbytes
from leanact.ops.lossy.fewbit_tables import TABLES

ROOT = pathlib.Path(__file__).resolve().parents[1]
BITS = (1, 2, 3, 4)


def _solver():
    spec = importlib.util.spec_from_file_location("fewbit_tables_script", ROOT / "scripts" / "fewbit_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


S = _solver()


def _piecewise(function, bits, x64):
    t = TABLES[(function, bits)]
    idx = torch.bucketize(x64, torch.tensor(t["borders"], dtype=torch.float64))
    return torch.tensor(t["levels"], dtype=torch.float64)[torch.tensor(t["labels"])[idx]]


def _exact(function, x64):
    return S.derivative(function, x64)


# -- tables -------------------------------------------------------------------------------------

def _mp_derivative(function):
    if function == "gelu":
        return lambda x: mp.ncdf(x) + x * mp.npdf(x)
    if function == "gelu_tanh":
        k, a = mp.sqrt(2 / mp.pi), mp.mpf("0.044715")

        def d(x):
            t = mp.tanh(k * (x + a * x**3))
            return (1 + t) / 2 + x * (1 - t * t) * k * (1 + 3 * a * x * x) / 2
        return d
    return lambda x: (1 + x * (1 - 1 / (1 + mp.exp(-x)))) / (1 + mp.exp(-x))


@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize("bits", BITS)
def test_levels_are_weighted_means_of_their_regions(function, bits):
    """Independent check (mpmath quadrature, not the solver's): level j equals the
    normal-weighted mean of f' over {x : x's interval is labelled j}."""
    t = TABLES[(function, bits)]
    d = _mp_derivative(function)
    edges = [-mp.inf, *[mp.mpf(b) for b in t["borders"]], mp.inf]
    num, den = [mp.mpf(0)] * 2**bits, [mp.mpf(0)] * 2**bits
    with mp.workdps(20):
        for j, (a, b) in zip(t["labels"], zip(edges[:-1], edges[1:])):
            num[j] += mp.quad(lambda x: d(x) * mp.npdf(x), [a, b])
            den[j] += mp.ncdf(b) - mp.ncdf(a)
        for j, level in enumerate(t["levels"]):
            assert abs(float(num[j] / den[j]) - level) < 1e-11, (j, float(num[j] / den[j]), level)


@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize("bits", BITS)
def test_every_x_maps_to_the_nearest_level(function, bits):
    t = TABLES[(function, bits)]
    x = torch.linspace(-10, 10, 200_001, dtype=torch.float64)
    fp = _exact(function, x)
    levels = torch.tensor(t["levels"], dtype=torch.float64)
    mine = (fp - _piecewise(function, bits, x)).abs()
    best = (fp.unsqueeze(1) - levels).abs().min(dim=1).values
    assert (mine <= best + 1e-12).all()
    # at each border f' is the midpoint of the levels on either side
    b = torch.tensor(t["borders"], dtype=torch.float64)
    lab = torch.tensor(t["labels"])
    mid = 0.5 * (levels[lab[:-1]] + levels[lab[1:]])
    torch.testing.assert_close(_exact(function, b), mid, rtol=0, atol=1e-12)
    assert (levels[1:] > levels[:-1]).all() and len(t["levels"]) == 2**bits
    assert set(t["labels"]) == set(range(2**bits))  # every level is used


@pytest.mark.parametrize("function", FUNCTIONS)
def test_non_monotonic_derivative_gives_levels_several_intervals(function):
    """f' overshoots 1 right of 0 and undershoots 0 left of it: with 4 bits some levels own two
    x intervals (the tails come back to levels used near the extrema)."""
    labels = TABLES[(function, 4)]["labels"]
    assert len(labels) > 16 and len(set(labels)) == 16


@pytest.mark.parametrize("function", FUNCTIONS)
def test_error_decreases_with_bits(function):
    errs = [TABLES[(function, b)]["error"] for b in BITS]
    assert all(a > 3 * b for a, b in zip(errs, errs[1:])), errs
    # the same error, measured independently on a grid
    x = torch.linspace(-12, 12, 1_200_001, dtype=torch.float64)
    w = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi) * (x[1] - x[0])
    for b in BITS:
        e = (w * (_exact(function, x) - _piecewise(function, b, x)) ** 2).sum().item()
        assert abs(e - TABLES[(function, b)]["error"]) < 1e-7 * max(1.0, e) + 1e-9


@pytest.mark.slow
def test_solver_reproduces_shipped_tables_from_its_start_on_a_sample():
    """From the solver's own initial levels, on a sample of the tables (the 4-bit ones take ~1000
    Lloyd iterations each; ``python scripts/fewbit_tables.py --check`` solves them all)."""
    solved = {("silu", b): S.solve("silu", b) for b in (1, 2, 3)}
    solved[("gelu", 2)] = S.solve("gelu", 2)
    assert S.compare(TABLES, solved) == []


def test_every_shipped_table_is_the_solvers_fixed_point():
    """Started from each shipped table's levels, the solver stops within a few iterations, on the
    same table: every shipped table is a fixed point of its iteration (to 1e-15)."""
    solved = {key: S.solve(*key, start=t["levels"]) for key, t in TABLES.items()}
    assert S.compare(TABLES, solved) == []
    assert all(t["iterations"] <= 3 for t in solved.values()), {k: t["iterations"] for k, t in solved.items()}


def test_compare_detects_a_changed_table():
    solved = {("gelu", 1): S.solve("gelu", 1)}
    bad = {k: dict(v, levels=[v["levels"][0] + 1e-9, *v["levels"][1:]]) for k, v in solved.items()}
    assert S.compare(bad, solved)


# -- the op ---------------------------------------------------------------------------------------

def _inputs(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 2.5
    # also exactly on / next to the borders
    extra = torch.tensor([b for t in TABLES.values() for b in t["borders"]], dtype=torch.float64)
    return torch.cat([x, extra]).to(dtype)


@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_forward_is_torch_and_gradient_is_the_piecewise_derivative(function, bits, dtype):
    x = _inputs(4001, dtype).requires_grad_()
    y = fewbit_activation(x, function, bits)
    ref_y = F.silu(x.detach()) if function == "silu" else F.gelu(
        x.detach(), approximate="tanh" if function == "gelu_tanh" else "none")
    assert torch.equal(y, ref_y)
    g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(dtype)
    y.backward(g)
    d = _piecewise(function, bits, x.detach().double())  # analytic, float64 borders
    if dtype == torch.float64:
        assert torch.equal(x.grad, d * g)
    else:  # levels in float32 (16-bit) or float32, product rounded once to the dtype
        ld = torch.float32
        assert torch.equal(x.grad, (d.to(ld) * g.to(ld)).to(dtype))
    assert torch.equal(fewbit_derivative(x.detach(), function, bits).double(), d.to(
        torch.float32 if dtype == torch.bfloat16 else dtype).double())


@pytest.mark.parametrize("function", FUNCTIONS)
def test_gradient_error_decreases_with_bits_on_normal_inputs(function):
    x = torch.randn(200_000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    errs = []
    for b in BITS:
        xx = x.clone().requires_grad_()
        fewbit_activation(xx, function, b).sum().backward()
        errs.append((xx.grad - _exact(function, x)).pow(2).mean().item())
    assert all(a > 2.5 * b for a, b in zip(errs, errs[1:])), errs
    for b, e in zip(BITS, errs):  # Monte Carlo estimate of the tables' weighted error
        assert abs(e - TABLES[(function, b)]["error"]) < 0.05 * TABLES[(function, b)]["error"]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", [1, 8, 1000, 4099])
def test_saved_bytes_are_bits_times_ceil_n_over_8(bits, n):
    x = torch.randn(n, dtype=torch.bfloat16, requires_grad=True)
    assert (saved_bytes(lambda: fewbit_activation(x, "gelu", bits)) == bits * ((n + 7) // 8)
            == fewbit_packed_nbytes(n, bits))
    x = torch.randn(3, n, dtype=torch.float32).t().requires_grad_()  # non-contiguous
    y = fewbit_activation(x, "silu", bits)
    assert saved_bytes(lambda: fewbit_activation(x, "silu", bits)) == bits * ((3 * n + 7) // 8)
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, _piecewise("silu", bits, x.detach().double().contiguous()).float())


def test_no_grad_keeps_nothing_and_bad_input_raises():
    x = torch.randn(100, requires_grad=True)
    with torch.no_grad():
        assert torch.equal(fewbit_activation(x, "gelu", 2), F.gelu(x))
    assert saved_bytes(lambda: fewbit_activation(x.detach(), "gelu", 2)) == 0
    with pytest.raises(ValueError, match="bits must be"):
        fewbit_activation(x, "gelu", 5)
    with pytest.raises(ValueError, match="supports"):
        fewbit_activation(x, "relu", 2)
    with pytest.raises(TypeError, match="floating-point"):
        fewbit_activation(torch.arange(4), "gelu", 2)


def test_double_backward_raises():
    x = torch.randn(10, dtype=torch.float64, requires_grad=True)
    y = fewbit_activation(x, "gelu", 2)
    (g,) = torch.autograd.grad(y, x, torch.ones_like(y, requires_grad=True), create_graph=True)
    assert torch.equal(g, _piecewise("gelu", 2, x.detach()))
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()
