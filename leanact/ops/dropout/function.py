"""Dropout that keeps an 8-byte seed for backward instead of a mask.

``torch.nn.functional.dropout`` keeps a mask of the input's size (1 byte per element on CUDA,
the input's dtype on the CPU). Here the keep-mask is a pure function of (seed, element index)
(:mod:`leanact.ops.random`), so backward regenerates it from the seed: the only tensor saved is
the seed, a 0-dim int64 tensor. Other random calls between forward and backward cannot change
the regenerated mask, and in-place changes to the input or output after forward cannot corrupt
the gradient (neither is kept).
"""
from __future__ import annotations

import contextlib
import sys

import torch
from torch._subclasses.fake_tensor import is_fake

from .. import fake_rules, random as _random
from ..random import (
    CHUNK,
    _as_seed,
    _at_least,
    _cpu_range_blocks,
    _eager_chunks,
    _range_words,
    draw_seed,
    keep_mask,
    keep_mask_like,
    keep_threshold,
    seed_keys,
)
from ..transforms import functorch_active, unwrap
from ..triton.dispatch import register_check
from . import launchers as _launchers

__all__ = ["dropout", "dropout_seeded", "apply_dropout"]


def _check_p(p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")


def apply_dropout(x: torch.Tensor, seed: torch.Tensor, p: float, inplace: bool) -> torch.Tensor:
    """``x * keep_mask_like(seed, x.shape, p) / (1 - p)`` (into ``x`` when ``inplace``), no graph: the
    forward and backward of this op, and the dropout inside :mod:`leanact.ops.norms.dropout_add_norm`."""
    thr, scale = keep_threshold(p), 1.0 / (1.0 - p)
    out = _launchers.dropout(x, seed, thr, scale, inplace)  # CUDA: one Triton kernel (None: this path)
    if out is not None:
        return out
    n = x.numel()
    if not _eager_chunks(x.device, n, x, seed):
        keep = _at_least(_range_words(*seed_keys(seed), 0, n, x.device), thr).view(x.shape)
        return x.mul_(keep).mul_(scale) if inplace else x * keep * scale
    # Eager CPU: blocks of CHUNK elements in C order, so the integer temporaries stay in cache.
    write_back = inplace and not x.is_contiguous()
    src = x.reshape(-1)
    out = x if inplace and not write_back else torch.empty(x.shape, dtype=x.dtype)
    flat = out.view(-1)
    keep = torch.empty(CHUNK, dtype=torch.bool)
    int32 = n <= 1 << 32 and thr < 1 << 32  # int32 lanes (random._rounds32_): same words, ~5x faster
    for j0, j1, words in _cpu_range_blocks(seed, 0, n, int32):
        t = thr - (1 << 31) if int32 else thr
        k = torch.ge(words, t, out=keep[: j1 - j0]).view(torch.uint8)  # float * uint8 beats * bool
        torch.mul(src[j0:j1], k, out=flat[j0:j1]).mul_(scale)
    return x.copy_(out) if write_back else out


def _check_inplace(x: torch.Tensor) -> None:
    # Raise torch's error before anything is written (mark_dirty would raise only afterwards).
    if torch.is_grad_enabled() and x.requires_grad:
        if x.is_leaf:
            raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
        if x._is_view() and x._base.is_leaf:
            raise RuntimeError("a view of a leaf Variable that requires grad is being used in an in-place operation.")


class _SeededDropout(torch.autograd.Function):
    """y = x * mask(seed) / (1 - p); saves only ``seed``; backward is the same op on dy."""

    @staticmethod
    def forward(ctx, x, seed, p, inplace):
        ctx.p = p
        ctx.save_for_backward(seed)
        if inplace:
            ctx.mark_dirty(x)
        return apply_dropout(x, seed, p, inplace)

    @staticmethod
    def backward(ctx, dy):
        (seed,) = ctx.saved_tensors
        return _run(dy, seed, ctx.p, False), None, None, None


def _under_functorch(x: torch.Tensor, seed: torch.Tensor, p: float, inplace: bool) -> torch.Tensor:
    """The same mask, applied with differentiable torch ops (torch.func transforms cannot run the
    custom Function; :mod:`leanact.ops.transforms`): keeps the mask, as torch's dropout does."""
    with torch._C._DisableFuncTorch():
        keep = keep_mask_like(unwrap(seed), x.shape, p, x.device)
    scale = 1.0 / (1.0 - p)
    return x.mul_(keep).mul_(scale) if inplace else x * keep * scale


def _run(x: torch.Tensor, seed: torch.Tensor, p: float, inplace: bool) -> torch.Tensor:
    if functorch_active():
        return _under_functorch(x, seed, p, inplace)
    if torch.is_grad_enabled() and x.requires_grad:
        return _SeededDropout.apply(x, seed, p, inplace)
    return apply_dropout(x, seed, p, inplace)  # no graph: nothing to save


def dropout_seeded(x: torch.Tensor, seed: torch.Tensor | int, p: float = 0.5, inplace: bool = False) -> torch.Tensor:
    """Training-mode dropout with an explicit seed (0-dim int64 tensor or Python int).

    The mask is ``keep_mask_like(seed, x.shape, p, x.device)``: the same seed gives the same mask
    on every call and device. Saves only the seed for backward (8 bytes).
    """
    _check_p(p)
    if p == 0.0 or x.numel() == 0:
        return x
    if inplace:
        _check_inplace(x)
    if p == 1.0:
        return x.mul_(0.0) if inplace else x * 0.0
    return _run(x, _as_seed(seed, x.device), float(p), bool(inplace))


def dropout(
    x: torch.Tensor,
    p: float = 0.5,
    training: bool = True,
    inplace: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.dropout`` that keeps an 8-byte seed, not a mask.

    Each call draws a seed from ``generator`` (default: the default generator of ``x.device``,
    so ``torch.manual_seed`` makes runs reproducible). Identity (returns ``x``) when
    ``training=False`` or ``p == 0``; ``p == 1`` gives zeros (``x * 0``) and zero gradient.
    """
    _check_p(p)
    if not training or p == 0.0 or x.numel() == 0:
        return x
    if inplace:
        _check_inplace(x)
    if p == 1.0:
        return x.mul_(0.0) if inplace else x * 0.0
    return _run(x, draw_seed(x.device, generator), float(p), bool(inplace))


# -- the self-check of the "dropout" kernels (float keys: the dropout kernel; int64: the mask kernels) -


def _self_check(device: torch.device, key) -> None:
    """Bitwise: this op's forward and backward (``key`` a float dtype), else :func:`keep_mask_like`
    and attention's mask rows, through the kernels and the PyTorch path (see
    :mod:`leanact.ops.triton.selfcheck`)."""
    from ..triton.dispatch import forced
    from ..triton.selfcheck import FLOATS, both, forward_backward, generator, randn, same

    gen = generator(device)
    seed = torch.tensor(-4242424242, device=device)
    if key in FLOATS:
        x, dy = randn((3, 701), device, key, gen), randn((3, 701), device, key, gen)

        def run():
            y, (dx, *_) = forward_backward(_SeededDropout, (x, seed, 0.3, False), dy, (True, False, False, False))
            return y, dx

        (y, dx), (y0, dx0) = both(run)
        same("dropout forward", y, y0)
        same("dropout backward", dx, dx0)
        return
    for p, offset in ((0.1, 0), (0.5, (1 << 32) - 1000)):
        got, ref = both(lambda: keep_mask_like(seed, (5, 333), p, device=device, offset=offset))
        same(f"dropout keep-mask (p={p})", got, ref)
    starts = torch.tensor([0, 97, 5000, (1 << 33) + 3], device=device)
    with forced("on"):
        rows = _launchers.keep_mask_rows(seed, starts, 1100, keep_threshold(0.2))
    assert rows is not None, "dropout keep-mask rows: the kernel did not run"
    index = starts[:, None] + torch.arange(1100, device=device)
    same("dropout keep-mask rows", rows, keep_mask(seed, index, 0.2))


register_check("dropout", _self_check)


# -- on fake tensors (leanact.estimate) ----------------------------------------------------------


@contextlib.contextmanager
def _fake_rule(run):
    """Modelling the CPU: on fake CPU tensors larger than one block, :func:`apply_dropout` allocates
    what its eager CPU path allocates (the output, one block's bool mask, int32 indices and hash
    words, and a slice of the per-process arange) instead of the per-element int64 words of its
    generic path, the one fake tensors would take (as CUDA's does): the eager path reads the seed as
    Python ints, which a fake seed does not have."""
    real = apply_dropout

    def apply(x, seed, p, inplace):
        if not is_fake(x) or x.device.type != "cpu" or x.numel() <= CHUNK:
            return real(x, seed, p, inplace)
        out = x if inplace and x.is_contiguous() else torch.empty(x.shape, dtype=x.dtype)
        # per block: the bool mask, the int32 indices and one int32 temporary of the hash rounds
        block = [torch.empty(CHUNK, dtype=torch.bool), torch.empty(CHUNK, dtype=torch.int32),
                 torch.empty(CHUNK, dtype=torch.int32)]
        del block
        key = (CHUNK, torch.int32)
        fake_rules.hold_slice(run, lambda: _random._BASE.get(key) if key in _random._BASE
                              else _random._BASE.setdefault(key, torch.arange(CHUNK, dtype=torch.int32)))
        if out is not x and inplace:
            return x.copy_(out)
        return out

    with fake_rules.swapped(sys.modules[__name__], apply_dropout=apply if run.kind == "cpu" else None):
        yield


def _prepare() -> None:
    """The per-process CPU cache of the hash (an arange of CHUNK elements), created before a
    measured step."""
    dropout(torch.ones(CHUNK + 1), 0.5)


fake_rules.register("dropout", rule=_fake_rule, prepare=_prepare)
