"""A counter-based random generator written with plain integer tensor ops.

The random word of element ``i`` is a pure function ``hash32(seed, i)``: no generator state, no
``get_rng_state``. A 64-bit seed (an 8-byte int64 tensor) is therefore all an op must keep to
regenerate a dropout mask in backward, the mask is the same whatever random calls happen in
between, it is the same on every device, and it traces under ``torch.compile`` (fullgraph).
:func:`keep_mask` takes arbitrary int64 element indices, so a block of a larger mask (e.g. rows
r0:r1, columns c0:c1 of an s x s attention matrix, index ``row * s + col``) can be regenerated
on its own and equals the same block of the full mask.

The hash (our own design; constants drawn at random, 31-bit odd multipliers)::

    mix(x, r, M) = ((x ^ x >> r) * M) mod 2^32
    k0 = mix(mix(mix(((lo(s) ^ K0) * M1) mod 2^32, 16, M2) ^ hi(s), 15, M3), 16, M4)   # keys from
    k1 = mix(mix(mix(((hi(s) ^ K1) * M1) mod 2^32, 16, M2) ^ k0,    15, M3), 16, M4)   # the seed s
    x = ((lo(i) ^ k0) * M1) mod 2^32 ^ hi(i)   # lo, hi: bits 0..31 and 32..63 of the index
    x = mix(mix(mix(x, 16, M2) ^ k1, 15, M3), 16, M4)   # the 32-bit random word

Lanes are int64 tensors holding values in [0, 2^32); multipliers are below 2^31, so every
product is below 2^63: no signed overflow anywhere (C++, CUDA, Triton and inductor's C++ all
agree without relying on wrap-around). ``mod 2^32`` is ``& 0xFFFFFFFF``; shifts of non-negative
values are logical. (k0, k1) is a bijection of the seed (2^64 distinct key pairs); the key is injected
twice, with two multiply rounds in between, so masks of different seeds (even consecutive ones)
are not shifted or permuted copies of each other. For a fixed seed and hi(i), the word is a
bijection of lo(i): 2^32 consecutive aligned indices get distinct words. Flipping any bit of the
index or of the seed flips each word bit with probability 1/2 (tests/test_random.py checks this
and lag / cross-seed correlations of the keep bits).

Keep decision: ``keep = word >= round(p * 2^32)``, so P(keep) = 1 - p to within 2^-33.

On the CPU in eager mode the work runs in chunks of :data:`CHUNK` elements so the temporaries
stay in the L2 cache (4-5x faster than whole-tensor passes); under ``torch.compile`` or on
other devices it is one expression (inductor fuses it into one kernel).
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from .dropout import launchers as _dropout_launchers

__all__ = ["CHUNK", "draw_seed", "keep_mask", "keep_mask_like", "keep_threshold", "random_bits", "seed_keys"]

_M32 = 0xFFFFFFFF
_M1, _M2, _M3, _M4 = 0x4C1B838F, 0x4E13EDB5, 0x67455873, 0x654EB15B  # odd, < 2^31
_K0, _K1 = 0x6D0A0665, 0x6386D131  # key-schedule constants
_TWO32 = 1 << 32
CHUNK = 1 << 17  # elements per block in the eager CPU path (2 threads x 512 KiB int64 temporaries)


def draw_seed(device: torch.device | str | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """A fresh 64-bit seed: a 0-dim int64 tensor (8 bytes) drawn from torch's generator.

    ``generator=None`` uses the default generator of ``device`` (so ``torch.manual_seed`` /
    ``torch.cuda.manual_seed`` control it). Traceable by ``torch.compile``.
    """
    return torch.randint(-(1 << 63), (1 << 63) - 1, (), dtype=torch.int64, device=device, generator=generator)


def _as_seed(seed: torch.Tensor | int, device: torch.device) -> torch.Tensor:
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64 or seed.numel() != 1:
            raise TypeError(f"seed must be a one-element int64 tensor, got {seed.dtype} of shape {tuple(seed.shape)}")
        return seed.reshape(()).to(device)
    return torch.tensor(seed, dtype=torch.int64, device=device)


def _mix(x: torch.Tensor, shift: int, mul: int) -> torch.Tensor:
    return ((x ^ (x >> shift)) * mul) & _M32


def _mix_(x: torch.Tensor, shift: int, mul: int) -> torch.Tensor:
    return x.bitwise_xor_(x >> shift).mul_(mul).bitwise_and_(_M32)


def seed_keys(seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 32-bit round keys (0-dim int64 tensors) of a 64-bit ``seed`` tensor.

    A bijection of the seed's words (lo, hi): distinct seeds give distinct key pairs.
    """
    lo, hi = seed & _M32, (seed >> 32) & _M32
    k0 = _mix(_mix(_mix(((lo ^ _K0) * _M1) & _M32, 16, _M2) ^ hi, 15, _M3), 16, _M4)
    k1 = _mix(_mix(_mix(((hi ^ _K1) * _M1) & _M32, 16, _M2) ^ k0, 15, _M3), 16, _M4)
    return k0, k1


def _rounds_(x: torch.Tensor, hi, k1) -> torch.Tensor:
    """In place on a fresh ``x = lo(i) ^ k0``; ``hi`` is ``hi(i)`` (tensor or int, None = 0)."""
    x.mul_(_M1).bitwise_and_(_M32)
    if hi is not None:
        x.bitwise_xor_(hi)
    _mix_(x, 16, _M2).bitwise_xor_(k1)
    return _mix_(_mix_(x, 15, _M3), 16, _M4)


def _words(index: torch.Tensor, k0, k1) -> torch.Tensor:
    """32-bit words of arbitrary int64 ``index`` (keys as tensors or ints)."""
    return _rounds_((index & _M32) ^ k0, (index >> 32) & _M32, k1)


_SHIFT_MASK = {15: (1 << 17) - 1, 16: (1 << 16) - 1}  # logical right shift of an int32 bit pattern


def _signed32(k: int) -> int:
    """The int32 value with the bit pattern of the uint32 ``k``."""
    return k - _TWO32 if k >= (1 << 31) else k


def _rounds32_(x: torch.Tensor, k1: int) -> torch.Tensor:
    """:func:`_rounds_` (no high index word) on int32 lanes, in place; returns the words with their
    top bit flipped, so that ``word >= thr`` is ``result >= thr - 2^31`` as a signed comparison.

    Bitwise the same words: products mod 2^32 are int32 multiplications (two's complement wrap),
    and each right shift is masked to be logical. Half the bytes of the int64 lanes and no
    ``& 0xFFFFFFFF`` after each product: ~5x faster in eager on the CPU (used for the s² masks of
    attention dropout). ``x`` holds ``lo(i) ^ k0`` as an int32 bit pattern.
    """
    x.mul_(_M1)
    for shift, mul in ((16, _M2), (15, _M3), (16, _M4)):
        x.bitwise_xor_((x >> shift).bitwise_and_(_SHIFT_MASK[shift])).mul_(mul)
        if shift == 16 and mul == _M2:
            x.bitwise_xor_(_signed32(k1))
    return x.bitwise_xor_(-(1 << 31))


def _range_words(k0, k1, start: int, end: int, device) -> torch.Tensor:
    """Words of indices start..end-1 (one expression; for compile and non-CPU devices)."""
    i = torch.arange(start, end, dtype=torch.int64, device=device)
    if end <= _TWO32:  # the high word is 0 throughout
        return _rounds_(i ^ k0, None, k1)
    return _words(i, k0, k1)


_BASE: dict[tuple[int, torch.dtype], torch.Tensor] = {}


def _cpu_range_blocks(seed: torch.Tensor, start: int, n: int, int32: bool = False):
    """Eager CPU: yield ``(j0, j1, words)`` for indices ``start + j0 .. start + j1 - 1``.

    Blocks are aligned to multiples of :data:`CHUNK` (a power of two dividing 2^32), so within a
    block ``lo(i) ^ k0 = base ^ (lo(A) ^ k0)`` and ``hi(i) = hi(A)`` are one cached arange and two
    Python ints; the integer temporaries stay in cache. ``int32=True`` (indices below 2^32 only)
    yields :func:`_rounds32_`'s int32 words with the top bit flipped: compare with ``thr - 2^31``.
    """
    k0, k1 = (int(k) for k in seed_keys(seed))
    dtype = torch.int32 if int32 else torch.int64
    if int32 and start + n > _TWO32:
        raise ValueError("int32 words need indices below 2^32")
    base = _BASE.get((CHUNK, dtype))
    if base is None:
        base = _BASE[(CHUNK, dtype)] = torch.arange(CHUNK, dtype=dtype)
    pos, end = start, start + n
    while pos < end:
        blk = pos - pos % CHUNK
        a, b = pos - blk, min(end - blk, CHUNK)
        if int32:
            x = _rounds32_(base[a:b] ^ _signed32(k0 ^ blk), k1)
        else:
            x = _rounds_(base[a:b] ^ (k0 ^ (blk & _M32)), blk >> 32 or None, k1)
        yield pos - start, blk + b - start, x
        pos = blk + b


def _at_least(words: torch.Tensor, thr: int) -> torch.Tensor:
    """``words >= thr`` as a bool tensor.

    Under ``torch.compile`` the comparison goes through int32 (``words - 2^31`` fits), because
    AOTAutograd's min-cut partitioner (inductor's default) never recomputes an op whose output
    is over 4x smaller than its inputs (int64 -> bool is 8x): it would save the mask instead of
    the seed. int64 -> int32 -> bool is 2x then 4x, so the whole mask is recomputed from the
    8-byte seed in backward. Same result either way.
    """
    if not torch.compiler.is_compiling():
        return words >= thr
    if thr >= _TWO32:
        return torch.zeros(words.shape, dtype=torch.bool, device=words.device)
    return (words - (1 << 31)).to(torch.int32) >= thr - (1 << 31)


def keep_threshold(p: float) -> int:
    """Integer threshold: an element is kept iff its 32-bit word >= ``round(p * 2^32)``."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    return int(round(p * _TWO32))


def _eager_chunks(device: torch.device, n: int, *tensors: torch.Tensor) -> bool:
    """Whether to run in cache-sized blocks: eager, CPU, large, real tensors (not fake/traced)."""
    if device.type != "cpu" or n <= CHUNK or torch.compiler.is_compiling():
        return False
    return not any(is_fake(t) for t in tensors)


def random_bits(seed: torch.Tensor | int, index: torch.Tensor) -> torch.Tensor:
    """The 32-bit random words (int64 tensor, values in [0, 2^32)) of int64 element ``index``."""
    if index.dtype != torch.int64:
        raise TypeError(f"index must be int64, got {index.dtype}")
    return _words(index, *seed_keys(_as_seed(seed, index.device)))


def keep_mask(seed: torch.Tensor | int, index: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout keep-mask (bool, shape of ``index``) of the elements numbered ``index`` (int64).

    Element ``i`` is kept with probability ``1 - p``; the decision depends only on
    ``(seed, i)``. ``keep_mask(seed, torch.arange(n) + offset, p)`` equals
    ``keep_mask_like(seed, (n,), p, offset=offset)``.
    """
    thr = keep_threshold(p)
    if index.dtype != torch.int64:
        raise TypeError(f"index must be int64, got {index.dtype}")
    k0, k1 = seed_keys(_as_seed(seed, index.device))
    if not _eager_chunks(index.device, index.numel(), index, k0):
        return _at_least(_words(index, k0, k1), thr)
    k0, k1 = int(k0), int(k1)
    flat, out = index.reshape(-1), torch.empty(index.shape, dtype=torch.bool, device=index.device)
    for s in range(0, flat.numel(), CHUNK):
        torch.ge(_words(flat[s : s + CHUNK], k0, k1), thr, out=out.view(-1)[s : s + CHUNK])
    return out


def keep_mask_like(
    seed: torch.Tensor | int,
    shape: torch.Size | tuple[int, ...],
    p: float,
    device: torch.device | str | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """Keep-mask of a tensor of ``shape`` whose C-order element ``j`` has index ``offset + j``.

    The same as ``keep_mask(seed, offset + torch.arange(numel).view(shape), p)``.
    """
    thr = keep_threshold(p)
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    if device is None:
        device = seed.device if isinstance(seed, torch.Tensor) else "cpu"
    device = torch.device(device)
    seed = _as_seed(seed, device)
    n = 1
    for d in shape:
        n *= int(d)
    if not _eager_chunks(device, n, seed):
        out = _dropout_launchers.keep_mask_like(seed, shape, thr, device, offset)  # CUDA: one kernel (None: below)
        if out is not None:
            return out
        return _at_least(_range_words(*seed_keys(seed), offset, offset + n, device), thr).view(shape)
    out = torch.empty(shape, dtype=torch.bool, device=device)
    flat = out.view(-1)
    int32 = offset + n <= _TWO32 and thr < _TWO32
    for j0, j1, words in _cpu_range_blocks(seed, offset, n, int32):
        torch.ge(words, thr - (1 << 31) if int32 else thr, out=flat[j0:j1])
    return out
