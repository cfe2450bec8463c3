import pytest
import torch

from leanact.memory import SavedTensorMeter
from leanact.saved import SavedTensorTransform, active_transforms, disabled


class KeepHalf(SavedTensorTransform):
    """Toy transform: keeps big fp32 tensors as fp16 copies (lossy, for the test only)."""

    def __init__(self, min_numel=100):
        self.min_numel = min_numel
        self.packed = 0

    def pack(self, t):
        if t.dtype != torch.float32 or t.numel() < self.min_numel:
            return None
        self.packed += 1
        return (t.half(), t.dtype)

    def unpack(self, packed):
        h, dtype = packed
        return h.to(dtype)

    def kept_tensors(self, packed):
        return [packed[0]]


def _f(x):
    return x.sin() * 2


@pytest.mark.parametrize("meter_outside", [True, False])
def test_meter_counts_what_the_transform_keeps_in_either_nesting_order(meter_outside):
    x = torch.randn(1000, requires_grad=True)
    meter, tr = SavedTensorMeter(), KeepHalf()
    first, second = (meter, tr) if meter_outside else (tr, meter)
    with first, second:
        y = _f(x)
    assert tr.packed == 1
    assert meter.total_bytes == 1000 * 2  # the fp16 copy of x, not x itself
    y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach().half().float().cos(), rtol=0, atol=0)


def test_transforms_nest_innermost_first_and_unwind():
    outer, inner = KeepHalf(), KeepHalf()
    x = torch.randn(1000, requires_grad=True)
    with outer:
        with inner:
            assert active_transforms() == [outer, inner]
            _f(x)
        _f(x)
    assert (outer.packed, inner.packed) == (1, 1)
    assert active_transforms() == []
    with outer, disabled():
        _f(x)
    assert outer.packed == 1


def test_pipeline_still_applies_inside_foreign_hooks():
    x = torch.randn(1000, requires_grad=True)
    tr = KeepHalf()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        with tr:
            _f(x)
    assert tr.packed == 1


@pytest.mark.parametrize("member", [SavedTensorMeter, KeepHalf])
def test_in_place_modification_of_a_kept_tensor_raises_inside_the_pipeline(member):
    # torch itself skips this check while saved_tensors_hooks are active; the pipeline must not.
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4) * 1.0
    with member():
        y = x @ w
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
