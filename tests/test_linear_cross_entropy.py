"""Fused linear + cross-entropy (leanact.ops.cross_entropy.function): exactness, semantics, memory.

Reference: the unfused computation, ``F.cross_entropy(F.linear(x, W, b).float() [scaled, capped])``
(:func:`linear_cross_entropy_reference`). fp32: loss and every gradient within 1e-5 relative
(norm-wise; observed ~2e-7). bf16: both are compared with the fp64 truth on the same rounded
inputs; the fused error must be ≤ 2x the unfused one (observed ≤ 1.3x: dx is summed over
vocabulary tiles, each product rounded to bf16 before an fp32 sum). Tiles are made tiny
(``chunk_tokens``/``tile_elements``) so every path (several token chunks, several vocabulary tiles,
a chunk whose tokens are all ignored) runs on small shapes.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import leanact.ops.cross_entropy.function as L
from leanact.functional import linear_cross_entropy
from leanact.memory import NewStoragePeak, SavedTensorMeter
from leanact.nn import LinearCrossEntropyLoss

REF = L.linear_cross_entropy_reference
TINY = dict(chunk_tokens=5, tile_elements=5 * 7)  # 5 tokens x 7 vocabulary entries per tile


def _data(n=23, h=6, v=19, dtype=torch.float32, bias=True, ignore="some", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) * 0.5).to(dtype)
    b = (torch.randn(v, generator=g) * 0.5).to(dtype) if bias else None
    y = torch.randint(0, v, (n,), generator=g)
    if ignore == "some":
        y[1::4] = -100
        y[5:10] = -100  # with chunk_tokens=5 in the masked path, a chunk of ignored tokens only
    elif ignore == "all":
        y[:] = -100
    return x, w, b, y


def _run(fn, x, w, b, y, **kw):
    """(loss, [dx, dW, db]) with the loss summed to a scalar for 'none'."""
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    b = None if b is None else b.clone().requires_grad_()
    loss = fn(x, w, y, b, **kw)
    s = loss.sum() if loss.dim() else loss
    grads = torch.autograd.grad(s, [t for t in (x, w, b) if t is not None])
    return loss.detach(), list(grads)


def _rel(a, b):
    if torch.isnan(b).all():
        return 0.0 if torch.isnan(a).all() else float("inf")
    d = (a.double() - b.double()).norm()
    n = b.double().norm()
    return (d / n).item() if n > 0 else d.item()


def _check(kw, data_kw=None, tol=1e-5, fused_kw=None):
    x, w, b, y = _data(**(data_kw or {}))
    l0, g0 = _run(REF, x, w, b, y, **kw)
    l1, g1 = _run(linear_cross_entropy, x, w, b, y, **kw, **(fused_kw if fused_kw is not None else TINY))
    assert l1.dtype == l0.dtype and l1.shape == l0.shape
    errs = [_rel(l1, l0)] + [_rel(a, c) for a, c in zip(g1, g0)]
    assert max(errs) < tol, (kw, data_kw, errs)
    return errs


@pytest.fixture(params=[None, 3.0], ids=["product-per-chunk", "products-of-chunks"])
def products(request, monkeypatch):
    """dW, dx and db as one matmul per chunk (the default for these tiny shapes) or per several
    chunks' gradients kept in one buffer (PRODUCT_FRACTION raised: 18 one-row chunks per product
    with TINY tiles, a ragged last product)."""
    if request.param is not None:
        monkeypatch.setattr(L, "PRODUCT_FRACTION", request.param)
    return request.param


# ---- float64 gradcheck ------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    dict(),
    dict(reduction="sum", label_smoothing=0.2),
    dict(reduction="none", softcap=2.0, scale=0.7),
    dict(grad_in_forward=True, softcap=3.0, label_smoothing=0.1),
    dict(num_items_in_batch=torch.tensor(7.0, dtype=torch.float64), bias=False),
], ids=["mean", "sum-smooth", "none-softcap", "grad_in_forward", "num_items-nobias"])
def test_gradcheck_float64(kw, products):
    kw = dict(kw)
    bias = kw.pop("bias", True)
    x, w, b, y = _data(n=9, h=3, v=7, dtype=torch.float64, bias=bias)
    inputs = [x.requires_grad_(), w.requires_grad_()] + ([b.requires_grad_()] if bias else [])

    def fn(*t):
        return linear_cross_entropy(t[0], t[1], y, t[2] if bias else None, **kw, chunk_tokens=4, tile_elements=12)

    assert torch.autograd.gradcheck(fn, inputs)


# ---- semantics matrix (fp32 vs the unfused computation) --------------------------------------

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_semantics_matrix_fp32(reduction, products):
    for smooth, cap, scale, ignore, gif in itertools.product((0.0, 0.15), (None, 2.5), (1.0, 0.6),
                                                             ("none", "some"), (False, True)):
        _check(dict(reduction=reduction, label_smoothing=smooth, softcap=cap, scale=scale),
               dict(ignore=ignore), fused_kw=dict(TINY, grad_in_forward=gif))


@pytest.mark.parametrize("compact", [True, False], ids=["gathered-rows", "masked-rows"])
@pytest.mark.parametrize("tiles", ["tiny", "one-tile", "full-vocab-rows"])
def test_tiling_and_row_paths(compact, tiles, monkeypatch, products):
    monkeypatch.setattr(L, "COMPACT", 1.0 if compact else 0.0)
    fused = {"tiny": TINY, "one-tile": {}, "full-vocab-rows": dict(chunk_tokens=3, tile_elements=19 * 3)}[tiles]
    for kw, gif in ((dict(), False), (dict(reduction="none", label_smoothing=0.1, softcap=1.5), False),
                    (dict(label_smoothing=0.1), True)):
        _check(kw, fused_kw=dict(fused, grad_in_forward=gif))


def test_ignore_index_other_value_and_no_bias():
    x, w, _, y = _data(bias=False)
    y = torch.where(y == -100, torch.full_like(y, 3), y)  # class 3 is "ignored" now
    l0, g0 = _run(REF, x, w, None, y, ignore_index=3)
    l1, g1 = _run(linear_cross_entropy, x, w, None, y, ignore_index=3, **TINY)
    assert _rel(l1, l0) < 1e-5 and all(_rel(a, c) < 1e-5 for a, c in zip(g1, g0))


@pytest.mark.parametrize("compact", [True, False])
def test_all_ignored(compact, monkeypatch):
    """Every token ignored: mean is NaN with zero gradients (as torch), sum and none are 0."""
    monkeypatch.setattr(L, "COMPACT", 1.0 if compact else 0.0)
    x, w, b, y = _data(ignore="all")
    for red in ("mean", "sum", "none"):
        l0, g0 = _run(REF, x, w, b, y, reduction=red)
        l1, g1 = _run(linear_cross_entropy, x, w, b, y, reduction=red, **TINY)
        assert torch.equal(l1.isnan(), l0.isnan()) and torch.equal(l1.nan_to_num(), l0.nan_to_num())
        assert all(torch.equal(a, torch.zeros_like(a)) for a in g1) and all(torch.equal(a, c) for a, c in zip(g1, g0))


def test_num_items_in_batch_hf_semantics():
    """HF's gradient-accumulation path: sum over valid tokens / num_items_in_batch (int or tensor)."""
    x, w, b, y = _data()
    for items in (11, torch.tensor(11), torch.tensor(11.0)):
        l0, g0 = _run(REF, x, w, b, y, num_items_in_batch=items)
        l1, g1 = _run(linear_cross_entropy, x, w, b, y, num_items_in_batch=items, **TINY)
        assert _rel(l1, l0) < 1e-6 and all(_rel(a, c) < 1e-6 for a, c in zip(g1, g0))
    ref = REF(x, w, y, b, reduction="sum") / 11
    torch.testing.assert_close(linear_cross_entropy(x, w, y, b, num_items_in_batch=11), ref, rtol=1e-6, atol=0)


def test_batched_shapes_and_module():
    x, w, b, y = _data(n=24)
    x3, y3 = x.reshape(2, 12, -1), y.reshape(2, 12)
    out = linear_cross_entropy(x3, w, y3, b, reduction="none")
    assert out.shape == (2, 12) and out.dtype == torch.float32
    torch.testing.assert_close(out, REF(x3, w, y3, b, reduction="none"), rtol=1e-6, atol=1e-6)
    m = LinearCrossEntropyLoss(label_smoothing=0.1, softcap=4.0)
    assert "softcap=4.0" in repr(m)
    torch.testing.assert_close(m(x3, w, y3, b), REF(x3, w, y3, b, label_smoothing=0.1, softcap=4.0), rtol=1e-6, atol=0)


# ---- 16-bit: within 2x the unfused error against the fp64 truth -------------------------------

def _errors(dtype, kw, fused_kw, autocast=False):
    x, w, b, y = _data(n=160, h=32, v=300, dtype=torch.float32)
    if not autocast:
        x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
    truth = _run(REF, x.to(dtype).double(), w.to(dtype).double(), b.to(dtype).double(), y, **kw)
    out = []
    for fn, fkw in ((REF, {}), (linear_cross_entropy, fused_kw)):
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            loss, grads = _run(fn, x, w, b, y, **kw, **fkw)
        out.append([_rel(loss, truth[0])] + [_rel(a, c) for a, c in zip(grads, truth[1])])
    return out


@pytest.mark.parametrize("matmul", ["bf16-matmuls", "auto-matmuls"])
@pytest.mark.parametrize("case", ["bf16", "bf16-softcap-smooth", "bf16-grad_in_forward", "autocast-bf16"])
def test_bf16_within_2x_unfused_error(case, matmul, products):
    """With bf16 matmuls (as the unfused head) and with the automatic choice (fp32 on a CPU that
    emulates bf16 GEMM: more accurate still)."""
    kw = dict(softcap=5.0, label_smoothing=0.1) if "softcap" in case else {}
    fused = dict(chunk_tokens=64, tile_elements=64 * 50, grad_in_forward="grad_in_forward" in case,
                 matmul_dtype=torch.bfloat16 if matmul == "bf16-matmuls" else None)
    unfused, fused_err = _errors(torch.bfloat16, kw, fused, autocast=case.startswith("autocast"))
    for u, f in zip(unfused, fused_err):
        assert f <= 2 * u + 1e-7, (case, unfused, fused_err)


def test_matmul_dtype_choice(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(L, "_native_16bit_gemm", lambda dtype: False)
    assert L._matmul_dtype(torch.bfloat16, cpu) == torch.float32
    assert L._matmul_dtype(torch.float16, cpu) == torch.float32
    assert L._matmul_dtype(torch.float32, cpu) == torch.float32 and L._matmul_dtype(torch.float64, cpu) == torch.float64
    assert L._matmul_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    monkeypatch.setattr(L, "_native_16bit_gemm", lambda dtype: True)
    assert L._matmul_dtype(torch.bfloat16, cpu) == torch.bfloat16


def test_autocast_grads_keep_parameter_dtype():
    x, w, b, y = _data()
    w = torch.nn.Parameter(w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(x.requires_grad_(), w, y, b)
    loss.backward()
    assert loss.dtype == torch.float32 and w.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


# ---- memory: what backward keeps, to the byte --------------------------------------------------

def test_kept_bytes_recompute():
    """Recompute mode keeps x (excluded here: the op before keeps it), the parameters (excluded) and
    8 bytes per token: fp32 log-sum-exp + int32 target."""
    x, w, b, y = _data(n=40, h=8, v=50, dtype=torch.bfloat16)
    lin = torch.nn.Linear(8, 50).to(torch.bfloat16)
    x.requires_grad_()
    meter = SavedTensorMeter(lin, exclude=[x])
    with meter:
        loss = linear_cross_entropy(x, lin.weight, y, lin.bias, **TINY)
    assert meter.total_bytes == L.KEPT_BYTES_PER_TOKEN * 40 == 320
    loss.backward()
    # the unfused head keeps the bf16 logits' fp32 copy's log-softmax (and more): far above
    meter2 = SavedTensorMeter(lin, exclude=[x])
    with meter2:
        REF(x, lin.weight, y, lin.bias)
    assert meter2.total_bytes >= 40 * 50 * 4


def test_upcast_copy_of_x_is_one_chunk():
    """16-bit x with fp32 matmuls (a CPU without 16-bit GEMM): backward upcasts one chunk of x at a
    time, never the whole of it: its transient is dx in the matmul dtype (n·h·4 bytes), the fp32
    dW accumulator (v·h·4: several chunks), one chunk's copy of x and one chunk's logits (rows × the
    whole vocabulary), not a second n·h·4."""
    n, h, v, chunk = 1024, 64, 256, 64
    x, w, _, y = _data(n=n, h=h, v=v, dtype=torch.bfloat16, bias=False, ignore="none")
    x.requires_grad_()
    w.requires_grad_()
    loss = linear_cross_entropy(x, w, y, chunk_tokens=chunk, matmul_dtype=torch.float32)
    with NewStoragePeak() as mode:
        loss.backward()
    grads = x.numel() * 2 + w.numel() * 2
    transient = mode.peak - grads
    dx, dw_acc, chunk_copy, logits = n * h * 4, v * h * 4, chunk * h * 4, chunk * v * 4
    assert dx + dw_acc <= transient <= dx + dw_acc + 2 * chunk_copy + logits + 2 * chunk * 4 * 4  # (+ row stats)
    assert transient < dx + dw_acc + n * h * 4  # a whole upcast copy of x would be another 256 KiB


def test_kept_bytes_grad_in_forward():
    """grad_in_forward keeps the gradients themselves: dx (x's dtype), dW (W's), db (b's); the meter
    files them as gradients, not activations."""
    x, _, _, y = _data(n=40, h=8, v=50)
    lin = torch.nn.Linear(8, 50)
    x.requires_grad_()
    meter = SavedTensorMeter(lin, exclude=[x])
    with meter:
        loss = linear_cross_entropy(x, lin.weight, y, lin.bias, grad_in_forward=True, tile_elements=50 * 7)
    assert meter.total_bytes == 0  # gradients, filed apart from activations
    assert sum(r.storage_nbytes for r in meter.records if r.excluded == "gradient") == (40 * 8 + 50 * 8 + 50) * 4
    loss.backward()
    ref = _run(REF, x.detach(), lin.weight.detach(), lin.bias.detach(), y)[1]
    assert all(_rel(a, c) < 1e-5 for a, c in zip((x.grad, lin.weight.grad, lin.bias.grad), ref))


def test_no_grad_keeps_nothing_and_frozen_weight():
    x, w, b, y = _data()
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(x, w, y, b), REF(x, w, y, b), rtol=1e-6, atol=0)
    xr = x.clone().requires_grad_()
    linear_cross_entropy(xr, w, y, b, **TINY).backward()  # W, b frozen: dx only
    xr2 = x.clone().requires_grad_()
    REF(xr2, w, y, b).backward()
    assert _rel(xr.grad, xr2.grad) < 1e-5


def test_fake_tensors_keep_the_same_shapes():
    """Under FakeTensorMode (leanact.estimate) all rows are computed and masked: no data-dependent shape."""
    with FakeTensorMode():
        x = torch.randn(12, 4, requires_grad=True)
        w = torch.randn(9, 4, requires_grad=True)
        y = torch.randint(0, 9, (12,))
        loss = linear_cross_entropy(x, w, y, **TINY)
        loss.backward()
        assert x.grad.shape == x.shape and w.grad.shape == w.shape and loss.shape == ()


def test_errors():
    x, w, b, y = _data()
    with pytest.raises(IndexError, match="out of bounds"):
        linear_cross_entropy(x, w, torch.full_like(y, 19), b)
    with pytest.raises(ValueError, match="batch_size"):
        linear_cross_entropy(x, w, y[:-1], b)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(x, w, y, b, reduction="avg")
    with pytest.raises(RuntimeError, match="dtype"):
        linear_cross_entropy(x.double(), w, y, b)
    with pytest.raises(RuntimeError, match="do not match"):
        linear_cross_entropy(x[:, :3], w, y, b)


def test_while_a_cuda_graph_is_captured(monkeypatch):
    """While a CUDA graph is captured (``reduce-overhead``) the host reads nothing: all rows, masked,
    the same loss and gradients, and an out-of-range target asserted on the device (here the CPU,
    where the assertion raises at once). The capture is simulated: this test has no GPU."""
    monkeypatch.setattr(L, "_capturing", lambda t: True)
    monkeypatch.setattr(L, "COMPACT", 1.0)  # (would compact the ignored rows otherwise)
    for kw, gif in ((dict(), False), (dict(reduction="sum", label_smoothing=0.1), False), (dict(), True)):
        _check(kw, fused_kw=dict(TINY, grad_in_forward=gif))
    x, w, b, y = _data()
    y[0] = 19
    with pytest.raises(RuntimeError, match="out of bounds"):
        linear_cross_entropy(x, w, y, b)


# ---- the chunk plan, launches, grad_output ----------------------------------------------------

def test_chunk_plan():
    """Chunks of rows × the whole vocabulary, the same plan on every device: the transient at most
    5% of the fp32 logits, at least 128 rows, at most 2^25 logits per chunk; explicit bounds win."""
    v = 128256
    assert L.chunk_rows(8192, v, torch.float32) == L.chunk_rows(8192, v, torch.bfloat16) == 2**25 // v == 261
    assert L.chunk_rows(2048, v, torch.float32) == 128  # 5% would be 102 rows: the floor
    assert L.chunk_rows(4096, 32000, torch.bfloat16) == 136  # 0.05 * 4 * 4096 / (4 + 2) bytes per logit
    assert L.chunk_rows(4096, 32000, torch.float32) == 204  # 0.05 * 4096 (fp32 logits only)
    assert L.chunk_rows(100, v, torch.float32) == 100  # fewer tokens than a chunk: one chunk
    # 16-bit weights: several chunks would sum dW in an fp32 buffer of W's size (V·H·4 bytes); one
    # chunk where all the logits' transient (N·V·6) is no larger and fits 2^25 logits
    assert L.chunk_rows(256, v, torch.bfloat16, weight_dtype=torch.bfloat16, hidden=2048) == 256
    assert L.chunk_rows(256, v, torch.bfloat16, weight_dtype=torch.float32, hidden=2048) == 128
    assert L.chunk_rows(512, 8192, torch.bfloat16, weight_dtype=torch.bfloat16, hidden=64) == 128
    assert L.chunk_rows(8192, v, torch.bfloat16, weight_dtype=torch.bfloat16, hidden=2048) == 261
    assert L.chunk_rows(8192, v, torch.float32, chunk_tokens=64) == 64
    assert L.chunk_rows(8192, 19, torch.float32, tile_elements=5 * 19) == 5
    for n, dtype in ((8192, torch.bfloat16), (65536, torch.float32)):  # transient <= 5% where not floored
        rows = L.chunk_rows(n, v, dtype)
        per = 4 + (2 if dtype == torch.bfloat16 else 0)
        assert rows * v * per <= 0.05 * n * v * 4


def test_product_plan():
    """Several chunks' logit gradients per dW product where dW sums over chunks: as many chunks as
    fit in half of dW's fp32 accumulator (at least one): at V = 128,256, H = 2048 and 8,192 bf16
    tokens, 7 chunks of 261 rows, so dW's 1 GiB accumulator is read and written 5 times, not 32."""
    v, h = 128256, 2048
    step = L.chunk_rows(8192, v, torch.bfloat16)
    rows = L.product_rows(8192, v, h, step, torch.bfloat16)
    assert (step, rows, -(-8192 // rows)) == (261, 7 * 261, 5)
    assert rows * v * 2 <= L.PRODUCT_FRACTION * v * h * 4 < (rows + step) * v * 2
    assert L.product_rows(8192, v, h, step, torch.float32) == 3 * 261  # fp32 gradients: half the rows
    assert L.product_rows(8192, v, 64, step, torch.bfloat16) == 261  # a narrow head: one chunk each
    assert L.product_rows(1000, v, h, 261, torch.bfloat16) == 1000  # fewer rows than a product


def _dw_products(n, h, v, **kw):
    """How many matmuls wrote or added to dW (a (v, h) result) in one forward with grad_in_forward,
    and the loss and gradients."""
    x, w, b, y = _data(n=n, h=h, v=v)
    seen = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.addmm_, torch.ops.aten.addmm, torch.ops.aten.mm) \
                    and isinstance(out, torch.Tensor) and tuple(out.shape) == (v, h):
                seen.append(func)
            return out

    xr, wr, br = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    with Count():
        loss = linear_cross_entropy(xr, wr, y, br, grad_in_forward=True, **kw)
    loss.backward()
    ref = _run(REF, x, w, b, y)
    return len(seen), [_rel(loss.detach(), ref[0])] + [_rel(a, c) for a, c in zip((xr.grad, wr.grad, br.grad), ref[1])]


def test_dw_is_one_matmul_per_product():
    """dW's accumulator is touched once per product of several chunks (the memory-bound read and
    write of V·H·4 bytes on a GPU), once per chunk when products hold one chunk; same values."""
    n, h, v, chunk = 64, 32, 19, 4  # product: 0.5·19·32·4 bytes / (19·4 bytes a row) = 16 rows, 4 chunks
    assert L.product_rows(n, v, h, chunk, torch.float32) == 16
    count, errs = _dw_products(n, h, v, chunk_tokens=chunk)
    assert count == n // 16 and max(errs) < 1e-5, (count, errs)
    count, errs = _dw_products(n, h, v, chunk_tokens=chunk, tile_elements=chunk * v)
    assert count == n // 16
    count1, errs1 = _dw_products(n, 4, v, chunk_tokens=chunk)  # h = 4: 2 rows fit, one chunk each
    assert count1 == n // chunk and max(errs1) < 1e-5, (count1, errs1)


def test_kernel_and_pytorch_chunks_in_one_product(monkeypatch):
    """A product whose chunks took different paths (the kernel, which applies the row factor, and
    fp32 PyTorch chunks, which leave it to dx's and x's rows): the PyTorch chunks are scaled in place
    and the result is still exact. (A stand-in kernel: the PyTorch path's arithmetic, every other
    call.)"""
    from leanact.ops.cross_entropy import launchers as CE
    calls = []

    def every_other(z, y, coef, lse, zy, zsum, scale, softcap, eps, stats, grad):
        calls.append(1)
        if len(calls) % 2 or not grad:
            return False
        s_lse, s_zy, s_zsum, g = CE.reference_(z, y.reshape(-1), coef, scale, softcap, eps, torch.float32)
        if stats:
            lse.copy_(s_lse)
            zy.reshape(-1).copy_(s_zy)
            if zsum is not None:
                zsum.copy_(s_zsum)
        z.copy_(g)
        return True

    monkeypatch.setattr(L._launchers, "chunk_", every_other)
    monkeypatch.setattr(L, "PRODUCT_FRACTION", 3.0)
    for kw in (dict(), dict(label_smoothing=0.1, softcap=2.0, scale=0.7)):
        for gif in (True, False):
            calls.clear()
            errs = _check(kw, fused_kw=dict(chunk_tokens=3, grad_in_forward=gif))
            assert len(calls) > 4 and max(errs) < 1e-5


def test_product_buffer_transient():
    """The peak of a forward with grad_in_forward and bf16 matmuls: dx, the fp32 dW accumulator, the
    product's buffer of 16-bit gradients (at most half the accumulator: 4 chunks here), then one
    chunk's fp32 logits or, where addmm has no out_dtype (a CPU), one chunk's upcast gradient and
    rows of x at a time, and the row statistics; no more. A buffer of one chunk would be 24 KiB
    less (below the floor); a product's upcast copy 60 KiB more (above the ceiling)."""
    n, h, v, chunk = 512, 64, 256, 16
    x, w, _, y = _data(n=n, h=h, v=v, dtype=torch.bfloat16, bias=False, ignore="none")
    rows = L.product_rows(n, v, h, chunk, torch.bfloat16)
    assert rows == 4 * chunk  # 0.5·256·64·4 bytes / (256·2 bytes a row)
    x.requires_grad_()
    w.requires_grad_()
    with NewStoragePeak() as mode:
        loss = linear_cross_entropy(x, w, y, chunk_tokens=chunk, matmul_dtype=torch.bfloat16, grad_in_forward=True)
    dx, dw_acc, buffer = n * h * 2, v * h * 4, rows * v * 2
    logits, upcast = chunk * v * 4, chunk * (v + h) * 4
    stats = n * 64  # lse, target logit, row factors, masks, targets: under 64 bytes a token
    floor = dx + dw_acc + buffer + logits
    assert floor <= mode.peak <= dx + dw_acc + buffer + max(logits, upcast) + stats, (mode.peak, floor)
    loss.backward()


class _Dispatches(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.slow
def test_launch_bound_of_a_patched_llama_step():
    """The launch proxy (aten ops dispatched, one per kernel launch or fewer on a GPU) of one
    forward + backward of a patched 1-layer Llama with a 128,256 vocabulary, 8 x 1024 tokens, fp32:
    at most 1,000 (HF's own step: ~285; the fused head adds ~20 ops per chunk of 261 rows). The
    head's earlier plan (4096 rows x 256 vocabulary tiles) dispatched ~52,000."""
    transformers = pytest.importorskip("transformers")
    import leanact

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128256)
    torch.manual_seed(0)
    model = leanact.patch(transformers.LlamaForCausalLM(cfg))
    ids = torch.randint(0, cfg.vocab_size, (8, 1024), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids[:1, :16], labels=ids[:1, :16]).loss.backward()  # first use: self-checks, caches
    model.zero_grad(set_to_none=True)
    count = _Dispatches()
    with count:
        model(input_ids=ids, labels=ids).loss.backward()
    assert leanact.summary(model).loss_states and count.n <= 1000, count.n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_grad_output_other_than_one(dtype, grad_in_forward, products):
    """loss * w (a loss scale, a weighted sum, HF's division by num_items_in_batch): the gradients
    are w times the unit ones. fp32 within 1e-5 of the reference; bf16 no further from float64
    than 2x the unfused computation (grad_in_forward scales its kept gradients once more)."""
    x, w, b, y = _data(n=64, h=16, v=50, dtype=dtype)
    weight = 0.3711  # not a power of two: scaling rounds
    kw = dict(chunk_tokens=16, grad_in_forward=grad_in_forward)
    truth = _run(lambda *a: REF(*a) * weight, x.double(), w.double(), b.double(), y)
    ref = _run(lambda *a: REF(*a) * weight, x, w, b, y)
    got = _run(lambda *a: linear_cross_entropy(*a, **kw) * weight, x, w, b, y)
    for r, g, t in zip([ref[0]] + ref[1], [got[0]] + got[1], [truth[0]] + truth[1]):
        if dtype == torch.float32:
            assert _rel(g, r) < 1e-5
        else:
            assert _rel(g, t) <= 2 * max(_rel(r, t), 2**-9), (_rel(g, t), _rel(r, t))


def test_fp32_accumulation_probe_falls_back(monkeypatch):
    """dW of 16-bit chunks sums in fp32: through addmm's out_dtype only where a probe on the device
    shows it adds in place correctly; an addmm that raises or aliases wrongly takes the fallback."""
    out, a, b = torch.zeros(6, 5), torch.randn(6, 4).bfloat16(), torch.randn(4, 5).bfloat16()
    want = a.float() @ b.float()
    real = torch.addmm

    def wrong(c, x, y, *args, out_dtype=None, out=None, **kw):
        if out_dtype is None:
            return real(c, x, y, *args, out=out, **kw) if out is not None else real(c, x, y, *args, **kw)
        result = x.to(out_dtype) @ y.to(out_dtype)  # forgets c: a wrong in-place accumulation
        if out is not None:
            out.copy_(result)
            return out
        return result

    for fake_addmm in (wrong, None):
        monkeypatch.setattr(L, "_FP32_ADDMM", {})
        if fake_addmm is not None:
            monkeypatch.setattr(torch, "addmm", fake_addmm)
        acc = out.clone()
        L._accumulate_mm_(acc, a, b)
        L._accumulate_mm_(acc, a, b)
        assert L._FP32_ADDMM == {"cpu": False}
        torch.testing.assert_close(acc, 2 * want, rtol=1e-6, atol=1e-6)
        monkeypatch.setattr(torch, "addmm", real)


def test_lossy_compression_leaves_the_kept_gradients_exact():
    """Opt-in lossy compression of saved activations (fp8) must not touch the gradients the fused
    loss computed in its forward: they come back bitwise."""
    from leanact.lossy.compress import CompressTransform

    x, w, b, y = _data(n=64, h=32, v=50, dtype=torch.bfloat16)  # (compression takes 16-bit tensors)
    plain = _run(lambda *a: linear_cross_entropy(*a, grad_in_forward=True), x, w, b, y)
    with CompressTransform("fp8", min_numel=1) as tr:
        squeezed = _run(lambda *a: linear_cross_entropy(*a, grad_in_forward=True), x, w, b, y)
    assert tr.compressed == 0
    assert all(torch.equal(p, q) for p, q in zip([plain[0]] + plain[1], [squeezed[0]] + squeezed[1]))
