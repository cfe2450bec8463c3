"""leanact.parallel's own autograd pieces, in one process: the sequence-sharded dropout
(gradcheck, and its mask is the single-process leanact mask's slice) and the re-gather transform
(on a 1-rank gloo group: keeps the shard, rebuilds the gathered input, raises after an in-place
change of the shard)."""
import datetime
import socket

import pytest
import torch
import torch.distributed as dist

from leanact.ops.dropout.function import dropout_seeded
from leanact.parallel.dropout import _ShardDropoutFn

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_shard_dropout_is_the_slice_of_the_single_process_mask(dim):
    shape, p = (3, 10, 8), 0.3
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    seed = torch.tensor(12345, dtype=torch.int64)
    ref = dropout_seeded(full, seed, p)
    n = shape[dim]
    for start, stop in ((0, n // 2), (n // 2, n)):
        local = full.narrow(dim, start, stop - start).contiguous()
        out = _ShardDropoutFn.apply(local, seed, p, dim, start, n)
        assert torch.equal(out, ref.narrow(dim, start, stop - start))
    assert 0.5 < (ref == 0).float().mean().item() / p < 1.5


def test_shard_dropout_gradcheck_and_saves_only_the_seed():
    from leanact.memory import SavedTensorMeter

    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    seed = torch.tensor(7, dtype=torch.int64)
    assert torch.autograd.gradcheck(lambda t: _ShardDropoutFn.apply(t, seed, 0.4, 1, 5, 10), (x,))
    meter = SavedTensorMeter()
    with meter:
        _ShardDropoutFn.apply(x, seed, 0.4, 1, 5, 10)
    assert meter.total_bytes == 8


@pytest.fixture(scope="module")
def one_rank_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    from torch.distributed.device_mesh import init_device_mesh

    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def _gathered_linear(mesh, regather, weight, shard):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    with regather:
        full = DTensor.from_local(shard, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()
        regather.register(full, shard, mesh, 1)
        x = DTensor.from_local(full, mesh, [Replicate()], run_check=False)
        w = DTensor.from_local(weight, mesh, [Replicate()], run_check=False)
        return (x @ w).to_local()


def test_regather_keeps_the_shard_and_rebuilds_the_input(one_rank_group):
    from leanact.parallel.meter import ShardedSavedTensorMeter
    from leanact.parallel.regather import RegatherTransform

    weight = torch.randn(8, 6, requires_grad=True)
    base = torch.randn(2, 4, 8, requires_grad=True)
    shard = base * 2  # a non-leaf activation, like a norm's output
    regather = RegatherTransform()
    regather.active = 1
    rebuilt = []
    unpack = regather.unpack
    regather.unpack = lambda packed: rebuilt.append(unpack(packed)) or rebuilt[-1]
    meter = ShardedSavedTensorMeter(exclude=[weight])
    with meter:
        y = _gathered_linear(one_rank_group, regather, weight, shard)
    assert meter.total_bytes == shard.numel() * 4  # the shard itself: no second copy of the input
    kept = [r for r in meter.records if r.counted_bytes]
    assert len(kept) == 1 and kept[0].storage_key == shard.untyped_storage()._cdata
    y.sum().backward()
    assert len(rebuilt) == 1 and torch.equal(rebuilt[0].to_local(), shard.detach().reshape(rebuilt[0].shape))
    expected = (base.detach() * 2).reshape(-1, 8).sum(0, keepdim=True).T.expand(8, 6)
    assert torch.allclose(weight.grad, expected)


def test_regather_raises_after_in_place_change_of_the_shard(one_rank_group):
    from leanact.parallel.regather import RegatherTransform

    weight = torch.randn(8, 6, requires_grad=True)
    shard = torch.randn(2, 4, 8, requires_grad=True) * 1.0
    regather = RegatherTransform()
    regather.active = 1
    y = _gathered_linear(one_rank_group, regather, weight, shard)
    with torch.no_grad():
        shard.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*leanact.parallel.regather"):
        y.sum().backward()
