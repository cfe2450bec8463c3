"""Compressed saved activations (leanact.lossy.compress): round-trip error bounds per format,
stochastic rounding unbiased, exact kept bytes, deduplication, what is left alone, in-place safety."""
import math

import pytest
import torch
from torch import nn

from leanact.lossy.compress import CompressTransform, compress, compressed_nbytes, decompress, keep_exact
from leanact.memory import SavedTensorMeter, saved_bytes


def _data(n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # blocks with very different magnitudes (per-block scales matter)
    return (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2)).to(dtype)


@pytest.mark.parametrize("n", [4096, 1000, 129])
def test_fp8_relative_error_bound(n):
    x = _data(n)
    q, scales = compress(x, "fp8", 128)
    assert q.dtype == torch.float8_e4m3fn and q.numel() == n and scales.numel() == math.ceil(n / 128)
    back = decompress(q, scales, torch.float32, 128)
    scale = scales.repeat_interleave(128)[:n]
    err = (back - x).abs()
    normal = x.abs() >= scale * 2.0**-6  # e4m3's normal range (times the block scale)
    assert normal.float().mean() > 0.8
    # round to nearest with 3 mantissa bits: 2**-4 relative (+ float32 rounding of x/scale, *scale)
    assert (err[normal] <= x.abs()[normal] * 2.0**-4 * (1 + 1e-5)).all()
    assert (err[~normal] <= scale[~normal] * 2.0**-10 * (1 + 1e-5)).all()  # subnormals: half their step
    blocks = x[: (n // 128) * 128].view(-1, 128)
    if blocks.numel():  # the block maximum is kept (to float32 rounding)
        torch.testing.assert_close(back[: blocks.numel()].view(-1, 128).abs().amax(1), blocks.abs().amax(1),
                                   rtol=1e-6, atol=0)


@pytest.mark.parametrize("n", [4096, 1000])
def test_int8_error_below_one_step_and_unbiased(n):
    x = _data(n, seed=1)
    g = torch.Generator().manual_seed(5)
    reps = 400
    backs = []
    for _ in range(reps):
        q, scales = compress(x, "int8", 64, g)
        assert q.dtype == torch.int8 and q.numel() == n
        backs.append(decompress(q, scales, torch.float32, 64))
    backs = torch.stack(backs)
    scale = scales.repeat_interleave(64)[:n]
    assert ((backs - x).abs() <= scale * (1 + 1e-5)).all()  # |err| < one quantisation step
    # unbiased: with p = frac(x / scale), one draw has mean x and sd scale*sqrt(p(1-p)), so
    # z = (mean of reps - x) / (that sd / sqrt(reps)) is ~N(0, 1) per element
    v = x / scale
    p = v - v.floor()
    sd = scale * (p * (1 - p)).sqrt() / reps**0.5
    ok = p * (1 - p) > 0.01
    z = (backs.mean(0) - x)[ok] / sd[ok]
    assert z.abs().max() < 6 and z.pow(2).mean() < 1.3 and abs(z.mean()) < 5 / z.numel() ** 0.5
    # the same statistic rejects round-to-nearest (biased: its error does not average out)
    z_near = ((v.round() * scale - x)[ok] / sd[ok])
    assert z_near.pow(2).mean() > 10


def test_int8_stochastic_rounding_statistics():
    """A value 0.3 steps above a grid point rounds up with probability 0.3."""
    x = torch.zeros(128 * 200)
    x[::128] = 127.0  # block maximum -> scale 1
    x[1::128] = 10.3
    q, scales = compress(x, "int8", 128, torch.Generator().manual_seed(0))
    assert torch.all(scales == 1.0)
    ups = (q[1::128] == 11).float().mean().item()
    assert abs(ups - 0.3) < 4 * math.sqrt(0.3 * 0.7 / 200)
    assert set(q[1::128].tolist()) <= {10, 11}


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_saved_bytes_exact_and_gradients_close(fmt, dtype):
    torch.manual_seed(0)
    lin = nn.Linear(256, 64).to(dtype)
    x = torch.randn(3, 50, 256, dtype=dtype, requires_grad=True)

    def run():
        with CompressTransform(fmt):
            return lin(torch.tanh(x))

    # tanh keeps its output (3*50*256) and Linear keeps the same tensor: one compressed copy
    n = 3 * 50 * 256
    assert saved_bytes(run, lin) == compressed_nbytes(n, 128) == n + 4 * math.ceil(n / 128)
    y = run()
    g = torch.randn_like(y)
    y.backward(g)
    gx, gw = x.grad.clone(), lin.weight.grad.clone()
    x.grad = None
    lin.zero_grad()
    lin(torch.tanh(x)).backward(g)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert rel(gw, lin.weight.grad) < 0.04 and rel(gx, x.grad) < 0.04


def test_dedup_views_and_reused_storage():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(64, 3 * 64, dtype=torch.bfloat16))
    x = torch.randn(100, 64, dtype=torch.bfloat16, requires_grad=True)
    tr = CompressTransform("fp8")

    def run():
        with tr:
            qkv = x @ w  # one storage, three views kept by three ops
            q, k, v = qkv.split(64, dim=1)
            return (q * 2).sum() + (k * k).sum() + (v.t() * 3).sum()

    meter = SavedTensorMeter(exclude=[x])
    with meter:
        out = run()
    n = 100 * 3 * 64
    assert tr.compressed == 1 and tr.reused >= 1
    assert meter.total_bytes == compressed_nbytes(n, 128)
    out.backward()
    gx = x.grad.clone()
    x.grad = None
    qkv = x @ w
    q, k, v = qkv.split(64, dim=1)
    ((q * 2).sum() + (k * k).sum() + (v.t() * 3).sum()).backward()
    assert ((gx.float() - x.grad.float()).norm() / x.grad.float().norm()) < 0.05


def test_left_alone_parameters_small_nonfloat_float32_and_marked():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(128, 128, dtype=torch.bfloat16))
    small = torch.randn(10, 10, dtype=torch.bfloat16, requires_grad=True) * 1
    f32 = torch.randn(100, 100, requires_grad=True) * 1
    marked = torch.randn(100, 100, dtype=torch.bfloat16, requires_grad=True) * 1
    keep_exact(marked)
    col = torch.randn(5000, 1, dtype=torch.bfloat16, requires_grad=True) * 1  # last dim 1 (a statistic)
    src = torch.randn(5000, 10, requires_grad=True) * 1
    idx = torch.randint(0, 10, (5000, 1))
    leaf = torch.randn(100, 100, dtype=torch.bfloat16, requires_grad=True)
    tr = CompressTransform("fp8")
    with tr:
        outs = [w * w, small * small, f32 * f32, marked * marked, col * col, src.gather(1, idx), leaf * leaf]
    assert tr.compressed == 0  # the int64 index of gather is not float; src's storage is float32
    with tr:  # a plain 16-bit activation of the same size is compressed
        h = leaf * 1
        outs.append(h * h)
    assert tr.compressed == 1


def test_inplace_modification_after_saving_raises():
    x = torch.randn(100, 100, dtype=torch.bfloat16, requires_grad=True)
    with CompressTransform("fp8"):
        h = x * 2
        y = (h * h).sum()
    h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    # modified and then saved again: the first saves are stale even once every reference is gone
    with CompressTransform("int8"):
        h = x * 2
        y1 = (h.sin()).sum()
        h.relu_()  # relu_ saves h again, at the new version
        y2 = h.sum()
    del h
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (y1 + y2).backward()


def test_bad_arguments():
    with pytest.raises(ValueError, match="format"):
        CompressTransform("fp4")
    with pytest.raises(ValueError, match="block"):
        CompressTransform("fp8", block=0)
    with pytest.raises(ValueError, match="floating"):
        CompressTransform("fp8", dtypes=(torch.int32,))


def test_float32_opt_in_and_select():
    x = torch.randn(200, 200, requires_grad=True)
    tr = CompressTransform("int8", dtypes=(torch.float32,), select=lambda t: t.shape[0] == 200)
    with tr:
        h = x * 1
        y = (h * h).sum() + (h[:10] * 1).sum()
    assert tr.compressed == 1
    y.backward()
    expected = 2 * x.detach() + (torch.arange(200)[:, None] < 10).float()
    assert ((x.grad - expected).norm() / expected.norm()) < 0.02
