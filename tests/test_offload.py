"""leanact.strategies offload: host copies from a reused pool, exact gradients, device bytes kept,
in-place checks, views sharing one copy, recipes (RecipeTransform) inside an offloaded layer."""
import copy
import math

import pytest
import torch
from torch import nn

from leanact import recompute
from leanact import strategies as S
from leanact.memory import SavedTensorMeter
from leanact.nn.fused import LeanMLP


class Block(nn.Module):
    def __init__(self, h=32):
        super().__init__()
        self.h = h
        self.qkv, self.out, self.ln = nn.Linear(h, 3 * h), nn.Linear(h, h), nn.LayerNorm(h)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)  # three views of one storage
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.h), -1) @ v
        return self.ln(x + self.out(a))


class Stack(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _stack(n=3, h=32, cls=Block):
    torch.manual_seed(0)
    return Stack([cls(h) for _ in range(n)])


def _x(h=32, device="cpu"):
    return torch.randn(4, 16, h, generator=torch.Generator().manual_seed(1)).to(device)


def _grads(m, x):
    m.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_(True)
    out = m(xx)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in m.parameters()] + [xx.grad]


THRESHOLD = 1024


def test_offload_gradients_equal_and_device_bytes_below_threshold():
    m = _stack()
    x = _x()
    out_ref, g_ref = _grads(m, x)
    plan = S.uniform(m, "offload", offload_threshold=THRESHOLD)
    assert plan.choices == ["offload", "offload", "lean"]
    plan.apply(m)
    meter = SavedTensorMeter(m)
    with meter:
        out = m(x.clone().requires_grad_(True))
    split = S.split_kept(meter)
    assert split.offloaded > 0
    for r in meter.counted():
        if r.module.startswith(("blocks.0", "blocks.1")) and not S.is_host_copy_key(r.storage_key):
            assert r.counted_bytes < THRESHOLD, r
    # every tensor >= threshold in the offloaded layers went to the host: the device keeps only
    # the last layer's (lean) bytes and small tensors
    lean_last = [r for r in meter.counted() if r.module.startswith("blocks.2")]
    assert split.device == sum(r.counted_bytes for r in lean_last) + sum(
        r.counted_bytes for r in meter.counted()
        if r.module.startswith(("blocks.0", "blocks.1")) and not S.is_host_copy_key(r.storage_key))
    del out
    out, g = _grads(m, x)
    assert torch.equal(out, out_ref)
    for a, b in zip(g, g_ref):
        assert torch.equal(a, b)


class ViewsBlock(nn.Module):
    def __init__(self, h=32):
        super().__init__()
        self.qkv = nn.Linear(h, 3 * h)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return q * k * v  # keeps the views q, k (first product) and v


def test_views_of_one_storage_share_one_host_copy():
    m = _stack(n=2, cls=ViewsBlock)
    x = _x()
    _, g_ref = _grads(m, x)
    S.Plan(["blocks.0"], ["offload"], offload_threshold=THRESHOLD).apply(m)
    meter = SavedTensorMeter(m)
    with meter:
        m(x.clone().requires_grad_(True))
    qkv, qk = 4 * 16 * 96 * 4, 4 * 16 * 32 * 4  # bytes of the fused projection output, of q * k
    host = sorted(r.counted_bytes for r in meter.counted() if r.module.startswith("blocks.0")
                  and S.is_host_copy_key(r.storage_key))
    assert host == [x.numel() * 4, qk, qkv]  # the input (kept by qkv), q * k, and one copy for q, k, v
    _, g = _grads(m, x)
    for a, b in zip(g, g_ref):
        assert torch.equal(a, b)


def test_pool_buffers_return_and_are_reused():
    m = _stack()
    plan = S.uniform(m, "offload", offload_threshold=THRESHOLD)
    plan.apply(m)
    x = _x()
    _grads(m, x)
    allocated = plan.pool.allocated
    assert allocated > 0 and plan.pool.free_bytes() == allocated  # all back after backward
    _grads(m, x)
    assert plan.pool.allocated == allocated  # second step: no new buffer


def test_inplace_change_inside_the_layer_raises():
    class Bad(nn.Module):
        def __init__(self, h=32):
            super().__init__()
            self.fc = nn.Linear(h, h)

        def forward(self, x):
            y = self.fc(x)
            z = y * y  # keeps y
            y.add_(1.0)  # y modified after being kept
            return z

    m = Stack([Bad(), Bad()])
    S.Plan(["blocks.0"], ["offload"], offload_threshold=THRESHOLD).apply(m)
    out = m(_x().requires_grad_(True))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_inplace_change_after_the_layer_raises():
    """The layer keeps y (y * y) and returns it; the caller changes y in place and still holds
    it at backward: raises. (A tensor modified and then freed before backward cannot be seen:
    backward then uses the kept value, which is the one the gradient of y * y needs -- checked
    at the end.)"""
    class Square(nn.Module):
        def __init__(self, h=32):
            super().__init__()
            self.fc = nn.Linear(h, h)

        def forward(self, x):
            y = self.fc(x)
            return y, y * y

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Square(), Square()])

        def forward(self, x, keep=True):
            y, z = self.blocks[0](x)
            y.mul_(2.0)
            return (z, y) if keep else z

    m = Two()
    S.Plan(["blocks.0"], ["offload"], offload_threshold=THRESHOLD).apply(m)
    out, y = m(_x().requires_grad_(True))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    x = _x().requires_grad_(True)
    m(x, keep=False).sum().backward()
    y0 = m.blocks[0].fc(x.detach())
    torch.testing.assert_close(m.blocks[0].fc.bias.grad, (2 * y0).sum((0, 1)) * 1, rtol=1e-5, atol=1e-5)


class MLPBlock(nn.Module):
    """LayerNorm → LeanMLP (recipes: the GELU output is rebuilt, not kept)."""

    def __init__(self, h=32):
        super().__init__()
        self.mlp = LeanMLP(h, 4 * h)

    def forward(self, x):
        return x + self.mlp(x)


def test_offload_with_recipes_inside():
    m = _stack(cls=MLPBlock)
    x = _x()
    out_ref, g_ref = _grads(m, x)
    plain = SavedTensorMeter(m)
    with plain:
        m(x.clone().requires_grad_(True))
    off = copy.deepcopy(m)
    S.uniform(off, "offload", offload_threshold=THRESHOLD).apply(off)
    recompute.reset_counters()
    meter = SavedTensorMeter(off)
    with meter:
        off(x.clone().requires_grad_(True))
    assert recompute.counters().get("claimed", 0) > 0  # the last (lean) layer still uses recipes
    split = S.split_kept(meter)
    assert split.offloaded > 0
    out, g = _grads(off, x)
    assert torch.equal(out, out_ref)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_offload_plus_recompute_keeps_nothing_on_the_device():
    m = _stack()
    x = _x()
    _, g_ref = _grads(m, x)
    plan = S.uniform(m, "offload+recompute", offload_threshold=THRESHOLD)
    assert plan.choices == ["offload+recompute", "offload+recompute", "full"]
    plan.apply(m)
    meter = SavedTensorMeter(m)
    with meter:
        m(x.clone().requires_grad_(True))
    dev = [r for r in meter.counted() if r.module in ("blocks.0", "blocks.1") and not S.is_host_copy_key(r.storage_key)]
    assert dev == []
    assert S.split_kept(meter).offloaded == 2 * x.numel() * 4  # the two layer inputs
    _, g = _grads(m, x)
    for a, b in zip(g, g_ref):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_cuda_pinned_side_stream_prefetch():
    m = _stack(n=4, h=256).cuda()
    x = _x(h=256, device="cuda")
    out_ref, g_ref = _grads(m, x)
    plan = S.uniform(m, "offload", offload_threshold=THRESHOLD)
    plan.apply(m)
    meter = SavedTensorMeter(m)
    with meter:
        m(x.clone().requires_grad_(True))
    host = [r for r in meter.counted() if S.is_host_copy_key(r.storage_key)]
    assert host and all(r.device == "cpu" for r in host)
    for bufs in plan.pool._free.values():
        assert all(b.is_pinned() for b in bufs)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    xx = x.clone().requires_grad_(True)
    out = m(xx)
    torch.cuda.synchronize()
    kept_offload = torch.cuda.memory_allocated() - before
    out.square().mean().backward()
    for _ in range(2):
        out, g = _grads(m, x)
        torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
        for a, b in zip(g, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    S.remove(m)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = m(x.clone().requires_grad_(True))
    kept_plain = torch.cuda.memory_allocated() - before
    assert kept_offload < 0.6 * kept_plain, (kept_offload, kept_plain)
