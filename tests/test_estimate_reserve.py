"""leanact.estimate.maximize keeps a reserve of the budget free for CUDA's caching allocator: the
largest size is the one whose predicted peak fits ``budget - reserve``."""
import pytest
from test_plan_maximize import _ids, _llama

from leanact.estimate import estimate, maximize
from leanact.estimate.maximize import RESERVE_FRACTION, RESERVE_MIN, reserve_for

GIB, MIB = 2**30, 2**20


def test_reserve_for():
    assert (RESERVE_FRACTION, RESERVE_MIN) == (0.02, GIB)
    assert reserve_for(80 * GIB) == int(0.02 * 80 * GIB)  # 1.6 GiB: 2% of the budget
    assert reserve_for(16 * GIB) == GIB  # at least 1 GiB
    assert reserve_for(4 * GIB) == GIB // 2  # at most an eighth of a small budget
    assert reserve_for(80 * MIB) == 10 * MIB
    assert reserve_for(80 * GIB, "cpu") == 0  # no caching allocator


@pytest.mark.slow
def test_largest_batch_leaves_the_reserve():
    model, x, budget = _llama(), _ids(2, 64), 80 * MIB
    found = maximize(model, x, budget, "batch", strategies=["lean"])
    assert found.reserve == reserve_for(budget) and found.limit == budget - found.reserve
    assert "reserve=" in repr(found)
    b = found.value
    assert b > 0 and found.estimate.peak <= found.limit < estimate(model, x, None, "cuda", batch=b + 1).peak
    none = maximize(model, x, budget, "batch", strategies=["lean"], reserve=0)
    assert none.reserve == 0 and none.value > b and none.estimate.peak <= budget
    with pytest.raises(ValueError, match="reserve"):
        maximize(model, x, budget, "batch", strategies=["lean"], reserve=budget + 1)
    with pytest.raises(ValueError, match="reserve"):
        maximize(model, x, budget, "batch", strategies=["lean"], reserve=-1)
