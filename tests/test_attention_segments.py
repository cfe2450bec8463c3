"""Segment ids and sliding windows in leanact's attention core: the O(b·s) form of the masks of
packed sequences, padded keys and windows (context parallelism builds its masks this way).

float64 gradcheck; fp32/bf16 bitwise equal to the same call with the dense bool mask they stand for
(the core masks the same score entries either way, dropout included); the bytes kept (the ids, not
an s² mask); the dead rows context parallelism derives in O(b·s) equal the dense mask's.
"""
import pytest
import torch

from leanact.memory import SavedTensorMeter
from leanact.ops.attention import attention
from leanact.ops.attention.function import dense_mask
from test_attention import SEED, _one_thread, grads, make_qkv  # noqa: F401 (autouse fixture)


def packed_ids(b, s, gen, padded=True):
    """(b, 2s) core ids: runs of random lengths per row (packed sequences); keys of padded tokens -1."""
    seg = torch.zeros(b, s, dtype=torch.int64)
    for r in range(b):
        cuts = torch.randperm(s - 1, generator=gen)[:2].add(1)
        for c in cuts.tolist():
            seg[r, c:] += 1
    keys = seg.clone()
    if padded:
        pad = torch.rand(b, s, generator=gen) < 0.25
        keys[pad] = -1
    return torch.cat([seg, keys], 1)


CASES = [  # (causal, window, GQA groups, p, padded)
    (True, None, 1, 0.0, True),
    (True, 3, 2, 0.0, False),
    (True, 4, 1, 0.2, True),
    (False, None, 2, 0.25, True),
    (False, 3, 1, 0.0, False),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_gradcheck_float64(case):
    causal, window, g, p, padded = case
    gen = torch.Generator().manual_seed(3)
    b, h, s, d = 2, 2 * g, 9, 4
    _, q, k, v = make_qkv(b, h, s, d, torch.float64, hkv=h // g, generator=gen)
    ids = packed_ids(b, s, gen, padded)

    def fn(q, k, v):
        return attention(q, k, v, None, p, causal, block_size=4, seed=SEED, enable_gqa=g > 1, segments=ids,
                         window=window)

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("mode", ["recompute", "tempo"])
def test_equals_the_dense_mask(dtype, case, mode):
    """Output and q, k, v gradients bitwise those of the same call with the dense bool mask (b, 1, s, s)."""
    causal, window, g, p, padded = case
    gen = torch.Generator().manual_seed(5)
    b, h, s, d = 2, 2 * g, 40, 16
    _, q, k, v = make_qkv(b, h, s, d, dtype, hkv=h // g, generator=gen)
    ids = packed_ids(b, s, gen, padded)
    dense = dense_mask(ids, window, s, s)
    kw = dict(dropout_p=p, is_causal=causal, mode=mode, block_size=16, seed=SEED, enable_gqa=g > 1)
    got = attention(q, k, v, segments=ids, window=window, **kw)
    want = attention(q, k, v, dense, **kw)
    assert torch.equal(got, want)
    for x, y in zip(grads(got, (q, k, v)), grads(want, (q, k, v))):
        assert torch.equal(x, y)


def test_shared_ids_for_equal_lengths():
    """(b, s) ids stand for the same ids on queries and keys."""
    gen = torch.Generator().manual_seed(1)
    _, q, k, v = make_qkv(2, 2, 12, 8, generator=gen)
    ids = packed_ids(2, 12, gen, padded=False)
    assert torch.equal(attention(q, k, v, is_causal=True, segments=ids[:, :12]),
                       attention(q, k, v, is_causal=True, segments=ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_kept_are_the_ids_not_a_mask(dtype):
    """q, k, v, the fp32 log-sum-exp and the (b, 2s) ids: nothing of size s²."""
    def kept(s):
        gen = torch.Generator().manual_seed(0)
        _, q, k, v = make_qkv(2, 4, s, 16, dtype, hkv=2, generator=gen)
        ids = packed_ids(2, s, gen).to(torch.int32)
        with SavedTensorMeter() as meter:
            attention(q, k, v, is_causal=True, block_size=16, enable_gqa=True, segments=ids, window=7)
        return meter.total_bytes

    es = torch.empty((), dtype=dtype).element_size()
    for s in (64, 128):
        assert kept(s) == (2 * 4 * s * 16 + 2 * 2 * 2 * s * 16) * es + 2 * 4 * s * 4 + 2 * 2 * s * 4


def test_compiled_matches_eager():
    """Through the custom op (torch.compile, aot_eager): the same output and gradients."""
    gen = torch.Generator().manual_seed(2)
    _, q, k, v = make_qkv(2, 2, 24, 8, generator=gen)
    ids = packed_ids(2, 24, gen)

    def fn(q, k, v):
        return attention(q, k, v, is_causal=True, block_size=8, segments=ids, window=5)

    torch._dynamo.reset()
    eager, compiled = fn(q, k, v), torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)
    assert torch.equal(eager, compiled)
    for x, y in zip(grads(eager, (q, k, v)), grads(compiled, (q, k, v))):
        assert torch.equal(x, y)


def test_errors():
    _, q, k, v = make_qkv(2, 2, 6, 4)
    ids = torch.zeros(2, 6, dtype=torch.int64)
    with pytest.raises(ValueError, match="either segments or attn_mask"):
        attention(q, k, v, torch.ones(2, 1, 1, 6, dtype=torch.bool), segments=ids)
    with pytest.raises(ValueError, match="integer tensor of segment ids"):
        attention(q, k, v, segments=ids.float())
    with pytest.raises(ValueError, match=r"segments must be \(batch, seq\) = \(2, 6\)"):
        attention(q, k, v, segments=ids[:, :5])
    with pytest.raises(ValueError, match="window must be a positive int"):
        attention(q, k, v, is_causal=True, window=0)


@pytest.mark.parametrize("causal,window", [(True, None), (True, 3), (False, None)])
def test_exchange_dead_rows_equal_the_dense_masks(causal, window):
    """Context parallelism's O(b·s) dead rows (queries that see no key) equal those of the dense mask
    its segment ids stand for, on padded and packed rows (a SimulatedGroup: no communication)."""
    from leanact.parallel.context import SequenceExchange, SimulatedGroup, _packed

    gen = torch.Generator().manual_seed(4)
    b, s = 6, 24
    for trial in range(20):
        padding = torch.rand(b, s, generator=gen) < 0.6
        padding[0] = True
        positions = torch.cat([torch.arange(7), torch.arange(s - 7)]).expand(b, s).clone()
        positions[1] = torch.cat([torch.arange(3), torch.arange(10), torch.arange(s - 13)])
        exchange = SequenceExchange(SimulatedGroup(2), s, padding, _packed(positions) if trial % 2 else None)
        ids, w = exchange.mask(causal, window, torch.device("cpu"))
        dense = dense_mask(ids, w, s, s)
        if causal:
            dense = dense & torch.ones(s, s, dtype=torch.bool).tril()
        want = ~dense.any(-1)
        got = exchange.dead_rows(causal, window, torch.device("cpu"))
        assert torch.equal(got if got is not None else torch.zeros_like(want), want)
