"""Fake copies of models and inputs (``FakeTensorMode``): shapes, dtypes and storages, no data.

A real model is converted without copying its weights: ``copy.deepcopy`` runs with a memo that
maps every parameter, buffer and plain tensor attribute to a fake tensor of the same shape (tied
weights stay tied). A model can also be built from a config directly under the fake mode
(:func:`build_fake`), so big geometries never allocate real weights.

How leanact's own ops run on fake tensors is each op's rule (:mod:`leanact.ops.fake_rules`); how
Hugging Face's mask builder does: :func:`causal_skip_on_fake`.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                           FakeTensorMode, is_fake)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

__all__ = ["new_mode", "fake_copy", "build_fake", "fake_inputs", "causal_skip_on_fake", "RealIntegerOps",
           "DATA_DEPENDENT"]

#: What a fake trace raises where the model reads values it does not have.
DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)


def new_mode() -> FakeTensorMode:
    # Real tensors met during the run (constants a model creates from Python data) are allowed.
    return FakeTensorMode(allow_non_fake_inputs=True)


def _to_fake(mode: FakeTensorMode, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A fake CPU tensor like ``t`` (the trace always runs on fake CPU tensors; meta and CUDA
    tensors become fake CPU ones of the same shape and dtype)."""
    if t.device.type != "cpu" or (is_fake(t) and t.fake_mode is not mode):
        with mode:
            f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    else:
        f = t if is_fake(t) else mode.from_tensor(t.detach())
    if dtype is not None and f.is_floating_point() and f.dtype != dtype:
        with mode:
            f = f.to(dtype)
    return f


def fake_copy(model: nn.Module, mode: FakeTensorMode, dtype: torch.dtype | None = None
              ) -> tuple[nn.Module, dict[int, torch.Tensor]]:
    """A deep copy of ``model`` whose parameters/buffers/tensor attributes are fake (cast to
    ``dtype`` if given). Returns ``(copy, {id(fake tensor): real tensor})``. Nothing real is copied
    but the module objects and small non-tensor state."""
    memo: dict[int, Any] = {}
    real_of: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None and id(p) not in memo:
                fp = nn.Parameter(_to_fake(mode, p, dtype), requires_grad=p.requires_grad)
                memo[id(p)], real_of[id(fp)] = fp, p
        for name, b in mod._buffers.items():
            if b is not None and id(b) not in memo:
                memo[id(b)] = _to_fake(mode, b, dtype if name not in mod._non_persistent_buffers_set else None)
        for v in vars(mod).values():
            if isinstance(v, torch.Tensor) and id(v) not in memo:
                memo[id(v)] = _to_fake(mode, v, None)
    out = copy.deepcopy(model, memo)
    _copy_attention_state(model, out)
    return out, real_of


def _copy_attention_state(src: nn.Module, dst: nn.Module) -> None:
    """leanact.patch keeps the attention mode per config object (by identity): give the copied
    configs the same state."""
    try:
        from leanact.patching import attention_hf
    except ImportError:  # pragma: no cover
        return
    for (_, a), (_, b) in zip(src.named_modules(), dst.named_modules()):
        ca, cb = getattr(a, "config", None), getattr(b, "config", None)
        if ca is not None and cb is not None and ca is not cb:
            state = attention_hf.config_state(ca)
            if state is not None:
                attention_hf.set_config_state(cb, state)


def _no_init_weights():
    """transformers' ``no_init_weights`` (weight initialisation skipped: fake weights have no values, and
    some initialisers read them, e.g. SigLIP's truncated normal); a null context without transformers."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - transformers is optional; older layouts
        return contextlib.nullcontext()
    return no_init_weights()


def build_fake(build: Callable[[], nn.Module], mode: FakeTensorMode, dtype: torch.dtype | None = None) -> nn.Module:
    """``build()`` run under the fake mode (weights are fake from the start), cast to ``dtype``. Where
    an initialiser reads the weights' values (SigLIP's truncated normal), built again with the
    initialisers skipped and the weights tied after, as ``post_init`` would."""
    try:
        with mode:
            model = build()
    except DATA_DEPENDENT:
        with mode, _no_init_weights():
            model = build()
            if callable(getattr(model, "tie_weights", None)):
                model.tie_weights()
    if dtype is not None:
        with mode:
            _cast_floating(model, dtype)
    return model


def _cast_floating(model: nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)`` for fake weights: new Parameters in place of the old (``Module.to`` swaps
    tensor subclasses in place, which fake tensors refuse); tied weights stay tied."""
    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (old, new): old kept alive, ids unique
    for mod in model.modules():
        for slots, wrap in ((mod._parameters, True), (mod._buffers, False)):
            for name, t in list(slots.items()):
                if t is None or not t.is_floating_point():
                    continue
                if id(t) not in done:
                    new = t.detach().to(dtype)
                    done[id(t)] = (t, nn.Parameter(new, requires_grad=t.requires_grad) if wrap else new)
                slots[name] = done[id(t)][1]


def _resize(t: torch.Tensor, batch: int | None, seq: int | None, b0: int | None, s0: int | None) -> tuple[int, ...]:
    shape = list(t.shape)
    if batch is not None and shape and shape[0] == b0:
        shape[0] = batch
    if seq is not None and len(shape) >= 2 and shape[1] == s0:
        shape[1] = seq
    return tuple(shape)


def fake_inputs(inputs: Any, mode: FakeTensorMode, *, batch: int | None = None, seq: int | None = None,
                dtype: torch.dtype | None = None, real_integers: bool = False, real_floats: bool = False) -> Any:
    """Fake versions of the tensors in ``inputs`` (dict, tuple or list). ``batch``/``seq`` resize
    every tensor whose dim 0 / dim 1 equals the sample's batch / sequence (those of the first
    tensor with at least two dimensions); floating tensors are cast to ``dtype`` if given.
    ``real_integers``: integer and bool tensors stay real (CPU copies; for :class:`RealIntegerOps`),
    which needs them at their own sizes. ``real_floats``: so do floating tensors that need no gradient
    (pixels a model reads: Idefics3 drops all-zero images), cast to ``dtype`` if given."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    ref = next((t for t in leaves if t.dim() >= 2), None)
    if (batch is not None or seq is not None) and ref is None:
        raise ValueError("batch=/seq= need a sample input with at least 2 dimensions (batch, seq, ...)")
    b0, s0 = (ref.shape[0], ref.shape[1]) if ref is not None else (None, None)

    def conv(t):
        if not isinstance(t, torch.Tensor):
            return t
        shape = _resize(t, batch, seq, b0, s0)
        floating = t.is_floating_point()
        if not is_fake(t) and ((real_integers and not floating) or (real_floats and floating and not t.requires_grad)):
            if shape != tuple(t.shape):
                raise ValueError("this model reads the values of its inputs (token ids, image grids, pixels): "
                                 "estimate it at the sample's own sizes (no batch=/seq=), with the sample "
                                 f"made at the size wanted; {tuple(t.shape)} would need new values at {shape}")
            return t.detach().to("cpu", dtype=dtype if floating and dtype is not None else t.dtype, copy=True)
        if shape == tuple(t.shape):
            f = _to_fake(mode, t, dtype)
        else:
            with mode:
                f = torch.empty(shape, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)
        if t.requires_grad:
            f.requires_grad_(True)
        return f

    return torch.utils._pytree.tree_map(conv, inputs)


def _real_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.bool and not is_fake(t)


def _mask_positions(indices: list) -> list:
    """Indices with each real bool mask replaced by the positions it selects (one long tensor per
    dimension it covers): a fake tensor indexed by a real mask gets its size from the mask's values."""
    out = []
    for i in indices:
        if _real_mask(i):
            with _disable_current_modes():
                out.extend(i.nonzero(as_tuple=True))
        else:
            out.append(i)
    return out


class RealIntegerOps(TorchDispatchMode):
    """Inside a fake trace (entered above the ``FakeTensorMode``): an op whose tensor arguments are
    all real runs for real, so what a model computes from the values of its integer inputs (the
    image-token positions in ``input_ids``, M-RoPE positions, an image grid's patch counts) has
    values, and ``.item()`` / ``.tolist()`` on it work; so do factories (no tensor argument) of
    integer or bool tensors of at most :attr:`LIMIT` elements (the ``arange`` of an image grid's
    positions). Ops that touch a fake tensor, float factories and ``empty`` ones stay fake; a fake
    tensor indexed by a real bool mask (``logps[mask]``) takes the mask's positions."""

    LIMIT = 1 << 22
    #: factories whose values are undefined: real, they would give garbage values (indices, sizes)
    UNFILLED = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and not any(is_fake(t) for t in tensors):
            with _disable_current_modes():
                return func(*args, **kwargs)
        if func is torch.ops.aten.index.Tensor and any(_real_mask(i) for i in args[1]):
            return func(args[0], _mask_positions(args[1]), *args[2:], **kwargs)
        out = func(*args, **kwargs)
        if (not tensors and func not in self.UNFILLED and isinstance(out, torch.Tensor) and is_fake(out)
                and not out.is_floating_point() and not out.is_complex() and out.numel() <= self.LIMIT):
            with _disable_current_modes():
                return func(*args, **kwargs)
        return out


@contextlib.contextmanager
def causal_skip_on_fake():
    """While active, Hugging Face's mask builder treats fake ``position_ids`` as one sequence per
    row (not packed), as it finds for real ones: ``masking_utils.find_packed_sequence_indices``
    cannot read fake values and reports packing, which makes it build and keep a (b, 1, s, s) mask
    where the real step passes SDPA ``is_causal=True`` (no padding mask; on CUDA the flash
    kernel). Packed sequences given as ``position_ids`` are therefore not modelled."""
    try:
        from transformers import masking_utils as mu
    except ImportError:  # pragma: no cover - transformers is optional
        yield
        return
    original = getattr(mu, "find_packed_sequence_indices", None)
    if original is None:  # pragma: no cover - other transformers versions
        yield
        return

    def packed(position_ids, *args, **kwargs):
        if isinstance(position_ids, torch.Tensor) and is_fake(position_ids):
            return None
        return original(position_ids, *args, **kwargs)

    mu.find_packed_sequence_indices = packed
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = original
