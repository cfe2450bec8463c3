"""Dropout under tensor + sequence parallelism: which masks agree across ranks, which differ.

leanact's dropout draws a 64-bit seed from the default generator and derives the keep-mask from
``(seed, element index)`` (:mod:`leanact.ops.random`). Every rank starts from the same generator
state (``torch.manual_seed`` with the same value on all ranks) and makes the same draws, so:

* Replicated regions (embeddings, heads): the same seed and the same full-size tensor on every
  rank: **the masks agree**, as they must (the replicas stay identical).
* Sequence-parallel regions (the hidden dropout before each residual add):
  :class:`SequenceShardedDropout` draws the same seed on every rank but numbers each local
  element by its index in the *full* tensor, so rank r's mask is rank r's slice of the mask a
  single process would draw: **masks differ across ranks** (different elements), and the result
  is bitwise the single-process model's dropout. Kept for backward: the 8-byte seed.
* Tensor-parallel attention (heads split across ranks): :func:`fork_rng_per_rank` hooks make the
  attention's dropout draw from a generator seeded by (a synchronised draw, rank), as Megatron's
  model-parallel RNG tracker does: **masks differ across ranks** (otherwise local head j of every
  rank would reuse one mask), and the default generator is restored afterwards, so ranks stay in
  step. The forked draw happens at the same point of a re-run under
  ``torch.utils.checkpoint`` (which restores the generator state), so recompute draws the same
  masks.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import SequenceParallel

from ..ops.random import draw_seed, keep_mask, keep_threshold

__all__ = ["SequenceShardedDropout", "ShardedDropoutStyle", "fork_rng_per_rank"]


def _global_index(local_shape, dim: int, start: int, full: int, device) -> torch.Tensor:
    """C-order index, in the full tensor, of each element of a slice [start, start+n) along ``dim``."""
    pre = 1
    for d in local_shape[:dim]:
        pre *= int(d)
    post = 1
    for d in local_shape[dim + 1:]:
        post *= int(d)
    n = int(local_shape[dim])
    rows = torch.arange(pre, dtype=torch.int64, device=device).view(-1, 1, 1) * full
    cols = torch.arange(start, start + n, dtype=torch.int64, device=device).view(1, -1, 1)
    idx = (rows + cols) * post + torch.arange(post, dtype=torch.int64, device=device).view(1, 1, -1)
    return idx.view(local_shape)


def _masked(x: torch.Tensor, seed: torch.Tensor, p: float, dim: int, start: int, full: int) -> torch.Tensor:
    keep = keep_mask(seed, _global_index(x.shape, dim, start, full, x.device), p)
    return x * keep * (1.0 / (1.0 - p))


class _ShardDropoutFn(torch.autograd.Function):
    """y = x * mask(seed, global index) / (1 - p); saves only the seed."""

    @staticmethod
    def forward(ctx, x, seed, p, dim, start, full):
        ctx.args = (p, dim, start, full)
        ctx.save_for_backward(seed)
        return _masked(x, seed, p, dim, start, full)

    @staticmethod
    def backward(ctx, dy):
        (seed,) = ctx.saved_tensors
        return _masked(dy, seed, *ctx.args), None, None, None, None, None


class SequenceShardedDropout(nn.Dropout):
    """Dropout of a ``Shard(dim)`` DTensor whose mask is the single-process mask's local slice.

    Same arguments as ``torch.nn.Dropout`` (``inplace`` is ignored: the output is a new tensor);
    takes and returns DTensors sharded on one dimension (installed by :class:`ShardedDropoutStyle`);
    a plain tensor is treated as unsharded. Kept for backward: one 0-dim int64 seed.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p == 1.0:
            return x * 0.0
        keep_threshold(self.p)
        seed = draw_seed(x.device)
        if not isinstance(x, DTensor):  # unsharded: the whole mask (as leanact.ops.dropout draws it)
            flat = x.reshape(-1)
            return _ShardDropoutFn.apply(flat, seed, float(self.p), 0, 0, flat.shape[0]).view(x.shape)
        shards = [(i, pl.dim) for i, pl in enumerate(x.placements) if isinstance(pl, Shard)]
        if len(shards) != 1 or any(not (pl.is_shard() or pl.is_replicate()) for pl in x.placements):
            raise ValueError(f"SequenceShardedDropout expects a DTensor sharded on one dim, got {x.placements}")
        mesh_dim, dim = shards[0]
        full = x.shape[dim]
        t = x.device_mesh.size(mesh_dim)
        chunk = -(-full // t)  # torch.chunk sizes, as DTensor's Shard uses
        start = min(x.device_mesh.get_local_rank(mesh_dim) * chunk, full)
        local = x.to_local()
        out = _ShardDropoutFn.apply(local, seed.to(local.device), float(self.p), dim, start, full)
        return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                                  stride=x.stride())


class ShardedDropoutStyle(SequenceParallel):
    """``SequenceParallel`` for a dropout module: swaps in :class:`SequenceShardedDropout`."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, nn.Dropout):
            raise TypeError(f"ShardedDropoutStyle applies to nn.Dropout modules, got {type(module).__name__}")
        module.__class__ = SequenceShardedDropout  # same attributes (p, inplace), no state
        return super()._apply(module, device_mesh)


def _mix(base: int, rank: int) -> int:
    x = (base ^ (0x9E3779B97F4A7C15 * (rank + 1))) & ((1 << 64) - 1)
    x = ((x ^ (x >> 31)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    return (x ^ (x >> 29)) & ((1 << 63) - 1)


def _generator_state(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device), lambda s: torch.cuda.set_rng_state(s, device), \
            lambda seed: torch.cuda.default_generators[device.index or 0].manual_seed(seed)
    return torch.get_rng_state(), torch.set_rng_state, torch.default_generator.manual_seed


def fork_rng_per_rank(module: nn.Module, rank: int, active) -> None:
    """Forward hooks: inside ``module``, the default generator of its device is seeded with
    mix(synchronised draw, ``rank``) and restored afterwards (only when ``active(module)``)."""

    def pre(mod, args, kwargs):
        if not active(mod):
            return None
        p = next(mod.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
        base = int(draw_seed(device))  # the same on every rank: the generators stay in step
        state, restore, seed = _generator_state(device)
        seed(_mix(base, rank))
        mod.__dict__.setdefault("_leanact_rng_stack", []).append((restore, state))
        return None

    def post(mod, args, kwargs, out):
        stack = mod.__dict__.get("_leanact_rng_stack")
        if stack:
            restore, state = stack.pop()
            restore(state)
        return None

    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post, with_kwargs=True, always_call=True)
