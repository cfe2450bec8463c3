"""The counter-based generator of leanact.ops.random: exactness, consistency, statistics."""
import math

import pytest
import torch

from leanact.ops import random as R
from leanact.ops.random import CHUNK, draw_seed, keep_mask, keep_mask_like, keep_threshold, random_bits

M32 = 0xFFFFFFFF


# An independent reference in Python's unbounded integers, from the formula in the module docstring.
def _ref_mix(x, r, m):
    return ((x ^ (x >> r)) * m) & M32


def _ref_word(seed: int, i: int) -> int:
    lo, hi = seed & M32, (seed >> 32) & M32
    k0 = _ref_mix(_ref_mix(_ref_mix(((lo ^ R._K0) * R._M1) & M32, 16, R._M2) ^ hi, 15, R._M3), 16, R._M4)
    k1 = _ref_mix(_ref_mix(_ref_mix(((hi ^ R._K1) * R._M1) & M32, 16, R._M2) ^ k0, 15, R._M3), 16, R._M4)
    x = (((i & M32) ^ k0) * R._M1) & M32 ^ ((i >> 32) & M32)
    return _ref_mix(_ref_mix(_ref_mix(x, 16, R._M2) ^ k1, 15, R._M3), 16, R._M4)


def _corr_z(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson correlation of two bit vectors, in units of its null standard deviation 1/sqrt(n)."""
    a, b = a.double(), b.double()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).mean() / (a.std() * b.std())) * math.sqrt(a.numel())


def test_no_signed_overflow_possible():
    # Lanes hold values < 2^32 and multipliers are < 2^31: every product is < 2^63.
    for m in (R._M1, R._M2, R._M3, R._M4):
        assert m % 2 == 1 and m < 2**31
    w = random_bits(-(2**63), torch.tensor([0, 2**63 - 1, -1, -(2**63)]))
    assert w.dtype == torch.int64 and bool(((w >= 0) & (w <= M32)).all())


@pytest.mark.parametrize("seed", [0, 1, -1, 2**63 - 1, -(2**63), 0x123456789ABCDEF])
def test_matches_python_integer_reference(seed):
    idx = [0, 1, 2, 12345, 2**31, M32, 2**32, 2**32 + 7, 2**40 + 3, 2**62 + 11]
    got = random_bits(seed, torch.tensor(idx)).tolist()
    assert got == [_ref_word(seed, i) for i in idx]
    # the tensor seed and the int seed agree
    assert random_bits(torch.tensor(seed), torch.tensor(idx)).tolist() == got


def test_threshold():
    assert keep_threshold(0.0) == 0 and keep_threshold(1.0) == 2**32 and keep_threshold(0.5) == 2**31
    assert keep_threshold(0.1) == round(0.1 * 2**32)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="between 0 and 1, but got"):
            keep_threshold(bad)
    idx = torch.arange(1000)
    assert bool(keep_mask(3, idx, 0.0).all()) and not bool(keep_mask(3, idx, 1.0).any())
    w = random_bits(3, idx)
    assert torch.equal(keep_mask(3, idx, 0.3), w >= keep_threshold(0.3))


@pytest.mark.parametrize("offset", [0, 5, CHUNK - 3, 2**32 - 3 * CHUNK - 17, 2**45 + 1])
def test_keep_mask_like_equals_keep_mask(offset):
    seed = draw_seed()
    n = 3 * CHUNK + 123  # several chunks, unaligned ends
    full = keep_mask_like(seed, (n,), 0.3, offset=offset)
    assert torch.equal(full, keep_mask(seed, torch.arange(n) + offset, 0.3))
    # one expression (the compile / non-CPU path) gives the same words as the chunked path
    k0, k1 = R.seed_keys(seed)
    assert torch.equal(full, R._range_words(k0, k1, offset, offset + n, "cpu") >= keep_threshold(0.3))
    # any part regenerated alone equals the same part of the whole
    assert torch.equal(full[CHUNK - 10 : CHUNK + 50], keep_mask_like(seed, (60,), 0.3, offset=offset + CHUNK - 10))
    perm = torch.randperm(n)[:1000]
    assert torch.equal(full[perm], keep_mask(seed, perm + offset, 0.3))


def test_attention_subblock():
    """A block (rows r0:r1, cols c0:c1) of an s x s mask, index = row * s + col, regenerates alone."""
    s, seed = 700, torch.tensor(42)
    full = keep_mask_like(seed, (3, s, s), 0.2)  # e.g. batch*heads = 3
    rows, cols = torch.arange(100, 164), torch.arange(320, 448)
    for bh in range(3):
        idx = bh * s * s + rows[:, None] * s + cols[None, :]
        assert torch.equal(keep_mask(seed, idx, 0.2), full[bh, 100:164, 320:448])


def test_shapes_and_validation():
    m = keep_mask_like(7, (4, 0, 3), 0.5)
    assert m.shape == (4, 0, 3) and m.dtype == torch.bool
    assert keep_mask(7, torch.arange(12).view(3, 4), 0.5).shape == (3, 4)
    with pytest.raises(TypeError):
        keep_mask(7, torch.arange(4, dtype=torch.int32), 0.5)
    with pytest.raises(ValueError):
        keep_mask_like(7, (4,), 0.5, offset=-1)
    with pytest.raises(TypeError):
        keep_mask_like(torch.tensor(1.0), (4,), 0.5)


def test_draw_seed():
    torch.manual_seed(0)
    a, b = draw_seed(), draw_seed()
    torch.manual_seed(0)
    assert draw_seed() == a and a.shape == () and a.dtype == torch.int64 and a != b
    assert a.untyped_storage().nbytes() == 8
    g = torch.Generator().manual_seed(5)
    s1 = draw_seed(generator=g)
    assert draw_seed(generator=torch.Generator().manual_seed(5)) == s1


def test_words_distinct_within_aligned_range():
    """For a fixed seed the word is a bijection of lo(i): no two indices of a 2^32 block collide."""
    w = random_bits(99, torch.arange(1 << 20))
    assert torch.unique(w).numel() == 1 << 20  # a random function would give ~128 collisions


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction(p):
    n = 1 << 21
    for seed in (0, 123456789):
        kept = float(keep_mask_like(seed, (n,), p).double().mean())
        assert abs(kept - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)


def test_neighbour_and_lag_correlations():
    n = 1 << 20
    for seed in (1, -5):
        for p in (0.5, 0.1):
            m = keep_mask_like(seed, (n,), p)
            for lag in (1, 2, 3, 4, 7, 4096, CHUNK, 500009):
                assert abs(_corr_z(m[:-lag], m[lag:])) < 5, (seed, p, lag)


def test_consecutive_seeds_uncorrelated():
    n = 1 << 19
    for s in (0, 1, 2**32 - 1, 10**12):
        a = keep_mask_like(s, (n,), 0.5)
        for other in (s + 1, s ^ (1 << 32), s ^ (1 << 63) if s < 2**63 else s):
            other = other - (1 << 64) if other >= 2**63 else other
            b = keep_mask_like(other, (n,), 0.5)
            for lag in (0, 1, 2):
                assert abs(_corr_z(a[lag:], b[: n - lag])) < 5, (s, other, lag)
                assert abs(_corr_z(b[lag:], a[: n - lag])) < 5, (s, other, lag)


def test_window_chi_square():
    """Consecutive keep bits (p = 0.5) read as 8-bit numbers are uniform (chi-square, 255 dof)."""
    n = 1 << 20
    m = keep_mask_like(2024, (n,), 0.5).long()
    w = sum(m[k : n - 7 + k] << k for k in range(8))
    cnt = torch.bincount(w, minlength=256).double()
    chi2 = float(((cnt - cnt.mean()) ** 2 / cnt.mean()).sum())
    assert chi2 < 255 + 6 * math.sqrt(2 * 255)


def test_avalanche():
    """Flipping any one of the 64 index bits or 64 seed bits flips each word bit with probability 1/2."""
    g = torch.Generator().manual_seed(0)
    n = 1 << 13
    idx = torch.randint(0, 2**62, (n,), generator=g)
    seed = 0x0123456789ABCDEF
    w0 = random_bits(seed, idx)
    flips = []
    for b in range(63):
        flips.append(random_bits(seed, idx ^ (1 << b)) ^ w0)
    for b in range(64):
        s = seed ^ (1 << b)
        flips.append(random_bits(s - (1 << 64) if s >= 2**63 else s, idx) ^ w0)
    d = torch.stack(flips)  # (127, n)
    frac = torch.stack([((d >> k) & 1).double().mean(1) for k in range(32)])  # (32, 127)
    sd = 0.5 / math.sqrt(n)
    assert float((frac - 0.5).abs().max()) < 5.5 * sd  # 4064 cells


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.cuda
def test_cpu_and_cuda_identical():
    seed = draw_seed()
    idx = torch.cat([torch.arange(3 * CHUNK + 5), torch.arange(1000) + 2**33])
    cpu = keep_mask(seed, idx, 0.37)
    assert torch.equal(cpu, keep_mask(seed.cuda(), idx.cuda(), 0.37).cpu())
    assert torch.equal(keep_mask_like(seed, (5, 777), 0.37), keep_mask_like(seed.cuda(), (5, 777), 0.37).cpu())


def _block_fn(seed, rows, cols):
    return (keep_mask(seed, rows[:, None] * 5000 + cols[None, :], 0.25)
            & keep_mask_like(seed, (rows.numel(), cols.numel()), 0.6))


def test_compile_aot_eager():
    seed, rows, cols = torch.tensor(-77), torch.arange(100, 400), torch.arange(4000, 4300)
    compiled = torch.compile(_block_fn, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(seed, rows, cols), _block_fn(seed, rows, cols))


@pytest.mark.slow
def test_compile_inductor():
    seed, rows, cols = torch.tensor(2**40 + 1), torch.arange(100, 400), torch.arange(4000, 4300)
    compiled = torch.compile(_block_fn, fullgraph=True, backend="inductor")
    assert torch.equal(compiled(seed, rows, cols), _block_fn(seed, rows, cols))
