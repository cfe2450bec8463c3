"""leanact.estimate.fit.largest_fitting: the exact answer of a monotone cost, in few evaluations."""
import math

import pytest

from leanact.estimate.fit import largest_fitting


def _brute(cost, budget, multiple=1, limit=10**7):
    n = 0
    while n + multiple <= limit and cost(n + multiple) <= budget:
        n += multiple
    return n


@pytest.mark.parametrize("cost", [
    lambda n: 1000 + 37 * n,                       # linear (batch)
    lambda n: 5000 + 3 * n + n * n // 7,           # quadratic (sequence, eager attention)
    lambda n: 512 * math.ceil((700 + 300 * n) / 512),  # allocator rounding
    lambda n: 100 + 10 * n + (5000 if n > 300 else 0),  # a step the fit cannot see
])
@pytest.mark.parametrize("budget", [900, 20_000, 123_456])
@pytest.mark.parametrize("multiple", [1, 64])
@pytest.mark.parametrize("degree", [1, 2])
def test_exact(cost, budget, multiple, degree):
    calls = []

    def counted(n):
        calls.append(n)
        return cost(n)

    n, seen = largest_fitting(counted, budget, multiple=multiple, degree=degree)
    assert n == _brute(cost, budget, multiple)
    assert n % multiple == 0 and len(calls) == len(set(calls)) == len(seen)
    assert len(calls) <= 30


def test_few_evaluations_for_polynomials():
    for cost in (lambda n: 10**6 + 12345 * n, lambda n: 10**6 + 999 * n + 3 * n * n):
        n, seen = largest_fitting(cost, 10**9)
        assert cost(n) <= 10**9 < cost(n + 1) and len(seen) <= 6


def test_few_evaluations_when_small_sizes_peak_elsewhere():
    """A step's peak at small batches is often the optimizer's (flat in the batch), the activations'
    beyond: the line through the largest sizes seen, not through the flat start, finds the answer."""
    for kink, most in ((3, 6), (5, 7), (40, 10)):  # a flat start past the probes: doubling out of it
        def cost(n, kink=kink):
            return 512 * math.ceil((68_000_000 + 313_000 * max(n, kink)) / 512)

        n, seen = largest_fitting(cost, 92_274_688, degree=1)
        assert n == _brute(cost, 92_274_688) and len(seen) <= most, (kink, seen)


def test_limit_and_nothing_fits():
    assert largest_fitting(lambda n: n, 10**9, limit=100)[0] == 100
    assert largest_fitting(lambda n: 10 * n, 10**9, multiple=64, limit=1000)[0] == 960
    assert largest_fitting(lambda n: 1000 + n, 999)[0] == 0
    with pytest.raises(ValueError, match="multiple"):
        largest_fitting(lambda n: n, 10, multiple=0)
    with pytest.raises(ValueError, match="degree"):
        largest_fitting(lambda n: n, 10, degree=3)


@pytest.mark.parametrize("start_at", [0, 1, 50, 99, 100, 101, 150, 400])
def test_a_start_gives_the_exact_answer(start_at):
    """``start`` (a likely answer from a cheaper model of the cost): two calls when it is the answer;
    exact wherever it is; the costs in ``known`` are not computed again."""
    def cost(n):
        return max(5000, 1000 + 50 * n)  # a floor, then linear: 100 fits, 101 does not

    for multiple in (1, 4):
        calls = []

        def counted(n):
            calls.append(n)
            return cost(n)

        start = start_at - start_at % multiple
        n, seen = largest_fitting(counted, 6000, multiple=multiple, start=start)
        assert n == _brute(cost, 6000, multiple) and len(calls) == len(set(calls))
        if start == n:
            assert calls == [n, n + multiple]
        known = {n: cost(n)}
        calls.clear()
        assert largest_fitting(counted, 6000, multiple=multiple, start=n, known=known)[0] == n
        assert calls == [n + multiple]
    with pytest.raises(ValueError, match="start must be a multiple of 4"):
        largest_fitting(cost, 6000, multiple=4, start=6)
