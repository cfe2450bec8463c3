"""Sequence-tiled MLP (strategy ``"tiled_mlp"``): the MLP runs over chunks of the sequence, each
chunk under ``torch.utils.checkpoint`` (non-reentrant), so that nothing of the MLP's inside (the
up/gate projections, the activation, BERT's 4h intermediate) is kept for backward; in backward each
chunk's intermediate is recomputed from the MLP's input -- which the norm before it keeps anyway
(leanact's lean norms keep their output) -- so the transient is one chunk's. Cost: one more MLP
forward. Gradients are the MLP's own (the same kernels on row slices; fp32 within rounding of the
different matmul shapes). Dropout inside the MLP draws its mask per chunk (checkpoint replays each
chunk's RNG state, so backward matches forward), hence not the mask the untiled MLP would draw.

Which module is tiled, per layer: a child named ``mlp`` whose output is one tensor (LLaMA-family
SwiGLU MLPs, GPT-2's MLP, ...), or the layer's ``feed_forward_chunk`` method (BERT, RoBERTa,
ELECTRA, ...: intermediate dense + activation + output dense + dropout + residual LayerNorm). The
MLP is position-wise, so the chunks are runs of ``chunk`` tokens of the (batch · sequence) tokens
(contiguous views of the input, which is what checkpoint holds); a non-contiguous input runs untiled.

On fake tensors (``leanact.estimate``) the chunks between the first two and the last two make their
allocations only -- their output in forward, their input's gradient in backward -- without their
work (:class:`_StandIn`): the chunks that set the peak run as they are (the first two: backward
reaches them last, with every other chunk's gradient alive; the last two: forward reaches them last,
with every other chunk's output alive, the last one possibly ragged), so the estimate is the same
in a time that does not grow with the sequence (a million tokens: a thousand chunks per layer).
"""
from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from leanact.ops import fake_rules

__all__ = ["DEFAULT_MLP_CHUNK", "TiledMLP", "find_mlp", "tiled_forward"]

DEFAULT_MLP_CHUNK = 1024  # tokens per chunk


def find_mlp(layer: nn.Module) -> tuple[Any, str] | None:
    """(owner, attribute) of what to tile in ``layer``: (layer.mlp, "forward") or (layer,
    "feed_forward_chunk"); None if the layer has neither."""
    mlp = layer._modules.get("mlp")
    if isinstance(mlp, nn.Module):
        return mlp, "forward"
    if callable(getattr(type(layer), "feed_forward_chunk", None)):
        return layer, "feed_forward_chunk"
    return None


def tiled_forward(fn: Callable, x: torch.Tensor, chunk: int) -> Any:
    """fn(x) over chunks of ``chunk`` tokens, each checkpointed; fn(x) itself without autograd, for
    inputs that are not contiguous (..., hidden) floats, or when fn does not return one tensor per token."""
    if not (torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 2
            and x.is_contiguous()):
        return fn(x)
    flat = x.view(1, -1, x.shape[-1])  # position-wise: chunks of the (batch·seq) tokens, contiguous views
    pieces = flat.split(chunk, 1)
    stand_in = _stand_ins(len(pieces))
    outs = []
    for i, c in enumerate(pieces):
        if i in stand_in and c.requires_grad:
            outs.append(_StandIn.apply(c, outs[0].shape[-1], outs[0].dtype))
            continue
        out = checkpoint(fn, c, use_reentrant=False, preserve_rng_state=True)
        if not isinstance(out, torch.Tensor) or out.shape[:-1] != c.shape[:-1]:
            return fn(x)  # not a position-wise map to one tensor (e.g. an MoE block returning router logits)
        outs.append(out)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
    return out.view(*x.shape[:-1], out.shape[-1])


def _stand_ins(n: int) -> range:
    """The chunks (of ``n``) that only make their allocations: none but on fake tensors (the rule below)."""
    return range(0)


class _StandIn(torch.autograd.Function):
    """A middle chunk on fake tensors: allocates its output (forward) and its input's gradient
    (backward) as the chunk would; keeps nothing for backward (the chunk's checkpoint keeps a view of
    the input, whose storage the first chunk's already holds)."""

    @staticmethod
    def forward(ctx, c: torch.Tensor, features: int, dtype: torch.dtype) -> torch.Tensor:
        ctx.shape, ctx.dtype = c.shape, c.dtype
        return c.new_empty((*c.shape[:-1], features), dtype=dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.new_empty(ctx.shape, dtype=ctx.dtype), None, None


@contextlib.contextmanager
def _fake_rule(run: fake_rules.FakeRun):
    def middle(n: int) -> range:
        return range(2, n - 2) if fake_rules.faking() else range(0)

    with fake_rules.swapped(sys.modules[__name__], _stand_ins=middle if run.fewer_iterations else None):
        yield


fake_rules.register("tiled MLP", rule=_fake_rule)


class TiledMLP:
    """Installed on one layer: replaces the MLP's ``forward`` (or the layer's ``feed_forward_chunk``)
    by an instance attribute running :func:`tiled_forward`; :meth:`remove` restores it."""

    def __init__(self, layer: nn.Module, chunk: int | None = None):
        found = find_mlp(layer)
        if found is None:
            raise ValueError(f"tiled_mlp: {type(layer).__name__} has no `mlp` child nor a feed_forward_chunk method")
        chunk = DEFAULT_MLP_CHUNK if chunk is None else chunk
        if chunk < 1:
            raise ValueError(f"tiled_mlp: chunk must be >= 1, got {chunk}")
        self.owner, self.attr = found
        self.chunk = chunk
        self.had_instance = self.attr in self.owner.__dict__
        self.original = self.owner.__dict__.get(self.attr) or getattr(type(self.owner), self.attr).__get__(self.owner)
        try:  # callers that inspect it (HF's apply_chunking_to_forward) see the original's signature
            self.__signature__ = inspect.signature(self.original)
        except (TypeError, ValueError):
            pass
        self.owner.__dict__[self.attr] = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) != 1 or kwargs:
            return self.original(*args, **kwargs)
        return tiled_forward(self.original, args[0], self.chunk)

    def remove(self) -> None:
        if self.owner.__dict__.get(self.attr) is self:
            if self.had_instance:
                self.owner.__dict__[self.attr] = self.original
            else:
                del self.owner.__dict__[self.attr]
